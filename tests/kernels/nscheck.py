"""make test-kernels' check of an agent in a pid namespace of its own, as in a container (systemd-nspawn, a
pod): its QEMU is known to it only by its pid there, and the kernel's programs must count that QEMU's reads,
and not those of a host process whose pid on the host is the same number.

The agent's side runs in ``unshare --pid --fork --mount-proc`` (its /proc that namespace's), with a lock
directory of its own (a container's /run), and joins the set the checks' agent loaded. Its stand-in QEMU
is a reader started there. A second counter of that namespace registers, as its QEMU, the pid a reader on
the host has on the host: that reader's reads must not count.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Protocol

from tests.pagecache_util import random_image

MiB = 1 << 20

INNER = r"""
import json, os, struct, subprocess, sys, tempfile
from vmcache.host.pidns import SLOTS, PidNs
from vmcache.host.readcount import ReadCounter
from vmcache.host.readhost import close_all, find_set
from vmcache.host.readmaps import Maps
from vmcache.host.readsets import ORDER

path, host_pid = sys.argv[1], int(sys.argv[2])
READER = ("import os, sys\nfd = os.open(sys.argv[1], os.O_RDONLY)\nfor line in sys.stdin:\n"
          "    off, n, count = map(int, line.split())\n    [os.pread(fd, n, off) for _ in range(count)]\n"
          "    print('done', flush=True)\n")
reader = subprocess.Popen([sys.executable, "-c", READER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True)
ns = PidNs.own()


def pread(off, n, count):
    reader.stdin.write(f"{off} {n} {count}\n")
    reader.stdin.flush()
    assert reader.stdout.readline().strip() == "done"


def slots():
    found = find_set(ORDER)
    maps = Maps.adopt(found.maps)
    try:
        table = maps.pidns.lookup(struct.pack("=I", 0))
        return sum(1 for i in range(SLOTS) if struct.unpack_from("=QQ", table, 16 * i) == (ns.dev, ns.ino))
    finally:
        maps.close()
        close_all(found.links)


lock = tempfile.mkdtemp()
counter = ReadCounter.open(reader.pid, lock_dir=lock)
other = ReadCounter.open(host_pid, lock_dir=lock)
reads = counter.watch(path, 1 << 20)
out = {"ns_ino": ns.ino, "reader_pid": reader.pid, "host_pid": host_pid}
reads.take(64)
fd = os.open(path, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
os.close(fd)
pread(8 << 20, 4 << 20, 3)
out["reader"] = reads.take(64).totals()
print("ready", flush=True)
sys.stdin.readline()  # the host's reader reads the file now
out["host_reader"] = reads.take(64).totals()
out["slots_counting"] = slots()
reads.close()
counter.close()
out["slots_one_left"] = slots()
other.close()
out["slots_after"] = slots()
reader.kill()
print(json.dumps(out), flush=True)
"""


class _Reader(Protocol):
    pid: int

    def pread(self, path: Any, offset: int, length: int, count: int = 1) -> None: ...


def pid_namespace(run: Any, new_reader: type[_Reader]) -> str:
    """Counted from a pid namespace of its own: its QEMU's reads exactly, a host process with the pid the
    namespace registered not at all; its namespace in the table while it counts, out of it after its last counter."""
    image = random_image(run.data.parent / "pidns.raw", 64 * MiB)
    host = new_reader()  # on the host, in no agent's map
    inner = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", INNER, str(image),
                              str(host.pid)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert inner.stdout and inner.stdin
        line = inner.stdout.readline()
        assert line.strip() == "ready", line + inner.communicate(timeout=60)[1][-3000:]
        host.pread(image, 8 * MiB, 4 * MiB, count=2)
        got, err = inner.communicate("go\n", timeout=120)
    finally:
        if inner.poll() is None:
            inner.kill()
        host.close()  # type: ignore[attr-defined]
    assert inner.returncode == 0, err[-3000:]
    out = json.loads(got.splitlines()[-1])
    assert out["reader"][0] == 3 * 1024, f"the namespace's reader: {out['reader']} pages, not 3072 read"
    assert out["host_reader"] == [0, 0], f"a host process with the registered pid counted: {out['host_reader']}"
    assert (out["slots_counting"], out["slots_one_left"], out["slots_after"]) == (1, 1, 0), out
    return (f"a QEMU of pid {out['reader_pid']} in namespace {out['ns_ino']}: 3 x 4 MiB counted "
            f"{out['reader'][0] * 4096 // MiB} MiB, {out['reader'][1] * 4096 // MiB} MiB hits; the host's pid "
            f"{out['host_pid']}, registered there, 0; the namespace out of the table after its last counter")
