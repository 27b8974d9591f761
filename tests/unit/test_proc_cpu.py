"""bench/proc_cpu.py: CPU seconds per label between two samples of this machine's processes."""

from __future__ import annotations

import os

from bench.proc_cpu import TICK, cpu_seconds, cpu_ticks


def test_a_process_counts_what_it_used_between_the_samples_and_a_new_one_all_it_used() -> None:
    before = {1: ("-/qemu", 100), 2: ("-/sh", 50), -1: ("-/qemu:waiting", 30)}
    after = {1: ("-/qemu", 100 + TICK), 3: ("-/sh", TICK // 2), -1: ("-/qemu:waiting", 30 + TICK // 4)}
    assert cpu_seconds(before, after) == {"-/qemu": 1.0, "-/sh": 0.5, "-/qemu:waiting": 0.25}


def test_a_waiting_count_that_fell_when_a_thread_ended_counts_nothing() -> None:
    assert cpu_seconds({-1: ("-/qemu:waiting", 30)}, {-1: ("-/qemu:waiting", 10)}) == {}


def test_this_process_is_in_the_sample_under_this_machines_label() -> None:
    label, ticks = cpu_ticks({})[os.getpid()]
    assert label.startswith("-/") and ticks >= 0
