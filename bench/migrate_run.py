"""One run of the migration bench (one arm, one round): cold caches, the guest warm on A, migrated, measured on B.

1. The image (one per bench, fully allocated) is evicted from both hosts'
   caches (fadvise DONTNEED through each host's own mount) and its backing
   file read into this machine's cache (a miss costs the delay only).
2. The guest is defined on A; in the vmcache arm opted in there
   (``vmcache enable NAME --budget 256M --config``), in the kernel arm not
   (no vmcache on either host acts on it).
3. zoned: A's cache is warmed the same way in both arms, the hot zone (the
   first 10% of the image) read through A's mount before the guest starts
   (docs/benchmarks.md says why); web: the trace's warm-up part on A.
4. The guest starts on A and runs: zoned at least ``on_a`` s from its
   first requests and, in the vmcache arm, until A's agent pins
   ``pin_share`` of the zone (or, with ``settle``, its pins stay the same
   that long), at most ``on_a_cap`` s; web until its measured part begins
   (VMCACHE-FIO-BEGIN 2).
5. ``virsh migrate --live --p2p --persistent --undefinesource --unsafe`` to
   B; ``measure`` s are watched after the switch (B's resume event, or the
   command's end), or until the trace's measured part ends.

bench/migrate_sample.py samples the run, bench/migrate_windows.py makes its
figures, bench/migrate_loads.py finds B's agent's loads in B's read log.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.device_reads import parse_reads
from bench.e2e_host import evict, file_size, loadavg, log, warm
from bench.migrate_loads import loaded_bytes, parse_pins, value_of
from bench.migrate_sample import STEP, Sampler, block_ios
from bench.migrate_windows import MIB, Timeline, run_figures
from tests.host.migration import (Side, agent_running, console, define_guest, lines, migrate, remove_domains, resident,
                                  status, unit_of)
from tests.host.twohosts import mounts_from_env, plain_from_env, shared_from_env
from tests.live.livelib import wait_for
from vmcache.host.cachestat import cachestat

PAGE = 4096
PREFIX = "vmb-"
CONFFILE = "/etc/vmcache/vmcache.yaml"
SHIPPED = Path(__file__).resolve().parent.parent / "hooks" / "vmcache.yaml"
BOOT = 180.0          # seconds for the guest to come up and start its first fio run
TRACE_WARMUP = 3600.0  # most seconds the trace's warm-up part may take on A
WARM_CHUNK = 64 << 10  # what one WILLNEED asks for while the zone is warmed (under the readahead window)
IO_START = 100         # requests on A after which the guest's fio runs


@dataclass(frozen=True)
class Trace:
    """The web server trace prepared for the guest: its initramfs (as the hosts name it) and the set on B,
    the oracle's most-read blocks of the measured part (bench/e2e_trace.py)."""

    initrd: str
    ranges: tuple[tuple[int, int], ...]
    requests: tuple[int, int]


@dataclass(frozen=True)
class Setup:
    """What every run of one bench shares."""

    sides: tuple[Side, Side]
    image: str                 # the image's file name in the shared directory
    disk_bytes: int
    device: str                # hdd, ssd: the delay devices' setting
    out: Path
    stats: tuple[Path, Path]   # A's and B's delay device counters
    read_log: Path             # B's delay device's read log
    budget_mib: int = 256
    memory_mib: int = 384
    measure: float = 120.0
    on_a: float = 60.0
    on_a_cap: float = 300.0
    pin_share: float = 0.9
    settle: float = 0.0      # 0: off
    trace: Trace | None = None

    @property
    def zone(self) -> int:
        """Bytes of the zoned workload's hot zone: the first 10% of the image, page aligned."""
        return (self.disk_bytes // 10) // PAGE * PAGE

    def ranges(self, workload: str) -> list[tuple[int, int]]:
        """The set whose residency on B is watched: the zone, or the trace's most-read blocks."""
        if workload == "web":
            assert self.trace is not None
            return list(self.trace.ranges)
        return [(0, self.zone)]


def domain_name(workload: str, mode: str, round_: int) -> str:
    return f"{PREFIX}r{round_}-{workload}-{mode}"


def run(st: Setup, workload: str, mode: str, round_: int, slot: int) -> dict[str, Any]:
    """Run one arm once; its row (the samples go to its result.json only). Never raises for the run's failure."""
    name = domain_name(workload, mode, round_)
    arm = f"{workload}-{st.device}-{mode}"
    rdir = st.out / f"r{round_}" / arm
    rdir.mkdir(parents=True, exist_ok=True)
    row: dict[str, Any] = {"arm": arm, "workload": workload, "device": st.device, "mode": mode, "round": round_,
                           "slot": slot, "domain": name, "ok": False, "error": None, "times": {}, "figures": {}}
    sampler: Sampler | None = None
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    row["times"]["start"] = time.time()
    try:
        settings(st, mode)
        cold_caches(st)
        row["uuid"] = define(st, name, workload, mode).UUIDString()
        if workload == "zoned":
            warm_zone(st)
        sampler = Sampler(st.sides, name, st.image, st.ranges(workload), st.stats)
        log_offset = file_size(st.read_log)
        start_on_a(st, name, mode, sampler, row)
        row["why_moved"] = run_on_a(st, name, workload, mode, row)
        move_and_measure(st, name, workload, sampler, row)
        samples = sampler.stop()
        collect(st, name, workload, mode, samples, log_offset, sampler.statuses[1], row)
        row["ok"] = True
        log(f"{arm}: {describe(row)}")
    except Exception as err:  # noqa: BLE001 - one run's failure must not stop the others
        row["error"] = f"{type(err).__name__}: {err}"
        log(f"{arm}: FAILED {row['error']}")
    finally:
        if sampler is not None:
            samples = sampler.stop()
        cleanup(st, name, row.get("uuid"), rdir, row["times"]["start"])
        settings(st, "vmcache")
        row["wall_seconds"] = round(time.monotonic() - started, 1)
        (rdir / "result.json").write_text(json.dumps({**row, "samples": samples}, indent=1))
    return row


def settings(st: Setup, mode: str) -> None:
    """Both hosts' conffile as the package ships it, but for the ``inferred`` arm's ``read_model: inferred``
    (the counter still runs, for the metrics: what the model decides on is the only difference)."""
    text = SHIPPED.read_text()
    if mode == "inferred":
        if "\nread_model: counted\n" not in text:
            raise RuntimeError(f"{SHIPPED} has no 'read_model: counted' line to change")
        text = text.replace("\nread_model: counted\n", "\nread_model: inferred\n")
    for side in st.sides:
        conf = side.host.path(CONFFILE)
        if conf.read_text() != text:
            conf.write_text(text)


def cold_caches(st: Setup) -> None:
    """The image in neither host's page cache (fadvise DONTNEED through each mount), its backing file in this
    machine's (e2e_host.warm): a miss on either host costs the delay device's time, and only that."""
    here, _ = shared_from_env()
    warm(here / st.image)

    def cold() -> bool:
        for mount in mounts_from_env():
            evict(mount / st.image)
        return all(resident(side, "", 0, st.disk_bytes, image=st.image) == 0 for side in (0, 1))

    wait_for(cold, "both hosts' caches of the image to be empty", timeout=60, step=1)


def warm_zone(st: Setup) -> None:
    """The zone read into A's cache through A's mount: WILLNEED asks for exactly a range, but reads at most the
    readahead window (128 KiB by default) a call, and FUSE may skip some while its queue is full; so every
    ``WARM_CHUNK`` not all cached yet is asked for again until the zone is."""
    fd = os.open(mounts_from_env()[0] / st.image, os.O_RDONLY)
    try:
        def cached() -> bool:
            missing = [off for off in range(0, st.zone, WARM_CHUNK)
                       if cachestat(fd, off, min(WARM_CHUNK, st.zone - off)).nr_cache * PAGE < min(WARM_CHUNK, st.zone - off)]
            for off in missing:
                os.posix_fadvise(fd, off, min(WARM_CHUNK, st.zone - off), os.POSIX_FADV_WILLNEED)
            return not missing

        wait_for(cached, "the zone to be in A's cache", timeout=300, step=0.5)
    finally:
        os.close(fd)


def define(st: Setup, name: str, workload: str, mode: str) -> Any:
    """The guest defined on A (zoned: one fio run longer than the run; web: the trace's two parts), opted in
    for the arms that are not the kernel's."""
    a = st.sides[0]
    if workload == "web":
        assert st.trace is not None
        spec: dict[str, Any] = {"workload": "trace", "loops": 2, "initrd": st.trace.initrd}
    else:
        spec = {"workload": "zoned", "loops": 0, "runtime": 3600}
    dom = define_guest(a, name, image=st.image, memory_mib=st.memory_mib, **spec)
    if mode != "kernel":
        a.host.run("vmcache", "enable", name, "--budget", f"{st.budget_mib}M", "--config")
    return dom


def start_on_a(st: Setup, name: str, mode: str, sampler: Sampler, row: dict[str, Any]) -> None:
    a = st.sides[0]
    a.host.run("virsh", "start", name)
    sampler.start()
    if mode != "kernel":
        agent_running(a.host, name)
    wait_for(lambda: "VMCACHE-FIO-BEGIN 1" in console(name), "the guest's first fio run", timeout=BOOT, step=0.2)
    # fio takes seconds to start under TCG: time on A counts from its first requests
    wait_for(lambda: (block_ios(a, name) or 0) >= IO_START, "the guest's first requests", timeout=BOOT, step=0.2)
    row["times"]["fio_begin"] = time.time()


def _pinned(side: Side, name: str) -> int:
    s = status(side.host, name)
    return sum(d.get("pinned_bytes", 0) for d in s.get("disks", [])) if s else 0


def run_on_a(st: Setup, name: str, workload: str, mode: str, row: dict[str, Any]) -> str:
    """Wait on A until the guest should move (module docstring, step 4); why it moves: time, pinned, cap, trace."""
    a = st.sides[0]
    if workload == "web":
        wait_for(lambda: "VMCACHE-FIO-BEGIN 2" in console(name) or block_ios(a, name) is None,
                 "the trace's measured part to begin", timeout=TRACE_WARMUP, step=0.2)
        why = "trace"
    else:
        why = wait_on_a(st, name, mode, row["times"]["fio_begin"])
    if block_ios(a, name) is None:
        raise RuntimeError(f"the guest no longer runs on A: {console(name)[-300:]!r}")
    a_status = status(a.host, name)
    row["a_status"] = a_status
    row["figures"]["a_pinned_mib"] = _pinned(a, name) / MIB if a_status else None
    return why


def wait_on_a(st: Setup, name: str, mode: str, begin: float) -> str:
    """zoned: ``on_a`` s from ``begin``; in the vmcache arm also until A's agent pins ``pin_share`` of the zone
    or its pins have not changed for ``settle`` s, at most ``on_a_cap`` s. Why it ended: time, pinned, settled, cap."""
    a = st.sides[0]
    last, since = -1, time.time()
    while True:
        now, pinned = time.time(), _pinned(a, name)
        if pinned != last:
            last, since = pinned, now
        if now >= begin + st.on_a:
            if mode == "kernel":
                return "time"
            if pinned >= st.pin_share * st.zone:
                return "pinned"
            if st.settle and pinned and now - since >= st.settle:
                return "settled"
        if now >= begin + st.on_a_cap:
            return "cap"
        time.sleep(0.5)


def move_and_measure(st: Setup, name: str, workload: str, sampler: Sampler, row: dict[str, Any]) -> None:
    """Migrate A -> B, then watch ``measure`` s after the switch (or up to the trace's measured part's end)."""
    a, b = st.sides
    times = row["times"]
    times["migrate_start"] = time.time()
    migrate(a, b, name, timeout=600)
    times["migrate_end"] = time.time()
    try:
        times["switch"] = wait_for(sampler.resumed, "B's resume event", timeout=10)
        times["resumed"] = True
    except AssertionError:
        times["switch"], times["resumed"] = times["migrate_end"], False
    row["load_switch"] = loadavg()
    end = times["switch"] + st.measure
    while time.time() < end + STEP + 0.5:   # a sample past the end
        if workload == "web" and "work_end" not in times and "VMCACHE-FIO-END 2" in console(name):
            times["work_end"] = time.time()
            end = min(end, times["work_end"])
        time.sleep(0.25)
    row["figures"]["load_end"] = loadavg()


def collect(st: Setup, name: str, workload: str, mode: str, samples: list[dict[str, Any]], log_offset: int,
            b_status: Any, row: dict[str, Any]) -> None:
    """The run's figures: its windows (bench/migrate_windows.py), and in the vmcache arm B's agent's
    (``b_status``: its last status the sampler saw)."""
    t = row["times"]
    tl = Timeline(t["migrate_start"], t["migrate_end"], t["switch"], st.measure, t.get("work_end"), t["resumed"])
    fig = row["figures"]
    fig.update(run_figures(samples, tl, sum(n for _, n in st.ranges(workload))))
    fig["on_a_s"] = round(t["migrate_start"] - t["fio_begin"], 1)
    fig["read_signal_a"] = (row.get("a_status") or {}).get("read_signal")
    if mode == "kernel":
        return
    b = st.sides[1]
    row["b_status"] = b_status
    fig["read_signal_b"] = (b_status or {}).get("read_signal")
    fig["read_signal_reason_b"] = (b_status or {}).get("read_signal_reason")
    since = t["start"]   # a domain of this name in an earlier bench on these hosts logged in the same unit

    def agent_lines(event: str) -> list[tuple[float, str]]:
        return [(when, m) for when, m in lines(b.host, name, event) if when >= since]

    done = agent_lines("warm.done")
    fig["warm_done_s"] = round(done[0][0] - t["switch"], 2) if done else None
    fig["restored_mib"] = int(value_of(done[0][1], "restored") or 0) / MIB if done else None
    loaded = agent_lines("hotset.loaded")
    # no hotset.loaded line from an agent that ran: it found no set to warm from (hotset.none)
    fig["carried_mib"] = int(value_of(loaded[0][1], "bytes") or 0) / MIB if loaded else 0.0 if b_status else None
    with open(st.read_log, "rb") as f:
        f.seek(log_offset)
        reads = parse_reads(f.read().decode(errors="replace"))
    pins = parse_pins(agent_lines("pin.add"))
    fig["loaded_mib"] = loaded_bytes(reads, pins, st.image, t["switch"], t["switch"] + fig["end_s"]) / MIB
    # the log is flushed every 0.5 s: a load after its last line is not in it
    fig["read_log_until_s"] = round(reads[-1].time - t["switch"], 1) if reads else None
    fig["last_pin_s"] = round(max(p.time for p in pins) - t["switch"], 1) if pins else None


def describe(row: dict[str, Any]) -> str:
    f = row["figures"]
    w = f["windows"]
    iops = ", ".join(f"{k} s {w[k]['iops']:.0f}" for k in ("0-10", "10-30", "30-60", "60-120", "0-60")
                     if w.get(k, {}).get("iops") is not None)
    ref = f.get("warm_ref") or {}
    cores = ", ".join(f"{p} {c:.2f}" for p, c in list((f.get("cpu") or {}).get("0-60", {}).items())[:5])
    return (f"IOPS after the switch {iops or 'none'}; cores 0-60 s: {cores or '-'}; warm ref {ref.get('iops', 0):.0f}; "
            f"moved after "
            f"{f['on_a_s']} s ({row.get('why_moved')}), migrate {f['migrate_s']} s; set resident on B "
            f"{f.get('resident_s')} s, warm.done {f.get('warm_done_s')} s, loaded {f.get('loaded_mib')} MiB")


def cleanup(st: Setup, name: str, uuid: str | None, rdir: Path, since: float) -> None:
    """The domain gone from both hosts, their agents stopped, the hot sets they saved on each host removed; the
    agents' journals since ``since`` and the console kept in ``rdir``."""
    remove_domains(st.sides, name)
    plain, _ = plain_from_env()
    for side, x in zip(st.sides, "ab"):
        try:
            wait_for(lambda: side.host.unit(unit_of(name))["ActiveState"] in ("inactive", "failed"),
                     f"{name}'s agent on {side.host.name} to stop", timeout=60, step=0.5)
            journal = [(t, m) for t, m in side.host.journal(unit_of(name)) if t >= since]
            if journal:
                (rdir / f"agent-{x}.log").write_text("".join(f"{t:.3f} {m}\n" for t, m in journal))
            if uuid:
                side.host.run("rm", "-f", f"/var/lib/vmcache/hotsets/{uuid}.xml")
        except Exception as err:  # noqa: BLE001 - the next run checks its own start
            log(f"{name}: cleanup on {side.host.name}: {type(err).__name__}: {err}")
    con = plain / f"{name}.console"
    if con.exists():
        (rdir / "console.log").write_text(con.read_text(errors="replace"))
        con.unlink()

