"""What one run of an arm is: its settings, its guests, which fio runs are measured, and its result record.

Data only (no host effects): bench/e2e_run.py carries a run out,
bench/e2e_sample.py watches it, bench/e2e.py reports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bench.e2e_arms import Arm


TRACE_IOPS = 300   # about what the guest replays the web server trace at on the ssd setting (validation runs)


@dataclass(frozen=True)
class TraceFiles:
    """A trace prepared for the guest (bench/e2e_trace.py): the initramfs carrying its iologs, the oracle's runs."""

    initrd: Path
    oracle_ranges: Path      # "START LENGTH" lines: the measured part's most-read blocks
    oracle_bytes: int
    requests: tuple[int, int]          # warm-up, measured
    trace_seconds: tuple[float, float]  # the trace time each part spans


@dataclass
class Settings:
    runtime: int               # measured fio run, s
    warmup: int                # warm-up fio run, s
    slow_warmup: int           # warm-up on the HDD-class device, s
    gap: int                   # periodic: phase off the hot range, s
    cache_mib: int
    budget_mib: int
    disk: Path                 # the image on the real disk
    disk_bytes: int
    mount: Path                # where the delay device shows the image's directory
    neighbour_file: Path
    stream_rate: str
    reuse_iops: int
    reclaim_period: float
    out: Path
    guest_dir: str
    memory_mib: int
    model: dict
    hotset: str = ""           # the saved hot set element (namespaced) warm arms put in the domain XML
    phase: int = 60            # alternate: seconds of each busy or idle phase
    pair_cache_mib: int = 320  # alternate: the cache room of the two VMs together
    pair_cap_mib: int = 224    # alternate: the host's pinned_cap the two agents share (their host config)
    pair_config: Path | None = None   # that host config, written by bench/e2e.py
    host_settings: dict = field(default_factory=dict)  # --host-setting: over the installed config, for every agent
    host_config: Path | None = None   # the installed config with them, written by bench/e2e.py (None: none given)
    mode_configs: dict = field(default_factory=dict)  # (mode, pair?) -> host config of MODE_HOST_SETTINGS' modes
    traces: dict = field(default_factory=dict)   # trace name -> TraceFiles
    log_reads: bool = False    # the delay device logs every read it serves (diagnosis)
    min_mib: int = 0           # min= in the vmcache arms' metadata (0: none)

    def image(self, index: int) -> Path:
        """VM ``index``'s image on the real disk (the first is ``disk``)."""
        return self.disk if index == 0 else self.disk.with_name(f"{self.disk.stem}-{index + 1}{self.disk.suffix}")


@dataclass
class Vm:
    """One guest of a run: its domain, the image path it opens, its memory cgroup and console."""

    name: str
    image: Path
    cgroup: str
    console: Path
    phase: int | None = None
    qpid: int = 0
    agent_pid: int = 0
    agent_log_offset: int = 0
    uuid: str = ""                  # libvirt's, of the transient domain (its saved hot set's key on the host)


@dataclass
class ArmResult:
    arm: str
    round: int
    ok: bool = False
    error: str | None = None
    fio: list = field(default_factory=list)     # the measured fio runs (jobs[0] each), of every VM
    warmup_fio: dict | None = None
    steady_fio: dict | None = None      # boot scenarios: the run after the measured one
    limit_bytes: int = 0                # the parent cgroup's limit
    limits: dict = field(default_factory=dict)   # every limit set: cgroup -> bytes
    qemu_anon_bytes: int = 0            # all VMs'
    cgroup_peak_bytes: int = 0
    cgroup_samples: list = field(default_factory=list)
    agents: list = field(default_factory=list)   # per agent: pid, cmdline, cpu_percent, peak RSS, status at the end
    oracle_locked_bytes: int = 0
    load: dict = field(default_factory=dict)  # loadavg at start / end of the measured run, host CPU busy %
    reclaims: int = 0
    # bytes fetched from storage in the measured run: qemu and agent (/proc/PID/io) on the real disk,
    # "device" (and "device_requests") from the delay device's counters
    device_read_bytes: dict = field(default_factory=dict)
    wall_seconds: float = 0.0


@dataclass(frozen=True)
class Plan:
    """How the guest runs for an arm: fio runs in all, and which of them are measured (0-based)."""

    loops: int
    measured: tuple[int, ...]


def plan(arm: Arm) -> Plan:
    if arm.scenario.boot:
        return Plan(2, (0,))     # the first run from boot; the second one gives the steady state
    if arm.mode == "evicted":
        return Plan(1, (0,))
    if arm.scenario.workload == "periodic":
        return Plan(5, (2, 4))   # hot, off, hot, off, hot: the first hot phase warms up
    if arm.scenario.workload == "alternate":
        return Plan(4, (2, 3))   # each VM busy once to warm up, then once more, measured
    return Plan(2, (1,))


def busy_runs(loops: int, phase: int | None) -> list[int]:
    """The runs (0-based) a guest prints fio results for: all, or an alternating guest's busy ones
    (guest/init: run n is busy when n + phase is odd)."""
    return [i for i in range(loops) if phase is None or (i + 1 + phase) % 2 == 1]


def warmup(arm: Arm, s: Settings) -> int:
    """Seconds of the first fio run: none for evicted arms, longer where misses are slow."""
    if arm.mode == "evicted" or arm.scenario.boot:
        return s.runtime   # the first run, measured from boot
    if arm.scenario.workload == "alternate":
        return s.phase
    return s.slow_warmup if arm.device == "hdd" else s.warmup


def guest_seconds(arm: Arm, s: Settings) -> int:
    """About how long the guest's runs take in all (a trace's runs take what its requests take: about this)."""
    p = plan(arm)
    trace = s.traces.get(arm.scenario.trace)
    if trace is not None:
        return sum(trace.requests) // TRACE_IOPS
    if arm.scenario.workload == "alternate":
        return s.phase * p.loops
    if arm.scenario.workload == "periodic":
        return warmup(arm, s) + s.runtime * len(p.measured) + s.gap * (p.loops // 2)
    if p.loops == 1:
        return s.runtime
    return warmup(arm, s) + s.runtime * (p.loops - 1)


def hot_range(s: Settings) -> int:
    """Bytes of the hot range (the first 10% of the image), page aligned."""
    return (s.disk_bytes // 10) // 4096 * 4096
