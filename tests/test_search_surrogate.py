"""The surrogate's ridge baseline: closed-form leave-one-out, basis choice, clipping; expected-HVI and per-clock passes."""
import numpy as np
import pytest

from kareus.registry import ACQUISITIONS, SURROGATES
from kareus.search.acquisition import Context
from kareus.search.config import Centre, MBOConfig, PassName, RidgeBasis, SurrogateConfig, config_problems
from kareus.search.surrogate import _basis, _loo_error, choose_basis

import kareus.search  # noqa: F401  (registers)


def grid(n_slots=3, seed=0, n=None):
    """Encoded-like rows: clock, SMs, six descriptor columns, slot rank (column 7)."""
    rng = np.random.default_rng(seed)
    rows = [[f, s, 0, r / 3, 0, 0, 0, r] for r in range(n_slots) for s in (2, 4, 8, 12, 16)
            for f in (900, 1100, 1300, 1410)]
    X = np.array(rows, dtype=float)
    if n is not None:
        X = X[rng.choice(len(X), n, replace=False)]
    return X


def brute_force_loo(A, y, alpha):
    """Refit without each row; features standardised once, penalty fixed, intercept unpenalised."""
    mu, sd = A.mean(axis=0), A.std(axis=0)
    Z = (A - mu) / np.where(sd > 0, sd, 1.0)
    lam = alpha * len(y) + 1.0
    errs = []
    for i in range(len(y)):
        keep = np.arange(len(y)) != i
        Zk, yk = Z[keep], y[keep]
        D = np.column_stack([np.ones(len(yk)), Zk])
        P = lam * np.eye(D.shape[1])
        P[0, 0] = 0.0
        w = np.linalg.solve(D.T @ D + P, D.T @ yk)
        errs.append((y[i] - np.concatenate(([1.0], Z[i])) @ w) ** 2)
    return float(np.mean(errs))


@pytest.mark.parametrize("inter", [False, True])
@pytest.mark.parametrize("alpha", [1e-3, 1e-1])
def test_closed_form_loo_matches_refitting(inter, alpha):
    X = grid(n=14, seed=1)
    y = np.log(1e3 / X[:, 0] + 2.0 / X[:, 1]) + 0.05 * np.random.default_rng(2).standard_normal(len(X))
    A = _basis(X, inter)
    assert _loo_error(A, y, alpha) == pytest.approx(brute_force_loo(A, y, alpha), rel=1e-6)


def test_basis_choice_follows_the_data():
    # additive in slot, clock and SMs, few points: the interaction terms only add variance
    X = grid(n=8, seed=3)
    y = 0.2 * X[:, 7] + np.log(1e3 / X[:, 0]) + np.log(1 + 8 / X[:, 1])
    assert choose_basis(X, y)[0] is False
    # slot x clock interaction, every point measured: the interactions pay for themselves
    X = grid()
    y = np.log(1e3 / X[:, 0]) * (1 + 2 * X[:, 7]) + np.log(1 + 8 / X[:, 1])
    assert choose_basis(X, y)[0] is True


def test_predictions_are_clipped_to_the_widened_observed_range():
    X = grid(n=10, seed=4)
    Y = np.column_stack([np.log(X[:, 0]), -np.log(X[:, 1])])
    far = grid()
    far[:, 1] = 1000.0  # far outside the measured SM counts
    for margin in (0.0, 0.25):
        cfg = SurrogateConfig(members=3, rounds=20, clip_margin=margin, basis=RidgeBasis.main)
        out = SURROGATES.build("xgboost", config=cfg).fit(X, Y, seed=0).sample(far)
        lo, hi = Y.min(axis=0), Y.max(axis=0)
        pad = margin * (hi - lo + 0.1)
        assert np.all(out >= lo - pad - 1e-12) and np.all(out <= hi + pad + 1e-12)


def test_centred_members_keep_their_spread_and_fit_the_measured_points():
    # few points, a steep response: members that left a point out of their bootstrap sample miss it
    X = grid(n=12, seed=5)
    Y = np.column_stack([np.log(1e3 / X[:, 0] + 30.0 / X[:, 1]), 0.5 * X[:, 7]])
    out = {}
    for center in (Centre.none, Centre.trees):
        cfg = SurrogateConfig(members=6, rounds=50, basis=RidgeBasis.main, clip_margin=10.0, center=center)
        out[center] = SURROGATES.build("xgboost", config=cfg).fit(X, Y, seed=0).sample(X)
    np.testing.assert_allclose(out[Centre.trees].std(axis=0), out[Centre.none].std(axis=0), atol=1e-9)  # same members
    assert out[Centre.none].std(axis=0).max() > 0
    err = {c: np.abs(o.mean(axis=0) - Y).mean(axis=0) for c, o in out.items()}
    assert np.all(err[Centre.trees] < 0.5 * err[Centre.none])


def context(expected):
    """Two candidates: one every member puts slightly behind the front, one that a single member puts
    far ahead of it (the mean does not)."""
    measured = {"time": np.array([1.0, 2.0]), "total": np.array([2.0, 1.0])}
    t = np.array([[1.6, 0.5], [1.6, 2.5], [1.6, 2.5], [1.6, 2.5]])  # member 0: the second candidate beats
    e = t.copy()  # everything measured; the mean (2, 2) is dominated
    samples = {"time": t, "total": e, "dynamic": e, "static": t}
    return Context(np.arange(2), samples, measured, kappa=0.0, greedy=False, expected=frozenset(expected))


def test_expected_hvi_pass_rewards_a_candidate_some_member_puts_on_the_front():
    free = np.ones(2, dtype=bool)
    mean_pick = ACQUISITIONS.build("total").select(context([]), 1, free)
    assert mean_pick[0][0] == 0  # the mean of candidate 1 is dominated; candidate 0 improves the front
    ehvi_pick = ACQUISITIONS.build("total").select(context(["total"]), 1, free)
    assert ehvi_pick[0][0] == 1  # one member's frontier point outweighs the other's small gain
    # a pass not named in ``expected`` keeps scoring the mean
    assert ACQUISITIONS.build("total").select(context(["dynamic"]), 1, free)[0][0] == 0


def test_expected_accepts_only_hypervolume_passes():
    assert config_problems(MBOConfig(expected=[PassName.dynamic, PassName.local])) == []
    bad = config_problems(MBOConfig(expected=[PassName.uncertainty]))
    assert len(bad) == 1 and "search.expected" in bad[0] and "uncertainty" in bad[0]
    assert config_problems(MBOConfig(surrogate=SurrogateConfig(clip_margin=-1)))[0].startswith(
        "search.surrogate.clip_margin")


def clock_context(per_clock, greedy=False):
    """Measured: (1, 1) at clock 0. Predicted: candidate 0 (clock 1) at (1.2, 1.2) and candidate 2
    (clock 1) at (1.3, 1.3), both behind it; candidate 1 (clock 0) at (0.95, 1.5), just beside it."""
    measured = {"time": np.array([1.0]), "dynamic": np.array([1.0]), "total": np.array([1.0])}
    t = np.array([[1.2, 0.95, 1.3]] * 2)
    e = np.array([[1.2, 1.5, 1.3]] * 2)
    samples = {"time": t, "dynamic": e, "total": e, "static": t}
    return Context(np.arange(3), samples, measured, kappa=0.0, greedy=greedy, per_clock=frozenset(per_clock),
                   clock_of=np.array([1, 0, 1]), measured_clock=np.array([0]))


def test_per_clock_pass_scores_against_the_front_of_the_candidates_own_clock():
    free = np.ones(3, dtype=bool)
    dynamic = ACQUISITIONS.build("dynamic")
    # against the whole front only candidate 1 is not dominated
    assert [p for p, _ in dynamic.select(clock_context([]), 3, free)][0] == 1
    # clock 1 has no measured point: its candidates fill an empty front and outscore candidate 1
    assert [p for p, _ in dynamic.select(clock_context(["dynamic"]), 2, free)] == [0, 2]
    # greedy: the first pick joins clock 1's front, which then dominates candidate 2
    picks = dynamic.select(clock_context(["dynamic"], greedy=True), 2, free)
    assert [p for p, _ in picks] == [0, 1] and picks[1][1] > 0
    assert config_problems(MBOConfig(per_clock=[PassName.uncertainty]))[0].startswith("search.per_clock")


def test_a_hand_over_pass_stops_where_nothing_is_predicted_to_improve():
    """Against the whole front only candidate 1 improves (clock_context): a pass in ``hand_over``
    returns it alone, greedy or not, and leaves the batch's rest to the other passes; a pass not
    named there fills its share with the candidates nearest the front."""
    free = np.ones(3, dtype=bool)
    total = ACQUISITIONS.build("total")
    for greedy in (False, True):
        ctx = clock_context([], greedy=greedy)
        assert [p for p, _ in total.select(ctx, 3, free)][0] == 1 and len(total.select(ctx, 3, free)) == 3
        ctx.hand_over = frozenset(["total"])
        assert [p for p, _ in total.select(ctx, 3, free)] == [1]
        assert total.select(ctx, 3, free & (np.arange(3) != 1)) == []
        assert [p for p, _ in ACQUISITIONS.build("dynamic").select(ctx, 3, free)][0] == 1  # not named: fills
    assert config_problems(MBOConfig(hand_over=[PassName.uncertainty]))[0].startswith("search.hand_over")
    assert config_problems(MBOConfig(hand_over=[]))[:1] == []
