"""Arms of the end-to-end bench: scenario x device x mode, the sets `make bench` runs, and the goals.

A *scenario* is what the guest does and what happens around it (a
neighbour, proactive reclaim, a second VM), and in which memory cgroups
(its *layout*, bench/e2e_layout.py); a *device* is how much a cache miss
costs (bench/e2e_host.py DEVICES: ``ssd`` ~0.4 ms and ``hdd`` ~5 ms per miss
through the delay device bench/delaydev.py, ``none`` the real disk); a
*mode* is who manages the cache:

  evicted    image dropped from the cache, measured from boot, no warm-up
  kernel     no agent: the kernel's LRU alone
  vmcache    opted in through the domain's metadata (the installed hook starts the agent)
  oracle     the true hot range (first 10% of the image; a trace's most-read blocks) locked before boot
  warm       vmcache, and the domain XML carries the hot set an earlier vmcache run saved (warm start)
  inferred   vmcache, its agents on `read_model: inferred` (the default before 2026-11-28): the two
             read models side by side in one run; beside vmcache, what counting reads in BPF costs
  nopin      vmcache with `pinned_cap: 0`: the agent's cycle, write tracking and read counting, no pin;
             beside vmcache, what its pins cost (page tables, memory), beside kernel what the rest costs
  partition  no agent; each VM's memory cgroup capped (a static partition, libvirt <memtune> hard_limit):
             QEMU's anon + the budget beside a neighbour (the neighbour gets the rest), an equal share
             of the cache between VMs

(``protected``, cgroup v2 ``memory.min`` on the VM's cgroup, is not a mode: the memory
controller is bound to cgroup v1 on this machine, docs/benchmarks.md says why.)

Arm names read ``scenario-device-mode``, e.g. ``reuse-ssd-vmcache``.
"""

from __future__ import annotations

from dataclasses import dataclass

SAME, SIBLING = "same", "sibling"

AGENT_MODES = ("vmcache", "warm", "inferred", "nopin")   # the modes whose domains opt in: the hook starts an agent
# Agent modes whose agents run under other host settings than the installed ones (over --host-setting).
MODE_HOST_SETTINGS = {"inferred": {"read_model": "inferred"}, "nopin": {"pinned_cap": "0"}}


@dataclass(frozen=True)
class Scenario:
    name: str
    workload: str            # guest workload (guest/init): zoned, zipf, periodic, alternate, trace
    qd: int = 1
    neighbour: str = ""      # "", "stream" (one pass, no reuse), "reuse" (random reads, working set > cache)
    reclaim: bool = False    # memory.force_empty of the cgroup every --reclaim-period s
    boot: bool = False       # measured from boot on an evicted image: the first fio run, then one for the steady state
    layout: str = SAME       # SAME: the VM and its neighbour in one memory cgroup; SIBLING: each in its own
    vms: int = 1             # guests (alternate: two, busy in turn)
    trace: str = ""          # trace workload: the trace's name (bench/e2e_trace.py TRACES)
    help: str = ""

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes this scenario can run in."""
        if self.vms > 1:
            return ("kernel", "vmcache", "partition", "inferred")   # no oracle: both hot sets do not fit the cache
        modes = ("evicted", "kernel", "vmcache", "oracle", "warm", "inferred", "nopin")
        return (*modes, "partition") if self.layout == SIBLING else modes


SCENARIOS = {s.name: s for s in (
    Scenario("zoned", "zoned", help="zoned:90/10:10/90 QD1 sync, alone"),
    Scenario("reuse", "zoned", neighbour="reuse",
             help="zoned QD1 while a host process does 4 KiB random reads over a file 4x the cache, "
                  "faster than the guest, in the same cgroup (on a real host: I/O charged to the VM's own "
                  "cgroup, such as a backup or block job reading through QEMU)"),
    Scenario("sibreuse", "zoned", neighbour="reuse", layout=SIBLING,
             help="reuse with the VM and the neighbour in cgroups of their own under one parent whose limit "
                  "is the cache (a real host: each VM in its machine scope, neighbours pressing through a "
                  "shared parent)"),
    Scenario("reclaim", "zoned", reclaim=True,
             help="zoned QD1 while the cgroup's page cache is reclaimed (memory.force_empty) periodically"),
    Scenario("periodic", "periodic", neighbour="reuse",
             help="the hot 10% used in 30 s phases, between them the rest of the disk and the reuse "
                  "neighbour; measured: the hot phases after the first"),
    Scenario("stream", "zoned", neighbour="stream",
             help="zoned QD1 while a host process streams a large file once through the cgroup (no harm)"),
    Scenario("sibstream", "zoned", neighbour="stream", layout=SIBLING,
             help="stream with the VM and the neighbour in sibling cgroups (no harm)"),
    Scenario("qd32", "zoned", qd=32, help="zoned with libaio iodepth 32, alone (no harm)"),
    Scenario("coldboot", "zoned", boot=True,
             help="the guest boots on an evicted image and runs zoned QD1 at once: IOPS of the first run "
                  "(--runtime s from boot), a second run for its steady IOPS, time to 90% of that"),
    Scenario("alternate", "alternate", layout=SIBLING, vms=2,
             help="two VMs in sibling cgroups under a parent whose cache holds one hot set, not both: "
                  "each runs zoned QD1 for --phase s, then idles as long, the other one in turn; measured: "
                  "the third and fourth phases (each VM busy once more), total IOPS of the two"),
    Scenario("web", "trace", neighbour="reuse", layout=SIBLING, trace="webserver",
             help="the web server trace (../shared/traces) replayed by fio in the guest (iolog, QD1, as fast "
                  "as it goes) beside the reuse neighbour, sibling cgroups"),
    Scenario("webalone", "trace", trace="webserver", help="the web server trace replayed alone"),
)}


@dataclass(frozen=True)
class Arm:
    scenario: Scenario
    device: str
    mode: str

    @property
    def name(self) -> str:
        return f"{self.scenario.name}-{self.device}-{self.mode}"

    @property
    def group(self) -> str:
        """Arms of one group are compared with each other (same scenario and device)."""
        return f"{self.scenario.name}-{self.device}"


def group(scenario: str, device: str, modes: tuple[str, ...]) -> list[Arm]:
    for mode in modes:
        if mode not in SCENARIOS[scenario].modes:
            raise ValueError(f"{scenario} cannot run in mode {mode}")
    return [Arm(SCENARIOS[scenario], device, mode) for mode in modes]


KOV = ("kernel", "vmcache", "oracle")
PEERS = ("kernel", "partition")     # what an operator does instead: nothing, or a static partition

# `make bench`: the goals of issue 11, 3 interleaved rounds, ~49 minutes of runs at the default runtimes
# (bench/e2e.py prints its estimate) plus the device checks and waits for the hook lock.
DEFAULT = [
    *group("reuse", "ssd", KOV),
    *group("reclaim", "ssd", ("kernel", "vmcache")),
    *group("zoned", "hdd", ("evicted", "vmcache")),
    *group("stream", "ssd", ("kernel", "vmcache")),
    *group("qd32", "ssd", ("kernel", "vmcache")),
]

# --set long: the same plus the oracles left out above, the real-disk (none) column, HDD-class
# neighbours and the periodic hot set (~200 s per arm at the defaults: 3 modes x 3 rounds would add
# ~30 minutes, so it stays out of the default).
LONG = [
    *DEFAULT,
    Arm(SCENARIOS["reclaim"], "ssd", "oracle"),
    Arm(SCENARIOS["zoned"], "hdd", "oracle"),
    *group("reuse", "none", KOV),
    *group("reuse", "hdd", KOV),
    *group("reclaim", "hdd", KOV),
    *group("periodic", "ssd", KOV),
    *group("zoned", "ssd", ("evicted", "kernel", "vmcache", "oracle")),
    *group("zoned", "hdd", ("kernel",)),
    *group("zoned", "none", ("evicted", "kernel", "vmcache", "oracle")),
]

# --set warm: a cold boot - the kernel alone, vmcache warm-started from a saved hot set, the oracle
WARM = group("coldboot", "hdd", ("evicted", "warm", "oracle"))

# --set peers (issue 23): vmcache against what an operator would do instead, in sibling cgroups, the
# alternating pair and the web server trace (~98 minutes of runs for 3 rounds).
PEER_SET = [
    *group("sibreuse", "ssd", ("kernel", "partition", "vmcache", "oracle")),
    *group("sibstream", "ssd", ("kernel", "partition", "vmcache")),
    *group("alternate", "ssd", ("kernel", "partition", "vmcache")),
    *group("web", "ssd", ("kernel", "partition", "vmcache", "oracle")),
]

SETS = {"default": DEFAULT, "long": LONG, "warm": WARM, "peers": PEER_SET}


def every_arm() -> dict[str, Arm]:
    """Every arm --arms accepts, by name."""
    arms = {}
    for scenario in SCENARIOS.values():
        for device in ("none", "ssd", "hdd"):
            for mode in scenario.modes:
                arm = Arm(scenario, device, mode)
                arms[arm.name] = arm
    return arms


@dataclass(frozen=True)
class Goal:
    label: str
    arm: str
    reference: str
    target: float
    # more references: the ratio is then to the best of them in each round ("the best peer")
    best_of: tuple[str, ...] = ()

    @property
    def references(self) -> tuple[str, ...]:
        return (self.reference, *self.best_of)


def best_peer(label: str, group_: str, target: float) -> Goal:
    """vmcache against the best of the kernel alone and a static partition, round by round."""
    return Goal(label, f"{group_}-vmcache", f"{group_}-kernel", target, best_of=(f"{group_}-partition",))


# Goals of issue 11: medians of per-round ratios of total IOPS. The issue states the first three for a
# busy SSD; the `ssd` setting is what they are measured on (docs/benchmarks.md says what a miss costs there).
GOALS = [
    Goal("neighbour with reuse, ssd setting: vmcache vs kernel", "reuse-ssd-vmcache", "reuse-ssd-kernel", 1.5),
    Goal("proactive reclaim, ssd setting: vmcache vs kernel", "reclaim-ssd-vmcache", "reclaim-ssd-kernel", 1.3),
    Goal("periodic hot set, ssd setting: vmcache vs kernel", "periodic-ssd-vmcache", "periodic-ssd-kernel", 1.3),
    Goal("hdd setting, zoned QD1: vmcache vs cold (paper, preloaded vs empty: 2.36x SSD, 2.73x HDD)",
         "zoned-hdd-vmcache", "zoned-hdd-evicted", 2.36),
    Goal("streaming neighbour, ssd setting: vmcache vs kernel (no harm)", "stream-ssd-vmcache", "stream-ssd-kernel",
         0.97),
    Goal("QD32 zoned, ssd setting: vmcache vs kernel (no harm)", "qd32-ssd-vmcache", "qd32-ssd-kernel", 0.97),
    # issue 13: the first minute after a cold boot, warm-started from the hot set an earlier run saved
    Goal("cold boot, HDD class: vmcache warm start vs kernel cold", "coldboot-hdd-warm", "coldboot-hdd-evicted", 1.25),
    Goal("cold boot, HDD class: vmcache warm start vs oracle (within 10%)", "coldboot-hdd-warm",
         "coldboot-hdd-oracle", 0.90),
    # issue 23: against the best peer (the kernel alone or a static partition, whichever did better that round)
    best_peer("neighbour with reuse, sibling cgroups: vmcache vs best peer (no harm)", "sibreuse-ssd", 0.97),
    best_peer("streaming neighbour, sibling cgroups: vmcache vs best peer (no harm)", "sibstream-ssd", 0.97),
    best_peer("web server trace beside the reuse neighbour: vmcache vs best peer (no harm)", "web-ssd", 0.97),
    Goal("alternating phases, two VMs: vmcache vs 50/50 partition", "alternate-ssd-vmcache",
         "alternate-ssd-partition", 1.2),
    best_peer("alternating phases, two VMs: vmcache vs best peer (no harm)", "alternate-ssd", 0.97),
]
