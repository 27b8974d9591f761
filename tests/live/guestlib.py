"""The guest as the live tests drive it through QEMU: writes and reads, QMP, what vmcache left in QEMU, pins.

"Guest" I/O is HMP ``qemu-io`` on the virtio device, which QEMU performs
exactly as the guest's own; the domains are started paused (no guest OS).
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import libvirt
import libvirt_qemu

from tests.live.livelib import wait_for

__all__ = ["QMPError", "covered", "guest_active", "guest_read", "guest_write", "leftovers", "mapped",
           "pivot_when_ready", "qmp", "read_until_pinned", "write_until_pinned"]


class QMPError(RuntimeError):
    """QEMU answered a QMP command with an error (``desc`` is its message)."""




def guest_write(dom: Any, offset: int, length: int, dev: str = "ua-vda", pattern: int = 0xAB) -> None:
    """Write ``length`` bytes at ``offset`` through virtio device ``dev`` as the guest would (HMP qemu-io)."""
    out = libvirt_qemu.qemuMonitorCommand(
        dom, f'qemu-io -d /machine/peripheral/{dev}/virtio-backend "write -P {pattern:#x} {offset} {length}"',
        libvirt_qemu.VIR_DOMAIN_QEMU_MONITOR_COMMAND_HMP)
    assert "wrote" in out or not out.strip(), out  # HMP qemu-io prints nothing on success here


def write_until_pinned(dom: Any, offset: int, length: int, pinned: Callable[[], int], what: str = "a pin",
                       timeout: float = 30.0, *, more: Sequence[tuple[int, int]] = (), dev: str = "ua-vda",
                       at_least: int | None = None, pattern: int = 0xAB) -> None:
    """The guest writes ``length`` bytes at ``offset`` (and each ``(offset, length)`` of ``more``) every second
    until ``pinned()`` reaches ``at_least`` (default: all it writes).

    Written once, across a cycle's end, a block of it may stay under the
    threshold and the region be pinned without it; pinned and never read,
    the rest then cools in a few 1 s cycles before the missing block is
    taken (seen in CI: 3 MiB of 4 pinned; 16 MiB of 18, then none). A guest
    that keeps writing keeps every block hot. Where the guest's reads decide
    (``read_model: counted``, the default) writes count only while the
    guest reads written blocks back: :func:`read_until_pinned`.
    """
    _until_pinned(functools.partial(guest_write, pattern=pattern), dom, [(offset, length), *more], pinned, what, timeout, dev, at_least)


def read_until_pinned(dom: Any, offset: int, length: int, pinned: Callable[[], int], what: str = "a pin",
                      timeout: float = 30.0, *, more: Sequence[tuple[int, int]] = (), dev: str = "ua-vda",
                      at_least: int | None = None) -> None:
    """:func:`write_until_pinned`, the guest reading instead: what the counted reads take for hot."""
    _until_pinned(guest_read, dom, [(offset, length), *more], pinned, what, timeout, dev, at_least)


def _until_pinned(io: Callable[..., None], dom: Any, regions: Sequence[tuple[int, int]], pinned: Callable[[], int],
                  what: str, timeout: float, dev: str, at_least: int | None) -> None:
    target = sum(n for _, n in regions) if at_least is None else at_least

    def done_and_pinned() -> bool:
        for start, n in regions:
            io(dom, start, n, dev=dev)
        return pinned() >= target

    wait_for(done_and_pinned, what, timeout=timeout, step=1.0)


def guest_read(dom: Any, offset: int, length: int, dev: str = "ua-vda") -> None:
    """Read ``length`` bytes at ``offset`` through virtio device ``dev`` as the guest would (HMP qemu-io)."""
    out = libvirt_qemu.qemuMonitorCommand(
        dom, f'qemu-io -d /machine/peripheral/{dev}/virtio-backend "read {offset} {length}"',
        libvirt_qemu.VIR_DOMAIN_QEMU_MONITOR_COMMAND_HMP)
    assert "read" in out or not out.strip(), out


@contextmanager
def guest_active(dom: Any, offset: int = 0, dev: str = "ua-vda", every: float = 0.3) -> Iterator[None]:
    """While the block runs, the guest reads a page at ``offset`` every ``every`` s: it is not idle.

    An agent whose counted reads say the guest read and wrote nothing in a
    cycle fades every block's heat (model/reads.py ``idle``): a region
    written once by a paused test domain would cool before it is pinned
    whole. A guest that reads keeps what it left cached as hot as the
    inferred model takes it; a page a read is enough, and grows nothing.
    """
    stop = threading.Event()

    def read() -> None:
        while not stop.wait(every):
            try:
                guest_read(dom, offset, 4096, dev=dev)
            except (libvirt.libvirtError, AssertionError):  # the domain went (destroyed, reverted), or paused
                return

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def qmp(dom: Any, cmd: str, args: dict | None = None) -> Any:
    """Run QMP ``cmd`` through libvirt; its ``return``. Raises QMPError when QEMU answers an error."""
    msg = {"execute": cmd, **({"arguments": args} if args else {})}
    reply = json.loads(libvirt_qemu.qemuMonitorCommand(dom, json.dumps(msg), 0))
    if "error" in reply:
        raise QMPError(reply["error"]["desc"])
    return reply["return"]


def leftovers(dom: Any) -> dict[str, list[str]]:
    """Bitmaps, nodes and exports of vmcache's still in QEMU.

    ``bitmaps``: ours on the domain's own nodes (a read's union bitmap lives on our view node, which is
    in ``nodes`` while the read lasts); a block job's bitmap has no name.
    """
    nodes = qmp(dom, "query-named-block-nodes", {"flat": True})
    return {
        "bitmaps": sorted({b["name"] for n in nodes if not n["node-name"].startswith("vmcache")
                           for b in n.get("dirty-bitmaps", []) if b.get("name", "").startswith("vmcache")}),
        "nodes": [n["node-name"] for n in nodes if n["node-name"].startswith("vmcache")],
        "exports": [e["id"] for e in qmp(dom, "query-block-exports")],
    }


def pivot_when_ready(dom: Any, disk: str, timeout: float = 60.0) -> None:
    """Pivot ``disk``'s block job once libvirt has it ready (its ``cur == end`` comes before libvirt's READY)."""
    import libvirt

    wait_for(lambda: (i := dom.blockJobInfo(disk, 0)) and i["end"] > 0 and i["cur"] == i["end"],
             f"the block job of {disk} to catch up", timeout)

    def pivoted() -> bool:
        try:
            dom.blockJobAbort(disk, libvirt.VIR_DOMAIN_BLOCK_JOB_ABORT_PIVOT)
        except libvirt.libvirtError as err:
            if "not ready for pivot" in (err.get_error_message() or ""):
                return False
            raise
        return True

    wait_for(pivoted, f"the block job of {disk} to be ready for its pivot", timeout)


def mapped(pid: int, image: Path) -> list[tuple[int, int]]:
    """(file offset, length) of every mapping of ``image`` in process ``pid``: an agent's pinned regions."""
    ranges = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == str(image):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((int(fields[2], 16), end - start))
    return sorted(ranges)


def covered(ranges: list[tuple[int, int]], start: int, length: int) -> bool:
    """Whether every page of ``[start, start + length)`` is in one of ``ranges`` (:func:`mapped`'s)."""
    return all(any(o <= page < o + n for o, n in ranges) for page in range(start, start + length, 4096))
