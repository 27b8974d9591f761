"""Run one measurement per disk size in a fresh process, rounds interleaved; print one table.

Used by bench_model.py and bench_engine.py: each (round, size) is a child
process (``SCRIPT --one SIZE ...``) that prints one JSON line, so the memory
of one size never counts for another and imports are paid equally by all.
Sizes are taken in a rotated order in each round (arms interleaved); the
table shows per size the median over rounds and the spread (min-max).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence

from bench.order import round_order

SIZES = "64G,1T,16T,64T"


def status_bytes(key: str) -> int:
    """A ``kB`` field of /proc/self/status in bytes (RssAnon, VmHWM, ...)."""
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name == key:
                return int(value.split()[0]) * 1024
    raise KeyError(key)


def emit(result: dict[str, float]) -> None:
    """The child's answer: one JSON line on stdout."""
    print("RESULT " + json.dumps(result), flush=True)


def run_sizes(script: str, sizes: Sequence[str], rounds: int, child_args: Sequence[str]) -> dict[str, list[dict]]:
    """Run ``script --one SIZE *child_args`` for every size, ``rounds`` times, rotating the order."""
    results: dict[str, list[dict]] = {s: [] for s in sizes}
    for r in range(rounds):
        for size in round_order(sizes, r + 1):
            out = subprocess.run([sys.executable, script, "--one", size, *child_args], check=True,
                                 stdout=subprocess.PIPE, text=True).stdout
            line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
            results[size].append(json.loads(line[len("RESULT "):]))
            print(f"  round {r + 1} {size}: {line[len('RESULT '):]}", file=sys.stderr, flush=True)
    return results


def table(results: dict[str, list[dict]], columns: Sequence[tuple[str, str, str]]) -> str:
    """Markdown table: one row per size; ``columns`` are (key, heading, format) of each child's result."""
    head = "| disk size | " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|---|" + "|".join("---:" for _ in columns) + "|"
    rows = [head, rule]
    for size, runs in results.items():
        cells = []
        for key, _, fmt in columns:
            values = [run[key] for run in runs]
            med = statistics.median(values)
            cell = format(med, fmt)
            if min(values) != max(values):
                cell += f" ({format(min(values), fmt)}-{format(max(values), fmt)})"
            cells.append(cell)
        rows.append(f"| {size} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def load() -> str:
    """Host load for the record: the 1/5/15 min load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())
