"""What `make test-kernels` checks inside each VM (tests/kernels/run.sh boots them), as root, against the
vmcache that its Debian package installed (run by the package's own Python).

A child process stands for QEMU: the agent's read signal (service/readsignal.py, the code the agent runs
to choose its counter) registers its pid and counts its preads. Every check prints one line,
``vmk: ok NAME: ...`` or ``vmk: FAIL NAME: ...`` with the figures seen; the last line is
``vmk: done ok=N failed=M``. No pytest in the VM: its root is the clean host's, where vmcache's package
brings no test tools.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vmcache.host import bpf
from vmcache.host.cachestat import cachestat_supported
from vmcache.host.meminfo import read_pressure
from vmcache.host.pagecache import scan_residency
from vmcache.host.pinner import Pinner
from vmcache.host.readcount import FileReads, ReadCounter
from vmcache.host.readsets import ProbeSet, TracepointSet
from vmcache.model.region import Region
from vmcache.service.readsignal import ReadSignal

from tests.kernels.nscheck import pid_namespace as _pid_namespace
from tests.pagecache_util import drop, random_image

MiB = 1 << 20
PAGE = 4096
HOT = 8 * MiB  # the range the watch check's reader keeps reading
WORK = Path(os.environ.get("VMK_WORK", "/var/tmp/vmk"))
BLOCK_DEVICE = os.environ.get("VMK_BLOCK_DEVICE", "/dev/vdc")
#: Where other agents may run (this machine, not a VM): programs of theirs may be loaded, and stay.
SHARED_HOST = os.environ.get("VMK_SHARED_HOST") == "1"
READER = """
import os, sys
fds = {}
for line in sys.stdin:
    path, off, length, count = line.split()
    fd = fds.setdefault(path, os.open(path, os.O_RDONLY))
    for _ in range(int(count)):
        os.pread(fd, int(length), int(off))
    print("done", flush=True)
"""


class Reader:
    """The stand-in for QEMU: a process of its own that preads on request."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", READER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.pid = self.proc.pid

    def pread(self, path: str | Path, offset: int, length: int, count: int = 1) -> None:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(f"{path} {offset} {length} {count}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "done"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def mib(pages: int) -> str:
    return f"{pages * PAGE / MiB:g} MiB"


def exactly(reads: FileReads, nblocks: int, pages: int) -> tuple[int, int]:
    """The (read, hit) pages of one take; raises unless exactly ``pages`` were read."""
    read, hit = reads.take(nblocks).totals()
    if read != pages:
        raise AssertionError(f"counted {mib(read)} ({read} pages), not {mib(pages)} ({pages})")
    return read, hit


def mincore_pages(path: Path, block: int) -> dict[int, int]:
    """Resident pages per block of ``path``, asked of mincore page by page (not vmcache's code)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    os.close(fd)
    vec = (ctypes.c_ubyte * (size // PAGE))()
    if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    out: dict[int, int] = {}
    for page, flag in enumerate(vec):
        if flag & 1:
            out[page * PAGE // block] = out.get(page * PAGE // block, 0) + 1
    return out


def _locked(pid: int) -> int:
    """The bytes process ``pid`` has locked (VmLck)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1]) * 1024
    return 0


def programs_left() -> int:
    names = bpf.program_names()
    return sum(names.count(kind.NAME) for kind in (ProbeSet, TracepointSet))


@dataclass
class Run:
    """What the checks share: the stand-in QEMU, the agent's read signal, the data file and its counts."""

    reader: Reader
    signal: ReadSignal
    data: Path
    expected: str
    reads: FileReads | None = None


def counter(run: Run) -> str:
    run.reads = run.signal.watch(str(run.data), MiB)
    assert run.reads is not None, f"no counter: {run.signal.reason}"
    assert run.signal.signal == run.expected, f"{run.signal.signal} counts, not {run.expected}"
    return f"the agent's read signal chose {run.signal.signal!r}"


def one_set(run: Run) -> str:
    """A second agent joins the set the first loaded: the host's programs stay one set."""
    before = programs_left()
    second = ReadCounter.open(4_000_000)  # the pid of no process: it counts nothing
    try:
        after = programs_left()
        assert second.signal == run.signal.signal, second.signal
    finally:
        second.close()
    assert after == before, f"{before} programs before a second agent opened its counter, {after} after"
    return f"a second agent's counter joined the {second.signal} set: {after} programs on the host, as before"


def ten_reads(run: Run) -> str:
    assert run.reads is not None
    run.reads.take(64)
    drop(run.data)
    run.reader.pread(run.data, 8 * MiB, 4 * MiB, count=10)
    read, hit = exactly(run.reads, 64, 10 * 1024)
    assert hit >= 9 * 1024, f"only {mib(hit)} hits"
    return f"ten 4 MiB preads of one range counted {mib(read)} exactly, {mib(hit)} of them hits"


def others_not_counted(run: Run) -> str:
    assert run.reads is not None
    drop(run.data)
    with open(run.data, "rb") as f:  # this process (the agent's side) reads: not the guest
        os.pread(f.fileno(), 4 * MiB, 16 * MiB)
    with Pinner(run.data, floor_bytes=64 * MiB) as pinner:  # the agent's own load and lock of a pin
        pinner.apply([Region(32 * MiB, 8 * MiB, 1.0)], budget=8 * MiB)
        assert pinner.locked_bytes == 8 * MiB, pinner.locked_bytes
        exactly(run.reads, 64, 0)
        run.reader.pread(run.data, 32 * MiB, 8 * MiB)
        read, hit = exactly(run.reads, 64, 2048)
    assert hit == 2048, f"a read of a locked range missed {2048 - hit} pages"
    return f"the agent's 4 MiB read and 8 MiB pin load: 0 pages; the guest's read of the pin: {mib(read)}, all hits"


def block_device(run: Run) -> str:
    dev = run.signal.watch(BLOCK_DEVICE, MiB)
    assert dev is not None, "the block device is not counted"
    try:
        drop(BLOCK_DEVICE)
        run.reader.pread(BLOCK_DEVICE, 4 * MiB, 2 * MiB)
        read, hit = exactly(dev, 64, 512)
        run.reader.pread(BLOCK_DEVICE, 4 * MiB, 2 * MiB)
        again, hit2 = exactly(dev, 64, 512)
    finally:
        dev.close()
    assert hit2 == 512, f"the second read of {BLOCK_DEVICE} missed {512 - hit2} pages"
    return f"{BLOCK_DEVICE}: a 2 MiB pread counted {mib(read)} ({mib(hit)} hits), again {mib(again)} (all hits)"


def many_disks(run: Run) -> str:
    """A hundred images watched one after the other (an agent with many disks, agents starting together):
    each watch attaches a probe for the image's page-cache key and closes it; none may be refused."""
    images = []
    for i in range(100):
        images.append(WORK / f"disk{i}.raw")
        images[-1].write_bytes(os.urandom(PAGE))
    started = time.monotonic()
    watched = [run.signal.watch(str(path), MiB) for path in images]
    try:
        assert all(w is not None for w in watched), f"{watched.count(None)} of 100 images not counted"
        run.reader.pread(images[-1], 0, PAGE)
        exactly(watched[-1], 1, 1)  # type: ignore[arg-type]
    finally:
        for w in watched:
            if w is not None:
                w.close()
    return f"100 images watched in a row in {time.monotonic() - started:.1f} s, each counted"


def pid_namespace(run: Run) -> str:
    return _pid_namespace(run, Reader)


def tracepoint_set(run: Run) -> str:
    counter = ReadCounter.open(run.reader.pid, lock_dir=tempfile.mkdtemp(), order=(TracepointSet,))
    try:
        assert counter.signal == "tracepoint"
        fr = counter.watch(str(run.data), MiB)
        drop(run.data)
        run.reader.pread(run.data, 8 * MiB, 4 * MiB, count=10)
        read, hit = exactly(fr, 64, 10 * 1024)
        fr.close()
    finally:
        counter.close()
    return f"the tracepoint set (the fallback) counted the ten reads as {mib(read)}, {mib(hit)} hits"


def nothing_left(run: Run) -> str:
    if run.reads is not None:
        run.reads.close()
    run.signal.close()
    if SHARED_HOST:
        return "not asked on a shared host (other agents' programs may run and stay)"
    left = programs_left()
    assert left == 0, f"{left} programs left"
    return "no read-counting program left once the counters closed"


def residency_scan(run: Run) -> str:
    sparse = WORK / "sparse.raw"
    with open(sparse, "w+b") as f:
        f.truncate(1 << 30)
        for off, length in [(100 * MiB, 4 * MiB), (512 * MiB + 65536, MiB)] + [
                (i * 13 * MiB + 4096 * i, 65536) for i in range(40)]:
            f.seek(off)
            f.write(os.urandom(length))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        for off, length in [(100 * MiB, 2 * MiB), (512 * MiB + 65536, 4096)] + [
                (i * 26 * MiB + 8192 * i, 65536) for i in range(20)]:
            os.pread(f.fileno(), length, off)
    seen = scan_residency(sparse, MiB)
    ref = mincore_pages(sparse, MiB)
    got = {int(b): round(float(v) * MiB / PAGE) for b, v in zip(seen.blocks.index, seen.blocks.value)}
    assert got == ref, f"scan {got} != mincore {ref}"
    assert seen.resident_pages == sum(ref.values()), (seen.resident_pages, sum(ref.values()))
    detail = f"{seen.method}: {seen.resident_pages} pages in {len(ref)} blocks of a 1 GiB sparse file, as mincore"
    if seen.method == "cachestat":
        mc = scan_residency(sparse, MiB, use_cachestat=False)
        assert mc.resident_pages == seen.resident_pages
        detail += " (and the mincore-only scan)"
    out = subprocess.run(["vmcache", "scan", "--json", str(sparse)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    told = json.loads(out.stdout)
    assert told["resident_pages"] == seen.resident_pages, told
    return detail + f"; `vmcache scan` ({told['method']}) says the same"


def watch_pins(run: Run) -> str:
    """``vmcache watch`` (the inferred path: no counter) pins a range a reader keeps reading, and lets go."""
    image = random_image(WORK / "watch.raw", 64 * MiB)
    proc = subprocess.Popen(["vmcache", "watch", str(image), "--budget", "32M", "--interval", "1s",
                             "--min-free", "64M", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    pinned, cycles, line = 0, 0, ""
    try:
        assert proc.stdout
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            run.reader.pread(image, 16 * MiB, HOT)  # the guest keeps reading its hot range
            line = proc.stdout.readline()
            if not line:
                break
            cycles += 1
            pinned = json.loads(line)["pinned_bytes"]
            if pinned >= HOT // 2:
                break
        locked = _locked(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    # the model pins the zone's core: its edge blocks, beside blocks nobody reads, may stay under the threshold
    assert HOT // 2 <= pinned <= HOT + 2 * MiB, \
        f"{pinned} bytes pinned after {cycles} cycles; the last: {line.strip()}; {err[-2000:]}"
    assert locked >= HOT // 2, f"vmcache watch has {locked} bytes locked only"
    assert proc.returncode == 0 and "released all pins" in err, (proc.returncode, err[-2000:])
    return f"pinned {pinned // MiB} MiB of the hot {HOT // MiB} MiB range in {cycles} cycles ({locked // MiB} MiB locked), " \
           "all released at SIGTERM"


def bpf_refused(run: Run) -> str:
    code = ("import logging, sys\n"
            "from vmcache.service.readsignal import ReadSignal\n"
            "logging.basicConfig(stream=sys.stderr, level=logging.INFO, format='%(message)s')\n"
            f"s = ReadSignal('vmk', logger=logging.getLogger('a'), pid_of=lambda _: {run.reader.pid})\n"
            f"print(s.watch('{run.data}', 1 << 20), s.watch('{run.data}', 1 << 20), s.signal)\n")
    out = subprocess.run(["setpriv", "--bounding-set", "-bpf,-perfmon,-sys_admin", "--", sys.executable, "-c",
                          code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["None", "None", "inferred"], out.stdout + out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "reads." in ln]
    assert len(lines) == 1 and lines[0].startswith("reads.inferred"), lines
    return lines[0][:200]


def psi(run: Run) -> str:
    pressure = read_pressure()
    if "psi=0" in Path("/proc/cmdline").read_text():
        assert pressure is None, pressure
        return "booted with psi=0: no pressure (the agent backs off on MemAvailable alone)"
    assert pressure is not None
    return f"pressure some avg10={pressure.some.avg10}"


def check(name: str, fn: Callable[[Run], str], run: Run) -> bool:
    """Run one check; its return value is the ``ok`` line's detail, an exception a FAIL."""
    try:
        detail = fn(run)
    except Exception as err:  # noqa: BLE001 - every failure of a check is reported, the next one runs
        print(f"vmk: FAIL {name}: {type(err).__name__}: {err}", flush=True)
        traceback.print_exc(file=sys.stdout)
        return False
    print(f"vmk: ok {name}: {detail}", flush=True)
    return True


def main() -> int:
    WORK.mkdir(parents=True, exist_ok=True)
    has_tracepoint = _has_tracepoint_set()
    expected = os.environ.get("VMK_EXPECT_SIGNAL") or _first_set_that_loads()
    print(f"vmk: kernel {os.uname().release}; the tracepoint set's events: {has_tracepoint}; "
          f"cachestat: {cachestat_supported()}; expected counter: {expected}", flush=True)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="vmk-log: %(message)s")
    reader = Reader()
    run = Run(reader, ReadSignal("vmk", logger=logging.getLogger("vmk.agent"), pid_of=lambda _: reader.pid),
              random_image(WORK / "data.raw", 64 * MiB), expected)
    checks = [counter, one_set, ten_reads, others_not_counted, block_device, many_disks, pid_namespace,
              *([tracepoint_set] if has_tracepoint else []),
              nothing_left, residency_scan, watch_pins, bpf_refused, psi]
    results = [check(fn.__name__.replace("_", "-"), fn, run) for fn in checks]
    reader.close()
    print(f"vmk: done ok={sum(results)} failed={len(results) - sum(results)}", flush=True)
    return 0 if all(results) else 1


def _first_set_that_loads() -> str:
    """What ORDER should choose here: the probe where this kernel loads it on its own, else the tracepoint."""
    from vmcache.host.readmaps import Maps

    maps = Maps.create()
    try:
        for fd in ProbeSet.for_kernel().load(maps):
            os.close(fd)
        return "probe"
    except (bpf.BpfError, OSError) as err:
        print(f"vmk: the probe does not load here ({err}): the tracepoint is the one to expect", flush=True)
        return "tracepoint"
    finally:
        maps.close()


def _has_tracepoint_set() -> bool:
    """Whether this kernel has every tracepoint of the tracepoint set (mm_filemap_get_pages: 6.12; the
    readahead ones later)."""
    from vmcache.host.readsets import NoReadSet

    try:
        TracepointSet.for_kernel()
    except NoReadSet as err:
        print(f"vmk: no tracepoint set here: {err}", flush=True)
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
