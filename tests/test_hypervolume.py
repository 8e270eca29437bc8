"""Exact 2-D hypervolume, HVI and IGD+ against brute force and moocore."""
import itertools

import moocore
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.frontier import hypervolume_2d
from kareus.search.hv import hvi, hypervolume, igd_plus, nondominated, normalise

REF = (10.0, 10.0)
coord = st.integers(0, 12).map(float)
point = st.tuples(coord, coord)
points = st.lists(point, min_size=0, max_size=12)


def brute_hv(pts, ref=REF) -> float:
    """Union area of the boxes [p, ref] by cell enumeration over the compressed grid."""
    pts = [p for p in pts if p[0] < ref[0] and p[1] < ref[1]]
    if not pts:
        return 0.0
    xs = sorted({p[0] for p in pts} | {ref[0]})
    ys = sorted({p[1] for p in pts} | {ref[1]})
    area = 0.0
    for (x0, x1), (y0, y1) in itertools.product(zip(xs, xs[1:]), zip(ys, ys[1:])):
        if any(p[0] <= x0 and p[1] <= y0 for p in pts):
            area += (x1 - x0) * (y1 - y0)
    return area


@settings(max_examples=200, deadline=None)
@given(points)
def test_hypervolume_matches_brute_force_and_lead_sweep(pts):
    arr = np.array(pts, dtype=float).reshape(-1, 2)
    assert hypervolume(arr, REF) == pytest.approx(brute_hv(pts))
    assert hypervolume_2d(arr[:, 0], arr[:, 1], REF) == pytest.approx(brute_hv(pts))


@settings(max_examples=300, deadline=None)
@given(points, st.lists(point, min_size=1, max_size=8))
def test_hvi_is_hv_gain_of_adding_each_candidate(front, cands):
    got = hvi(np.array(cands), np.array(front, dtype=float).reshape(-1, 2), REF)
    base = brute_hv(front)
    want = [brute_hv(front + [c]) - base for c in cands]
    np.testing.assert_allclose(got, want, atol=1e-9)


def test_hvi_counts_points_that_dominate_the_front_unlike_moocore_contributions():
    front = np.array([[2.0, 6.0], [4.0, 4.0], [6.0, 2.0]])
    c = np.array([[3.0, 3.0]])  # dominates (4, 4)
    gain = hypervolume(np.vstack([front, c]), REF) - hypervolume(front, REF)
    assert hvi(c, front, REF)[0] == pytest.approx(gain) == pytest.approx(brute_hv(front.tolist() + [[3, 3]])
                                                                            - brute_hv(front.tolist()))
    # moocore's contribution (default ignore_dominated=True) drops the dominated (4, 4) and so credits
    # the candidate with the area (4, 4) already covered: 9, not the true improvement 5
    contrib = moocore.hv_contributions(np.vstack([front, c]), ref=np.array(REF))[-1]
    assert gain == pytest.approx(5.0)
    assert contrib == pytest.approx(9.0)


def test_hvi_of_dominated_or_outside_candidates_is_zero():
    front = np.array([[2.0, 2.0]])
    assert hvi(np.array([[3.0, 3.0], [11.0, 0.0], [0.0, 11.0], [2.0, 2.0]]), front, REF).tolist() == [0, 0, 0, 0]
    assert hvi(np.array([[0.0, 0.0]]), np.empty((0, 2)), REF)[0] == pytest.approx(100.0)


@settings(max_examples=100, deadline=None)
@given(points)
def test_nondominated_matches_moocore(pts):
    arr = np.array(pts, dtype=float).reshape(-1, 2)
    got = nondominated(arr)
    if len(arr) == 0:
        assert len(got) == 0
        return
    uniq = np.unique(arr, axis=0)
    want = uniq[moocore.is_nondominated(uniq)]
    assert sorted(map(tuple, got)) == sorted(map(tuple, want))


def test_hvi_vectorised_shape_and_values_on_large_input():
    rng = np.random.default_rng(0)
    t = np.sort(rng.random(50))
    front = np.column_stack([t, 1 - t])
    cands = rng.random((5000, 2))
    out = hvi(cands, front, (1.1, 1.1))
    assert out.shape == (5000,)
    base = hypervolume(front, (1.1, 1.1))
    for i in rng.choice(5000, 20, replace=False):
        assert out[i] == pytest.approx(hypervolume(np.vstack([front, cands[i]]), (1.1, 1.1)) - base, abs=1e-12)


def test_igd_plus():
    ref = np.array([[0.0, 1.0], [0.5, 0.5], [1.0, 0.0]])
    assert igd_plus(ref, ref) == 0.0
    assert igd_plus(ref[:1], ref) > 0
    # points that dominate the reference front cost nothing (the "+" in IGD+)
    assert igd_plus(ref - 0.1, ref) == 0.0
    assert igd_plus(ref + 0.1, ref) == pytest.approx(np.sqrt(0.02))
    assert igd_plus(np.empty((0, 2)), ref) == float("inf")


def test_a_one_point_front_scores_the_same_in_any_unit():
    """A front of one point spans nothing: its scale is its own size, not one unit of whatever unit."""
    front, found = np.array([[2e-3, 10.0]]), np.array([[2.2e-3, 10.5]])

    def ratio(scale):
        f, g = front * scale, found * scale
        return hypervolume(normalise(g, f[0], f[0]), (1.1, 1.1)) / hypervolume(normalise(f, f[0], f[0]), (1.1, 1.1))

    assert ratio(np.array([1e3, 1.0])) == pytest.approx(ratio(np.array([1.0, 1e-3])))  # ms and J, s and kJ
    assert 0 < ratio(np.array([1.0, 1.0])) < 1


def test_normalise_maps_ideal_and_nadir():
    out = normalise([[2.0, 10.0], [4.0, 30.0]], ideal=(2.0, 10.0), nadir=(4.0, 30.0))
    np.testing.assert_allclose(out, [[0, 0], [1, 1]])


def test_hypervolume_ratio_is_the_share_of_the_reference_rectangle():
    from kareus.frontier import hypervolume_ratio

    assert hypervolume_ratio(brute_hv([(5.0, 5.0)]), REF) == pytest.approx(0.25)
    assert hypervolume_ratio(0.0, REF) == 0.0
    assert hypervolume_ratio(1.0, None) is None and hypervolume_ratio(1.0, (0.0, 10.0)) is None


@pytest.mark.parametrize("searcher", ["random", "mbo"])
def test_live_ratio_never_falls_and_ends_at_the_final_one(tmp_path, searcher):
    """The live value used a reference fixed by the first batch and the final one 1.1 x the maxima of
    every measurement: the terminal's number jumped when a partition ended. Both now use one reference."""
    from kareus.config.hashing import stable_hash
    from kareus.events import BatchFinished, SearchFinished
    from kareus.hardware.tables import window_partition
    from kareus.launch import PartitionSearchTask, run_search_task

    search = {"name": searcher, "budget": 20}
    profiler = {"cooldown": {"name": "fixed", "seconds": 1.0}, "frequency": {"name": "sim"}}
    task = PartitionSearchTask(partition=window_partition(-1), hardware={"name": "sim"}, search=search,
                               profiler=profiler, seed=3, journal_path=str(tmp_path / "journal.sqlite"),
                               config_hash=stable_hash({"search": search, "profiler": profiler}))
    events: list = []
    result = run_search_task(task, listeners=[events.append])
    batches = [e for e in events if isinstance(e, BatchFinished)]
    [finished] = [e for e in events if isinstance(e, SearchFinished)]
    assert len(batches) >= 2 and {e.reference for e in batches} == {finished.reference} == {result.reference}
    ratios = [e.hypervolume_ratio for e in batches]
    assert all(0 < r < 1 for r in ratios) and ratios == sorted(ratios)
    assert finished.hypervolume_ratio == pytest.approx(ratios[-1])
