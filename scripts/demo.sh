#!/usr/bin/env bash
# make demo: a real libvirt domain with vmcache working on it.
#
# Installs vmcache (make install: /opt/vmcache, the libvirt hook, the default
# host config), starts libvirtd if needed, builds the tiny test guest from
# Debian packages (cloud kernel + busybox + fio), and starts the domain
# "vmcache-demo": a TCG guest running fio 4k randrw 80/20 (QD1, sync) on a
# 2 GiB writethrough raw disk, 80% of the I/O on the first 10% of the disk,
# opted in with a 256 MiB budget. The agent learns what the guest reads for
# 45 s and saves its hot set as the domain powers off; the guest then
# restarts twice on an evicted image (what a host reboot leaves), once with
# vmcache switched off (the kernel alone) and once with its warm start, and
# its IOPS in the first 20 s of each are shown side by side
# (scripts/demo_effect.py); then `vmcache status`, the agent's metrics and
# the disk's heat map. The domain keeps running (make demo-clean removes it).
#
#   scripts/demo.sh          run the demo
#   scripts/demo.sh clean    remove the demo domain and its disk (make demo-clean)
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=vmcache-demo
DIR=/var/lib/vmcache/demo
PY=.venv/bin/python
WATCH_SECONDS=${VMCACHE_DEMO_SECONDS:-20}   # each of the two measured windows
LEARN_SECONDS=${VMCACHE_DEMO_LEARN:-45}     # the first run, while the agent learns what the guest reads

if [ "${1:-}" = clean ]; then
  virsh -q destroy "$NAME" >/dev/null 2>&1 && echo "demo: destroyed $NAME" || true
  # The agent saves the hot set as it stops: clear it (the XML's and the host's copy) once the agent is gone.
  for _ in $(seq 1 30); do "$PY" -m vmcache status "$NAME" >/dev/null 2>&1 || break; sleep 0.5; done
  if virsh -q dominfo "$NAME" >/dev/null 2>&1; then
    "$PY" -m vmcache hotset "$NAME" --clear >/dev/null 2>&1 && echo "demo: removed its saved hot set" || true
  fi
  virsh -q undefine "$NAME" >/dev/null 2>&1 && echo "demo: undefined $NAME" || true
  rm -rf "$DIR" && echo "demo: removed $DIR"
  echo "demo: vmcache itself stays installed; 'make uninstall' removes it"
  exit 0
fi

[ "$(id -u)" = 0 ] || { echo "demo: run as root (it installs packages and a libvirt hook)" >&2; exit 1; }
scripts/setup.sh
scripts/libvirtd.sh
scripts/install.sh
guest=$(scripts/build-guest.sh)
mkdir -p "$DIR"
if [ ! -f "$DIR/disk.raw" ]; then
  echo "demo: writing a 2 GiB fully allocated raw disk ($DIR/disk.raw)"
  dd if=/dev/zero of="$DIR/disk.raw" bs=4M count=512 oflag=direct status=none
fi
virsh -q destroy "$NAME" >/dev/null 2>&1 || true
virsh -q undefine "$NAME" >/dev/null 2>&1 || true
# an earlier demo's agent unpins as it stops: then the image can be evicted
for _ in $(seq 1 30); do "$PY" -m vmcache status "$NAME" >/dev/null 2>&1 || break; sleep 0.5; done
vmtouch -q -e "$DIR/disk.raw"   # start cold: nothing of the image in the page cache
: > "$DIR/console.log"
"$PY" - "$NAME" "$DIR" "$guest" > "$DIR/domain.xml" <<'PYEOF'
import sys
from tests.lab import GuestSpec, domain_xml
from vmcache.settings.metadata import DomainSettings
name, d, guest = sys.argv[1:4]
print(domain_xml(GuestSpec(
    name=name, disk=f"{d}/disk.raw", console_log=f"{d}/console.log", guest_dir=guest,
    workload="demo", runtime=30, loops=0, qd=1,
    settings=DomainSettings(enabled=True, budget=256 << 20, model={"decay": 0.7}),
)))
PYEOF
virsh define "$DIR/domain.xml" >/dev/null
virsh start "$NAME"
echo "demo: $NAME started on an evicted image, opted in by its metadata:"
virsh metadata "$NAME" urn:x-vmcache:domain:1 || true
echo
# two restarts on an evicted image, the kernel alone and vmcache's warm start: IOPS of both
"$PY" scripts/demo_effect.py "$NAME" "$DIR/disk.raw" "$DIR/console.log" --seconds "$WATCH_SECONDS" --learn "$LEARN_SECONDS"
echo
echo "=== vmcache status $NAME"
vmcache status "$NAME" || true
url=$(vmcache status "$NAME" --json 2>/dev/null | "$PY" -c 'import json,sys; r=json.load(sys.stdin); print(r[0].get("metrics_url") or "")' 2>/dev/null || true)
if [ -n "$url" ]; then
  echo "--- $url (excerpt)"
  "$PY" - "$url" <<'PYEOF' || true
import sys, urllib.request
from prometheus_client.parser import text_string_to_metric_families
want = ("vmcache_pinned_bytes", "vmcache_resident_bytes", "vmcache_guest_dirtied_bytes_total",
        "vmcache_guest_read_bytes_total", "vmcache_guest_read_hit_bytes_total", "vmcache_guest_read_miss_bytes_total")
text = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
for fam in text_string_to_metric_families(text):
    for s in fam.samples:
        if s.name in want:
            print(f"  {s.name} {s.value:.0f}")
PYEOF
fi
# where the agent logs: its unit's journal with systemd, a file without
if [ -d /run/systemd/system ]; then
  agent_log="journalctl -f -u $(systemd-escape --template=vmcache-agent@.service "$NAME")"
else
  agent_log="tail -f /var/log/vmcache/agent-$NAME.log"
fi
# the disk's heat map as the agent sees it now: green what the guest read (where the kernel counts its
# reads; what it loaded where reads are inferred), red what it wrote, blue what vmcache pinned
heatmap="$DIR/heatmap-vda.png"
if vmcache heatmap "$NAME" vda -o "$heatmap"; then
  echo "demo: the heat map of $NAME's disk (reads green, writes red, pinned blue): $heatmap"
else
  heatmap="(not written: see the agent's log)"
fi
cat <<EOF

demo: vmcache keeps $NAME's hot region (the first ~200 MiB the guest hammers) in the page cache.
Look further:
  vmcache status $NAME --json        what the agent is doing
  curl -s \$(vmcache status $NAME --json | jq -r '.[0].metrics_url')   all its metrics
  ls /run/vmcache/prometheus/        file_sd targets for Prometheus (docs/metrics.md)
  $agent_log   the agent's log
  grep -a '"iops"' $DIR/console.log   the guest's fio results
  $heatmap   the disk's heat map (vmcache heatmap $NAME vda -o FILE.png writes a new one)
Clean up: make demo-clean   (and make uninstall to remove vmcache)
EOF
