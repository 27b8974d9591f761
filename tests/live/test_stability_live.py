"""A real agent's plan holds still while nothing reads or writes: no pin moves, nothing reloaded."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

libvirt = pytest.importorskip("libvirt")

from vmcache.cli import main  # noqa: E402

from tests.live.livelib import MiB, LiveEnv, agents_env, wait_for  # noqa: E402

from tests.live.guestlib import write_until_pinned  # noqa: E402

pytestmark = pytest.mark.live

PREFIX = f"vmcache-test-stab-{os.getpid()}-"
SETTLE = 4  # 1-second cycles after the last write before the plan is watched


@pytest.fixture(scope="module")
def env(live_tmp: Path, hooked) -> Iterator[LiveEnv]:
    yield from agents_env(live_tmp, hooked, PREFIX, cap=64 * MiB)


_PIN = re.compile(r"pin\.(add|remove) start=(\d+) length=(\d+)")


def _pins(log: str) -> list[tuple[str, range]]:
    """The log's pin events in order: ("add" or "remove", the MiB blocks)."""
    return [(op, range(int(a) // MiB, -(-(int(a) + int(n)) // MiB))) for op, a, n in _PIN.findall(log)]


def _still(env: LiveEnv, name: str, cycles: int, budget: int) -> None:
    """Over ``cycles`` 1-second cycles of an idle guest no pin takes a block that was not pinned at their
    start (pins may shrink and fade, not move: a move locks, or reloads, what the guest left), and the pins
    stay inside ``budget``."""
    before = len(_pins(env.agent_log(name)))
    time.sleep(cycles)
    log = env.agent_log(name)
    events = _pins(log)
    held: set[int] = set()
    for op, blocks in events[:before]:
        held = held | set(blocks) if op == "add" else held - set(blocks)
    moved = [(op, b) for op, b in events[before:] if op == "add" and not set(b) <= held]
    assert not moved, f"pins moved while nothing happened: {moved} (held {sorted(held)})\n{log[-4000:]}"
    assert env.pinned(name) <= budget


def test_an_idle_guest_s_pins_stay_where_they_are_when_its_zone_is_larger_than_the_budget(env: LiveEnv) -> None:
    name = PREFIX + "over"
    dom = env.domain(name, budget="16M")
    # a 32 MiB zone written until half of it, the budget, is pinned
    write_until_pinned(dom, 0, 32 * MiB, lambda: 2 * env.pinned(name), "the budget pinned")
    time.sleep(SETTLE)  # the guest idle long enough for the agent to take it so
    _still(env, name, 30, 16 * MiB)
    dom.destroy()


def test_after_a_smaller_budget_an_idle_guest_s_pins_stay_where_they_are(env: LiveEnv) -> None:
    name = PREFIX + "idle"
    dom = env.domain(name, budget="32M")
    write_until_pinned(dom, 0, 24 * MiB, lambda: env.pinned(name), "the written zone pinned")
    assert main(["enable", name, "--budget", "8M", "--live", "--host-config", str(env.config)]) == 0
    wait_for(lambda: 0 < env.pinned(name) <= 8 * MiB, "the pins cut to the new budget")
    time.sleep(SETTLE)
    _still(env, name, 30, 8 * MiB)
    dom.destroy()
