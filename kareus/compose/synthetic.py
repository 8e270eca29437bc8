"""Synthetic instruction options for composer benchmarks and tests (not measurements of anything).

Per (stage, direction) and clock, a compute-bound share of the time scales with 1/f and a
memory/communication share does not; dynamic power grows roughly with f * V(f)^2. Several overlap
variants per clock perturb time and energy, giving the staircase-like, mostly convex tradeoffs the
microbatch composition produces. Backward is about twice forward; the first and last stages carry
extra embedding / loss work.
"""
from __future__ import annotations

import numpy as np

from kareus.compose.microbatch import InstructionOption, pareto_indices
from kareus.types import Direction


def synthetic_options(num_stages: int, seed: int = 0, clocks: tuple[int, int, int] = (900, 1410, 15),
                      variants: int = 3, fwd_time_s: float = 0.030
                      ) -> dict[tuple[int, Direction], list[InstructionOption]]:
    """Pareto options per (stage, direction) on an A100-like clock range ``(min, max, step)`` in MHz."""
    rng = np.random.default_rng(seed)
    lo, hi, step = clocks
    freqs = np.arange(hi, lo - 1, -step)[::-1]
    out: dict[tuple[int, Direction], list[InstructionOption]] = {}
    for stage in range(num_stages):
        extra = 1.0 + (0.12 if stage == 0 else 0.0) + (0.18 if stage == num_stages - 1 else 0.0)
        for direction, scale in ((Direction.FWD, 1.0), (Direction.BWD, 2.0)):
            base = fwd_time_s * scale * extra * rng.uniform(0.97, 1.03)
            compute_share = rng.uniform(0.75, 0.9)
            p_max = rng.uniform(230.0, 270.0)  # dynamic watts at the top clock
            t, e, f = [], [], []
            for fr in freqs:
                x = fr / hi
                time_c = base * (compute_share / x + (1 - compute_share))
                power = p_max * x * (0.55 + 0.45 * x) ** 2 * (compute_share * 1.0 + (1 - compute_share) * 0.6)
                for v in range(variants):
                    jt = 1.0 + (rng.uniform(0.0, 0.04) if v else 0.0)
                    je = 1.0 - (rng.uniform(0.0, 0.05) if v else 0.0)
                    t.append(time_c * jt)
                    e.append(power * time_c * je)
                    f.append(int(fr))
            keep = pareto_indices(t, e)
            out[(stage, direction)] = [InstructionOption(float(t[i]), float(e[i]), f[i], {}) for i in keep]
    return out
