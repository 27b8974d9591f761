"""The test hook: vmcache's libvirt hook installed for a test's host config, and put back after.

The hook is host-wide: :func:`installed_hook` holds :data:`HOOK_LOCK`
(flock) for as long as a test hook is installed, so two live tests (or a
test and the soak) never replace each other's hook.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.live.livelib import REPO

__all__ = ["HOOK_LOCK", "HOOK_PATHS", "installed_hook", "is_our_hook"]

HOOKS_DIR = Path("/etc/libvirt/hooks")
HOOK_PATHS = (HOOKS_DIR / "qemu", HOOKS_DIR / "qemu.d" / "vmcache")
# The hook is host-wide: whoever installs a test hook takes this lock for as long as it is theirs.
HOOK_LOCK = "/run/lock/vmcache-live-hook.lock"
HOOK_MARKER = "vmcache-hook"



def is_our_hook(path: Path) -> bool:
    """Whether ``path`` is a vmcache hook (ours or an operator's install), not another program's."""
    return path.is_file() and HOOK_MARKER in path.read_text(errors="replace")


_held_by_us = False


@contextmanager
def installed_hook(config: Path, python: str = sys.executable) -> Iterator[str]:
    """The vmcache hook installed for host config ``config`` while inside; install.sh's output.

    Takes :data:`HOOK_LOCK` first (waits while another test's hook is
    installed), installs with ``scripts/install.sh --hook-only`` (libvirtd
    reloads when the hook is new). On exit removes the hook it installed and
    puts back the vmcache hook that was there, unless someone replaced ours
    meanwhile (then it is theirs and left alone). A foreign hook is never
    touched. Raises AssertionError when install.sh fails, RuntimeError when
    this process already holds the lock.
    """
    global _held_by_us
    if _held_by_us:
        raise RuntimeError("this process has a test hook installed already")
    os.makedirs(os.path.dirname(HOOK_LOCK), exist_ok=True)
    lock = os.open(HOOK_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    _held_by_us = True
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # waits for another live test's hook to be gone
        backups = {p: p.read_bytes() for p in HOOK_PATHS if is_our_hook(p)}
        had_qemu_d = HOOK_PATHS[1].parent.exists()
        installed: dict[Path, bytes] = {}
        try:
            done = subprocess.run([str(REPO / "scripts" / "install.sh"), "--hook-only", "--python", python,
                                   "--config", str(config)], capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr + done.stdout
            installed.update({p: p.read_bytes() for p in HOOK_PATHS if is_our_hook(p)})
            yield done.stdout
        finally:
            for path, content in installed.items():
                if path.exists() and path.read_bytes() == content:
                    path.unlink()
                    if path in backups:
                        path.write_bytes(backups[path])
                        path.chmod(0o755)
            if not had_qemu_d:
                try:
                    HOOK_PATHS[1].parent.rmdir()
                except OSError:
                    pass
    finally:
        os.close(lock)  # releases the flock
        _held_by_us = False
