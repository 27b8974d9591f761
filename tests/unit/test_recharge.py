"""Pins read in by the agent (Pinner ``recharge``), on a real file with real mlock and real device reads.

Where QEMU is under a memory limit the agent is not, a pin must hold pages
the agent read in itself: those are charged to the agent's memory cgroup,
and a limit an operator lowers on QEMU's never meets pages it cannot
reclaim. The charge itself is checked live (tests/live/test_memcg_live.py);
here, that the pinner reads what it should: the bytes this process read
from the device (``read_bytes`` of /proc/self/io).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vmcache.host.pinner import Pinner
from vmcache.service.engine import DiskEngine
from vmcache.service.enginepolicy import EnginePolicy
from vmcache.model.region import Region

from tests.pagecache_util import fake_meminfo, random_image, vmlck

MiB = 1 << 20
SIZE = 32 * MiB


def plenty():
    return fake_meminfo(available=64 << 30)()


def read_bytes() -> int:
    with open("/proc/self/io", encoding="ascii") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


@pytest.fixture
def cached(tmp_path: Path) -> Path:
    """A 32 MiB image on disk, all of it in the page cache (read by someone else: charged to them)."""
    path = random_image(tmp_path / "disk.img", SIZE)
    with open(path, "rb") as f:
        while f.read(4 * MiB):
            pass
    return path


def reads_of(action) -> int:
    before = read_bytes()
    action()
    return read_bytes() - before


def test_without_recharge_a_cached_pin_reads_nothing_and_recharge_reads_it_again_once(
        cached: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO")
    a = Region(4 * MiB, 4 * MiB, 2.0)
    base = vmlck()
    with Pinner(cached, floor_bytes=0, meminfo=plenty, apart=lambda: True) as pinner:
        assert pinner.charges_apart()
        assert reads_of(lambda: pinner.apply([a], budget=SIZE)) < MiB  # the first reader's pages, locked
        assert reads_of(lambda: pinner.recharge(None)) >= a.length  # dropped and read in by this process
        assert "pin.recharge bytes=4194304 failures=0" in caplog.text
        assert [r.span for r in pinner.pinned] == [a.span] and vmlck() - base == a.length
        assert reads_of(lambda: pinner.recharge(None)) == 0  # read in by the agent already: nothing to do
    assert vmlck() == base


def test_a_new_pin_under_recharge_reads_all_of_itself_and_a_grown_one_only_its_new_bytes(cached: Path) -> None:
    a, b = Region(2 * MiB, 4 * MiB, 2.0), Region(16 * MiB, 2 * MiB, 1.0)
    with Pinner(cached, floor_bytes=0, meminfo=plenty, apart=lambda: True) as pinner:
        assert reads_of(lambda: pinner.apply([a, b], budget=SIZE, recharge=True)) >= 6 * MiB
        grown = Region(2 * MiB, 6 * MiB, 2.0)  # the held 4 MiB stay locked, the new 2 MiB are read in
        read = reads_of(lambda: pinner.apply([grown, b], budget=SIZE, recharge=True))
        assert 2 * MiB <= read < 4 * MiB
        assert reads_of(lambda: pinner.recharge(None)) == 0  # all of it the agent's


def test_recharge_goes_by_priority_within_its_allowance_but_moves_at_least_one_pin(
        cached: Path, caplog: pytest.LogCaptureFixture) -> None:
    pins = [Region(0, 4 * MiB, 1.0), Region(8 * MiB, 4 * MiB, 3.0), Region(16 * MiB, 4 * MiB, 2.0)]

    def recharged() -> list[str]:
        return [r.getMessage().split()[1] for r in caplog.records if "reason=recharge" in r.getMessage()]

    caplog.set_level("INFO")
    with Pinner(cached, floor_bytes=0, meminfo=plenty) as pinner:
        assert not pinner.charges_apart()  # nobody said: QEMU shares the agent's limits
        pinner.apply(pins, budget=SIZE)
        assert 4 * MiB <= reads_of(lambda: pinner.recharge(MiB)) < 8 * MiB  # one pin, larger than the allowance
        assert 4 * MiB <= reads_of(lambda: pinner.recharge(6 * MiB)) < 8 * MiB  # the next: two would pass it
        assert 4 * MiB <= reads_of(lambda: pinner.recharge(None)) < 8 * MiB  # the last
        assert recharged() == ["start=8388608", "start=16777216", "start=0"]  # highest priority first
        assert len(pinner.pinned) == 3


def test_the_engine_reads_its_pins_in_while_qemu_is_apart_and_reports_them(
        cached: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A real engine: pins made by the guest's reads, then QEMU comes under a limit the agent is not."""
    from tests.unit.test_engine import PARAMS, Clock, guest_read

    caplog.set_level("INFO")
    apart = {"now": False}
    with DiskEngine(cached, params=PARAMS, budget=SIZE, policy=EnginePolicy(0, apart=lambda: apart["now"]),
                    meminfo=plenty, clock=Clock()) as e:
        for _ in range(4):
            guest_read(cached, 8 * MiB, 8 * MiB)
            stats = e.cycle()
        assert stats.pinned_bytes >= 8 * MiB and stats.agent_charged_bytes == 0
        apart["now"] = True
        guest_read(cached, 8 * MiB, 8 * MiB)
        read = reads_of(lambda: e.cycle())
        assert e.last is not None and e.last.agent_charged_bytes == e.last.pinned_bytes >= 8 * MiB
        assert read >= 8 * MiB  # no prefetch limit here: all of it at once
        assert "pin.charged_to who=agent" in caplog.text and "pin.recharge" in caplog.text
