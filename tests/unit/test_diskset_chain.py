"""A disk set with a backing chain: the layer beside its top, the disk's bytes divided between them by benefit."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vmcache.host.blockdev import ImageDisk
from vmcache.service.diskset import DiskSet
from vmcache.service.layers import Layers
from vmcache.settings.config import HostConfig
from vmcache.settings.metadata import DiskInfo, DomainInfo, DomainSettings
from tests.unit.test_agent import FakeRefs, FakeWorker

MiB = 1 << 20
LOG = logging.getLogger("test.diskset_chain")


@dataclass
class Chain:
    top: Path
    base: Path
    base_direct: bool = False
    pulled: bool = False

    def discover(self, _monitor: Any) -> list[ImageDisk]:
        backing = () if self.pulled else (str(self.base),)
        return [ImageDisk(str(self.top), "libvirt-1-storage", "file", 64 * MiB, False, False, "libvirt-1-format",
                          "qcow2", "/machine/peripheral/ua-vdb/virtio-backend", backing=backing),
                ImageDisk(str(self.base), "libvirt-2-storage", "file", 64 * MiB, self.base_direct, False,
                          "libvirt-2-format", "raw")]

    def chains(self, _monitor: Any) -> dict[str, tuple[str, ...]]:
        return {str(self.top.resolve()): () if self.pulled else (str(self.base.resolve()),)}


def _set(tmp_path: Path, chain: Chain) -> tuple[DiskSet, dict[str, FakeWorker], DomainInfo]:
    made: dict[str, FakeWorker] = {}

    def make(choice: Any, node: Any, monitor: Any, params: Any, layer_of: Any = None) -> FakeWorker:
        worker = FakeWorker(choice.disk.target, choice.disk.source, choice.budget, monitor)
        worker.status.layer_of = layer_of
        made[choice.disk.source] = worker
        return worker

    config = HostConfig(runtime_dir=str(tmp_path / "run"))
    disks = DiskSet(config, make, refs=FakeRefs(), logger=LOG, discover=chain.discover,  # type: ignore[arg-type]
                    images=lambda _m: {str(chain.top.resolve())}, chains=chain.chains,
                    layers=Layers("d", str(tmp_path / "run" / "layers"), logger=LOG))
    info = DomainInfo("d", "uuid-1", (DiskInfo("vdb", source=str(chain.top), cache="writethrough"),),
                      DomainSettings(enabled=True, budget=16 * MiB))
    return disks, made, info


def _chain(tmp_path: Path, **kw: Any) -> Chain:
    chain = Chain(tmp_path / "top.qcow2", tmp_path / "base.raw", **kw)
    chain.top.write_bytes(b"t")
    chain.base.write_bytes(b"b")
    return chain


def test_the_base_is_a_layer_of_its_disk_sharing_the_disks_bytes_by_benefit(tmp_path: Path) -> None:
    chain = _chain(tmp_path)
    disks, made, info = _set(tmp_path, chain)
    disks.sync(info, lambda: None, qemu_alive=lambda: True)  # type: ignore[arg-type,return-value]
    top, base = made[str(chain.top)], made[str(chain.base)]
    assert disks.budgets() == {"vdb": 16 * MiB}  # the domain asks for the disk's budget once
    assert [(s.source, s.layer_of) for s in disks.statuses()] == [(str(chain.top), None), (str(chain.base), "vdb")]
    disks.cycle({"vdb": 8 * MiB}, title="d")
    assert top.budgets == [4 * MiB] and base.budgets == [4 * MiB]  # no curves yet: even parts
    top.curve = ((2 * MiB, 1.0),)              # 2 MiB worth 1
    base.curve = ((8 * MiB, 40.0),)            # 8 MiB worth 40: denser
    curve = disks.demands(1.0)["vdb"]
    assert curve[-1] == (10 * MiB, 41.0)       # the disk's curve: both merged
    disks.cycle({"vdb": 8 * MiB}, title="d")
    assert base.budgets[-1] == 8 * MiB and top.budgets[-1] == 0
    assert disks.pinned_bytes() == 8 * MiB

    chain.pulled = True  # block pull: the base left the chain under an unchanged top
    assert disks.replaced(None) == ["vdb"]  # type: ignore[arg-type]
    disks.sync(info, lambda: None, qemu_alive=lambda: True)  # type: ignore[arg-type,return-value]
    assert base.closed and not top.closed and [s.source for s in disks.statuses()] == [str(chain.top)]
    assert not list((tmp_path / "run" / "layers").iterdir())


def test_an_o_direct_base_is_listed_and_left_alone(tmp_path: Path) -> None:
    chain = _chain(tmp_path, base_direct=True)
    disks, made, info = _set(tmp_path, chain)
    disks.sync(info, lambda: None, qemu_alive=lambda: True)  # type: ignore[arg-type,return-value]
    assert str(chain.base) not in made
    skipped = disks.statuses()[-1]
    assert (skipped.source, skipped.eligible, skipped.layer_of) == (str(chain.base), False, "vdb")
    assert skipped.reason == "QEMU opened it with O_DIRECT"
    disks.drop_all(qemu_alive=True)
    assert made[str(chain.top)].closed


def test_a_failed_discovery_keeps_the_layers(tmp_path: Path) -> None:
    from vmcache.errors import MonitorError

    chain = _chain(tmp_path)
    disks, made, info = _set(tmp_path, chain)
    disks.sync(info, lambda: None, qemu_alive=lambda: True)  # type: ignore[arg-type,return-value]

    def broken(_monitor: Any) -> list[ImageDisk]:
        raise MonitorError("QEMU went quiet")
    disks._discover = broken
    disks.sync(info, lambda: None, qemu_alive=lambda: True)  # type: ignore[arg-type,return-value]
    assert not made[str(chain.base)].closed and len(disks.statuses()) == 2
