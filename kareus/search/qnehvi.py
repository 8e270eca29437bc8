"""BoTorch qLogNEHVI over the exact candidate set: the strongest Bayesian-optimisation peer.

An optional extra (``pip install torch==2.13.0 botorch``): independent GPs on log time and log total
energy of the encoded candidates (failed settings at the worst measured values, as MBO fits them), q
candidates per batch chosen by ``optimize_acqf_discrete`` among the unmeasured ones. Without botorch
it stops with a clear message.
"""
from __future__ import annotations

import numpy as np

from kareus.registry import SEARCHERS
from kareus.search.base import SearchProblem, SearchResult
from kareus.search.common import SearchRun, Timer
from kareus.search.config import QNEHVIConfig, round_batch
from kareus.search.mbo import start, widened_at_random

MISSING = ("search=qnehvi needs the optional extra botorch (with torch): "
           "pip install torch==2.13.0 botorch")


def available() -> bool:
    try:
        import botorch  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


@SEARCHERS.register("qnehvi", QNEHVIConfig)
class QNEHVISearcher:
    """qLogNEHVI (BoTorch) with independent GPs, discrete optimisation over the candidate set."""

    def __init__(self, cfg: QNEHVIConfig) -> None:
        if not available():
            raise ImportError(MISSING)
        self.cfg = cfg
        self.timings: list[dict[str, float]] = []

    def run(self, problem: SearchProblem) -> SearchResult:
        import torch
        from botorch.acquisition.multi_objective.logei import qLogNoisyExpectedHypervolumeImprovement
        from botorch.fit import fit_gpytorch_mll
        from botorch.models import ModelListGP, SingleTaskGP
        from botorch.models.transforms import Standardize
        from botorch.optim import optimize_acqf_discrete
        from botorch.sampling import SobolQMCNormalSampler
        from gpytorch.mlls import SumMarginalLogLikelihood

        import warnings

        cfg = self.cfg
        torch.manual_seed(problem.seed)
        torch.set_num_threads(1)
        warnings.filterwarnings("ignore", module=r"(botorch|linear_operator|gpytorch)")
        run = SearchRun(problem)
        X = run.X
        keep = X.max(0) > X.min(0)
        X = X[:, keep]
        X = (X - X.min(0)) / (X.max(0) - X.min(0))
        Xt = torch.tensor(X, dtype=torch.double)
        start(run, cfg)
        batch = round_batch(cfg, run.remaining)
        rng = np.random.default_rng(problem.seed)
        for pool, k in run.batch_pools(batch):
            if widened_at_random(run, pool, k, rng):  # nothing to fit the GPs to yet
                continue
            timer = Timer()
            ok, failed = run.ok(), run.failed()
            obj = run.objectives(ok)
            Y = -np.log(obj[:, :2])  # BoTorch maximises
            # failed settings enter the GPs at the worst measured values, as in MBO: left out, a region
            # where everything fails stays predicted attractive and draws batch after batch
            Y = np.vstack([Y, np.tile(Y.min(axis=0), (len(failed), 1))])
            train_x = Xt[ok + failed]
            train_y = torch.tensor(Y, dtype=torch.double)
            models = [SingleTaskGP(train_x, train_y[:, j:j + 1], outcome_transform=Standardize(m=1))
                      for j in range(2)]
            model = ModelListGP(*models)
            fit_gpytorch_mll(SumMarginalLogLikelihood(model.likelihood, model))
            fit_s = timer.lap()
            lo, hi = Y.min(0), Y.max(0)
            ref = torch.tensor(lo - 0.1 * (hi - lo), dtype=torch.double)
            acq = qLogNoisyExpectedHypervolumeImprovement(
                model=model, ref_point=ref, X_baseline=Xt[ok], prune_baseline=True,
                sampler=SobolQMCNormalSampler(sample_shape=torch.Size([cfg.mc_samples]), seed=problem.seed))
            cand, _ = optimize_acqf_discrete(acq, q=k, choices=Xt[pool], unique=True)
            acq_s = timer.lap()
            rows = {tuple(np.round(r, 12)): int(i) for i, r in zip(pool, X[pool])}
            picks = [rows[tuple(np.round(r, 12))] for r in cand.detach().numpy()]
            run.evaluate(picks, [{"pass": "qnehvi"} for _ in picks])
            run.finish_batch(fit_s=fit_s, acq_s=acq_s)
            if cfg.verbose:
                print(f"qnehvi batch {run.batches}: fit {fit_s:.2f}s acq {acq_s:.2f}s", flush=True)
        self.timings = run.timings
        return run.result()
