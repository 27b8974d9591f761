"""/proc/meminfo and PSI parsing, on recorded samples and on this host's files."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from vmcache.errors import HostError
from vmcache.host.meminfo import (
    MEMINFO_PATH,
    PRESSURE_PATH,
    parse_meminfo,
    parse_pressure,
    read_meminfo,
    read_pressure,
)

# Recorded from the Debian 12 / kernel 6.18 test host (first lines, kB values).
MEMINFO_SAMPLE = """\
MemTotal:       24684092 kB
MemFree:        23620996 kB
MemAvailable:   24304804 kB
Buffers:           18140 kB
Cached:           834232 kB
SwapCached:            0 kB
Active:           412000 kB
Unevictable:       14880 kB
Mlocked:           14880 kB
Dirty:               128 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
"""

PSI_SAMPLE = """\
some avg10=1.25 avg60=0.40 avg300=0.08 total=123456
full avg10=0.50 avg60=0.10 avg300=0.00 total=65432
"""

KiB = 1024


def test_meminfo_sample(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    path.write_text(MEMINFO_SAMPLE)
    info = read_meminfo(str(path))
    assert info.total_bytes == 24684092 * KiB
    assert info.available_bytes == 24304804 * KiB
    assert info.free_bytes == 23620996 * KiB
    assert info.cached_bytes == 834232 * KiB
    assert info.mlocked_bytes == 14880 * KiB
    assert info.unevictable_bytes == 14880 * KiB
    assert info.dirty_bytes == 128 * KiB
    assert info.fields["HugePages_Total"] == 0  # unitless lines are counts, not kB
    assert info.fields["Buffers"] == 18140 * KiB


def test_meminfo_without_memavailable_falls_back_to_free() -> None:
    info = parse_meminfo("MemTotal: 1000 kB\nMemFree: 300 kB\n")
    assert info.available_bytes == 300 * KiB


def test_meminfo_errors(tmp_path: Path) -> None:
    with pytest.raises(HostError) as info:
        read_meminfo(str(tmp_path / "missing"))
    assert info.value.errno == errno.ENOENT
    garbage = tmp_path / "garbage"
    garbage.write_text("hello\n")
    with pytest.raises(HostError):
        read_meminfo(str(garbage))


def test_pressure_sample(tmp_path: Path) -> None:
    path = tmp_path / "memory"
    path.write_text(PSI_SAMPLE)
    psi = read_pressure(str(path))
    assert psi is not None
    assert psi.some.avg10 == 1.25 and psi.some.avg60 == 0.40 and psi.some.avg300 == 0.08
    assert psi.some.total_us == 123456
    assert psi.full is not None and psi.full.avg10 == 0.50 and psi.full.total_us == 65432


def test_pressure_without_full_line() -> None:
    psi = parse_pressure("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    assert psi.full is None


def test_missing_psi_is_none(tmp_path: Path) -> None:
    assert read_pressure(str(tmp_path / "no-psi")) is None


def test_bad_psi_raises(tmp_path: Path) -> None:
    bad = tmp_path / "memory"
    bad.write_text("some avg10=x\n")
    with pytest.raises(HostError):
        read_pressure(str(bad))


def test_real_files() -> None:
    info = read_meminfo()
    assert 0 < info.available_bytes <= info.total_bytes
    assert info.total_bytes > 256 << 20
    if Path(PRESSURE_PATH).exists():
        psi = read_pressure()
        assert psi is not None and 0.0 <= psi.some.avg10 <= 100.0
    assert MEMINFO_PATH == "/proc/meminfo"
