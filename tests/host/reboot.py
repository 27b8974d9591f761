"""A real reboot of the clean host: autostarted opted-in domains warm from the host's copies of their sets.

tests/host/inside.sh runs ``before`` with vmcache installed from its
Debian package; tests/host/cleanhost.sh then runs ``systemctl reboot`` in
the container, evicts the images' pages from this machine's page cache
(the container's page cache is this machine's: a reboot of the container
alone would leave it warm), checks none is resident, boots the same root
again (its /var/lib, images and hot-set copies as they were) and runs
``after``::

    python -m tests.host.reboot before|after

``before``: two persistent domains of the test guest (idle: it reads
nothing but its partition table; it powers off on the ACPI power button),
opted in with different budgets and ``virsh autostart``; each "guest" reads its own hot zone (HMP qemu-io, as
the guest's own reads) until the agent keeps a set covering it in the live
XML. At the reboot libvirt-guests shuts the guests down (ACPI), each agent
sees its domain stop and saves the set to the host's copy alone (the
persistent XML gets one only at a periodic save, every hotset_interval).

``after``: libvirt autostarted both; each agent says it warmed from the
host's copy (status ``hotset_source``, the journal's ``hotset.loaded``),
restored all of it, and holds every byte of the zone pinned and resident
while the guest has read none of it; the previous boot's journal shows
the agent outlived its QEMU and saved to the host's copy. Then the domains
are destroyed, their saved sets cleared as an operator does (``vmcache
hotset --clear``), and nothing of either is left.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import libvirt

from tests.host.test_systemd_host import AGENTS, IMAGES, PREFIX, agent_running, assert_nothing_left, show, unit_of
from tests.lab import GuestSpec, domain_xml
from tests.live.guestlib import covered, guest_read, mapped
from tests.live.livelib import MiB, connect, create_disk, read_status, wait_for
from vmcache.host.cachestat import PAGE_SIZE
from vmcache.host.hotstore import HotStore
from vmcache.host.pagecache import scan_residency
from vmcache.host.virtdomain import Affect, VirtDomain
from vmcache.settings.hotset import DiskHotSet
from vmcache.settings.metadata import DomainSettings

DIR = IMAGES / "reboot"
EXPECTED = DIR / "expected.json"
HOTSETS = Path("/var/lib/vmcache/hotsets")
DEVICE = "virtio-disk0"  # libvirt's alias of the guest's vda


@dataclass(frozen=True)
class Guest:
    name: str
    budget: int
    zone: tuple[int, int]  # (offset, length) of the image that its guest reads before the reboot

    @property
    def image(self) -> Path:
        return DIR / f"{self.name}.raw"


GUESTS = (Guest(PREFIX + "reboot-a", 16 * MiB, (8 * MiB, 6 * MiB)),
          Guest(PREFIX + "reboot-b", 32 * MiB, (24 * MiB, 20 * MiB)))


def say(text: str) -> None:
    print(f"ok: {text}", flush=True)


def live_record(conn: Any, name: str) -> DiskHotSet | None:
    hotset = VirtDomain(conn, name).hotset(Affect.LIVE)
    return hotset.disk("vda") if hotset else None


def holds(record: DiskHotSet | None, zone: tuple[int, int]) -> bool:
    """Whether ``record``'s regions cover every byte of ``zone``."""
    if record is None:
        return False
    spans = [(r.start, r.length) for r in record.regions]
    return covered(spans, *zone)


def console(guest: Guest) -> str:
    try:
        return (DIR / f"{guest.name}.log").read_text(errors="replace")
    except FileNotFoundError:
        return ""


def define(conn: Any, guest: Guest, kernel: str) -> Any:
    create_disk(guest.image, 64 * MiB)
    xml = domain_xml(GuestSpec(name=guest.name, disk=str(guest.image), console_log=str(DIR / f"{guest.name}.log"),
                               guest_dir=kernel, workload="idle",
                               settings=DomainSettings(enabled=True, budget=guest.budget)))
    dom = conn.defineXML(xml)
    dom.setAutostart(1)
    dom.create()
    return dom


def before() -> None:
    DIR.mkdir(parents=True, exist_ok=True)
    kernel = subprocess.run(["scripts/build-guest.sh", str(DIR / "guest")], capture_output=True, text=True,
                            check=True).stdout.strip()
    conn = connect()
    doms = {g.name: define(conn, g, kernel) for g in GUESTS}
    expected = {}
    for guest in GUESTS:
        dom = doms[guest.name]
        agent_running(guest.name)

        def saved(g: Guest = guest, d: Any = dom) -> DiskHotSet | None:
            guest_read(d, *g.zone, dev=DEVICE)
            record = live_record(conn, g.name)
            return record if holds(record, g.zone) else None

        record = wait_for(saved, f"{guest.name}'s agent to keep a set covering the zone its guest reads",
                          timeout=120, step=1.0)
        assert dom.autostart() == 1 and dom.isPersistent() == 1
        # libvirt-guests' ACPI shutdown at the reboot is lost on a guest that has not armed its power button yet
        wait_for(lambda g=guest: "VMCACHE-GUEST-POWER-BUTTON" in console(g), f"{guest.name}'s guest to boot and "
                 "arm its power button", timeout=120, step=0.5)
        expected[guest.name] = {"uuid": dom.UUIDString(), "zone": list(guest.zone)}
        say(f"{guest.name}: autostarted, the guest read {guest.zone[1] // MiB} MiB at {guest.zone[0] // MiB} MiB, "
            f"the live XML holds a set of {record.bytes // MiB} MiB ({len(record.regions)} regions)")
    EXPECTED.write_text(json.dumps(expected))
    conn.close()


def resident(path: Path, start: int, length: int) -> int:
    """Bytes of ``[start, start + length)`` of ``path`` in the page cache, by mincore: the images are on an
    overlayfs here, whose files' cachestat(2) counts the overlay's own (empty) cache, not the real file's."""
    fraction = scan_residency(path, PAGE_SIZE, use_cachestat=False).fraction
    return int(fraction[start // PAGE_SIZE:(start + length) // PAGE_SIZE].sum()) * PAGE_SIZE


def journal(unit: str, boot: str) -> str:
    return subprocess.run(["journalctl", "-q", "--no-pager", "-o", "cat", "-b", boot, "-u", unit],
                          capture_output=True, text=True, timeout=30).stdout


def check_restored(conn: Any, guest: Guest, uuid: str) -> None:
    """The autostarted domain's agent warmed from the host's copy, and holds it pinned and resident."""
    dom = wait_for(lambda: (d := conn.lookupByName(guest.name)) and d.isActive() and d, f"{guest.name} to autostart")
    assert dom.UUIDString() == uuid
    pid = agent_running(guest.name)
    copy = HotStore(str(HOTSETS)).load(uuid)
    assert copy is not None, f"no host's copy of {guest.name}'s set"
    record = copy.disk("vda")
    assert record is not None and holds(record, guest.zone), (guest, record)
    status = wait_for(lambda: (s := read_status(AGENTS, guest.name)) and s["disks"]
                      and s["disks"][0]["warm_restored_bytes"] == record.bytes and s,
                      f"{guest.name}'s agent to restore its set", timeout=60)
    assert status["hotset_source"] == "host", status
    assert status["disks"][0]["warm_total_bytes"] == record.bytes, status
    spans = wait_for(lambda: (m := mapped(pid, guest.image)) and covered(m, *guest.zone) and m,
                     f"{guest.name}'s agent to pin the zone")
    assert resident(guest.image, *guest.zone) == guest.zone[1]
    unit = unit_of(guest.name)
    now, last = journal(unit, "0"), journal(unit, "-1")
    assert f"hotset.loaded disks=1 saved={copy.saved} definition=host" in now, now[-3000:]
    assert "agent.stopped qemu_alive=False" in last and "to=host" in last, last[-3000:]
    say(f"{guest.name}: autostarted; its agent warmed from {HotStore(str(HOTSETS)).path(uuid)} "
        f"(status hotset_source=host), {record.bytes // MiB} MiB restored, the zone's {guest.zone[1] // MiB} MiB "
        f"pinned ({sum(n for _, n in spans) // MiB} MiB mapped) and resident before its guest read any of it; "
        "before the reboot it had saved there after its QEMU exited")


def remove(conn: Any, guest: Guest, uuid: str) -> None:
    """Destroy, clear the saved set (the operator's way), undefine: nothing of the domain is left."""
    dom = conn.lookupByName(guest.name)
    dom.destroy()
    unit = unit_of(guest.name)
    wait_for(lambda: show(unit)["ActiveState"] in ("inactive", "failed"), f"the hook to stop {unit}")
    assert show(unit)["Result"] == "success", show(unit)
    cleared = subprocess.run(["vmcache", "hotset", guest.name, "--clear"], capture_output=True, text=True)
    assert cleared.returncode == 0, cleared.stderr
    dom.undefine()
    assert_nothing_left(None, guest.name)
    assert not Path(HotStore(str(HOTSETS)).path(uuid)).exists()
    for path in DIR.glob(f"{guest.name}.*"):
        path.unlink()
    say(f"{guest.name}: destroyed, its saved set cleared, undefined: no agent, pin, file or copy left")


def after() -> None:
    expected = json.loads(EXPECTED.read_text())
    conn = connect(timeout=60)
    for guest in GUESTS:
        check_restored(conn, guest, expected[guest.name]["uuid"])
    for guest in GUESTS:
        remove(conn, guest, expected[guest.name]["uuid"])
    conn.close()
    EXPECTED.unlink()
    subprocess.run(["rm", "-rf", str(DIR)], check=True)


if __name__ == "__main__":
    libvirt.registerErrorHandler(lambda _c, _e: None, None)
    {"before": before, "after": after}[sys.argv[1]]()
