"""Surrogates: a bootstrap ensemble of XGBoost regressors, its spread is the uncertainty.

Small data (tens to a few hundred points) makes one thread per model with the members fitted in a
thread pool (xgboost releases the GIL) faster than one model with several threads. An optional ridge
baseline on physically shaped features (1/clock, 1/SMs, ...) lets the ensemble extrapolate smoothly
in clock and SMs, where trees alone are piecewise constant; the trees model what it leaves. Its basis
and penalty are chosen per fit by closed-form leave-one-out error: a handful of points cannot carry
the slot-interaction terms without fitting noise, a few hundred can. The bootstrap gives the spread,
not the mean: on a few points each member misses about a third of them, so the plain bootstrap mean
(``center=none``) is pulled towards the neighbours of every point left out; ``center=trees`` shifts
the members onto one more fit on every row. With ``center=gp`` (the default)
the centre is a Gaussian process's posterior mean on the successful rows once ``gp_min_points`` of them
are measured (``kareus.search.gp``): between measured settings it interpolates where trees step, which
on the benchmark's simulated tables roughly halves the error at the frontier's near-ties; below that
count its dozen hyperparameters are guesses, and the trees' fit centres instead. Candidates whose
nearest fitted row is a failed one (entered at the worst measured values) keep the trees' centre, so
a failing region stays unattractive.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from kareus.registry import SURROGATES
from kareus.search.config import Centre, GPKernel, RidgeBasis, SurrogateConfig
from kareus.search.gp import GaussianProcess


class Surrogate(Protocol):
    def fit(self, X: np.ndarray, Y: np.ndarray, seed: int, failed: np.ndarray | None = None) -> "Surrogate":
        """``failed``: rows standing in for failed measurements (entered at the worst measured values)."""
    def sample(self, X: np.ndarray) -> np.ndarray:
        """Member predictions, shape (members, len(X), targets)."""


def _basis(X: np.ndarray, interactions: bool = False) -> np.ndarray:
    """Ridge features: clock and SMs with their reciprocals, plus the slot descriptors; with
    ``interactions`` also each descriptor times 1/clock and 1/SMs (time ~ a(slot) + b(slot)/f)."""
    f = np.maximum(X[:, :1], 1.0)
    s = np.maximum(X[:, 1:2], 1.0)
    cols = [f / 1000.0, 1000.0 / f, s / 10.0, 10.0 / s, X[:, 2:]]
    if interactions:
        rank = np.rint(X[:, 7]).astype(int) if X.shape[1] > 7 else np.zeros(len(X), dtype=int)
        onehot = (rank[:, None] == np.arange(16)[None, :]).astype(float)  # slot identity (ranks 0..15)
        desc = np.hstack([X[:, 2:], onehot])
        cols += [onehot, desc * (1000.0 / f), desc * (10.0 / s), desc * (s / 10.0), (1000.0 / f) * (10.0 / s)]
    return np.hstack(cols)


RIDGE_ALPHA = 1e-2  # the penalty of a fixed basis (``basis=main`` or ``interactions``)


def _standardise(A: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(Z, mean, scale) with constant columns left unscaled."""
    mu, sd = A.mean(axis=0), A.std(axis=0)
    sd = np.where(sd > 0, sd, 1.0)
    return (A - mu) / sd, mu, sd


def _penalty(alpha: float, n: int) -> float:
    """Ridge penalty on standardised features: (alpha x n + 1) keeps a handful of points tame."""
    return alpha * n + 1.0


def _ridge(A: np.ndarray, y: np.ndarray, alpha: float = RIDGE_ALPHA) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Ridge on standardised features with an unpenalised intercept."""
    Z, mu, sd = _standardise(A)
    ym = float(y.mean())
    w = np.linalg.solve(Z.T @ Z + _penalty(alpha, len(y)) * np.eye(Z.shape[1]), Z.T @ (y - ym))
    return w, mu, sd, ym


def _loo_error(A: np.ndarray, y: np.ndarray, alpha: float) -> float:
    """Closed-form leave-one-out mean squared error of ``_ridge`` (kernel form: cheap when features > rows)."""
    Z = _standardise(A)[0]
    n = len(y)
    K = Z @ Z.T
    H = K @ np.linalg.solve(K + _penalty(alpha, n) * np.eye(n), np.eye(n))
    r = (y - y.mean()) - H @ (y - y.mean())
    lev = np.clip(np.diag(H) + 1.0 / n, 0.0, 0.999)
    return float(np.mean((r / (1.0 - lev)) ** 2))


def choose_basis(X: np.ndarray, y: np.ndarray, alphas: tuple[float, ...] = (1e-3, 1e-2, 1e-1, 1.0)) -> tuple[bool, float]:
    """(interactions, alpha) of the ridge baseline with the lowest leave-one-out error on the data:
    a handful of points cannot carry the interaction terms, a few hundred can."""
    best = (np.inf, False, alphas[0])
    for inter in (False, True):
        A = _basis(X, inter)
        for a in alphas:
            e = _loo_error(A, y, a)
            if e < best[0]:
                best = (e, inter, a)
    return best[1], best[2]


def _ridge_predict(model: tuple[np.ndarray, np.ndarray, np.ndarray, float], A: np.ndarray) -> np.ndarray:
    w, mu, sd, ym = model
    return ((A - mu) / sd) @ w + ym


@SURROGATES.register("xgboost", SurrogateConfig)
class XGBoostEnsemble:
    """Bootstrap members of (ridge baseline +) gradient-boosted trees, one per target column."""

    def __init__(self, cfg: SurrogateConfig) -> None:
        self.cfg = cfg
        self._members: list[list[tuple]] = []
        self._bases: list[tuple[bool, float]] = []
        self._full: list[tuple] | None = None
        self._gps: list[GaussianProcess] | None = None
        self._fit_X, self._fit_failed = np.empty((0, 0)), np.empty(0, dtype=bool)
        self._clip: tuple[np.ndarray, np.ndarray] = (np.array(-np.inf), np.array(np.inf))

    def _params(self, seed: int) -> dict:
        c = self.cfg
        return {"max_depth": c.max_depth, "eta": c.learning_rate, "subsample": c.subsample,
                "min_child_weight": c.min_child_weight, "nthread": 1, "seed": seed, "verbosity": 0,
                "objective": "reg:squarederror", "tree_method": "hist", "max_bin": 64}

    def _fit_member(self, X: np.ndarray, Y: np.ndarray, rows: np.ndarray, seed: int) -> list[tuple]:
        import xgboost as xgb

        Xb, Yb = X[rows], Y[rows]
        out = []
        for t in range(Y.shape[1]):
            y = Yb[:, t]
            base = None
            resid = y
            if self.cfg.linear_base:
                inter, alpha = self._bases[t]
                A = _basis(Xb, inter)
                base = (inter, _ridge(A, y, alpha))
                resid = y - _ridge_predict(base[1], A)
            d = xgb.DMatrix(Xb, label=resid, nthread=1)
            booster = xgb.train(self._params(seed + t), d, num_boost_round=self.cfg.rounds)
            out.append((base, booster))
        return out

    def fit(self, X: np.ndarray, Y: np.ndarray, seed: int, failed: np.ndarray | None = None) -> "XGBoostEnsemble":
        with _one_blas_thread():
            return self._fit(X, Y, seed, np.zeros(len(X), dtype=bool) if failed is None else np.asarray(failed, bool))

    def _fit(self, X: np.ndarray, Y: np.ndarray, seed: int, failed: np.ndarray) -> "XGBoostEnsemble":
        lo, hi = Y.min(axis=0), Y.max(axis=0)
        m = self.cfg.clip_margin  # no wild extrapolation from few points (it would lure the expected-HVI passes)
        self._clip = (lo - m * (hi - lo + 0.1), hi + m * (hi - lo + 0.1))
        basis = RidgeBasis(self.cfg.basis)
        if self.cfg.linear_base:  # one basis choice per target, shared by the bootstrap members
            self._bases = [choose_basis(X, Y[:, t]) if basis is RidgeBasis.auto
                           else (basis is RidgeBasis.interactions, RIDGE_ALPHA) for t in range(Y.shape[1])]
        rng = np.random.default_rng(seed)
        n = len(X)
        rows = [rng.integers(0, n, n) for _ in range(self.cfg.members)]
        seeds = [int(s) for s in rng.integers(0, 2**31 - 1, self.cfg.members)]
        centre = Centre(self.cfg.center)
        ok = ~failed
        if centre is Centre.gp and ok.sum() < self.cfg.gp_min_points:
            centre = Centre.trees
        # the trees' fit on every row centres under center=trees, and near failed rows under center=gp: a
        # smooth GP fitted across a failure's worst-value plateau would make the failing region look good
        trees_centre = centre is Centre.trees or (centre is Centre.gp and failed.any())
        if trees_centre:
            rows.append(np.arange(n))
            seeds.append(seed + 1)
        jobs = [lambda r=r, s=s: self._fit_member(X, Y, r, s) for r, s in zip(rows, seeds)]
        if centre is Centre.gp:  # one GP per target on the successful rows, fitted beside the members
            kernel = GPKernel(self.cfg.gp_kernel).value
            jobs += [lambda t=t: GaussianProcess(kernel=kernel).fit(X[ok], Y[ok, t], seed + t) for t in range(Y.shape[1])]
        if self.cfg.threads > 1:
            with ThreadPoolExecutor(self.cfg.threads) as pool:
                fits = list(pool.map(lambda job: job(), jobs))
        else:
            fits = [job() for job in jobs]
        self._members = fits[:self.cfg.members]
        self._full = fits[self.cfg.members] if trees_centre else None
        self._gps = fits[self.cfg.members + int(trees_centre):] if centre is Centre.gp else None
        self._fit_X, self._fit_failed = X, failed
        return self

    def sample(self, X: np.ndarray) -> np.ndarray:
        with _one_blas_thread():
            bases = {inter: _basis(X, inter) for inter, _ in self._bases}  # only the bases the fit chose
            out = np.stack([_member_predict(member, X, bases) for member in self._members])
            if self._gps is not None:  # the bootstrap gives the spread, the GP's posterior mean the centre ...
                centre = np.column_stack([gp.mean(X) for gp in self._gps])
                if self._full is not None:  # ... but the trees' beside failures
                    near = nearest_is_failed(self._gps[0], X, self._fit_X, self._fit_failed)
                    centre[near] = _member_predict(self._full, X[near], {k: v[near] for k, v in bases.items()})
                out = out - out.mean(axis=0, keepdims=True) + centre[None]
            elif self._full is not None:  # ... or the trees' fit on every row
                out = out - out.mean(axis=0, keepdims=True) + _member_predict(self._full, X, bases)[None]
        return np.clip(out, self._clip[0], self._clip[1])


def nearest_is_failed(gp: GaussianProcess, X: np.ndarray, fit_X: np.ndarray, failed: np.ndarray) -> np.ndarray:
    """Per row of ``X``: is its nearest fitted row a failed one, in the GP's metric or in the plain
    standardised features? The GP's metric finds a failing clock/SM corner, since the target varies
    along those; but a slot that always fails can differ from the others by a feature the successful
    rows barely vary along, which that metric all but ignores."""
    from scipy.spatial.distance import cdist

    near = np.zeros(len(X), dtype=bool)
    for view in (gp.metric, gp.standardised):
        near |= failed[np.argmin(cdist(view(X), view(fit_X)), axis=1)]
    return near


def _one_blas_thread() -> Any:
    """BLAS at one thread while the members' ridge solves run in their own threads: the solves are
    tiny, and BLAS threads waiting on busy cores stalled a batch from 0.3 s to over 1.5 s."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="blas")


def _member_predict(member: list[tuple], X: np.ndarray, bases: dict[bool, np.ndarray]) -> np.ndarray:
    """One member's prediction of every target for ``X``: (len(X), targets)."""
    out = np.empty((len(X), len(member)))
    for t, (base, booster) in enumerate(member):
        out[:, t] = booster.inplace_predict(X)
        if base is not None:
            out[:, t] += _ridge_predict(base[1], bases[base[0]])
    return out
