"""Domains of the test guest for ``make demo``, ``make bench`` and live tests.

The guest (``scripts/build-guest.sh``) is a Debian cloud kernel with a
busybox + fio initramfs. It runs the fio workload named on its kernel
command line against its first disk and prints fio's JSON on the serial
console, which libvirt writes to a file here. Nothing in here is used by
the agent itself.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from xml.sax.saxutils import escape, quoteattr

from vmcache.settings.metadata import NAMESPACE, PREFIX, DomainSettings, build_settings

__all__ = ["GuestSpec", "domain_xml", "fio_results", "GUEST_DIR"]

GUEST_DIR = "/var/lib/vmcache/guest"

_FIO_RE = re.compile(r"VMCACHE-FIO-BEGIN (\S+)\r?\n(.*?)VMCACHE-FIO-END \1", re.S)


@dataclass(frozen=True)
class GuestSpec:
    """What the test domain looks like."""

    name: str
    disk: str                       # image path (raw)
    console_log: str                # serial console output file
    workload: str = "demo"          # demo, zoned, zipf, moving, periodic, alternate, trace, stamp, idle
    runtime: int = 60               # seconds per fio run
    warmup: int | None = None       # seconds of the first fio run (default: runtime)
    gap: int | None = None          # periodic: seconds of each phase off the hot range
    loops: int = 0                  # 0: forever
    qd: int = 1                     # 1: psync + sync=1, else libaio iodepth
    size: int | None = None         # bytes of the disk fio uses (default all)
    memory_mib: int = 384
    cache: str = "writethrough"
    guest_dir: str = GUEST_DIR
    settings: DomainSettings | None = None   # vmcache metadata, None: not opted in
    extra_disks: tuple[str, ...] = field(default=())   # more raw images (vdb, vdc...)
    phase: int | None = None        # alternate: 0 busy first, 1 idle first
    initrd: str | None = None       # another initramfs (default: guest_dir's), e.g. with a trace appended
    stamp_at: int | None = None     # stamp: the MiB where its 64 stamped blocks start (default 8)
    console_append: bool = False    # each QEMU of the domain appends to the console file (a migration's
                                    # destination would empty it otherwise)


def domain_xml(spec: GuestSpec) -> str:
    """Libvirt XML for the test guest (TCG: nested KVM guests hang on these hosts)."""
    args = [
        "console=ttyS0", "quiet", "panic=-1",
        f"vmcache_workload={spec.workload}",
        f"vmcache_runtime={spec.runtime}",
        f"vmcache_loops={spec.loops}",
        f"vmcache_qd={spec.qd}",
    ]
    if spec.size:
        args.append(f"vmcache_size={spec.size}")
    if spec.warmup is not None:
        args.append(f"vmcache_warmup={spec.warmup}")
    if spec.gap is not None:
        args.append(f"vmcache_gap={spec.gap}")
    if spec.phase is not None:
        args.append(f"vmcache_phase={spec.phase}")
    if spec.stamp_at is not None:
        args.append(f"vmcache_stamp_at={spec.stamp_at}")
    metadata = ""
    if spec.settings is not None:
        element = _namespaced(build_settings(spec.settings))
        metadata = f"<metadata>{element}</metadata>"
    disks = []
    for index, path in enumerate((spec.disk, *spec.extra_disks)):
        dev = "vd" + chr(ord("a") + index)
        disks.append(
            f"<disk type='file' device='disk'><driver name='qemu' type='raw' cache={quoteattr(spec.cache)}/>"
            f"<source file={quoteattr(path)}/><target dev='{dev}' bus='virtio'/></disk>"
        )
    append = " append='on'" if spec.console_append else ""
    return f"""<domain type='qemu'>
  <name>{escape(spec.name)}</name>
  {metadata}
  <memory unit='MiB'>{spec.memory_mib}</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>{escape(spec.guest_dir)}/vmlinuz</kernel>
    <initrd>{escape(spec.initrd or spec.guest_dir + "/initramfs.cpio")}</initrd>
    <cmdline>{escape(" ".join(args))}</cmdline>
  </os>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    {"".join(disks)}
    <serial type='file'><source path={quoteattr(spec.console_log)}{append}/><target port='0'/></serial>
    <console type='file'><source path={quoteattr(spec.console_log)}{append}/><target type='serial' port='0'/></console>
    <memballoon model='none'/>
  </devices>
</domain>
"""


def _namespaced(element: str) -> str:
    """The metadata element as libvirt stores it: in vmcache's namespace, with its prefix."""
    ET.register_namespace(PREFIX, NAMESPACE)
    root = ET.fromstring(element)  # our own output, not operator input
    for node in root.iter():
        node.tag = f"{{{NAMESPACE}}}{node.tag}"
    return ET.tostring(root, encoding="unicode")


def fio_results(console: str) -> list[dict]:
    """fio's JSON results printed by the guest, in order (incomplete runs left out)."""
    results = []
    for match in _FIO_RE.finditer(console):
        text = match.group(2)
        start = text.find("{")
        if start < 0:
            continue
        try:
            results.append(json.loads(text[start:text.rfind("}") + 1]))
        except json.JSONDecodeError:
            continue
    return results
