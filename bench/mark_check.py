"""Do two reads from another descriptor keep buffered-written pages through a stream? (host check, root)

What hypothesis A of issue 21 (docs/replay.md, "Second attempt") relies on:
a buffered write leaves its pages unreferenced on the inactive list, and a
``pread`` of a resident page marks it accessed (``folio_mark_accessed``),
twice activates it. In a memory cgroup (v1) of 64 MiB, a child writes
16 MiB to a file, reads the first 8 MiB ``--marks`` times from a second
descriptor (one byte a page), writes and reads a 256 MiB stream, and
prints how many pages of each half are still cached (cachestat). The
cgroup and the files are removed afterwards.

    flock /run/lock/vmcache-team.lock .venv/bin/python -m bench.mark_check --marks 2 [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil

from vmcache.host.cachestat import cachestat

MiB, PAGE = 1 << 20, 4096
CGROUP = "/sys/fs/cgroup/memory"


def child(cgroup: str, work: str, marks: int) -> None:
    with open(f"{cgroup}/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))
    chunk, half = b"x" * (8 * MiB), 8 * MiB
    fd = os.open(f"{work}/written", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, chunk + chunk)
    os.fsync(fd)
    marker = os.open(f"{work}/written", os.O_RDONLY)  # the agent's own descriptor
    for _ in range(marks):
        for off in range(0, half, PAGE):
            os.pread(marker, 1, off)
    stream = os.open(f"{work}/stream", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    for _ in range(32):
        os.write(stream, chunk)
    os.fsync(stream)
    os.lseek(stream, 0, os.SEEK_SET)
    while os.read(stream, MiB):
        pass
    print(f"marks={marks}: pages cached after the stream - marked half {cachestat(fd, 0, half).nr_cache} "
          f"of {half // PAGE}, unmarked half {cachestat(fd, half, half).nr_cache} of {half // PAGE}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--marks", type=int, default=2)
    p.add_argument("--dir", default="/var/tmp")
    p.add_argument("--name", default="vmcache-markcheck", help="cgroup and work directory name")
    args = p.parse_args()
    cgroup, work = f"{CGROUP}/{args.name}", os.path.join(args.dir, args.name)
    os.makedirs(work)
    os.mkdir(cgroup)
    try:
        with open(f"{cgroup}/memory.limit_in_bytes", "w") as f:
            f.write(str(64 * MiB))
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                child(cgroup, work, args.marks)
                code = 0
            finally:
                os._exit(code)
        os.waitpid(pid, 0)
    finally:
        shutil.rmtree(work)
        os.rmdir(cgroup)


if __name__ == "__main__":
    main()
