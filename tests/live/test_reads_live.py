"""Every guest read counted in the kernel (issue 20), with the real libvirtd, QEMU, agent and BPF.

Paused opted-in domains; "guest" reads are HMP ``qemu-io`` on the virtio
disk, which QEMU serves with preadv from its thread pool as it would a
guest's. The agents count them in the kernel: exactly, cache hits
included, never the agent's own loads or another domain's reads, on the
backing layer a read reaches. Where BPF is refused (the agent's
capabilities dropped) the agent infers reads, says so once, and runs.
Nothing of the program outlives the agents, also after ``kill -9``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("libvirt")

from vmcache.host import bpf
from vmcache.host.readsets import ORDER

from tests.live.guestlib import guest_read
from tests.live.livelib import (
    MiB,
    LiveEnv,
    agents_env,
    cache_metadata,
    connect,
    domain_xml,
    loop_device,
    restart_libvirtd,
    scrape,
    start_paused,
    wait_for,
)

pytestmark = pytest.mark.live

PREFIX = f"rd-{os.getpid()}-"
READ = "vmcache_guest_read_bytes_total"
HIT = "vmcache_guest_read_hit_bytes_total"


@pytest.fixture(scope="module")
def env(live_tmp: Path, hooked) -> Iterator[LiveEnv]:
    # the counted reads decide in the model too: a range the guest keeps reading is pinned
    yield from agents_env(live_tmp, hooked, PREFIX, cap=256 * MiB, read_model="counted")


def programs() -> int:
    """The read-counting programs loaded on the host now (either set's)."""
    names = bpf.program_names()
    return sum(names.count(kind.NAME) for kind in ORDER)


def one_set(env: LiveEnv, name: str) -> int:
    """The programs of one set of the kind the agent of domain ``name`` counts with."""
    return {kind.SIGNAL: kind.LINKS for kind in ORDER}[env.status(PREFIX + name)["read_signal"]]


def data_image(path: Path, size: int) -> Path:
    """``size`` bytes of data (not holes) at ``path``, out of the page cache."""
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return path


def start(env: LiveEnv, name: str, disk: Path, *, devices: str = "") -> Any:
    dom = start_paused(env.conn, domain_xml(PREFIX + name, disk, metadata=cache_metadata("64M"), devices=devices))
    try:
        wait_for(lambda: (s := env.status(PREFIX + name)) and s["state"] == "running" and s["disks"]
                 and s["disks"][0].get("cycles", 0) >= 1, f"{name}'s agent to run a cycle", timeout=30)
    except AssertionError as err:
        raise AssertionError(f"{err}: {env.status(PREFIX + name)}\nagent log:\n{env.agent_log(PREFIX + name)[-3000:]}"
                             f"\nhook log:\n{env.hook_log()[-3000:]}") from None
    return dom


def counted(env: LiveEnv, name: str, metric: str = READ, source: Path | None = None) -> float:
    status = env.status(PREFIX + name)
    labels = {"target_device": "vda"} if source is None else {"source_file": str(source)}
    return scrape(status["metrics_url"], metric, labels)


def settled(env: LiveEnv, name: str, at_least: float, **kw: Any) -> float:
    """The read bytes once they reached ``at_least`` and two more cycles added nothing."""
    wait_for(lambda: counted(env, name, **kw) >= at_least, f"{name}'s reads to be counted", timeout=20)
    cycles = env.status(PREFIX + name)["disks"][0]["cycles"]
    wait_for(lambda: env.status(PREFIX + name)["disks"][0]["cycles"] >= cycles + 2, "two more cycles", timeout=20)
    return counted(env, name, **kw)


def stop(env: LiveEnv, dom: Any, name: str) -> None:
    dom.destroy()
    wait_for(lambda: env.agent_pid(PREFIX + name) is None, f"{name}'s agent to exit", timeout=30)


def test_ten_reads_count_40_mib_exactly_hits_included_and_never_the_agent_s_own_loads(env: LiveEnv) -> None:
    before = programs()
    image = data_image(env.tmp / f"{PREFIX}one.raw", 64 * MiB)
    dom = start(env, "one", image)
    signal = env.status(PREFIX + "one")["read_signal"]
    assert signal in ("probe", "tracepoint"), env.agent_log(PREFIX + "one")
    assert programs() == max(before, one_set(env, "one"))  # one set per host, whoever loaded it
    read0, hit0 = counted(env, "one"), counted(env, "one", HIT)
    for _ in range(10):
        guest_read(dom, 8 * MiB, 4 * MiB)
    with open(image, "rb") as f:  # another reader of the image: not the guest
        os.pread(f.fileno(), 4 * MiB, 8 * MiB)
    read = settled(env, "one", read0 + 40 * MiB)
    assert read - read0 == 40 * MiB
    assert counted(env, "one", HIT) - hit0 >= 36 * MiB
    # read on until the agent pins the range (its own preadv + mlock of it): only the guest's bytes count
    reads = []

    def pinned() -> bool:
        guest_read(dom, 8 * MiB, 4 * MiB)
        reads.append(4 * MiB)
        return env.pinned(PREFIX + "one") >= 4 * MiB

    wait_for(pinned, "the read range to be pinned", timeout=30, step=0.3)
    read += sum(reads)
    assert settled(env, "one", read) == read
    disk = env.status(PREFIX + "one")["disks"][0]
    assert disk["guest_read_bytes"] == read and disk["guest_read_hit_bytes"] >= 36 * MiB
    out = subprocess.run([sys.executable, "-m", "vmcache", "status", "--host-config", str(env.config)],
                         capture_output=True, text=True, timeout=30)
    assert f"guest reads: {signal}" in out.stdout and "% hits of" in out.stdout, out.stdout + out.stderr
    stop(env, dom, "one")
    assert programs() == before


def test_two_domains_on_two_images_never_count_each_other_s_reads(env: LiveEnv) -> None:
    a = start(env, "a", data_image(env.tmp / f"{PREFIX}a.raw", 32 * MiB))
    b = start(env, "b", data_image(env.tmp / f"{PREFIX}b.raw", 32 * MiB))
    a0, b0 = counted(env, "a"), counted(env, "b")
    guest_read(a, 0, 4 * MiB)
    guest_read(b, 16 * MiB, MiB)
    assert settled(env, "a", a0 + 4 * MiB) - a0 == 4 * MiB
    assert settled(env, "b", b0 + MiB) - b0 == MiB
    stop(env, a, "a")
    stop(env, b, "b")


def test_a_backing_layer_s_reads_are_counted_on_the_layer(env: LiveEnv) -> None:
    base = data_image(env.tmp / f"{PREFIX}base.raw", 32 * MiB)
    top = env.tmp / f"{PREFIX}top.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "raw", str(top)], check=True)
    os.chmod(top, 0o644)
    disk = (f"<disk type='file' device='disk'><driver name='qemu' type='qcow2' cache='writethrough'/>"
            f"<source file='{top}'/><target dev='vdb' bus='virtio'/><alias name='ua-vdb'/></disk>")
    dom = start(env, "chain", data_image(env.tmp / f"{PREFIX}chain.raw", 8 * MiB), devices=disk)
    wait_for(lambda: any(d["source"] == str(base) and d["eligible"] for d in env.status(PREFIX + "chain")["disks"]),
             "the base to be managed as a layer", timeout=30)
    b0 = counted(env, "chain", source=base)
    guest_read(dom, 8 * MiB, 4 * MiB, dev="ua-vdb")  # never written on the top: read from the base
    assert settled(env, "chain", b0 + 4 * MiB, source=base) - b0 == 4 * MiB
    stop(env, dom, "chain")


def test_a_block_device_s_reads_are_counted(env: LiveEnv) -> None:
    """A block device's page cache belongs to the kernel's bdev inode, not to the /dev node the domain names."""
    with loop_device(env.tmp / f"{PREFIX}loop.img", 16 * MiB) as dev:
        disk = (f"<disk type='block' device='disk'><driver name='qemu' type='raw' cache='writethrough'/>"
                f"<source dev='{dev}'/><target dev='vdb' bus='virtio'/><alias name='ua-vdb'/></disk>")
        dom = start(env, "block", data_image(env.tmp / f"{PREFIX}blockvda.raw", 8 * MiB), devices=disk)
        wait_for(lambda: any(d["source"] == dev and d["eligible"] and d.get("cycles", 0) >= 1
                             for d in env.status(PREFIX + "block")["disks"]), "the device to be managed", timeout=30)
        d0 = counted(env, "block", source=Path(dev))
        guest_read(dom, 4 * MiB, 2 * MiB, dev="ua-vdb")
        try:
            assert settled(env, "block", d0 + 2 * MiB, source=Path(dev)) - d0 == 2 * MiB
        finally:
            stop(env, dom, "block")


def test_the_program_goes_with_the_last_agent_also_after_kill_9(env: LiveEnv) -> None:
    before = programs()
    dom = start(env, "kill", data_image(env.tmp / f"{PREFIX}kill.raw", 8 * MiB))
    assert programs() == max(before, one_set(env, "kill"))
    pid = env.agent_pid(PREFIX + "kill")
    assert pid
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), "the agent to die", timeout=10)
    if before == 0:  # no other agent on the host holds them
        wait_for(lambda: programs() == 0, "the programs to go with their last holder", timeout=10)
    dom.destroy()
    assert programs() == before


def test_counting_outlives_a_stopped_neighbour_a_libvirtd_restart_and_a_killed_agent(env: LiveEnv) -> None:
    """The operator's day: two agents share the programs, one domain stops, libvirtd restarts, an agent is
    killed and the reconnect hook starts a new one - each time the remaining reads are counted exactly."""
    before = programs()
    a = start(env, "opa", data_image(env.tmp / f"{PREFIX}opa.raw", 16 * MiB))
    b = start(env, "opb", data_image(env.tmp / f"{PREFIX}opb.raw", 16 * MiB))
    loaded = max(before, one_set(env, "opb"))
    assert programs() == loaded
    b0 = counted(env, "opb")
    stop(env, a, "opa")  # the agent that loaded the programs goes; b's own descriptors keep them
    assert programs() == loaded
    guest_read(b, 0, 2 * MiB)
    b1 = settled(env, "opb", b0 + 2 * MiB)
    assert b1 - b0 == 2 * MiB
    agent = env.agent_pid(PREFIX + "opb")
    assert agent
    env.conn.close()
    restart_libvirtd()
    env.conn = connect()
    b = env.conn.lookupByName(PREFIX + "opb")
    wait_for(lambda: "agent.reconnected" in env.agent_log(PREFIX + "opb"), "the agent to reconnect", timeout=30)
    assert env.agent_pid(PREFIX + "opb") == agent
    guest_read(b, 4 * MiB, MiB)
    b2 = settled(env, "opb", b1 + MiB)
    assert b2 - b1 == MiB
    os.kill(agent, signal.SIGKILL)
    wait_for(lambda: env.agent_pid(PREFIX + "opb") is None, "the killed agent to be gone", timeout=10)
    env.conn.close()
    restart_libvirtd()  # its reconnect hook starts the domain's agent again
    env.conn = connect()
    b = env.conn.lookupByName(PREFIX + "opb")
    wait_for(lambda: (p := env.agent_pid(PREFIX + "opb")) and p != agent, "the hook to start a new agent", timeout=30)
    wait_for(lambda: (s := env.status(PREFIX + "opb")) and s["pid"] != agent and s["state"] == "running"
             and s["disks"] and s["disks"][0].get("cycles", 0) >= 1, "the new agent's first cycle", timeout=30)
    assert env.status(PREFIX + "opb")["read_signal"] in ("probe", "tracepoint"), env.agent_log(PREFIX + "opb")[-3000:]
    assert programs() == max(before, one_set(env, "opb"))  # joined or loaded anew: never a second set
    c0 = counted(env, "opb")
    guest_read(b, 8 * MiB, 3 * MiB)
    assert settled(env, "opb", c0 + 3 * MiB) - c0 == 3 * MiB
    stop(env, b, "opb")
    assert programs() == before


def test_bpf_refused_the_agent_infers_reads_says_so_once_and_runs(env: LiveEnv) -> None:
    drop = [shutil.which("setpriv"), "--bounding-set", "-bpf,-perfmon,-sys_admin", "--",
            *env.base["agent_command"]]
    with env.config_override(agent_command=drop):
        dom = start(env, "nobpf", data_image(env.tmp / f"{PREFIX}nobpf.raw", 8 * MiB))
    status = env.status(PREFIX + "nobpf")
    assert status["read_signal"] == "inferred" and status["read_signal_reason"], status
    assert status["disks"][0]["guest_read_bytes"] is None
    guest_read(dom, 0, MiB)
    url = status["metrics_url"]
    wait_for(lambda: scrape(url, "vmcache_agent_info", {"read_signal": "inferred"}) == 1, "the signal label")
    assert scrape(url, READ) == 0  # no series
    assert env.agent_log(PREFIX + "nobpf").count("reads.inferred") == 1
    assert dom.isActive()
    stop(env, dom, "nobpf")


def test_pins_read_after_a_gap_the_kernel_missed_the_unpinned_blocks_at_are_counted_as_saved(env: LiveEnv) -> None:
    """What a disk's pins are worth (vmcache.model.pinvalue): the hits of a pinned range whose unpinned
    neighbours, read as long before, had to come from the device again."""
    image = data_image(env.tmp / f"{PREFIX}worth.raw", 64 * MiB)
    name = PREFIX + "worth"
    dom = start_paused(env.conn, domain_xml(name, image, metadata=cache_metadata("4M")))  # room for H alone
    wait_for(lambda: (s := env.status(name)) and s["disks"] and s["disks"][0].get("cycles", 0) >= 1,
             "the agent to run a cycle", timeout=30)
    hot, cold = (8 * MiB, 4 * MiB), (32 * MiB, 8 * MiB)
    def read_hot_until_pinned() -> bool:
        guest_read(dom, *hot)
        return env.pinned(name) >= 4 * MiB

    wait_for(read_hot_until_pinned, "H pinned", timeout=30, step=0.3)
    guest_read(dom, *cold)
    guest_read(dom, *hot)
    cycles = env.status(name)["disks"][0]["cycles"]
    wait_for(lambda: env.status(name)["disks"][0]["cycles"] >= cycles + 3, "three more cycles", timeout=20)
    assert counted(env, "worth", "vmcache_pin_saved_bytes_total") == 0   # nothing missed yet: nothing saved
    with open(image, "rb") as f:  # the kernel evicts what is not pinned (the locked pages stay)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    guest_read(dom, *cold)        # missed: read again after as long a gap as H
    guest_read(dom, *hot)         # hits, in the pins
    wait_for(lambda: counted(env, "worth", "vmcache_pin_saved_bytes_total") >= 3 * MiB, "H's hits counted as saved",
             timeout=20)
    saved = counted(env, "worth", "vmcache_pin_saved_bytes_total")
    assert saved <= 4 * MiB, saved                                        # never more than the pinned hits
    assert counted(env, "worth", "vmcache_pin_cost_bytes_total") < saved  # no limit: a share of the host's refaults
    out = subprocess.run([sys.executable, "-m", "vmcache", "status", "--host-config", str(env.config)],
                         capture_output=True, text=True, timeout=30)
    line = next(ln for ln in out.stdout.splitlines() if "pins saved" in ln)
    assert "the kernel keeps a page read again ~" in line, out.stdout
    stop(env, dom, "worth")
