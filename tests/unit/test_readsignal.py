"""The agent's read signal: counted where the host's counter opens, inferred (said once) where it cannot."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from vmcache.errors import HostError
from vmcache.model.blocks import BlockValues
from vmcache.model.reads import GuestReads
from vmcache.service.readsignal import INFERRED, ReadSignal


class FakeCounter:
    signal = "probe"

    def __init__(self) -> None:
        self.watched: list[tuple[str, int]] = []
        self.closed = False

    def watch(self, path: str, block_size: int) -> str:
        self.watched.append((path, block_size))
        return f"reads of {path}"

    def close(self) -> None:
        self.closed = True


def test_refused_counter_leaves_every_disk_inferred_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    opened: list[int] = []

    def refuse(pid: int) -> FakeCounter:
        opened.append(pid)
        raise HostError("program vmcache_reads1: Operation not permitted")

    signal = ReadSignal("web", logger=logging.getLogger("t"), open_counter=refuse,  # type: ignore[arg-type]
                        pid_of=lambda _: 4242)
    with caplog.at_level(logging.INFO):
        assert signal.watch("/a.img", 1 << 20) is None
        assert signal.watch("/b.img", 1 << 20) is None
    assert opened == [4242]  # asked once
    assert signal.signal == INFERRED and "not permitted" in (signal.reason or "")
    assert [r.getMessage() for r in caplog.records] == [
        'reads.inferred reason="program vmcache_reads1: Operation not permitted"']
    signal.close()


def test_no_qemu_process_is_a_reason_to_infer() -> None:
    signal = ReadSignal("web", logger=logging.getLogger("t"), open_counter=lambda pid: FakeCounter(),  # type: ignore[arg-type,return-value]
                        pid_of=lambda _: None)
    assert signal.watch("/a.img", 65536) is None
    assert signal.signal == INFERRED and "no QEMU" in (signal.reason or "")


def test_opened_counter_watches_each_image_and_is_closed_with_the_signal() -> None:
    counter = FakeCounter()
    signal = ReadSignal("web", logger=logging.getLogger("t"), open_counter=lambda pid: counter,  # type: ignore[arg-type,return-value]
                        pid_of=lambda _: 7)
    assert signal.watch("/a.img", 65536) == "reads of /a.img"  # type: ignore[comparison-overlap]
    assert signal.signal == "probe" and signal.reason is None  # the counter's set
    signal.close()
    assert counter.closed and counter.watched == [("/a.img", 65536)]


def test_read_totals_hits_are_per_block_reads_minus_pages_brought_in_never_below_zero() -> None:
    reads = GuestReads(BlockValues(np.array([1, 2, 5]), np.array([256, 10, 4], np.float32)),
                       BlockValues(np.array([1, 3, 5]), np.array([256, 64, 1], np.float32)))
    assert reads.totals() == (270, 13)  # block 1 all missed, 2 all hits, 5: 3 hits; 3 is readahead only
    assert GuestReads.empty().totals() == (0, 0)
