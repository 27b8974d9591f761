"""Which signal of the guest's reads an agent has: counted in the kernel, or inferred from residency.

The agent asks the host's read counter (:mod:`vmcache.host.readcount`)
once, when its first disk starts (QEMU runs by then): where the kernel
counts QEMU's reads - with the ``filemap_read`` probe (``probe``) or,
where the kernel refuses it, the 6.12+ tracepoints (``tracepoint``) -
each disk worker gets its image's counts; where it cannot (no BPF, not
allowed, neither, no QEMU pid), the agent says why once in its log and
every disk keeps the inferred signal (residency growth and referenced
bits). Neither ever stops a disk from being managed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..errors import VmcacheError
from ..host.readcount import FileReads, ReadCounter, qemu_pid
from ..logfmt import event

__all__ = ["ReadSignal", "INFERRED"]

INFERRED = "inferred"


class ReadSignal:
    """One agent's read counter, opened on first use; ``signal`` says which one its disks get (the counter's
    set, ``probe`` or ``tracepoint``, or ``inferred``)."""

    def __init__(self, domain: str, *, logger: logging.Logger,
                 open_counter: Callable[[int], ReadCounter] = ReadCounter.open,
                 pid_of: Callable[[str], int | None] = qemu_pid) -> None:
        """``open_counter`` joins the host's counting program for a QEMU pid (raises VmcacheError);
        ``pid_of`` finds the domain's QEMU."""
        self.domain = domain
        self._log = logger
        self._open = open_counter
        self._pid_of = pid_of
        self._counter: ReadCounter | None = None
        self._tried = False
        self.signal = INFERRED
        self.reason: str | None = None

    def _counter_or_none(self) -> ReadCounter | None:
        if not self._tried:
            self._tried = True
            pid = self._pid_of(self.domain)
            try:
                if pid is None:
                    raise VmcacheError(f"no QEMU process found for domain {self.domain!r}")
                self._counter = self._open(pid)
            except VmcacheError as err:
                self._fall_back(str(err))
            else:
                self.signal = self._counter.signal
                self._log.info(event("reads.counted", by=self.signal, qemu_pid=pid))
        return self._counter

    def _fall_back(self, reason: str) -> None:
        self.signal, self.reason = INFERRED, reason
        self._log.warning(event("reads.inferred", reason=reason))

    def watch(self, image: str, block_size: int) -> FileReads | None:
        """The counts of QEMU's reads of ``image`` in blocks of ``block_size``; None where they cannot be had."""
        counter = self._counter_or_none()
        if counter is None:
            return None
        try:
            return counter.watch(image, block_size)
        except VmcacheError as err:
            self._log.warning(event("reads.disk_inferred", image=image, reason=err))
            return None

    def close(self) -> None:
        """Let go of the host's program (the last agent's close removes it)."""
        if self._counter is not None:
            self._counter.close()
            self._counter = None
