"""The agent's budget: PSI back-off and proration under the host-wide cap (pure), and the ledger around it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from vmcache.errors import HostError
from vmcache.host.ledger import Ledger
from vmcache.host.meminfo import MemInfo, MemoryPressure, PressureLine
from vmcache.model.budget import MIN_SHARE, next_share, prorate
from vmcache.service.budget import Budget
from vmcache.settings.config import PinnedCap

GiB = 1 << 30


def test_share_halves_per_cycle_over_the_threshold_then_drops_to_nothing() -> None:
    share, seen = 1.0, []
    for _ in range(5):
        share = next_share(share, level=40.0, threshold=10.0)
        seen.append(share)
    assert seen == [0.5, 0.25, 0.125, 0.0, 0.0]


def test_share_doubles_back_from_the_minimum_only_under_half_the_threshold() -> None:
    assert next_share(0.0, level=7.0, threshold=10.0) == 0.0  # between half and the threshold: hold
    assert next_share(0.25, level=10.0, threshold=10.0) == 0.25  # at the threshold: hold
    share, seen = 0.0, []
    for _ in range(5):
        share = next_share(share, level=4.9, threshold=10.0)
        seen.append(share)
    assert seen == [MIN_SHARE, 0.25, 0.5, 1.0, 1.0]


def test_prorate_gives_each_disk_the_same_fraction_of_its_own_budget() -> None:
    budgets = {"vda": 300, "vdb": 100}
    want = sum(budgets.values())
    assert {d: prorate(b, 1.0, want, want) for d, b in budgets.items()} == budgets
    assert {d: prorate(b, 1.0, want, 200) for d, b in budgets.items()} == {"vda": 150, "vdb": 50}
    assert {d: prorate(b, 0.5, want // 2, 100) for d, b in budgets.items()} == {"vda": 75, "vdb": 25}
    assert prorate(100, 1.0, 0, 0) == 100  # nothing wanted: nothing to scale
    assert prorate(100, 1.0, 100, 0) == 0  # the cap is taken by others


def _psi(level: float) -> MemoryPressure:
    return MemoryPressure(some=PressureLine(level, 0.0, 0.0, 0), full=None)


def _mem(total: int = 8 * GiB) -> MemInfo:
    return MemInfo(total, total, total, 0, 0, 0, 0)


def _budget(tmp_path: Path, levels: list[float], *, cap: PinnedCap = PinnedCap(), pid: int | None = None,
            domain: str = "d") -> Budget:
    ledger = Ledger(str(tmp_path / "ledger.json"), None, pid=pid, alive=lambda _p, _s: True)
    feed = iter(levels)
    return Budget(domain, ledger, cap=cap, psi_threshold=10.0, pressure=lambda: _psi(next(feed)),
                  meminfo=_mem, logger=logging.getLogger("test"))


def test_budget_backs_off_under_psi_and_reserves_what_it_grants(tmp_path: Path) -> None:
    budget = _budget(tmp_path, [0.0, 40.0, 40.0, 1.0])
    disks = {"vda": 64 << 20, "vdb": 32 << 20}
    full = budget.grant(disks, {}, held=0)
    assert (full.want, full.granted, full.backing_off) == (96 << 20, 96 << 20, False)
    assert dict(full.disks) == disks
    half = budget.grant(disks, {}, held=0)
    assert half.backing_off and dict(half.disks) == {"vda": 32 << 20, "vdb": 16 << 20}
    assert budget.grant(disks, {}, held=0).disks["vda"] == 16 << 20
    assert budget.grant(disks, {}, held=0).disks["vda"] == 32 << 20  # PSI low again: doubles back
    budget.hold(5 << 20)
    assert Ledger(str(tmp_path / "ledger.json"), None).entries()["d"].bytes == 5 << 20
    budget.release()
    assert "d" not in Ledger(str(tmp_path / "ledger.json"), None).entries()


def test_budget_prorates_disks_under_the_host_wide_cap(tmp_path: Path) -> None:
    other = _budget(tmp_path, [0.0], cap=PinnedCap(size=100 << 20, fraction=None), pid=1, domain="other")
    other.grant({"vda": 60 << 20}, {}, held=0)
    mine = _budget(tmp_path, [0.0], cap=PinnedCap(size=100 << 20, fraction=None), pid=2)
    grant = mine.grant({"vda": 60 << 20, "vdb": 20 << 20}, {}, held=0)
    # no demand curves yet: the cap is shared equally (50 each), but other still holds 60
    assert (grant.want, grant.target, grant.granted) == (80 << 20, 50 << 20, 40 << 20)
    assert dict(grant.disks) == {"vda": 30 << 20, "vdb": 10 << 20}


def _flat(nbytes: int, density: float) -> tuple[tuple[int, float], ...]:
    return ((nbytes, nbytes * density),)


def test_budget_takes_its_share_by_benefit_and_divides_it_between_disks_by_benefit(tmp_path: Path) -> None:
    MiB = 1 << 20
    cap = PinnedCap(size=100 * MiB, fraction=None)
    cold = _budget(tmp_path, [0.0] * 4, cap=cap, pid=1, domain="cold")
    hot = _budget(tmp_path, [0.0] * 4, cap=cap, pid=2, domain="hot")
    first = cold.grant({"vda": 100 * MiB}, {"vda": _flat(100 * MiB, 0.1)}, held=0)
    assert first.granted == 100 * MiB  # alone
    cold.hold(100 * MiB)
    grant = hot.grant({"vda": 50 * MiB, "vdb": 50 * MiB},
                      {"vda": _flat(10 * MiB, 0.9), "vdb": _flat(50 * MiB, 0.5)}, held=0)
    assert grant.demand == 60 * MiB and grant.target == 60 * MiB
    assert grant.granted == 0  # cold still holds the cap
    shrink = cold.grant({"vda": 100 * MiB}, {"vda": _flat(100 * MiB, 0.1)}, held=100 * MiB)
    assert shrink.target == 40 * MiB and shrink.granted == 40 * MiB
    cold.hold(40 * MiB)
    grant = hot.grant({"vda": 50 * MiB, "vdb": 50 * MiB},
                      {"vda": _flat(10 * MiB, 0.9), "vdb": _flat(50 * MiB, 0.5)}, held=0)
    assert grant.granted == 60 * MiB
    assert dict(grant.disks) == {"vda": 10 * MiB, "vdb": 50 * MiB}  # each disk what its curve asks


def test_guaranteed_minimum_and_minimums_over_the_cap(tmp_path: Path) -> None:
    MiB = 1 << 20
    cap = PinnedCap(size=100 * MiB, fraction=None)
    a = _budget(tmp_path, [0.0] * 2, cap=cap, pid=1, domain="a")
    b = _budget(tmp_path, [0.0] * 2, cap=cap, pid=2, domain="b")
    a.minimum, b.minimum = 80 * MiB, 40 * MiB
    a.grant({"vda": 100 * MiB}, {}, held=0)
    grant = b.grant({"vda": 100 * MiB}, {}, held=0)
    assert grant.error and "minimums" in grant.error and grant.minimum == 40 * MiB


def test_unreadable_psi_keeps_the_share(tmp_path: Path) -> None:
    levels = iter([40.0])

    def pressure() -> MemoryPressure:
        for level in levels:
            return _psi(level)
        raise HostError("cannot read pressure")

    budget = Budget("d", Ledger(str(tmp_path / "ledger.json"), None), cap=PinnedCap(), psi_threshold=10.0,
                    pressure=pressure, meminfo=_mem, logger=logging.getLogger("test"))
    assert budget.grant({"vda": 8}, {}, held=0).share == 0.5
    assert budget.grant({"vda": 8}, {}, held=0).share == 0.5  # unreadable now: kept, not reset


def test_a_ledger_that_cannot_be_locked_fails_the_grant(tmp_path: Path) -> None:
    (tmp_path / "ledger.json.lock").mkdir()  # the lock file cannot be opened
    with pytest.raises(HostError):
        _budget(tmp_path, [0.0]).grant({"vda": 8}, {}, held=0)


def test_disks_sharing_the_domains_rest_give_it_to_the_hot_one_and_never_pin_more_than_it(tmp_path: Path) -> None:
    """Two disks may each take the whole 256 MiB rest: the hot one gets it all, an idle one none of it."""
    MiB = 1 << 20
    budget = _budget(tmp_path, [0.0, 0.0, 0.0])
    disks = {"vda": 256 * MiB, "vdb": 256 * MiB}
    first = budget.grant(disks, {}, held=0, total=256 * MiB)  # no curves yet: half each, the total kept
    assert first.want == 256 * MiB and dict(first.disks) == {"vda": 128 * MiB, "vdb": 128 * MiB}
    hot = budget.grant(disks, {"vda": _flat(256 * MiB, 0.8)}, held=0, total=256 * MiB)
    assert hot.want == 256 * MiB and dict(hot.disks) == {"vda": 256 * MiB, "vdb": 0}
    both = budget.grant(disks, {"vda": _flat(200 * MiB, 0.8), "vdb": _flat(200 * MiB, 0.4)}, held=0,
                        total=256 * MiB)
    assert dict(both.disks) == {"vda": 200 * MiB, "vdb": 56 * MiB}
