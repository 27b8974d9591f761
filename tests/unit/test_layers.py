"""Backing layers: one agent per shared file (real flock'd files), takeover, old tops kept as layers."""

from __future__ import annotations

import logging
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from vmcache.host.layerlock import LayerLock, holder, lock_key, sweep
from vmcache.observe.status import DiskStatus
from vmcache.service.layers import Layers, Wanted
from vmcache.settings.metadata import DiskInfo
from vmcache.settings.policy import DiskChoice

LOG = logging.getLogger("test.layers")


@dataclass
class FakeWorker:
    target: str
    image: str
    budget: int
    pinned_bytes: int = 0
    closed: bool = False
    demoted: bool = False
    status: DiskStatus = field(init=False)

    def __post_init__(self) -> None:
        self.status = DiskStatus(target=self.target, source=self.image, cache="writethrough", eligible=True)

    def close(self, *, qemu_alive: bool = True) -> None:
        self.closed = True

    def demote(self, *, qemu_alive: bool = True) -> None:
        self.demoted = True
        self.status.layer_of = self.target


def _choice(target: str, budget: int = 8 << 20) -> DiskChoice:
    disk = DiskInfo(target=target, source="/top.qcow2", driver_type="qcow2", cache="writethrough")
    return DiskChoice(disk=disk, eligible=True, reason=None, budget=budget)


def _layers(tmp: Path, domain: str, made: list[FakeWorker]) -> tuple[Layers, object]:
    def make(choice: DiskChoice, target: str) -> FakeWorker:
        worker = FakeWorker(target, choice.disk.source or "", choice.budget)
        made.append(worker)
        return worker
    return Layers(domain, str(tmp / "locks"), logger=LOG), make


def test_a_lock_is_held_once_named_after_its_holder_and_gone_after_release(tmp_path: Path) -> None:
    base = tmp_path / "base.raw"
    base.write_bytes(b"x")
    key = lock_key(str(base))
    assert key == lock_key(str(tmp_path / "." / "base.raw"))  # every path of one file: one lock
    first = LayerLock.take(str(tmp_path / "l"), key, "dom-a")
    assert first is not None
    assert LayerLock.take(str(tmp_path / "l"), key, "dom-b") is None  # another open file description
    assert holder(str(tmp_path / "l"), key) == "dom-a"
    first.release()
    first.release()
    assert list((tmp_path / "l").iterdir()) == []
    second = LayerLock.take(str(tmp_path / "l"), key, "dom-b")
    assert second is not None and holder(str(tmp_path / "l"), key) == "dom-b"
    second.release()


def test_the_kernel_releases_a_killed_holders_lock(tmp_path: Path) -> None:
    code = ("import sys, time; from vmcache.host.layerlock import LayerLock; "
            "assert LayerLock.take(sys.argv[1], 'k', 'dom-a'); print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        assert LayerLock.take(str(tmp_path), "k", "dom-b") is None
    finally:
        proc.kill()
        proc.wait()
    lock = LayerLock.take(str(tmp_path), "k", "dom-b")
    assert lock is not None  # the dead holder's file is reused, its name replaced
    assert holder(str(tmp_path), "k") == "dom-b"
    assert sweep(str(tmp_path)) == 0  # held: kept
    lock.release()


def test_sweep_removes_the_files_of_killed_holders_only(tmp_path: Path) -> None:
    code = ("import sys; from vmcache.host.layerlock import LayerLock; "
            "assert LayerLock.take(sys.argv[1], 'dead', 'dom-a'); import os; os._exit(0)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)
    held = LayerLock.take(str(tmp_path), "live", "dom-b")
    assert held is not None and sorted(p.name for p in tmp_path.iterdir()) == ["dead.lock", "live.lock"]
    assert sweep(str(tmp_path)) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["live.lock"] and holder(str(tmp_path), "live") == "dom-b"
    held.release()
    assert sweep(str(tmp_path / "absent")) == 0


def test_a_shared_base_is_managed_by_one_agent_and_taken_over_when_it_goes(tmp_path: Path) -> None:
    base = tmp_path / "base.raw"
    base.write_bytes(b"x")
    made_a: list[FakeWorker] = []
    made_b: list[FakeWorker] = []
    a, make_a = _layers(tmp_path, "dom-a", made_a)
    b, make_b = _layers(tmp_path, "dom-b", made_b)
    a.sync([Wanted(str(base), "vdb", _choice("vdb"))], make_a, qemu_alive=True)  # type: ignore[arg-type]
    b.sync([Wanted(str(base), "vda", _choice("vda"))], make_b, qemu_alive=True)  # type: ignore[arg-type]
    assert [w.image for w in a.workers("vdb")] == [str(base)] and b.workers() == [] and made_b == []
    [waiting] = b.statuses()
    assert (waiting.eligible, waiting.reason, waiting.layer_of) == (False, "managed by domain dom-a", "vda")
    assert b.paths() == {str(base.resolve()): "vda"}
    b.retry()
    assert b.workers() == []
    a.close_all(qemu_alive=True)
    assert made_a[0].closed and a.workers() == []
    b.retry()
    assert [w.image for w in b.workers("vda")] == [str(base)]
    assert b.statuses()[0].eligible
    b.sync([], make_b, qemu_alive=True)  # type: ignore[arg-type]
    assert made_b[0].closed and not list((tmp_path / "locks").iterdir())


def test_an_old_top_is_kept_as_a_layer_when_wanted_and_closed_when_not(tmp_path: Path) -> None:
    old = tmp_path / "old.raw"
    old.write_bytes(b"x")
    made: list[FakeWorker] = []
    layers, make = _layers(tmp_path, "dom", made)
    top = FakeWorker("vda", str(old), 1 << 20, pinned_bytes=4 << 20)
    layers.park(top, qemu_alive=True)  # type: ignore[arg-type]
    layers.sync([Wanted(str(old), "vda", _choice("vda", 8 << 20))], make, qemu_alive=True)  # type: ignore[arg-type]
    assert made == [] and [id(w) for w in layers.workers("vda")] == [id(top)]  # the same worker: heat and pins kept
    assert top.demoted and not top.closed and top.budget == 8 << 20
    assert layers.pinned_bytes() == 4 << 20 and id(layers.held(str(old))) == id(top)
    gone = FakeWorker("vda", str(tmp_path / "gone.raw"), 1 << 20)
    (tmp_path / "gone.raw").write_bytes(b"y")
    layers.park(gone, qemu_alive=True)  # type: ignore[arg-type]
    layers.sync([], make, qemu_alive=True)  # type: ignore[arg-type]
    assert gone.closed and top.closed and layers.pinned_bytes() == 0
