"""An Event a signal handler may set.

Python runs a signal handler in the main thread between two bytecodes,
wherever that thread is. ``threading.Event`` guards its flag with a
non-reentrant lock that ``wait`` and ``clear`` hold across a few bytecodes
of their own; a handler that calls ``set()`` there waits for a lock its own
thread holds, forever. The agent's loop waits on its wake event, and a
`vmcache disable` changes the metadata (the event thread sets the wake
event) and sends SIGTERM at once: the loop is woken and signalled within
the same instant. That is the likely cause of a hang seen once in CI
and once in 86 runs of that test here: an agent that never stopped, its
loop silent from the SIGTERM on while its event thread still logged.
"""

from __future__ import annotations

import threading

__all__ = ["SignalSafeEvent"]


class SignalSafeEvent(threading.Event):
    """``threading.Event`` whose lock is reentrant: ``set()`` from a signal handler cannot deadlock.

    A handler that interrupts the main thread inside ``wait`` or ``clear``
    takes the lock again, sets the flag and notifies; the interrupted
    method then carries on. Between other threads it is a plain Event.
    """

    def __init__(self) -> None:
        super().__init__()
        # Event's methods all go through this condition (CPython 3.x); tests/unit/test_signalsafe.py
        # checks that a handler run under it returns.
        self._cond = threading.Condition(threading.RLock())
