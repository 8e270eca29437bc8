"""A held-out family of partition workloads for ``search_efficiency.py --holdout``.

MBO's defaults were chosen on two simulated workloads (qwen1.7b pp2_tp8, llama3.2-3b pp2_cp2_tp4 on
the A100) and the recorded A100 table. This module draws workloads none of that saw: a random model
shape and layout on one of the three simulated GPUs, whose *assumed* simulator parameters (those the
``conf/hardware/*_sim.yaml`` comments label "assumed", or an "A100 prior carried over") are drawn
within their plausible ranges (``kareus/hardware/assumed.py``, the one statement of them); datasheet,
paper and fitted values stay as shipped. Reading noise is set so one setting's energy readings spread
about 1% (coefficient of variation), near the recorded A100 table's repeats (``repeat_spread`` in
runs/bench/sim_fidelity.json).

Seeds are split by a fixed rule, stated here before anything is measured: seeds 0-99 are tuning
seeds (look at them, tune on them), seeds from 1000 on are report seeds (only reported). A default
that is tuned must never be judged on a report seed it was tuned on.

What a draw covers (uniform unless stated; a draw that breaks a validation rule is drawn again):
- GPU: a100_sim, h100_sim or h200_sim;
- model: head dim 64 or 128; attention heads 8..64 (``HEADS``) with hidden size = heads x head dim in
  1024..8192; kv heads a divisor of the heads (1, 2, 4, 8 or all) that tp divides; ffn 2.5-4.0 x hidden
  in multiples of 256; vocab 32000..151936 (``VOCABS``); tied embeddings and qk-layernorm either way;
  layers 2-8 per stage;
- layout: tp 2, 4 or 8; pp 1, 2 or 4; cp 1; sequence parallelism on or off; sequence 1024..8192;
  micro batch 2, 4 or 8; 4 or 8 microbatches; full recompute or none; nanobatches 2 (the only count
  the nanobatch partitioner forms overlap partitions for);
- assumed simulator parameters: ``kareus.hardware.assumed.RANGES`` (reading noise aside); reading
  noise: ``NOISE`` (absolute, within those ranges).

To keep a quick run to minutes on 2 cores, each workload keeps ``PARTITIONS`` of its partition types
(drawn), and each partition's space is subsampled: up to ``SLOTS`` of its launch slots (drawn),
``SM_LEVELS`` of the default SM counts 2..16 (drawn, the same for the workload's partitions), and
clocks every ``FREQ_STEP_MHZ`` MHz from the top clock down to 60% of it (5 on the A100, 7 on the
H100 and H200): 50-140 candidates a partition. That is for tuning; what a user gets is measured on
the spaces a run searches (``HeldOut.full_space``; search_efficiency.py ``--holdout-space full``).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from pathlib import Path

from kareus.hardware import assumed
from kareus.types import Candidate, ModelSpec, ParallelSpec, PartitionType

ROOT = Path(__file__).resolve().parents[1]
HARDWARE_DIR = ROOT / "kareus" / "conf" / "hardware"

TUNING_SEEDS = range(0, 100)
REPORT_SEEDS = range(1000, 2000)

GPUS = ("a100_sim", "h100_sim", "h200_sim")
HEAD_DIMS = (64, 128)
HEADS = (8, 12, 16, 24, 32, 40, 48, 64)
HIDDEN = (1024, 8192)
FFN_RATIO = (2.5, 4.0)
VOCABS = (32000, 50304, 128256, 151936)
TPS = (2, 4, 8)
PPS = (1, 2, 4)
SEQ_LENS = (1024, 2048, 4096, 8192)
MICRO_BATCHES = (2, 4, 8)
MICROBATCHES = (4, 8)

# the simulator's assumed parameters drawn (kareus/hardware/assumed.py: ranges, and the ones kept); reading
# noise is drawn from NOISE instead
DRAWN = frozenset(assumed.RANGES) - {"time_noise", "power_noise"}
# reading noise (absolute): with the counter's quantization, energy readings spread ~1% (CV), near the
# recorded table's repeats (repeat_spread in runs/bench/sim_fidelity.json); time ~0.2%
NOISE: dict[str, tuple[float, float]] = {"time_noise": (0.001, 0.003), "power_noise": (0.008, 0.012)}

PARTITIONS = 2
SLOTS = 4
SM_LEVELS = 5
SM_CHOICES = tuple(range(2, 17, 2))
FREQ_STEP_MHZ = 120
MAX_DRAWS = 200


@dataclass(frozen=True)
class HeldOut:
    """One drawn workload: what to build and which subsampled spaces to search."""

    seed: int
    gpu: str  # the hardware config it starts from (conf/hardware/<gpu>.yaml)
    model: ModelSpec
    parallel: ParallelSpec
    hardware: dict = field(hash=False)  # the sim config with its assumed parameters drawn
    partitions: tuple[str, ...] = ()  # partition keys kept
    slots: dict = field(default_factory=dict, hash=False)  # partition key -> slot labels kept
    sms: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        m, p = self.model, self.parallel
        return (f"heldout-{self.seed} {self.gpu} h{m.hidden_size} a{m.num_attention_heads}/{m.num_kv_heads} "
                f"tp{p.tp} pp{p.pp}{' sp' if p.sequence_parallel else ''} s{p.seq_len} mb{p.micro_batch_size} "
                "(simulated)")

    def space(self, partition: PartitionType, gpu) -> list[Candidate]:
        """The subsampled space of one kept partition on ``gpu`` (a GPUSpec)."""
        from kareus.search.space import FreqRange, SpaceConfig, build_space

        cfg = SpaceConfig(sms=list(self.sms), freq_mhz=FreqRange(step=FREQ_STEP_MHZ),
                          slots=list(self.slots[partition.key]))
        return build_space(partition, gpu, cfg)

    def full_space(self, partition: PartitionType, gpu) -> list[Candidate]:
        """The space a run searches for one kept partition (``search.space`` as shipped): every slot,
        SMs 2..16 step 2, every clock step; 160-900 candidates on the first report seeds."""
        from kareus.search.space import SpaceConfig, build_space

        return build_space(partition, gpu, SpaceConfig())


def is_report_seed(seed: int) -> bool:
    return seed in REPORT_SEEDS


def seeds(kind: str, count: int) -> list[int]:
    """The first ``count`` seeds of ``kind`` ("report" or "tuning")."""
    pool = {"report": REPORT_SEEDS, "tuning": TUNING_SEEDS}[kind]
    if count > len(pool):
        raise ValueError(f"{kind} seeds hold {len(pool)} workloads, asked for {count}")
    return list(pool[:count])


def shipped(gpu: str) -> dict:
    """The shipped sim config of ``gpu`` as a plain dict (its Hydra defaults list dropped)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(HARDWARE_DIR / f"{gpu}.yaml"))
    cfg.pop("defaults", None)
    return cfg


def assumed_keys(gpu: str) -> set[str]:
    """Keys the shipped config labels assumed (or an A100 prior carried over, never refitted)."""
    return set(assumed.labelled(HARDWARE_DIR / f"{gpu}.yaml"))


def draw_hardware(gpu: str, rng: random.Random) -> dict:
    """The shipped config with every assumed parameter in ``DRAWN`` drawn, and ``NOISE`` set."""
    cfg = assumed.draw(shipped(gpu), assumed_keys(gpu) & DRAWN, rng)
    for key, (lo, hi) in NOISE.items():
        cfg[key] = rng.uniform(lo, hi)
    return cfg


def draw_model(rng: random.Random, tp: int, pp: int) -> ModelSpec | None:
    """A model shape for ``tp`` x ``pp``, or None when the drawn heads leave no valid shape."""
    head_dim = rng.choice(HEAD_DIMS)
    heads = rng.choice(HEADS)
    hidden = heads * head_dim
    kv = [k for k in (1, 2, 4, 8, heads) if heads % k == 0 and k % tp == 0]
    if not HIDDEN[0] <= hidden <= HIDDEN[1] or heads % tp or not kv:
        return None
    ffn = 256 * round(hidden * rng.uniform(*FFN_RATIO) / 256)
    return ModelSpec(name="heldout", num_layers=pp * rng.randint(2, 8), hidden_size=hidden, ffn_hidden_size=ffn,
                     num_attention_heads=heads, num_kv_heads=rng.choice(sorted(set(kv))), head_dim=head_dim,
                     vocab_size=rng.choice(VOCABS), tied_embeddings=rng.random() < 0.5,
                     qk_layernorm=rng.random() < 0.5)


def draw_parallel(rng: random.Random) -> ParallelSpec:
    return ParallelSpec(tp=rng.choice(TPS), pp=rng.choice(PPS), micro_batch_size=rng.choice(MICRO_BATCHES),
                        num_microbatches=rng.choice(MICROBATCHES), seq_len=rng.choice(SEQ_LENS), nanobatches=2,
                        recompute=rng.choice(("full", "none")), sequence_parallel=rng.random() < 0.5)


def problems(model: ModelSpec, parallel: ParallelSpec, hardware: dict) -> list[str]:
    """The rules ``validate()`` applies to this model, layout and sim config (empty: usable)."""
    from kareus.config.validate import validate_model_parallel
    from kareus.hardware.sim_config import SimConfig
    from kareus.registry import to_dataclass
    from kareus.workload.memory import memory_problem

    sim = to_dataclass(SimConfig, hardware)
    out = validate_model_parallel(model, parallel, sim.gpus_per_node) + sim.problems()
    if not out:
        fit = memory_problem(model, parallel, sim.gpu, sim.memory_gb)
        out += [fit] if fit else []
    return out


def draw(seed: int) -> HeldOut:
    """The held-out workload of ``seed``: the same for a seed on every machine and run."""
    import kareus.partition  # noqa: F401  (registers the partitioner)
    from kareus.registry import PARTITIONERS
    from kareus.workload import build_workload

    rng = random.Random(f"heldout|{seed}")
    for _ in range(MAX_DRAWS):
        gpu = rng.choice(GPUS)
        parallel = draw_parallel(rng)
        model = draw_model(rng, parallel.tp, parallel.pp)
        if model is None:
            continue
        hardware = draw_hardware(gpu, rng)
        if problems(model, parallel, hardware):
            continue
        types = PARTITIONERS.build("nanobatch", config={}).partition(build_workload(model, parallel)).types
        kept = rng.sample(list(types), min(PARTITIONS, len(types)))
        slots = {t.key: tuple(rng.sample(list(t.slot_labels), min(SLOTS, len(t.slot_labels)))) for t in kept}
        sms = tuple(sorted(rng.sample(SM_CHOICES, SM_LEVELS)))
        return HeldOut(seed, gpu, replace(model, name=f"heldout-{seed}"), parallel, hardware,
                       tuple(t.key for t in kept), slots, sms)
    raise RuntimeError(f"held-out seed {seed}: no valid workload in {MAX_DRAWS} draws")
