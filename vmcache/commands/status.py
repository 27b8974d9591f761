"""``vmcache status [DOMAIN] [--json]``: what every agent on this host is doing, and which domain lacks one.

Reads the agents' status files (vmcache.observe.status) and, for agents that run
but have written none yet, their pidfiles. An agent whose process is gone
is shown as not running, with what it last said. Running domains vmcache
should manage (metadata, host rules) but no agent does are listed as ``no
agent`` (libvirt is asked, as ``vmcache reconcile`` does).

A broken host config does not hide anything: its error comes first, the
agents (which run on the config they started with) after it, found in the
file's ``runtime_dir`` where that can still be read; the exit status is 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any
from urllib.parse import unquote

from ..errors import ConfigError, DomainError, VmcacheError
from ..host.configfile import load_or_salvage
from ..host.files import lock_holder
from ..host.ledger import HostShare, Ledger
from ..observe.status import AgentEntry, read_statuses
from ..settings.hotset import PLACES
from ..settings.rules import Rule
from ..units import format_size
from ._host import add_host_options

NAME = "status"
HELP = ("show every agent: domain, disks, cache mode, budget, grant, demand, pinned, resident, dirtied rate, "
        "last cycle, errors")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("domain", nargs="?", help="only this domain")
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    add_host_options(parser)


def _starting(agents_dir: str, known: set[str]) -> list[dict[str, Any]]:
    """Agents holding a pidfile lock that have not written a status file yet."""
    found: list[dict[str, Any]] = []
    try:
        names = sorted(n for n in os.listdir(agents_dir) if n.endswith(".pid"))
    except FileNotFoundError:
        return found
    for name in names:
        stem = name[:-4]
        if stem in known:
            continue
        pid = lock_holder(os.path.join(agents_dir, name))
        if pid is not None:
            found.append({"domain": unquote(stem), "pid": pid or None, "running": True, "state": "starting",
                          "disks": []})
    return found


def _row(entry: AgentEntry) -> dict[str, Any]:
    if entry.status is None:
        return {"file": entry.path, "running": False, "state": "unreadable", "problem": entry.problem, "disks": []}
    data = entry.status.to_json()
    data["running"] = entry.running
    data["pinned_bytes"] = entry.status.pinned_bytes
    data["locked_bytes"] = entry.status.locked_bytes
    data["resident_bytes"] = entry.status.resident_bytes
    if not entry.running:
        data["state"] = "not running"
        for part in (data, *data.get("disks", [])):  # the kernel unlocked its memory when the process ended
            if isinstance(part.get("pinned_bytes"), int):
                part["last_pinned_bytes"], part["pinned_bytes"] = part["pinned_bytes"], 0
            part.pop("locked_bytes", None)
    return data


def _pinned(part: dict[str, Any]) -> str:
    """Pinned bytes, and the part locked where that is less (``fill: cached``); for an agent that is gone,
    0 and what it held at its last status."""
    now = _size(part.get("pinned_bytes"))
    last, locked = part.get("last_pinned_bytes"), part.get("locked_bytes")
    if isinstance(last, int) and last:
        return f"{now} ({format_size(last)} at its last status)"
    if isinstance(locked, int) and locked != part.get("pinned_bytes"):
        return f"{now} ({format_size(locked)} locked)"
    return now


def collect(agents_dir: str, domain: str | None = None) -> list[dict[str, Any]]:
    """Every agent as a dict (the --json output), sorted by domain."""
    entries = read_statuses(agents_dir)
    known = {os.path.basename(e.path)[:-5] for e in entries}
    rows = [_row(e) for e in entries] + _starting(agents_dir, known)
    if domain is not None:
        rows = [r for r in rows if r.get("domain") == domain]
    return sorted(rows, key=lambda r: r.get("domain") or r.get("file", ""))


def _size(value: Any) -> str:
    return format_size(value) if isinstance(value, int) else "-"


_COUNTED_AT = {"probe": "counted at filemap_read", "tracepoint": "counted at mm_filemap_get_pages"}


def _ago(then: Any, now: float) -> str:
    if not isinstance(then, (int, float)) or not then:
        return "never"
    return f"{max(0.0, now - then):.0f}s ago"


def _reads(disk: dict[str, Any]) -> str:
    """The disk's counted reads: rate and the true page-cache hit ratio since the agent started."""
    read, hit = disk.get("guest_read_bytes"), disk.get("guest_read_hit_bytes")
    if not isinstance(read, int) or not isinstance(hit, int):
        return ""
    ratio = f"{100 * hit / read:.1f}% hits" if read else "no reads"
    return (f" read {format_size(disk.get('read_bytes_per_second') or 0)}/s, {ratio} of {format_size(read)}"
            + _value(disk))


def _value(disk: dict[str, Any]) -> str:
    """What the disk's pins are worth: the hits they served that the kernel alone would likely have missed."""
    saved, cost, keeps = (disk.get(k) for k in ("pin_saved_bytes", "pin_cost_bytes", "kernel_retention_seconds"))
    if not isinstance(saved, int):
        return ""
    kernel = ("the kernel keeps what is read again" if keeps == -1 else "too few re-reads to judge the kernel"
              if not isinstance(keeps, (int, float)) else f"the kernel keeps a page read again ~{keeps:.0f}s")
    costs = f", cost others ~{format_size(cost)}" if isinstance(cost, int) else ""
    return f"; pins saved up to ~{format_size(saved)}{costs} of device reads ({kernel})"


def render(rows: list[dict[str, Any]], now: float) -> str:
    """The human table: one line per agent, one indented line per disk."""
    if not rows:
        return "no vmcache agents"
    lines = []
    for row in rows:
        if row.get("state") == "unreadable":
            lines.append(f"? {row['file']}: {row['problem']}")
            continue
        if row.get("state") == "no agent":
            lines.append(f"{row['domain']}: no agent, though opted in by {row['managed_by']}"
                         " (`vmcache reconcile` starts it)")
            continue
        head = (f"{row['domain']}: {row['state']}"
                + (f" pid {row['pid']}" if row.get("pid") else "")
                + (f" ({row['managed_by']})" if row.get("managed_by") else "")
                + f", budget {_size(row.get('budget_bytes'))}"
                + (f", min {_size(row['minimum_bytes'])}" if row.get("minimum_bytes") else "")
                + f", demand {_size(row.get('demand_bytes'))}, granted {_size(row.get('granted_bytes'))}"
                + f", pinned {_pinned(row)}, resident {_size(row.get('resident_bytes'))}"
                + f", updated {_ago(row.get('updated_at'), now)}"
                + (f", hot set saved {_ago(row['hotset_saved_at'], now)}" if row.get("hotset_saved_at") else ""))
        lines.append(head)
        if row.get("last_error"):
            lines.append(f"  last error: {row['last_error']}")
        if row.get("running") and row.get("read_signal"):
            why = row.get("read_signal_reason") or _COUNTED_AT.get(row["read_signal"])
            lines.append(f"  guest reads: {row['read_signal']}" + (f" ({why})" if why else ""))
        if row.get("share_error") and row.get("running"):
            lines.append(f"  host cap: {row['share_error']}")
        for disk in row.get("disks", []):
            if not disk.get("eligible"):
                lines.append(f"  {disk['target']:6s} cache={disk['cache']:12s} skipped: {disk.get('reason')}"
                             + (f"  (layer: {disk['source']})" if disk.get("layer_of") else ""))
                continue
            cycle = disk.get("last_cycle_seconds")
            granule = disk.get("dirty_granule_bytes")
            lines.append(
                f"  {disk['target']:6s} cache={disk['cache']:12s} budget {_size(disk.get('budget_bytes'))}"
                f" pinned {_pinned(disk)} resident {_size(disk.get('resident_bytes'))}"
                f" dirtied {format_size(disk.get('dirtied_bytes_per_second') or 0)}/s"
                + (f" ({format_size(granule)} granules)" if isinstance(granule, int) else "")
                + f" last cycle {f'{cycle:.3f}s' if isinstance(cycle, (int, float)) else '-'}"
                f" {_ago(disk.get('last_cycle_at'), now)}"
                + _warm(disk, row.get("hotset_source"))
                + _reads(disk)
                + (f" error: {disk['error']}" if disk.get("error") else "")
                + (f"  ({'layer: ' if disk.get('layer_of') else ''}{disk['source']})" if disk.get("source") else ""))
    return "\n".join(lines)


def _warm(disk: dict[str, Any], source: str | None) -> str:
    """A disk's warm start: how much of the saved set is back, and which copy it came from."""
    if not disk.get("warm_total_bytes"):
        return ""
    return (f" warm {_size(disk.get('warm_restored_bytes'))}/{_size(disk.get('warm_total_bytes'))}"
            + (f" from {PLACES[source]}" if source in PLACES else ""))


def host_line(share: HostShare | None) -> str | None:
    """One line on how the host's pinned cap is divided (None when no agent published a demand)."""
    if share is None or not share.demands:
        return None
    s = share.split
    older = {d: b for d, b in share.held.items() if d not in share.demands}
    cap = "no pinned cap" if s.cap is None else f"pinned cap {format_size(s.cap)}"
    line = (f"host: {cap}, held {format_size(sum(share.held.values()))} by {len(share.held)} agents, "
            f"granted {format_size(sum(s.grants.values()))} by benefit to {len(share.demands)}"
            + (f", guaranteed {format_size(s.minimums)}" if s.minimums else "")
            + (f"; {len(older)} older agents hold {format_size(sum(older.values()))} first come" if older else ""))
    return line + (f"\n  error: {s.error}" if s.error else "")


def _host_share(config: Any) -> HostShare | None:
    try:
        return Ledger(config.ledger_path, None).host_share()
    except VmcacheError:  # status shows the agents even when the ledger cannot be read
        return None


def missing_agents(uri: str, rules: tuple[Rule, ...], known: set[str]) -> tuple[list[dict[str, Any]], str | None]:
    """Rows for the running domains vmcache should manage that no agent manages; or why libvirt could not tell."""
    from ..host.virtdomain import connect  # libvirt: only here
    from ..service.reconcile import plan, survey

    try:
        conn = connect(uri)
        try:
            todo = plan(survey(conn, rules))
        finally:
            conn.close()
    except VmcacheError as err:
        return [], f"running domains without an agent unknown: {err}"
    return [{"domain": d.name, "uuid": d.uuid, "domain_id": d.run, "running": False, "state": "no agent",
             "managed_by": d.opt_in.why, "disks": []} for d in todo.start if d.name not in known], None


def run(args: argparse.Namespace) -> int:
    config, config_error = load_or_salvage(args.host_config)
    rows = collect(config.agents_dir, args.domain)
    missing, unknown = missing_agents(args.uri, config.rules, {r["domain"] for r in rows if r.get("running")})
    rows = sorted(rows + [r for r in missing if args.domain in (None, r["domain"])],
                  key=lambda r: r.get("domain") or r.get("file", ""))
    notes = [f"host config: {config_error} (agents run on the config they started with; the hook starts none"
             " until it is fixed, then `vmcache reconcile`)"] if config_error else []
    notes += [unknown] if unknown else []
    if args.domain is not None and not rows:
        raise DomainError(f"no vmcache agent for domain {args.domain!r} (status files in {config.agents_dir})")
    if args.json:
        print(json.dumps(rows, indent=1, sort_keys=True))
        for note in notes:
            print(f"vmcache status: {note}", file=sys.stderr)
    else:
        host = host_line(_host_share(config)) if args.domain is None else None
        print("\n".join(notes + ([host] if host and rows else []) + [render(rows, time.time())]))
    return 2 if isinstance(config_error, ConfigError) else 0
