"""scripts/install.sh --hook-only: where the hook goes, and that a foreign hook is never touched."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALL = str(REPO / "scripts" / "install.sh")

pytestmark = pytest.mark.skipif(shutil.which("libvirtd") is None, reason="needs libvirtd --version")


def install(hooks_dir, *extra, config="/tmp/vmcache-test.yaml"):
    done = subprocess.run(
        [INSTALL, "--hook-only", "--python", sys.executable, "--config", config, "--hooks-dir", str(hooks_dir),
         "--no-reload", *extra],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_free_slot_gets_the_hook_rendered_for_this_python(tmp_path):
    out = install(tmp_path)
    hook = tmp_path / "qemu"
    text = hook.read_text()
    assert "vmcache-hook" in text
    assert f"VMCACHE_PYTHON={sys.executable}\n" in text and "VMCACHE_CONFIG=/tmp/vmcache-test.yaml\n" in text
    assert hook.stat().st_mode & 0o111
    assert "reload libvirtd so it sees it" in out  # new hook: libvirtd must be told
    # it runs: a migrate filter echoes the XML
    xml = b"<domain><name>x</name></domain>"
    done = subprocess.run([str(hook), "x", "migrate", "begin", "-"], input=xml, capture_output=True, timeout=30)
    assert (done.returncode, done.stdout) == (0, xml)
    # reinstalling updates in place, and is not a new hook
    assert "reload libvirtd" not in install(tmp_path, config="/etc/other.yaml")
    assert "VMCACHE_CONFIG=/etc/other.yaml\n" in hook.read_text()
    assert not (tmp_path / "qemu.d").exists()


def test_foreign_hook_is_never_overwritten(tmp_path):
    foreign = tmp_path / "qemu"
    foreign.write_text("#!/bin/sh\n# someone else's hook\nexit 0\n")
    foreign.chmod(0o755)
    before = foreign.read_bytes()
    out = install(tmp_path)
    assert foreign.read_bytes() == before
    ours = tmp_path / "qemu.d" / "vmcache"
    assert "vmcache-hook" in ours.read_text()
    assert f"{foreign} belongs to another program: left alone, vmcache's hook goes to {ours}" in out
    # uninstall removes ours only
    out = install(tmp_path, "--uninstall")
    assert not ours.exists() and foreign.read_bytes() == before
    assert f"left {foreign} alone" in out


def test_uninstall_removes_our_hook(tmp_path):
    install(tmp_path)
    out = install(tmp_path, "--uninstall")
    assert not (tmp_path / "qemu").exists()
    assert "removed hook" in out


def test_hook_left_behind_without_vmcache_stays_out_of_the_way(tmp_path):
    """After vmcache's python is gone, the hook still exits 0 and echoes filters."""
    subprocess.run([INSTALL, "--hook-only", "--python", str(tmp_path / "gone" / "python"), "--hooks-dir",
                    str(tmp_path), "--no-reload"], check=True, capture_output=True, timeout=60)
    for op, expect in (("migrate", b"<x/>"), ("started", b"")):
        done = subprocess.run([str(tmp_path / "qemu"), "d", op, "begin", "-"], input=b"<x/>", capture_output=True,
                              timeout=30)
        assert (done.returncode, done.stdout) == (0, expect)


def _validation_commands() -> list[tuple[str, str]]:
    """The ``python -c '...'`` config checks that install.sh and the package's postinst run."""
    found = []
    for path in (REPO / "scripts" / "install.sh", REPO / "debian" / "vmcache.postinst"):
        for line in path.read_text().splitlines():
            if "load_host_config" in line and " -c '" in line:
                found.append((path.name, line.split(" -c '", 1)[1].split("'", 1)[0]))
    return found


def test_the_config_checks_of_install_and_postinst_accept_a_good_config_and_refuse_a_bad_one(tmp_path):
    """Both run on every install/upgrade; an import they name that no longer exists made every
    upgrade warn that a good config was invalid."""
    commands = _validation_commands()
    assert {name for name, _ in commands} == {"install.sh", "vmcache.postinst"}
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text((REPO / "hooks" / "vmcache.yaml").read_text())
    bad.write_text("interval: -3\n")
    for name, code in commands:
        ok = subprocess.run([sys.executable, "-c", code, str(good)], capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0, (name, ok.stderr)
        refused = subprocess.run([sys.executable, "-c", code, str(bad)], capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0 and "ImportError" not in refused.stderr, (name, refused.stderr)
