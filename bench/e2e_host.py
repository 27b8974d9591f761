"""Host side of the end-to-end bench: cgroups, the throttled device, host processes, load.

Everything here touches the host (cgroup v1 files, /proc, processes it
starts); bench/e2e_run.py puts it together per arm. Nothing here knows
about arms or reports.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
CGROUPS = Path("/sys/fs/cgroup")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, stdin=subprocess.DEVNULL, capture_output=True, text=True, **kw)


# ---------------------------------------------------------------- cgroups (v1)

@dataclass(frozen=True)
class Cgroup:
    """One cgroup v1 directory, ``/sys/fs/cgroup/<controller>/<name>``."""

    controller: str
    name: str

    @property
    def path(self) -> Path:
        return CGROUPS / self.controller / self.name

    @property
    def root(self) -> Path:
        return CGROUPS / self.controller

    def write(self, name: str, value: str | int) -> None:
        (self.path / name).write_text(f"{value}\n")

    def read(self, name: str) -> str:
        return (self.path / name).read_text()

    def join(self, pid: int) -> bool:
        """Move process ``pid`` (all its threads) in; False if it is gone."""
        return _move(pid, self.path)

    def create(self) -> None:
        self.remove()
        self.path.mkdir()

    def remove(self) -> None:
        """Move whatever is still inside back to the root, then remove the directory."""
        if not self.path.exists():
            return
        for _ in range(100):
            for pid in self.read("cgroup.procs").split():
                _move(int(pid), self.root)
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
        log(f"warning: could not remove {self.path}")

    def shell_prefix(self) -> str:
        """``sh -c`` prefix that puts the shell (and what it execs) in here."""
        return f"echo $$ > {self.path}/cgroup.procs && "


def _move(pid: int, cg: Path) -> bool:
    try:
        (cg / "cgroup.procs").write_text(f"{pid}\n")
        return True
    except (ProcessLookupError, FileNotFoundError):
        return False
    except OSError as err:
        if err.errno == 3:  # ESRCH
            return False
        raise


def memory_stat(cg: Cgroup) -> dict[str, int]:
    out = {}
    for line in cg.read("memory.stat").splitlines():
        key, _, value = line.partition(" ")
        out[key] = int(value)
    return out


# ---------------------------------------------------------------- the device

@dataclass(frozen=True)
class Device:
    """A device class the bench imitates with blkio throttling (0: no limit).

    cgroup v1 throttling counts only bios sent to the device: page-cache
    hits cost nothing. It is a rate limit, not a delay: below
    ``read_iops`` a miss goes at the real disk's speed. So a *busy* device
    is imitated: a filler (:func:`start_filler`) in the same blkio cgroup
    keeps the limit reached with O_DIRECT reads, and every miss of the
    guest or the agent queues behind it, ~1-2 / ``read_iops`` s, as on a
    device another tenant keeps busy.
    """

    name: str
    read_iops: int = 0
    write_iops: int = 0
    read_bps: int = 0
    write_bps: int = 0

    def describe(self) -> str:
        if not (self.read_iops or self.write_iops):
            return f"{self.name} (unthrottled)"
        parts = [f"{d} {iops} IOPS {bps // MIB} MiB/s" for d, iops, bps in
                 (("read", self.read_iops, self.read_bps), ("write", self.write_iops, self.write_bps)) if iops]
        return f"{self.name} ({', '.join(parts)})"


# Reads only: what vmcache can change. A guest's O_SYNC write is a data write,
# a flush and a journal commit on ext4, so a write limit as tight as the read
# one made each guest write cost 2-4 ms on the busy-SSD setting, the same in
# every arm, and drowned the reads in the ratio. Writes go at the real disk's
# speed (~120 us O_SYNC on the host here).
DEVICES = {
    "none": Device("none"),
    # a busy SSD shared with others: 0.4 ms per 4 KiB read
    "ssd": Device("ssd", read_iops=2500, read_bps=400 * MIB),
    # network / HDD-class storage: 5 ms per 4 KiB read
    "hdd": Device("hdd", read_iops=200, read_bps=150 * MIB),
}


def whole_disk(path: Path) -> str:
    """``major:minor`` of the disk (not the partition) holding ``path``: blkio rules name disks."""
    st = path.stat()
    sysdev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if (sysdev / "partition").exists():
        sysdev = sysdev.resolve().parent
    return (sysdev / "dev").read_text().strip()


def throttle(cg: Cgroup, disk: str, device: Device) -> None:
    """Set ``device``'s limits on ``disk`` for the blkio cgroup ``cg`` (already created)."""
    for key, value in (("read_iops", device.read_iops), ("write_iops", device.write_iops),
                       ("read_bps", device.read_bps), ("write_bps", device.write_bps)):
        if value:
            cg.write(f"blkio.throttle.{key}_device", f"{disk} {value}")


# ---------------------------------------------------------------- /proc

def proc_status(pid: int) -> dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def kib(status: dict[str, str], key: str) -> int:
    value = status.get(key, "0 kB").split()
    return int(value[0]) if value else 0


def cpu_seconds(pid: int) -> float | None:
    try:
        fields_ = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields_[11]) + int(fields_[12])) / CLK_TCK  # utime, stime


def read_bytes(pid: int | None) -> int:
    """Bytes process ``pid`` had fetched from storage (``/proc/PID/io`` read_bytes): its page-cache misses."""
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def alive(pid: int | None) -> bool:
    return pid is not None and Path(f"/proc/{pid}").exists()


def loadavg() -> float:
    """The host's 1-minute load average."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return float(sum(values) - idle), float(sum(values))


def busy_percent(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Host CPU busy between two :func:`cpu_times`, % of all CPUs."""
    total = after[1] - before[1]
    return 100.0 * (after[0] - before[0]) / total if total > 0 else 0.0


# ---------------------------------------------------------------- processes we start

def start_in(cg: Cgroup, argv: list[str]) -> subprocess.Popen:
    """``argv`` started inside cgroup ``cg`` (it joins before exec)."""
    return subprocess.Popen(["sh", "-c", cg.shell_prefix() + "exec " + " ".join(argv)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def start_locker(cg: Cgroup, image: Path, length: int) -> subprocess.Popen:
    """vmtouch -l on [0, length) of ``image``, inside ``cg``; returns once the range is locked."""
    proc = start_in(cg, ["vmtouch", "-q", "-l", "-m", "64G", "-p", f"0-{length}", str(image)])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vmtouch exited: {proc.stderr.read().decode(errors='replace')}")
        if kib(proc_status(proc.pid), "VmLck") * 1024 >= length - 4096:
            return proc
        time.sleep(0.2)
    stop(proc)
    raise RuntimeError("vmtouch did not lock the range within 120 s")


def start_stream(cg: Cgroup, path: Path, rate: str) -> subprocess.Popen:
    """A neighbour streaming ``path`` once through the page cache (no reuse), in ``cg``."""
    return start_in(cg, ["fio", "--name=stream", f"--filename={path}", "--rw=read", "--bs=1M",
                         "--ioengine=psync", "--invalidate=1", "--time_based", "--runtime=3600",
                         f"--rate={rate}", "--output-format=terse"])


def start_reuse(cg: Cgroup, path: Path, rate_iops: int) -> subprocess.Popen:
    """A neighbour with reuse: 4 KiB random reads over all of ``path`` at ``rate_iops``, in ``cg``.

    ``path`` is larger than the cache, so every page comes back again and
    again; hole pages of a sparse file fill the cache like data and cost no
    device time. fio's fadvise hint (random) keeps readahead out.
    """
    return start_in(cg, ["fio", "--name=reuse", f"--filename={path}", "--rw=randread", "--bs=4k",
                         "--ioengine=psync", "--invalidate=0", "--time_based", "--runtime=3600",
                         f"--rate_iops={rate_iops}", "--norandommap", "--output-format=terse"])


def start_filler(cg: Cgroup, path: Path) -> subprocess.Popen:
    """The other tenant of a busy device: O_DIRECT 4 KiB random reads of ``path`` (an allocated file on the
    image's disk, not the image) at QD1, as fast as ``cg``'s throttle lets them through (no page cache).

    Not the image itself: an O_DIRECT read of a file holds its inode lock
    while it waits in the throttle, and every buffered write to the file
    waits for it (a first version read the image: guest writes took 7-60
    ms). The block device itself cannot be opened in this sandbox.
    """
    proc = start_in(cg, ["fio", "--name=busy", f"--filename={path}", "--readonly", "--rw=randread", "--bs=4k",
                         "--direct=1", "--ioengine=psync", "--time_based", "--runtime=3600", "--norandommap",
                         "--output-format=terse"])
    time.sleep(0.5)
    if proc.poll() is not None:
        raise RuntimeError(f"the filler exited: {proc.stderr.read().decode(errors='replace')[:300]}")
    return proc


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Reclaimer:
    """Proactive reclaim: ``memory.force_empty`` of ``cg`` every ``period`` s, in a thread.

    force_empty reclaims every reclaimable page of the cgroup (page cache;
    there is no swap, so anonymous memory stays) and then fails with EBUSY
    because the tasks' own memory cannot go: that is expected. Locked pages
    are unevictable and stay.
    """

    def __init__(self, cg: Cgroup, period: float):
        self.cg, self.period = cg, period
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="reclaimer", daemon=True)

    def start(self) -> "Reclaimer":
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.cg.write("memory.force_empty", 0)
            except OSError:
                pass  # EBUSY: the anonymous memory left; the cache is gone
            self.count += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
