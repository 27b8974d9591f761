#!/usr/bin/env bash
# Runs inside the clean host that tests/host/cleanhost.sh boots, in a clean
# clone at /root/vmcache: what a new user of the README does, then the
# systemd checks, then the Debian package.
#
#   tests/host/inside.sh [--no-deb] [--full]
#
#  1. systemd is PID 1; `make setup` (a venv from PyPI); libvirtd from its
#     own units (scripts/libvirtd.sh); `make install`.
#  2. `make demo` (shortened): one opted-in TCG domain, its agent started by
#     the hook as vmcache-agent@vmcache\x2ddemo.service, pinning, metrics.
#  3. tests/host/test_systemd_host.py: unit names, memlock, kill -9 and
#     restart, systemctl stop, domain shutdown, the journal, a host rule
#     added and `systemctl reload vmcache` (reconcile).
#  4. `make demo-clean`, `make uninstall`: nothing of vmcache left.
#  5. `make deb` (its build dependencies from Debian's mirror), apt install,
#     the same checks against the package, upgrade over itself (an edited
#     conffile kept), a reboot (below), remove (agents stopped, hook gone,
#     config kept), purge (config gone). Not with --no-deb.
#  6. with --full: `make test` (the whole suite, ~20+ minutes).
#
# The reboot: --until-reboot runs up to the package's upgrade, then
# tests/host/reboot.py before (two autostarted opted-in domains, each with a
# saved hot set) and stops; the caller (tests/host/cleanhost.sh) reboots the
# container with the images evicted and runs --after-reboot: reboot.py after
# (both domains autostarted, warm from the host's copies), then the rest.
# Without either option, everything but the reboot.
set -euo pipefail
cd /root/vmcache
DEB=1
FULL=0
PART=all
while [ $# -gt 0 ]; do
  case "$1" in
    --no-deb) DEB=0; shift ;;
    --full) FULL=1; shift ;;
    --until-reboot) PART=until; shift ;;
    --after-reboot) PART=after; shift ;;
    *) echo "inside: unknown option $1" >&2; exit 2 ;;
  esac
done
[ "$PART" = all ] || [ "$DEB" = 1 ] || { echo "inside: the reboot is the package's: not with --no-deb" >&2; exit 2; }
export VMCACHE_CLEAN_HOST=1
T0=$SECONDS
step() { echo; echo "=== [$((SECONDS - T0)) s] $*"; }
fail() { echo "FAIL: $*" >&2; exit 1; }
ok() { echo "ok: $*"; }
DEMO_UNIT='vmcache-agent@vmcache\x2ddemo.service'
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider --no-header)

# What vmcache leaves on the host: must be nothing after uninstall/remove/purge.
vmcache_files() {
  ls -d /etc/libvirt/hooks/qemu /etc/libvirt/hooks/qemu.d/vmcache /etc/systemd/system/vmcache-agent@.service \
    /lib/systemd/system/vmcache-agent@.service /lib/systemd/system/vmcache.service /usr/local/bin/vmcache \
    /usr/bin/vmcache /opt/vmcache /usr/lib/vmcache 2>/dev/null || true
}
agents_running() { systemctl list-units --plain --no-legend --state=active 'vmcache-agent@*' | grep -c . || true; }

# systemd raises RLIMIT_MEMLOCK to LimitMEMLOCK=infinity only with CAP_SYS_RESOURCE,
# which this test machine's bounding set lacks (it then sets the closest it can).
memlock_can_be_unlimited() {
  local bnd
  bnd=$(awk '/^CapBnd:/ {print $2}' /proc/1/status)
  (( (16#$bnd >> 24) & 1 ))
}

# The demo domain's agent: active unit, pins, metrics.
check_agent() {
  local unit=$1 name=$2 i pid pinned url memlock
  for i in $(seq 1 60); do systemctl is-active -q "$unit" && break; sleep 1; done
  systemctl is-active -q "$unit" || { systemctl status "$unit" --no-pager || true; fail "$unit is not active"; }
  pid=$(systemctl show -p MainPID --value "$unit")
  [ "$(systemctl show -p LimitMEMLOCK --value "$unit")" = infinity ] || fail "$unit: LimitMEMLOCK is not infinity"
  if memlock_can_be_unlimited; then
    grep -q '^Max locked memory *unlimited *unlimited' "/proc/$pid/limits" || fail "agent $pid: memlock not unlimited"
    memlock="memlock unlimited"
  else
    memlock="LimitMEMLOCK=infinity"
    echo "  (this machine has no CAP_SYS_RESOURCE: memlock stays at $(awk '/^Max locked memory/ {print $4}' "/proc/$pid/limits") bytes; mlock works through CAP_IPC_LOCK)"
  fi
  for i in $(seq 1 60); do
    pinned=$(vmcache status "$name" --json 2>/dev/null | .venv/bin/python -c \
      'import json,sys; print(sum(d["pinned_bytes"] for d in json.load(sys.stdin)[0]["disks"]))' 2>/dev/null || echo 0)
    [ "$pinned" -gt 0 ] && break
    sleep 2
  done
  [ "$pinned" -gt 0 ] || { vmcache status "$name" || true; journalctl -u "$unit" --no-pager | tail -20; fail "nothing pinned"; }
  url=$(vmcache status "$name" --json | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)[0]["metrics_url"])')
  .venv/bin/python - "$url" <<'EOF' || fail "metrics at $url"
import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
lines = [ln for ln in text.splitlines() if ln.startswith("vmcache_pinned_bytes")]
assert lines and float(lines[0].split()[-1]) > 0, text[:2000]
print("  " + lines[0])
EOF
  ok "$unit: active (pid $pid), $memlock, $pinned bytes pinned, metrics at $url"
}

# The signal of the guest's reads the agent uses, in `vmcache status` and the metric label; where
# the kernel cannot count them (BPF refused, no tracepoint), the reason logged once.
check_read_signal() {
  local unit=$1 name=$2 line signal logged url invocation
  line=$(vmcache status "$name" | grep -o 'guest reads: .*' || true)
  [ -n "$line" ] || { vmcache status "$name" || true; fail "no 'guest reads:' line in vmcache status"; }
  signal=$(vmcache status "$name" --json | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)[0]["read_signal"])')
  # this run of the unit's: make demo restarts its domain, each start an agent of its own
  invocation=$(systemctl show -p InvocationID --value "$unit")
  logged=$(journalctl -u "$unit" "_SYSTEMD_INVOCATION_ID=$invocation" --no-pager -o cat | grep -c 'reads.inferred' || true)
  case "$signal" in
    probe|tracepoint) [ "$logged" = 0 ] || fail "counted reads, yet reads.inferred logged $logged times" ;;
    inferred) [ "$logged" = 1 ] || fail "inferred reads logged $logged times, not once" ;;
    *) fail "read_signal '$signal'" ;;
  esac
  url=$(vmcache status "$name" --json | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)[0]["metrics_url"])')
  .venv/bin/python -c 'import sys, urllib.request; sys.exit(sys.argv[2] not in urllib.request.urlopen(sys.argv[1]).read().decode())' \
    "$url" "read_signal=\"$signal\"" || fail "vmcache_agent_info has no read_signal=\"$signal\""
  ok "$line (metric label read_signal=\"$signal\", reads.inferred logged $logged time(s))"
}

# 1-4: the README's path with `make install`.
readme_path() {
  step "1. a clean Debian 12 with systemd as PID 1"
  [ "$(cat /proc/1/comm)" = systemd ] && [ -d /run/systemd/system ] || fail "systemd is not PID 1"
  . /etc/os-release; ok "$PRETTY_NAME, systemd $(systemctl --version | head -1 | cut -d' ' -f2), $(systemctl is-system-running || true)"
  ok "cgroups: $(stat -fc %T /sys/fs/cgroup), controllers: '$(cat /sys/fs/cgroup/cgroup.controllers 2>/dev/null || true)'"
  [ -z "$(vmcache_files)" ] || fail "vmcache files before install: $(vmcache_files)"

  step "make setup"
  make setup
  step "libvirtd from its units (scripts/libvirtd.sh)"
  scripts/libvirtd.sh
  systemctl is-active -q libvirtd.service || fail "libvirtd.service is not active"
  ok "$(virsh -c qemu:///system version | tr '\n' ' ')"
  step "make install"
  make install
  [ -f /etc/systemd/system/vmcache-agent@.service ] || fail "no unit installed"
  [ "$(systemctl is-enabled vmcache.service)" = enabled ] && systemctl is-active -q vmcache.service \
    || fail "vmcache.service is not enabled and active"
  grep -q vmcache-hook /etc/libvirt/hooks/qemu || fail "no hook installed"
  logrotate --debug /etc/logrotate.d/vmcache 2>&1 | grep -q 'rotating pattern: /var/log/vmcache/\*.log' \
    || fail "/etc/logrotate.d/vmcache missing or not read by logrotate"
  # An operator's edit: shorter cycles, so the checks below take seconds.
  sed -i 's/^interval: .*/interval: 2s/' /etc/vmcache/vmcache.yaml

  step "2. make demo (10-s windows, 20 s to learn)"
  VMCACHE_DEMO_SECONDS=10 VMCACHE_DEMO_LEARN=20 make demo
  check_agent "$DEMO_UNIT" vmcache-demo
  check_read_signal "$DEMO_UNIT" vmcache-demo
  journalctl -u "$DEMO_UNIT" --no-pager -o cat | grep -q 'disk.managed' || fail "no agent log in the journal of $DEMO_UNIT"
  ok "the agent's log is in the journal of $DEMO_UNIT"

  step "3. the systemd path (tests/host)"
  "${PYTEST[@]}" tests/host

  step "4. make demo-clean, make uninstall"
  make demo-clean
  # until the agent has stopped (deactivating: it still saves its hot set and lets go of its pins)
  for i in $(seq 1 30); do
    case "$(systemctl is-active "$DEMO_UNIT")" in active|activating|deactivating) sleep 1 ;; *) break ;; esac
  done
  systemctl is-active -q "$DEMO_UNIT" && fail "$DEMO_UNIT still active after the domain was destroyed"
  ! grep -qs demo/disk.raw /var/lib/vmcache/hotsets/*.xml || fail "make demo-clean left the demo's saved hot set"
  make uninstall
  [ -z "$(vmcache_files)" ] || fail "left after make uninstall: $(vmcache_files)"
  [ ! -e /etc/systemd/system/vmcache.service ] && [ ! -L /etc/systemd/system/multi-user.target.wants/vmcache.service ] \
    || fail "vmcache.service left after make uninstall"
  [ "$(agents_running)" = 0 ] || fail "agents still running after make uninstall"
  [ -f /etc/vmcache/vmcache.yaml ] || fail "make uninstall removed the config"
  [ ! -e /etc/logrotate.d/vmcache ] || fail "make uninstall left /etc/logrotate.d/vmcache"
  rm -rf /etc/vmcache   # a new start for the package
  ok "nothing of vmcache left but /etc/vmcache/vmcache.yaml (kept, as documented)"
}

# 5, to the upgrade: the Debian package installed, checked, upgraded over itself.
package_installed() {
  step "5. make deb"
  make deb
  local deb
  deb=$(ls "$PWD"/build/deb/vmcache_*_all.deb)
  step "the Debian package: apt install $deb"
  apt-get update -q >/dev/null
  since=$(date '+%Y-%m-%d %H:%M:%S')
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$deb" | tail -3
  dpkg-query -W -f='${Status}\n' vmcache | grep -q 'install ok installed' || fail "not installed"
  [ -f /lib/systemd/system/vmcache-agent@.service ] || fail "no unit"
  grep -q '^ExecStart=/usr/bin/vmcache ' /lib/systemd/system/vmcache-agent@.service || fail "unit runs the wrong vmcache"
  grep -q '^ExecReload=/usr/bin/vmcache reconcile ' /lib/systemd/system/vmcache.service || fail "no vmcache.service"
  [ "$(systemctl is-enabled vmcache.service)" = enabled ] && systemctl is-active -q vmcache.service \
    || fail "vmcache.service is not enabled and active after apt install"
  grep -q 'VMCACHE_PYTHON=/usr/lib/vmcache/venv/bin/python' /etc/libvirt/hooks/qemu || fail "hook not installed"
  dpkg-query --showformat='${Conffiles}\n' -W vmcache | grep -q /etc/vmcache/vmcache.yaml || fail "config is not a conffile"
  dpkg-query --showformat='${Conffiles}\n' -W vmcache | grep -q /etc/logrotate.d/vmcache \
    || fail "/etc/logrotate.d/vmcache is not a conffile of the package"
  journalctl -u libvirtd.service --since "$since" --no-pager | grep -qi 'reload' || fail "libvirtd was not reloaded"
  ok "installed: /usr/bin/vmcache, the unit, the hook, /etc/vmcache/vmcache.yaml (conffile), libvirtd reloaded"
  sed -i 's/^interval: .*/interval: 2s/' /etc/vmcache/vmcache.yaml
  "${PYTEST[@]}" tests/host -k "hook_starts or kill_9 or shutdown or reload"

  step "the Debian package: upgrade over itself"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --reinstall "$deb" | tail -2
  grep -q '^interval: 2s' /etc/vmcache/vmcache.yaml || fail "the edited conffile was replaced"
  "${PYTEST[@]}" tests/host -k "hook_starts"
  ok "upgraded; the edited config kept; agents start"
}

# 5, the rest: apt remove and purge leave nothing.
package_removed() {
  step "the Debian package: apt remove (with a running agent)"
  .venv/bin/python - <<'EOF'
from pathlib import Path
from tests.live.livelib import MiB, cache_metadata, connect, create_disk, domain_xml, start_paused
Path("/var/lib/libvirt/images/vmcache-host").mkdir(parents=True, exist_ok=True)
disk = create_disk(Path("/var/lib/libvirt/images/vmcache-host/remove.raw"), 64 * MiB)
start_paused(connect(), domain_xml("vmcache-host-remove", disk, metadata=cache_metadata("16M")))
EOF
  for i in $(seq 1 30); do [ "$(agents_running)" = 1 ] && break; sleep 1; done
  [ "$(agents_running)" = 1 ] || fail "the remove test's agent did not start"
  DEBIAN_FRONTEND=noninteractive apt-get remove -y -q vmcache | tail -2
  [ "$(agents_running)" = 0 ] || fail "agents still running after apt remove"
  [ -z "$(vmcache_files)" ] || fail "left after apt remove: $(vmcache_files)"
  [ -f /etc/vmcache/vmcache.yaml ] || fail "apt remove removed the config"
  virsh -q destroy vmcache-host-remove >/dev/null
  ok "removed: agents stopped, hook and unit gone, config kept"

  step "the Debian package: apt purge"
  DEBIAN_FRONTEND=noninteractive apt-get purge -y -q vmcache | tail -2
  [ ! -e /etc/vmcache ] || fail "/etc/vmcache left after purge: $(ls -la /etc/vmcache)"
  [ ! -e /etc/logrotate.d/vmcache ] || fail "/etc/logrotate.d/vmcache left after purge"
  [ ! -e /var/log/vmcache ] && [ ! -e /var/lib/vmcache ] && [ ! -e /run/vmcache ] && [ ! -e /run/lock/vmcache ] \
    || fail "logs, state or runtime files left after purge"
  [ ! -e /etc/systemd/system/vmcache.service ] && [ ! -L /etc/systemd/system/multi-user.target.wants/vmcache.service ] \
    || fail "vmcache.service links left after purge"
  dpkg-query -W vmcache 2>/dev/null | grep -q . && fail "dpkg still knows vmcache" || true
  ok "purged: nothing left"
}

if [ "$PART" != after ]; then
  readme_path
  if [ "$DEB" = 1 ]; then package_installed; fi
fi
if [ "$PART" = until ]; then
  step "the Debian package: a reboot, part 1 (tests/host/reboot.py before)"
  # the journal kept across the reboot (the previous boot's agent logs are checked after it)
  mkdir -p /var/log/journal && journalctl --flush
  .venv/bin/python -m tests.host.reboot before
  step "ready for the reboot after $((SECONDS - T0)) s"
  exit 0
fi
if [ "$PART" = after ]; then
  step "the Debian package: a reboot, part 2 (tests/host/reboot.py after)"
  .venv/bin/python -m tests.host.reboot after
fi
if [ "$DEB" = 1 ]; then package_removed; fi

if [ "$FULL" = 1 ]; then
  step "6. make test"
  make test
fi

step "done in $((SECONDS - T0)) s"
