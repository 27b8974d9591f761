"""`vmcache scan`: whole-file figures by default (one cachestat call, no numpy), blocks on request.

Resident pages are written and left dirty: this host's kernel reclaims
clean page cache within seconds (DAMON pageout), dirty pages stay for
dirty_expire_centisecs (30 s).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vmcache.cli import build_parser, main
from vmcache.errors import PageCacheError
from vmcache.host import cachestat
from vmcache.host.cachestat import PAGE_SIZE, file_cachestat

MiB = 1 << 20
SIZE = 16 * MiB + 3 * PAGE_SIZE
RESIDENT = [(2 * MiB, 3 * MiB), (9 * MiB + 4 * PAGE_SIZE, 8 * PAGE_SIZE)]  # blocks 2-4 full, 9 partly
PAGES = sum(n // PAGE_SIZE for _, n in RESIDENT)
BLOCK_KEYS = {"block_size", "blocks", "blocks_resident", "blocks_full"}

needs_cachestat = pytest.mark.skipif(not cachestat.cachestat_supported(), reason="kernel without cachestat")


def vmcache(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60)


@pytest.fixture
def image(tmp_path: Path) -> Path:
    path = tmp_path / "disk.img"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, SIZE)
        for off, length in RESIDENT:
            os.pwrite(fd, b"\xa5" * length, off)
    finally:
        os.close(fd)
    return path


@needs_cachestat
def test_default_json_is_whole_file_cachestat_without_blocks(image: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scan", str(image), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "cachestat"
    assert out["size_bytes"] == SIZE and out["page_size"] == PAGE_SIZE
    assert out["total_pages"] == -(-SIZE // PAGE_SIZE)
    assert out["resident_pages"] == out["nr_cache"] == PAGES
    assert out["resident_bytes"] == PAGES * PAGE_SIZE
    assert out["nr_dirty"] == PAGES  # written, never synced
    assert {"nr_writeback", "nr_evicted", "nr_recently_evicted", "elapsed_seconds"} <= out.keys()
    assert not BLOCK_KEYS & out.keys()


def test_blocks_flag_adds_the_block_counts(image: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scan", str(image), "--json", "--blocks"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["resident_pages"] == PAGES
    assert (out["block_size"], out["blocks"], out["blocks_resident"], out["blocks_full"]) == (MiB, 17, 4, 3)
    assert main(["scan", str(image), "--json", "--block-size", "2M"]) == 0  # --block-size implies --blocks
    out = json.loads(capsys.readouterr().out)
    assert (out["block_size"], out["blocks"], out["blocks_resident"], out["blocks_full"]) == (2 * MiB, 9, 3, 1)


def test_human_output_shows_blocks_only_when_asked(image: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scan", str(image)]) == 0
    out = capsys.readouterr().out
    assert f"Resident Pages: {PAGES}/{-(-SIZE // PAGE_SIZE)}" in out
    assert "Blocks:" not in out
    assert main(["scan", str(image), "--blocks"]) == 0
    assert "Blocks: 4/17 touched, 3 full (1MiB each)" in capsys.readouterr().out


def test_mincore_method_gives_the_same_pages(image: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scan", str(image), "--json", "--method", "mincore"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "mincore" and out["resident_pages"] == PAGES
    assert out["nr_dirty"] is None and not BLOCK_KEYS & out.keys()


def test_auto_falls_back_to_mincore_without_cachestat(
    image: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cachestat, "_NR_CACHESTAT", None)  # every cachestat call fails with ENOSYS
    monkeypatch.setattr(cachestat, "_supported", None)
    assert main(["scan", str(image), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "mincore" and out["resident_pages"] == PAGES
    assert main(["scan", str(image), "--method", "cachestat"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cachestat" in err[0] and "disk.img" in err[0]


def test_file_cachestat_errors(tmp_path: Path) -> None:
    with pytest.raises(PageCacheError) as info:
        file_cachestat(tmp_path / "missing.img")
    assert info.value.errno == errno.ENOENT and "missing.img" in str(info.value)


HEAVY = ("numpy", "scipy", "libvirt", "yaml")


@needs_cachestat
def test_default_scan_imports_no_numpy(image: Path) -> None:
    """The command as an operator runs it (``python -m vmcache``): no numpy, scipy, libvirt or yaml."""
    done = vmcache("-X", "importtime", "-m", "vmcache", "scan", str(image), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["resident_pages"] == PAGES
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "vmcache.host.cachestat" in imported  # the check below reads the right output
    assert {name for name in imported if name.split(".")[0] in HEAVY} == set()


@needs_cachestat
def test_default_scan_loads_only_its_own_command_module(image: Path) -> None:
    """sys.modules after the scan: also counts modules loaded by importlib (which -X importtime omits)."""
    code = (
        "import sys; from vmcache.cli import main; rc = main(['scan', sys.argv[1], '--json']); "
        "print(' '.join(sorted(sys.modules)), file=sys.stderr); sys.exit(rc)"
    )
    done = vmcache("-c", code, str(image))
    assert done.returncode == 0, done.stderr
    loaded = set(done.stderr.split())
    assert {name for name in loaded if name.split(".")[0] in HEAVY} == set()
    commands = {name for name in loaded if name.startswith("vmcache.commands.") and "._" not in name}
    assert commands == {"vmcache.commands.scan"}
    assert "logging" not in loaded  # scan sets LOGS = False: the CLI leaves logging alone


def test_blocks_does_import_numpy(image: Path) -> None:
    """The counterpart of the test above: --blocks needs the per-block scan."""
    code = "import sys; from vmcache.cli import main; main(['scan', sys.argv[1], '--blocks']); " \
           "print('numpy' in sys.modules)"
    done = vmcache("-c", code, str(image))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True"


def test_full_parser_still_lists_every_command() -> None:
    help_text = build_parser().format_help()
    for name in ("scan", "watch", "status", "enable", "disable"):
        assert name in help_text
    # an unknown command is reported against the full list
    done = vmcache("-m", "vmcache", "nope")
    assert done.returncode == 2 and "invalid choice: 'nope'" in done.stderr and "'scan'" in done.stderr
