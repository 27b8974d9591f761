"""The read counter's pure parts: record layouts from tracefs, the assembler, decoding the kernel's counts."""

from __future__ import annotations

import struct
from typing import Any
from pathlib import Path

import numpy as np
import pytest

from vmcache.host.bpfasm import Asm
from vmcache.host.btf import Member
from vmcache.host.readcount import decode, qemu_pid
from vmcache.host.tracefs import Field, parse_formats

FORMAT = """name: mm_filemap_get_pages
ID: 599
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:unsigned long i_ino;\toffset:8;\tsize:8;\tsigned:0;
\tfield:dev_t s_dev;\toffset:16;\tsize:4;\tsigned:0;
\tfield:unsigned long index;\toffset:24;\tsize:8;\tsigned:0;
\tfield:unsigned long last_index;\toffset:32;\tsize:8;\tsigned:0;

print fmt: "dev=%d:%d ino=%lx ofs=%lld-%lld", REC->s_dev
name: page_cache_sync_ra
ID: 617
format:
\tfield:unsigned long i_ino;\toffset:8;\tsize:8;\tsigned:0;
\tfield:char name[16];\toffset:16;\tsize:16;\tsigned:0;
"""


def test_formats_give_each_tracepoint_its_id_and_field_offsets() -> None:
    points = parse_formats(FORMAT)
    assert sorted(points) == ["mm_filemap_get_pages", "page_cache_sync_ra"]
    get = points["mm_filemap_get_pages"]
    assert get.id == 599
    assert get.fields["s_dev"] == Field(16, 4)
    assert get.fields["last_index"] == Field(32, 8)
    assert points["page_cache_sync_ra"].fields["name"] == Field(16, 16)


def test_assembler_encodes_instructions_and_resolves_jumps_both_ways() -> None:
    a = Asm()
    a.label("top")
    a.mov(6, ("r", 1))           # bf 16 0000 00000000
    a.jump("eq", 0, 0, "end")    # 15 00 0001 00000000: skips the next instruction
    a.jump("ja", 0, 0, "top")    # 05 00 fffd: back to 0
    a.label("end")
    a.exit()
    code = a.assemble()
    assert [code[i:i + 8].hex() for i in range(0, len(code), 8)] == [
        "bf16000000000000", "1500010000000000", "0500fdff00000000", "9500000000000000"]


def _entry(block: int, pages: int = 0, pdiff: int = 0, missed: int = 0, mdiff: int = 0) -> tuple[bytes, bytes]:
    return struct.pack("=Q", block), struct.pack("=qqqq", pages, pdiff, missed, mdiff)


def test_decode_adds_the_whole_blocks_a_span_marks_between_its_ends() -> None:
    # A read of pages 10..(5 * 256 + 9) with 256 pages a block: 246 in block 0, whole blocks 1-4, 10 in 5.
    entries = [_entry(5, pages=10, pdiff=-256), _entry(0, pages=246), _entry(1, pdiff=256),
               _entry(9, pages=3, missed=7)]
    reads = decode(entries, 256, nblocks=16)
    assert reads.pages.index.tolist() == [0, 1, 2, 3, 4, 5, 9]
    assert reads.pages.value.tolist() == [246, 256, 256, 256, 256, 10, 3]
    assert reads.missed.index.tolist() == [9]
    assert reads.missed.value.tolist() == [7]


def test_decode_overlapping_spans_and_blocks_past_the_disk() -> None:
    # two spans: whole blocks 2-5 and 4-7 (ppb 8); block 20 is past a 10-block disk
    entries = [_entry(2, pdiff=8), _entry(6, pdiff=-8), _entry(4, pdiff=8), _entry(8, pdiff=-8),
               _entry(20, pages=5)]
    reads = decode(entries, 8, nblocks=10)
    assert dict(zip(reads.pages.index.tolist(), reads.pages.value.tolist())) == {
        2: 8, 3: 8, 4: 16, 5: 16, 6: 8, 7: 8}
    assert reads.pages.index.dtype == np.int64
    assert decode([], 8, nblocks=10).pages.index.size == 0



def test_qemu_pid_is_the_pidfile_s_when_that_process_runs_the_domain(tmp_path: Path) -> None:
    run, proc = tmp_path / "run", tmp_path / "proc"
    run.mkdir()
    (proc / "42").mkdir(parents=True)
    (run / "web.pid").write_text("42\n")
    (proc / "42" / "cmdline").write_bytes(b"/usr/bin/qemu-system-x86_64\0-name\0guest=web,debug-threads=on\0")
    assert qemu_pid("web", run_dir=str(run), proc=str(proc)) == 42
    (run / "web-2.pid").write_text("42\n")  # a pid reused by another domain's QEMU
    assert qemu_pid("web-2", run_dir=str(run), proc=str(proc)) is None
    assert qemu_pid("absent", run_dir=str(run), proc=str(proc)) is None


@pytest.mark.parametrize("size", [0, 100, 4097])
def test_file_reads_refuse_block_sizes_that_are_not_whole_pages(size: int, tmp_path: Path) -> None:
    from vmcache.host.readcount import FileReads

    with pytest.raises(ValueError):
        FileReads(None, str(tmp_path), size, (1, 2), None)  # type: ignore[arg-type]  # refused before the maps are used


def bpf_map_stub(fd: int) -> Any:
    """A map as the assembler uses one: only its fd is read."""
    from types import SimpleNamespace

    return SimpleNamespace(fd=100 + fd)


class _Set:
    """A program set as :func:`load_set` sees one: for_kernel and load, either of which may refuse."""

    SIGNAL = "fake"
    refuse_kernel: Exception | None = None
    refuse_load: Exception | None = None
    loaded: list[str] = []

    @classmethod
    def for_kernel(cls) -> _Set:
        if cls.refuse_kernel:
            raise cls.refuse_kernel
        return cls()

    def load(self, maps: object) -> list[int]:
        if self.refuse_load:
            raise self.refuse_load
        _Set.loaded.append(self.SIGNAL)
        return [7]


class _Probe(_Set):
    SIGNAL = "probe"


class _Tracepoint(_Set):
    SIGNAL = "tracepoint"


class _FakeMaps:
    closed = 0

    @classmethod
    def create(cls) -> _FakeMaps:
        return cls()

    def close(self) -> None:
        _FakeMaps.closed += 1


@pytest.fixture
def sets(monkeypatch: pytest.MonkeyPatch) -> tuple[type[_Set], type[_Set]]:
    from vmcache.host import readhost

    monkeypatch.setattr(readhost, "Maps", _FakeMaps)
    _Set.loaded = []
    _FakeMaps.closed = 0
    for kind in (_Probe, _Tracepoint):
        monkeypatch.setattr(kind, "refuse_kernel", None)
        monkeypatch.setattr(kind, "refuse_load", None)
    return _Probe, _Tracepoint


def test_the_first_set_the_kernel_loads_runs_the_next_only_where_it_is_refused(sets: tuple[Any, Any]) -> None:
    from vmcache.host.bpf import BpfError
    from vmcache.host.readhost import load_set

    probe, tracepoint = sets
    _, links, chosen = load_set((probe, tracepoint))
    assert (type(chosen), links, _Set.loaded) == (probe, [7], ["probe"])
    probe.refuse_load = BpfError("program vmcache_fread1: Operation not permitted", errno=1)
    _, _, chosen = load_set((probe, tracepoint))
    assert type(chosen) is tracepoint and _FakeMaps.closed == 0  # the maps go on to the set that loaded


def test_no_set_is_one_error_with_every_set_s_reason_and_the_maps_closed(sets: tuple[Any, Any]) -> None:
    from vmcache.host.bpf import BpfError
    from vmcache.host.readhost import load_set
    from vmcache.host.readsets import NoReadSet

    probe, tracepoint = sets
    probe.refuse_load = BpfError("program vmcache_fread1: Operation not permitted", errno=1)
    tracepoint.refuse_kernel = NoReadSet("this kernel has no tracepoint filemap:mm_filemap_get_pages", errno=2)
    with pytest.raises(NoReadSet) as err:
        load_set((probe, tracepoint))
    assert str(err.value) == ("probe: program vmcache_fread1: Operation not permitted; "
                              "tracepoint: this kernel has no tracepoint filemap:mm_filemap_get_pages")
    assert _FakeMaps.closed == 1


def test_the_probe_s_programs_assemble_for_any_kernel_s_offsets() -> None:
    from vmcache.host.probeprog import Offsets, entry_program, exit_program
    from vmcache.host.readmaps import Maps
    from vmcache.host.readprog import added
    from vmcache.host.tracefs import Tracepoint

    maps = Maps(*(bpf_map_stub(i) for i in range(6)))
    offsets = Offsets(0, 8, 16, 0, Member(64, 8), 40, 16)
    for code in (entry_program(maps, offsets), exit_program(maps, offsets)):
        assert len(code) % 8 == 0 and code[-8:] == bytes.fromhex("9500000000000000")  # ends with exit
    # before 5.17 the tracepoint has no order field: a folio is one page
    old = Tracepoint("filemap", "mm_filemap_add_to_page_cache", 1, {"i_ino": Field(8, 8), "s_dev": Field(24, 4),
                                                                   "index": Field(16, 8)})
    from vmcache.host.readprog import program

    assert program(lambda a: added(a, maps, old), maps)
