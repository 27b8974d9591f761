"""HeatModel: what the heat of a block does under reads, writes, pinning and time."""

from __future__ import annotations

import numpy as np
import pytest

from vmcache.model.heat import HeatModel
from vmcache.model.params import ModelParams

N = 400


def arrays(n: int = N) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, bool)


def run(model: HeatModel, res: np.ndarray, wr: np.ndarray, ours: np.ndarray, cycles: int, t0: float = 0.0) -> float:
    """Step ``cycles`` times one interval apart; return the last ``now``."""
    now = t0
    for _ in range(cycles):
        model.step(res, wr, ours, now)
        now += model.params.interval
    return now - model.params.interval


def test_wide_resident_region_heats_towards_read_amplitude() -> None:
    p = ModelParams(read_amplitude=1.5)
    m = HeatModel(p, N)
    res, wr, ours = arrays()
    res[100:200] = 1.0
    run(m, res, wr, ours, 200)
    assert m.heat[150] == pytest.approx(1.5, rel=1e-3)
    assert m.heat[0] == 0.0 and m.heat[399] == 0.0
    # smoothing dilutes an isolated resident block below a wide region
    res[:] = 0
    res[300] = 1.0
    m2 = HeatModel(p, N)
    run(m2, res, wr, ours, 200)
    assert m2.heat[300] < 0.5 * 1.5


def test_first_step_counts_one_interval() -> None:
    p = ModelParams()
    m = HeatModel(p, N)
    res, wr, ours = arrays()
    res[100:200] = 1.0
    heat = m.step(res, wr, ours, 1234.0)
    assert heat[150] == pytest.approx((1 - p.decay) * p.read_amplitude, rel=1e-4)


def test_written_region_outranks_read_only_region_of_equal_residency() -> None:
    m = HeatModel(ModelParams(), N)
    res, wr, ours = arrays()
    res[50:100] = 1.0
    res[250:300] = 1.0
    wr[250:300] = 0.25
    run(m, res, wr, ours, 5)
    assert m.heat[250:300].sum() > 1.5 * m.heat[50:100].sum()


def test_our_residency_is_masked_and_does_not_heat_neighbours() -> None:
    m = HeatModel(ModelParams(), N)
    res, wr, ours = arrays()
    res[100:200] = 1.0
    ours[100:200] = True
    run(m, res, wr, ours, 50)
    assert float(m.heat.max()) == 0.0


def test_writes_to_our_blocks_still_count() -> None:
    m = HeatModel(ModelParams(), N)
    res, wr, ours = arrays()
    res[100:200] = 1.0
    ours[100:200] = True
    wr[100:200] = 0.5
    run(m, res, wr, ours, 50)
    assert m.heat[150] > m.params.threshold


def test_our_blocks_hold_heat_at_pinned_decay_others_at_decay() -> None:
    p = ModelParams(decay=0.8, pinned_decay=0.95)
    m = HeatModel(p, N)
    res, wr, ours = arrays()
    res[50:150] = 1.0
    res[250:350] = 1.0
    t = run(m, res, wr, ours, 100)
    h0 = m.heat.copy()
    res[:] = 0.0  # guest goes quiet; region 1 is ours (pinned), region 2 not
    ours[50:150] = True
    for k in range(1, 11):
        m.step(res, wr, ours, t + k * p.interval)
    assert m.heat[100] == pytest.approx(h0[100] * 0.95**10, rel=1e-3)
    assert m.heat[300] == pytest.approx(h0[300] * 0.8**10, rel=1e-3)


def test_two_half_interval_steps_match_one_interval_step() -> None:
    p = ModelParams(interval=10.0, decay=0.7)
    res, wr, ours = arrays()
    res[100:200] = 1.0
    wr[120:130] = 0.5
    a, b = HeatModel(p, N), HeatModel(p, N)
    ta = run(a, res, wr, ours, 3)
    tb = run(b, res, wr, ours, 3)
    quiet = np.zeros(N, np.float32)
    a.step(quiet, quiet, ours, ta + 10.0)
    b.step(quiet, quiet, ours, tb + 5.0)
    b.step(quiet, quiet, ours, tb + 10.0)
    np.testing.assert_allclose(a.heat, b.heat, rtol=1e-5, atol=1e-7)
    # and a longer gap decays more than a shorter one
    c = HeatModel(p, N)
    tc = run(c, res, wr, ours, 3)
    c.step(quiet, quiet, ours, tc + 30.0)
    assert c.heat[150] < a.heat[150] * 0.7**1.5


def test_step_without_elapsed_time_changes_nothing() -> None:
    m = HeatModel(ModelParams(), N)
    res, wr, ours = arrays()
    res[100:200] = 1.0
    m.step(res, wr, ours, 100.0)
    before = m.heat.copy()
    m.step(np.ones(N, np.float32), wr, ours, 100.0)
    m.step(np.ones(N, np.float32), wr, ours, 50.0)
    np.testing.assert_array_equal(m.heat, before)


def test_resize_keeps_heat_of_surviving_blocks() -> None:
    m = HeatModel(ModelParams(), N)
    res, wr, ours = arrays()
    res[100:200] = 1.0
    t = run(m, res, wr, ours, 10)
    before = m.heat.copy()
    m.resize(600)
    assert m.nblocks == 600
    np.testing.assert_array_equal(m.heat[:N], before)
    assert not m.heat[N:].any()
    res2, wr2, ours2 = arrays(600)
    m.step(res2, wr2, ours2, t + 10.0)  # steps work at the new size
    m.resize(150)
    assert m.nblocks == 150
    assert m.heat[120] > 0
    with pytest.raises(ValueError):
        m.step(res2, wr2, ours2, t + 20.0)


def test_reset_forgets_heat_and_time() -> None:
    p = ModelParams()
    m = HeatModel(p, N)
    res, wr, ours = arrays()
    res[100:200] = 1.0
    run(m, res, wr, ours, 10)
    m.reset()
    assert not m.heat.any()
    heat = m.step(res, wr, ours, 5.0)  # first step again: one interval
    assert heat[150] == pytest.approx((1 - p.decay) * p.read_amplitude, rel=1e-4)


def test_heat_is_read_only_and_inputs_are_not_modified() -> None:
    m = HeatModel(ModelParams(), N)
    res, wr, ours = arrays()
    res[100:200] = 1.0
    ours[150:160] = True
    saved = res.copy()
    heat = m.step(res, wr, ours, 0.0)
    np.testing.assert_array_equal(res, saved)
    with pytest.raises(ValueError):
        heat[0] = 1.0
    assert heat.dtype == np.float32


def test_distinct_sigmas_give_independent_filters() -> None:
    p = ModelParams(read_sigma=1.0, write_sigma=8.0)
    m = HeatModel(p, N)
    res, wr, ours = arrays()
    wr[200] = 1.0
    res[100] = 1.0
    run(m, res, wr, ours, 300)
    # wide write kernel reaches further than the narrow read kernel
    assert m.heat[216] > 0 and m.heat[106] == 0


@pytest.mark.parametrize("name", ["residency", "writes", "ours"])
def test_wrong_shape_is_a_value_error(name: str) -> None:
    m = HeatModel(ModelParams(), N)
    args = dict(zip(("residency", "writes", "ours"), arrays()))
    args[name] = args[name][:-1]
    with pytest.raises(ValueError, match=name):
        m.step(args["residency"], args["writes"], args["ours"], 0.0)


def test_zero_blocks_is_allowed() -> None:
    m = HeatModel(ModelParams(), 0)
    res, wr, ours = arrays(0)
    assert m.step(res, wr, ours, 0.0).shape == (0,)


def test_our_blocks_count_as_unknown_not_cold_for_their_neighbours() -> None:
    """The guest-read edges of a pinned region keep full heat (they get pinned too)."""
    p = ModelParams()
    m = HeatModel(p, N)
    res, wr, ours = arrays()
    res[100:200] = 1.0  # guest reads all of it; the middle is pinned by us
    ours[104:196] = True
    run(m, res, wr, ours, 200)
    # the edge block is the mean of its known neighbours: half in, half out
    assert 0.5 * p.read_amplitude < m.heat[100] < 0.7 * p.read_amplitude
    assert m.heat[103] > 0.85 * p.read_amplitude
    assert m.heat[97] < 0.25 * p.read_amplitude  # outside: still diluted


def test_disk_ends_are_not_halved() -> None:
    p = ModelParams()
    m = HeatModel(p, N)
    res, wr, ours = arrays()
    res[:50] = 1.0
    res[-50:] = 1.0
    run(m, res, wr, ours, 200)
    assert m.heat[0] == pytest.approx(m.heat[25], rel=1e-3)
    assert m.heat[-1] == pytest.approx(m.heat[-25], rel=1e-3)


def test_changing_ours_is_taken_into_account_every_step() -> None:
    p = ModelParams()
    m = HeatModel(p, N)
    res, wr, ours = arrays()
    res[100:200] = 1.0
    run(m, res, wr, ours, 100)
    ours2 = ours.copy()
    ours2[100:200] = True  # now we pin all of it: from here on no read signal
    t = 100 * p.interval
    for k in range(20):
        m.step(res, wr, ours2 if k % 2 else ours2.copy(), t + k * p.interval)
    assert m.heat[150] == pytest.approx(p.read_amplitude * p.pinned_decay**20, rel=0.02)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0, 3.7, 16.0])
def test_smoothing_matches_scipy_gaussian_filter1d(sigma: float) -> None:
    from scipy.ndimage import gaussian_filter1d

    rng = np.random.default_rng(5)
    for n in (1, 7, 50, 5000):
        p = ModelParams(read_sigma=sigma, write_sigma=sigma / 2, decay=0.5, pinned_decay=0.5)
        m = HeatModel(p, n)
        res = rng.random(n).astype(np.float32)
        wr = (rng.random(n) < 0.1).astype(np.float32) * 0.5
        ours = np.zeros(n, bool)
        m.step(res, wr, ours, 0.0)
        # the reference: scipy, normalised by the (here all-known) kernel weight
        known = gaussian_filter1d(np.ones(n), sigma, mode="constant")
        s = p.read_amplitude * gaussian_filter1d(res.astype(np.float64), sigma, mode="constant") / known
        s += p.write_amplitude * gaussian_filter1d(wr.astype(np.float64), sigma / 2, mode="constant")
        np.testing.assert_allclose(m.heat, 0.5 * s, rtol=1e-5, atol=1e-6)


def test_own_heat_stays_on_the_block_the_gaussian_spreads_over_its_neighbours() -> None:
    p = ModelParams(decay=0.5)
    m = HeatModel(p, N)
    res, wr, ours = arrays()
    wr[100] = 1.0            # one written block
    res[200:210] = 1.0       # a read range
    run(m, res, wr, ours, 20)
    assert m.heat[99] > p.threshold and m.heat[101] > p.threshold  # the filter warms the neighbours
    assert m.own[100] == pytest.approx(p.write_amplitude, rel=1e-3)
    assert m.own[99] == 0.0 and m.own[101] == 0.0                  # they did nothing themselves
    np.testing.assert_allclose(m.own[200:210], p.read_amplitude, rtol=1e-3)
    assert not m.own[190:200].any() and not m.own[210:220].any()


def test_own_heat_of_our_blocks_is_held_like_their_heat_and_resize_reset_keep_it_in_step() -> None:
    p = ModelParams(decay=0.8, pinned_decay=0.95)
    m = HeatModel(p, N)
    res, wr, ours = arrays()
    res[50:150] = 1.0
    t = run(m, res, wr, ours, 60)
    o0 = m.own[100]
    res[:] = 0.0
    ours[50:150] = True      # pinned: its reads are invisible, own heat held at pinned_decay
    for k in range(1, 6):
        m.step(res, wr, ours, t + k * p.interval)
    assert m.own[100] == pytest.approx(o0 * 0.95**5, rel=1e-3)
    with pytest.raises(ValueError):
        m.own[0] = 1.0       # read-only view
    m.resize(600)
    assert m.own.shape == (600,) and m.own[100] > 0 and not m.own[N:].any()
    m.reset()
    assert not m.own.any()
