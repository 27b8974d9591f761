"""What a live process has open, read from /proc without racing its short-lived files."""

from __future__ import annotations

import os


def open_files(pid: int) -> set[str]:
    """Targets of ``/proc/PID/fd/*``; a descriptor closed between listing and reading is skipped."""
    targets = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            pass  # a file the process had open for a moment (a status file, /proc/meminfo)
    return targets
