"""`vmcache watch`: the standalone tool as an operator runs it (a real subprocess)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vmcache.cli import main

from tests.pagecache_util import vmlck

MiB = 1 << 20


def vmcache(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vmcache", *args], capture_output=True, text=True,
                          timeout=60, **kw)


@pytest.fixture
def image(tmp_path: Path) -> Path:
    path = tmp_path / "disk.raw"
    with open(path, "wb") as f:
        f.truncate(64 * MiB)
        f.seek(8 * MiB)
        f.write(b"\xab" * 8 * MiB)  # resident: the page cache holds what was just written
    return path


@pytest.mark.parametrize("args, key", [
    (["--budget", "12Q"], "--budget"),
    (["--budget", "-5M"], "--budget"),
    (["--budget", "1G", "--decay", "1.5"], "--decay"),
    (["--budget", "1G", "--block-size", "1000"], "--block-size"),
    (["--budget", "1G", "--interval", "soon"], "--interval"),
])
def test_bad_values_get_a_one_line_error_naming_the_option(image: Path, args: list[str], key: str) -> None:
    proc = vmcache("watch", str(image), *args)
    assert proc.returncode == 2
    assert key in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_missing_image_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["watch", str(tmp_path / "nope.raw"), "--budget", "1G", "--count", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.raw" in err[0]


def test_json_cycles_pin_what_is_resident(image: Path) -> None:
    # The written 8 MiB are resident (guest-loaded) and get pinned; nobody reads them
    # afterwards, so the read evidence of the pinned pages lets them go again.
    proc = vmcache("watch", str(image), "--budget", "32M", "--interval", "0.2", "--count", "5", "--json",
                   "--decay", "0.5", "--prefetch-rate", "unlimited")
    assert proc.returncode == 0, proc.stderr
    cycles = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [c["cycle"] for c in cycles] == [1, 2, 3, 4, 5]
    assert all(c["pinned_bytes"] <= 32 * MiB for c in cycles)
    assert max(c["pinned_bytes"] for c in cycles) >= 8 * MiB
    assert cycles[-1]["size_bytes"] == 64 * MiB


def test_ctrl_c_releases_all_pins(image: Path, tmp_path: Path) -> None:
    png = tmp_path / "heat.png"
    proc = subprocess.Popen([sys.executable, "-m", "vmcache", "watch", str(image), "--budget", "32M",
                             "--interval", "0.2", "--decay", "0.5", "--png", str(png)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("cycle 1: pinned")
        deadline = time.monotonic() + 10
        while vmlck(proc.pid) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert vmlck(proc.pid) > 0
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert "released all pins" in err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
