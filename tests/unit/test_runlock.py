"""The host-wide run lock: one agent per run of a domain, whatever its host config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vmcache.errors import RunClaimedError
from vmcache.host.runlock import RunLock


def test_a_claimed_run_refuses_a_second_claim_naming_the_holder(tmp_path: Path) -> None:
    first = RunLock(str(tmp_path))
    first.claim("u", 7)
    with pytest.raises(RunClaimedError, match=f"pid {os.getpid()}"):
        RunLock(str(tmp_path)).claim("u", 7)
    RunLock(str(tmp_path)).claim("u", 8)  # another run of the same domain: a fast destroy/start's successor
    first.release()
    assert not (tmp_path / "u.7.lock").exists()
    again = RunLock(str(tmp_path))
    again.claim("u", 7)
    again.release()


def test_the_lock_ends_with_its_holder_even_killed(tmp_path: Path) -> None:
    """A kill -9 leaves the file, not the lock: the next agent claims the run."""
    code = (f"import sys, os; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r}); "
            f"from vmcache.host.runlock import RunLock; RunLock({str(tmp_path)!r}).claim('u', 3); "
            "print('held', flush=True); os.kill(os.getpid(), 9)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.stdout == "held\n" and done.returncode == -9
    assert (tmp_path / "u.3.lock").exists()
    lock = RunLock(str(tmp_path))
    lock.claim("u", 3)
    lock.release()
