"""SignalSafeEvent: a real signal handler sets it while the main thread holds its lock, and returns.

In a subprocess: with ``threading.Event`` the same script never ends (the
handler waits for a lock its own thread holds), which the timeout turns
into a failure instead of a hung test run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, signal
    from {module} import {name} as Event

    event = Event()
    signal.signal(signal.SIGUSR1, lambda *_: event.set())
    with event._cond:  # where Event.wait and Event.clear are between two bytecodes
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(1000):  # the handler runs at one of these bytecodes
            pass
    print("set" if event.wait(5) else "not set")
""")


def run(module: str, name: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(module=module, name=name)], capture_output=True,
                          text=True, timeout=timeout)


def test_a_signal_handler_sets_it_while_its_own_thread_holds_the_lock() -> None:
    done = run("vmcache.service.signalsafe", "SignalSafeEvent")
    assert done.returncode == 0 and done.stdout.strip() == "set", done


def test_a_plain_event_in_its_place_hangs() -> None:
    """What the first test guards against, shown on the standard Event (the reason for the class)."""
    with pytest.raises(subprocess.TimeoutExpired):
        run("threading", "Event", timeout=3)
