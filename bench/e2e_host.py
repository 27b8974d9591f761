"""Host side of the end-to-end bench: cgroups, the delay device, host processes, load.

Everything here touches the host (cgroup v1 files, /proc, processes it
starts); bench/e2e_run.py puts it together per arm. Nothing here knows
about arms or reports.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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

    def child(self, name: str) -> "Cgroup":
        return Cgroup(self.controller, f"{self.name}/{name}")

    def remove(self) -> None:
        """Remove the cgroups below, move whatever is still inside back to the root, remove the directory."""
        if not self.path.exists():
            return
        for sub in sorted((p for p in self.path.iterdir() if p.is_dir()), reverse=True):
            self.child(sub.name).remove()
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
    """A device class the bench imitates: every read request that misses the page cache costs ``read_ms``.

    The image is reached through the delay device (bench/delaydev.py), a
    FUSE passthrough under the page cache: hits never reach it, each miss
    sleeps ``read_ms`` in its own thread, requests in flight overlap (a
    queue). ``read_ms`` None: no delay device, the image on the real disk.
    The daemon's own overhead (~0.1 ms per request on this host) comes on
    top: the device check (bench/e2e.py) measures the total with fio.
    """

    name: str
    read_ms: float | None = None
    write_ms: float = 0.0
    nominal: str = ""          # the latency the setting stands for
    fsync_ms: float | None = None   # what a flush costs; None: a real fdatasync of the backing file

    @property
    def delayed(self) -> bool:
        return self.read_ms is not None

    def describe(self) -> str:
        if not self.delayed:
            return f"{self.name} (the real disk, no delay device)"
        writes = f", writes +{self.write_ms} ms" if self.write_ms else ""
        flush = "" if self.fsync_ms is None else f", a flush {self.fsync_ms} ms"
        return (f"{self.name} ({self.nominal} per miss: delay device sleeping {self.read_ms} ms per read "
                f"request{writes}{flush})")


# Reads are what vmcache can change. The guest's 20% O_SYNC writes are the same
# in every arm; each one's flush costs what a miss does, as on the device the
# class stands for (a real fdatasync of this machine's disk varied by the hour,
# and set the IOPS of every arm more than the reads did).
DEVICES = {
    "none": Device("none"),
    # a busy SSD shared with others: ~0.4 ms per 4 KiB read with the daemon's overhead
    "ssd": Device("ssd", read_ms=0.3, nominal="~0.4 ms", fsync_ms=0.3),
    # network / HDD-class storage: ~5 ms per 4 KiB read
    "hdd": Device("hdd", read_ms=4.8, nominal="~5 ms", fsync_ms=4.8),
}

DELAYDEV = Path(__file__).resolve().parent / "delaydev.py"
LOCKER = Path(__file__).resolve().parent / "locker.py"


def mount_delay(device: Device, backing: Path, mountpoint: Path, stats: Path,
                read_log: Path | None = None) -> subprocess.Popen:
    """The delay device over directory ``backing`` at ``mountpoint`` (created); returns once it is mounted.

    The daemon stays in the caller's cgroups: the backing file's own page cache is charged there, not to
    the arm's memory cgroup. ``read_log``: where it logs every read it serves (time, file, offset, bytes).
    """
    unmount_delay(None, mountpoint)   # a leftover of an interrupted run
    mountpoint.mkdir(parents=True, exist_ok=True)
    stats.unlink(missing_ok=True)
    errors = stats.with_suffix(".log")   # a file, not a pipe nobody reads while the arm runs
    with open(errors, "ab") as err:
        proc = subprocess.Popen([sys.executable, str(DELAYDEV), str(backing), str(mountpoint),
                                 "--read-ms", str(device.read_ms), "--write-ms", str(device.write_ms),
                                 "--stats", str(stats), *(["--log-reads", str(read_log)] if read_log else []),
                                 *(["--fsync-ms", str(device.fsync_ms)] if device.fsync_ms is not None else [])],
                                stdin=subprocess.DEVNULL, stdout=err, stderr=err)
    deadline = time.monotonic() + 30
    while not (os.path.ismount(mountpoint) and stats.exists()):
        if proc.poll() is not None or time.monotonic() > deadline:
            unmount_delay(proc, mountpoint)
            raise RuntimeError(f"the delay device did not mount: {errors.read_text(errors='replace')[-500:]}")
        time.sleep(0.1)
    return proc


def unmount_delay(proc: subprocess.Popen | None, mountpoint: Path) -> None:
    """Stop the daemon (it unmounts), lazily unmount whatever is left, remove the mount point."""
    stop(proc)
    if os.path.ismount(mountpoint):
        run(["umount", "-l", str(mountpoint)], check=False)
    try:
        mountpoint.rmdir()
    except OSError:
        pass


def delay_stats(path: Path) -> dict[str, int]:
    """The delay device's counters (reads, read_bytes, writes, ...); {} if it wrote none."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def initrd_with(base: Path, files: dict[str, str], out: Path) -> Path:
    """``base`` (a newc initramfs) with ``files`` (path in the guest -> text) appended as a second archive.

    The kernel unpacks concatenated archives in order, so the guest finds them beside its own files.
    """
    tree = out.with_suffix(".d")
    for name, text in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    names = "".join(f"{p.relative_to(tree)}\n" for p in sorted(tree.rglob("*")))
    extra = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], input=names.encode(), cwd=tree,
                           capture_output=True, check=True).stdout
    out.write_bytes(base.read_bytes() + extra)
    return out


def evict(path: Path) -> None:
    run(["vmtouch", "-q", "-e", str(path)])


def warm(path: Path) -> None:
    """Read ``path`` into the page cache (the delay device's backing file: a miss then costs the delay only)."""
    run(["vmtouch", "-q", "-t", str(path)])


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


def file_size(path: Path) -> int:
    """``path``'s size; 0 where there is no such file."""
    try:
        return path.stat().st_size
    except OSError:
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
    return _locked(start_in(cg, ["vmtouch", "-q", "-l", "-m", "64G", "-p", f"0-{length}", str(image)]), length)


def _locked(proc: subprocess.Popen, length: int) -> subprocess.Popen:
    """``proc`` once it holds ``length`` bytes locked (VmLck); stopped and RuntimeError after 120 s."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the locker exited: {proc.stderr.read().decode(errors='replace')}")
        if kib(proc_status(proc.pid), "VmLck") * 1024 >= length - 4096:
            return proc
        time.sleep(0.2)
    stop(proc)
    raise RuntimeError("the locker did not lock its ranges within 120 s")


def start_range_locker(cg: Cgroup, image: Path, ranges: Path, total: int) -> subprocess.Popen:
    """bench/locker.py locking the "START LENGTH" lines of ``ranges`` of ``image``, inside ``cg``; returns once
    ``total`` bytes are locked."""
    return _locked(start_in(cg, [sys.executable, str(LOCKER), str(image), str(ranges)]), total)


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
