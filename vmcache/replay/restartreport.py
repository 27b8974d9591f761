"""Host mode's restart (vmcache.replay.hostwarm) as text: per VM, then how the pacing divided the device.

Kept apart from vmcache.replay.report, which loads Pillow for its plot.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..units import format_size
from .hostwarm import HEADS, RestartResult

__all__ = ["aligned", "restart_tables"]

MiB = 1 << 20


def aligned(lines: Sequence[Sequence[str]], left: int = 1) -> str:
    """Rows of cells as columns: the first ``left`` left-aligned, the others right-aligned."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


def _when(seconds: float | None, saved: int = 1) -> str:
    """A time from the restart: ``-`` for a VM with nothing saved, ``never`` for one not reached."""
    return "-" if not saved else ("never" if seconds is None else f"{seconds:g}s")


def _per_vm(r: RestartResult) -> str:
    lines = [["vm", "saved", "restored", "90% at", "ended at", *(f"reads {h:g}s (cold)" for h in HEADS),
              *(f"x cold {h:g}s" for h in HEADS), "restore loaded", "unread 5 min"]]
    for vm in r.vms:
        lines.append([vm.name, format_size(vm.saved_bytes), format_size(vm.restored_bytes),
                      _when(vm.most_s, vm.saved_bytes), _when(vm.done_s, vm.saved_bytes),
                      *(f"{vm.reads[h]} ({vm.cold_reads[h]})" for h in HEADS),
                      *(f"{vm.reads[h] / vm.cold_reads[h]:.3f}" if vm.cold_reads[h] else "-" for h in HEADS),
                      format_size(vm.restore_loaded_bytes), format_size(vm.restore_unread_bytes)])
    total = {h: sum(vm.reads[h] for vm in r.vms) for h in HEADS}
    cold = {h: sum(vm.cold_reads[h] for vm in r.vms) for h in HEADS}
    lines.append(["all", format_size(sum(vm.saved_bytes for vm in r.vms)),
                  format_size(sum(vm.restored_bytes for vm in r.vms)),
                  _when(r.last_most_s), _when(r.last_done_s),
                  *(f"{total[h]} ({cold[h]})" for h in HEADS),
                  *(f"{total[h] / cold[h]:.3f}" if cold[h] else "-" for h in HEADS),
                  format_size(sum(vm.restore_loaded_bytes for vm in r.vms)),
                  format_size(sum(vm.restore_unread_bytes for vm in r.vms))])
    return aligned(lines)


def _division(r: RestartResult, cycles: int) -> str:
    """MiB/s each VM's pins loaded per cycle from the restart, and all of them (the device's load)."""
    host = r.host_loaded_per_cycle()
    shown = min(cycles, max(1, len(host)))

    def rates(per_cycle: Sequence[int]) -> list[str]:
        return [f"{(per_cycle[c] if c < len(per_cycle) else 0) / MiB / r.interval:.1f}" for c in range(shown)]

    lines = [["vm", *(f"{c * r.interval:g}s" for c in range(shown))]]
    lines += [[vm.name, *rates(vm.loaded_per_cycle)] for vm in r.vms]
    lines.append(["all", *rates(host)])
    return aligned(lines)


def restart_tables(results: list[RestartResult], cycles: int = 12) -> str:
    """Per pacing and cap: each VM's restart beside its cold start, then the device's division."""
    out = []
    for r in results:
        rate = format_size(r.warm_rate) + "/s" + (" for the host" if r.pacing == "shared" else " each")
        out.append(f"restart, pacing {r.pacing} (warm-up {rate}), cap {format_size(r.cap)}: the last VM had 90% of "
                   f"its set back at {_when(r.last_most_s)}, its restore ended at {_when(r.last_done_s)}")
        out.append(_per_vm(r))
        out.append(f"MiB/s each VM's pins loaded per {r.interval:g}s cycle (bytes / {r.interval:g}s), by the "
                   "cycle's time from the restart:")
        out.append(_division(r, cycles))
    return "\n".join(out)
