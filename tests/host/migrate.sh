#!/usr/bin/env bash
# Two libvirt hosts on this machine, a live migration between them (make test-migrate).
#
#   tests/host/migrate.sh run [PYTEST ARGS...]   build both hosts, run tests/host/test_migrate_hosts.py
#   tests/host/migrate.sh shell                  build both hosts, open a shell on the first (debugging)
#   tests/host/migrate.sh exec COMMAND...        build both hosts, run COMMAND here with their names in
#                                                the environment (debugging, measuring)
#
# Two systemd-nspawn containers over the clean host's cached root
# (tests/host/nspawn.sh, the root make test-host uses; the cache is only
# read), each booted with systemd as PID 1 under its own hostname, with its
# own libvirtd (host_uuid in libvirtd.conf, qemu+tcp on port 16509 with
# auth_tcp none) and vmcache installed from its Debian package with apt,
# as tests/host/inside.sh installs it. Between them a veth pair in their
# own network namespaces, 10.231.0.1 <-> 10.231.0.2, names in /etc/hosts:
# nothing else is reachable from either. The image directory is shared at the
# same path on both, /var/lib/libvirt/images/migrate (what a migration without
# storage copy needs), but each host reaches it through a mount of its own: a
# delay device (bench/delaydev.py, a FUSE passthrough whose misses cost
# $VMCACHE_MIGRATE_READ_MS, default 0.3 ms) per host over one directory of
# this machine. So each host has its own page cache of the images, as two
# hosts on NFS or a shared LUN have: a page one host caches is not resident
# on the other, and a write on one reaches the other's cache only when that
# one drops it. The guest's kernel and the consoles are in a second directory,
# bind-mounted into both at /var/lib/libvirt/images/plain.
#
# Before the hosts boot, a throwaway container with this machine's network
# builds the .deb from a clean clone of HEAD (scripts/deb.sh), downloads its
# dependencies and builds the test guest (scripts/build-guest.sh); the hosts
# get the .deb files and apt's lists, so `apt-get install ./vmcache_*.deb`
# needs no network there.
#
# The checks run here, on this machine, with the checkout's .venv: they reach
# each host's libvirtd through its socket (/proc/LEADER/root/run/libvirt/...)
# and run commands in it with nsenter. Everything (containers, veths,
# overlays, mounts, delay devices, the shared directories) is removed on exit, also on failure
# or Ctrl-C; the hosts' journals are kept in $VMCACHE_MIGRATE_LOGS (default
# build/migrate in the checkout). One run at a time per machine (the clean
# host's lock).
#
# VMCACHE_MIGRATE_PREFIX (default vmcache-mig): hostnames PREFIX-a, PREFIX-b,
# veths PREFIX-va, PREFIX-vb, run directory /var/tmp/PREFIX.XXXXXX.
# VMCACHE_MIGRATE_CONFIG (default test): "test" edits both hosts' conffile for
# the checks (interval 1s, min_free 256M, a host rule for Nova's flavor
# mig.large); "default" leaves the installed conffile as the package ships it
# (the product's defaults: what bench/migrate_bench.py measures).
# VMCACHE_MIGRATE_FSYNC_MS (default: what a miss costs): what a flush costs
# in the delay devices, instead of a real fdatasync on this machine's disk,
# whose hour-to-hour latency would bound a writethrough guest's writes.
# VMCACHE_MIGRATE_LOG_READS=1: each delay device also logs every read it
# serves (unix time, file, offset, bytes) to a file of its own, named in
# VMCACHE_MIGRATE_READ_LOGS (A's,B's); VMCACHE_MIGRATE_READ_MS is exported
# with the delay in force.
set -euo pipefail
SAY=migrate
# shellcheck source=tests/host/nspawn.sh
. "$(dirname "$0")/nspawn.sh"
PREFIX=${VMCACHE_MIGRATE_PREFIX:-vmcache-mig}
LOGS=${VMCACHE_MIGRATE_LOGS:-$REPO/build/migrate}
NET=10.231.0
IMAGES=/var/lib/libvirt/images/migrate
PLAIN=/var/lib/libvirt/images/plain
READ_MS=${VMCACHE_MIGRATE_READ_MS:-0.3}
FSYNC_MS=${VMCACHE_MIGRATE_FSYNC_MS:-$READ_MS}
CONFIG=${VMCACHE_MIGRATE_CONFIG:-test}
LOG_READS=${VMCACHE_MIGRATE_LOG_READS:-}
HOSTS=(a b)
declare -A DELAY_PID=()

RUN=
VETH=0
CHECK_PID=

cleanup() {
  local rc=$? x
  trap - EXIT INT TERM
  if [ -n "$CHECK_PID" ]; then kill -TERM "$CHECK_PID" 2>/dev/null || true; fi
  if [ -n "$RUN" ]; then
    mkdir -p "$LOGS"
    for x in "${HOSTS[@]}"; do
      if [ -n "${LEADER[$PREFIX-$x]:-}" ] && [ -n "${NSPAWN_PID[$PREFIX-$x]:-}" ]; then
        in_container "$PREFIX-$x" journalctl -b --no-pager > "$LOGS/journal-$x.log" 2>&1 || true
      fi
      cp "$RUN/$x/console.log" "$LOGS/console-$x.log" 2>/dev/null || true
    done
  fi
  container_cleanup
  for x in "${!DELAY_PID[@]}"; do
    kill -TERM "${DELAY_PID[$x]}" 2>/dev/null || true   # it unmounts and ends
    for _ in $(seq 1 100); do kill -0 "${DELAY_PID[$x]}" 2>/dev/null || break; sleep 0.1; done
    if mountpoint -q "$RUN/mnt-$x"; then umount -l "$RUN/mnt-$x" || true; fi
  done
  if [ "$VETH" = 1 ]; then
    for x in "${HOSTS[@]}"; do ip link del "$PREFIX-v$x" 2>/dev/null || true; done
  fi
  if [ -n "$RUN" ]; then rm -rf "$RUN"; fi
  exit "$rc"
}

# A throwaway container with this machine's network: the .deb, its dependencies, apt's lists, the guest.
prepare() {
  local started=$SECONDS
  mkdir -p "$RUN/debs/partial" "$RUN/out"
  # .deb files the cache already has (hard links: the cache is not changed)
  find "$CACHE/debs" -maxdepth 1 -name '*.deb' -exec cp -al -t "$RUN/debs/" {} + 2>/dev/null || true
  overlay "$RUN/prep"
  clone_repo "$RUN/prep/merged"
  trust_host_cas "$RUN/prep/merged"
  say "prepare: make deb, its dependencies, the guest ($(git -C "$REPO" log -1 --format='%h %s' | cut -c1-60))"
  systemd-nspawn -q -D "$RUN/prep/merged" --register=no --keep-unit --chdir=/root/vmcache \
    --bind="$RUN/debs:/var/cache/apt/archives" --bind="$RUN/out:/out" --setenv=DEBIAN_FRONTEND=noninteractive \
    bash -c 'set -e
      apt-get update -q
      scripts/deb.sh /out
      apt-get install -y -q --download-only /out/vmcache_*_all.deb
      scripts/build-guest.sh /out/guest
      mkdir /out/lists && find /var/lib/apt/lists -maxdepth 1 -type f ! -name lock -exec cp -a -t /out/lists {} +' \
    >"$RUN/prepare.log" 2>&1 || { tail -30 "$RUN/prepare.log" >&2; die "prepare failed"; }
  umount "$RUN/prep/merged"
  rm -rf "$RUN/prep"
  mkdir -p "$RUN/shared" "$RUN/plain"
  mv "$RUN/out/guest" "$RUN/plain/guest"
  say "prepare: done in $((SECONDS - started)) s"
}

# The root of host X before it boots: hostname, addresses, libvirtd's identity and TCP socket, the package.
configure() {
  local x=$1 merged=$RUN/$1/merged
  overlay "$RUN/$x"
  echo "$PREFIX-$x" > "$merged/etc/hostname"
  printf '%s.1 %s-a\n%s.2 %s-b\n' "$NET" "$PREFIX" "$NET" "$PREFIX" >> "$merged/etc/hosts"
  printf '\n# %s: a host of tests/host/migrate.sh\nhost_uuid = "%s"\nauth_tcp = "none"\n' \
    "$PREFIX-$x" "$(cat /proc/sys/kernel/random/uuid)" >> "$merged/etc/libvirt/libvirtd.conf"
  systemctl --root="$merged" --quiet enable libvirtd-tcp.socket
  # What the root has for other tests and would only take CPU here (2 hosts on a shared machine), and
  # two units that fail in a container anyway (no NVMe, no IPMI).
  systemctl --root="$merged" --quiet mask prometheus.service prometheus-node-exporter.service \
    prometheus-node-exporter-apt.timer vmtouch.service apt-daily.timer apt-daily-upgrade.timer \
    nvmf-autoconnect.service openipmi.service
  cp -a "$RUN/out/lists/." "$merged/var/lib/apt/lists/"
  cp "$RUN"/out/vmcache_*_all.deb "$merged/root/"
  mkdir -p "$merged$IMAGES" "$merged$PLAIN"
}

# Host X's own mount of the shared image directory: a delay device (its page cache is X's alone).
delay_mount() {
  local x=$1 mnt=$RUN/mnt-$1 i
  local reads=()
  mkdir -p "$mnt"
  if [ -n "$LOG_READS" ]; then reads=(--log-reads "$RUN/delay-$x-reads.log"); fi
  "$REPO/.venv/bin/python" "$REPO/bench/delaydev.py" "$RUN/shared" "$mnt" --read-ms "$READ_MS" --fsync-ms "$FSYNC_MS" \
    --stats "$RUN/delay-$x.json" "${reads[@]}" </dev/null >"$RUN/delay-$x.log" 2>&1 &
  DELAY_PID[$x]=$!
  for i in $(seq 1 100); do
    mountpoint -q "$mnt" && [ -f "$RUN/delay-$x.json" ] && return 0
    kill -0 "${DELAY_PID[$x]}" 2>/dev/null || break
    sleep 0.1
  done
  cat "$RUN/delay-$x.log" >&2
  die "the delay device of $PREFIX-$x did not mount"
}

# Boot host X with its end of the veth pair; address it; libvirtd and vmcache (apt, offline).
boot_host() {
  local x=$1 i=$2 name=$PREFIX-$1
  container_boot "$name" "$RUN/$x/merged" "$RUN/$x/console.log" --private-network \
    --bind="$RUN/mnt-$x:$IMAGES" --bind="$RUN/plain:$PLAIN" --bind="$RUN/debs:/var/cache/apt/archives"
  # Moved in by hand: nspawn's --network-interface wants udev to have seen it, and there is no udev here.
  ip link set "$PREFIX-v$x" netns "${LEADER[$name]}"
  in_container "$name" ip link set lo up
  in_container "$name" ip addr add "$NET.$i/24" dev "$PREFIX-v$x"
  in_container "$name" ip link set "$PREFIX-v$x" up
  in_container "$name" systemctl start virtlogd.socket libvirtd.socket libvirtd-tcp.socket libvirtd.service
  in_unit "$name" --setenv=DEBIAN_FRONTEND=noninteractive sh -c 'apt-get install -y -q /root/vmcache_*_all.deb | tail -2'
  if [ "$CONFIG" = test ]; then
    # An operator's edit of the conffile: short cycles, so the checks take seconds (hot-set saves at
    # their default: the live definition's set follows the pins cycle by cycle), and a host rule (the same on both hosts) for domains defined as Nova defines them.
    in_container "$name" sh -c 'sed -i "s/^interval: .*/interval: 1s/; s/^min_free: .*/min_free: 256M/" /etc/vmcache/vmcache.yaml
      sed -i "s/^domains: \[\]$/domains:\n  - match: {nova_flavor: mig.large}\n    budget: 16M/" /etc/vmcache/vmcache.yaml
      grep -q "nova_flavor: mig.large" /etc/vmcache/vmcache.yaml'
  fi
  in_container "$name" vmcache status >/dev/null
  say "$name: $(in_container "$name" dpkg-query -W vmcache | tr '\t' ' '), libvirt $(in_container "$name" virsh -q version --daemon | awk '/daemon/ {print $NF}'), config: $CONFIG"
}

case "${1:-}" in
  run|shell|exec) ;;
  *) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
esac
cmd=$1
shift
case "$CONFIG" in test|default) ;; *) die "VMCACHE_MIGRATE_CONFIG must be test or default, not '$CONFIG'" ;; esac
host_tools
[ -x "$REPO/.venv/bin/python" ] || die "no .venv: run make setup first"
host_lock
trap cleanup EXIT
trap 'say "interrupted"; exit 130' INT TERM HUP
started=$SECONDS
build_root
RUN=$(mktemp -d "/var/tmp/$PREFIX.XXXXXX")
prepare
ip link add "$PREFIX-va" type veth peer name "$PREFIX-vb"
VETH=1
configure a
configure b
delay_mount a
delay_mount b
boot_host a 1
boot_host b 2
for x in a b; do
  y=$([ "$x" = a ] && echo b || echo a)
  in_container "$PREFIX-$x" virsh -c "qemu+tcp://$PREFIX-$y/system" -q hostname >/dev/null \
    || die "$PREFIX-$x does not reach libvirtd on $PREFIX-$y (qemu+tcp)"
done
say "both hosts up in $((SECONDS - started)) s"
export VMCACHE_MIGRATE_HOSTS="$PREFIX-a:${LEADER[$PREFIX-a]}:$NET.1,$PREFIX-b:${LEADER[$PREFIX-b]}:$NET.2"
export VMCACHE_MIGRATE_SHARED="$RUN/shared:$IMAGES" VMCACHE_MIGRATE_PLAIN="$RUN/plain:$PLAIN"
export VMCACHE_MIGRATE_MOUNTS="$RUN/mnt-a,$RUN/mnt-b" VMCACHE_MIGRATE_DELAY_STATS="$RUN/delay-a.json,$RUN/delay-b.json"
export VMCACHE_MIGRATE_LOGS="$LOGS" VMCACHE_MIGRATE_READ_MS="$READ_MS" VMCACHE_MIGRATE_FSYNC_MS="$FSYNC_MS" VMCACHE_MIGRATE_CONFIG="$CONFIG"
if [ -n "$LOG_READS" ]; then export VMCACHE_MIGRATE_READ_LOGS="$RUN/delay-a-reads.log,$RUN/delay-b-reads.log"; fi
case "$cmd" in
  shell)
    say "VMCACHE_MIGRATE_HOSTS=$VMCACHE_MIGRATE_HOSTS VMCACHE_MIGRATE_SHARED=$VMCACHE_MIGRATE_SHARED"
    in_container "$PREFIX-a" bash -l || true
    ;;
  exec)
    "$@"
    ;;
  run)
    rc=0
    checks=$SECONDS
    (cd "$REPO" && exec .venv/bin/python -m pytest -p no:cacheprovider tests/host/test_migrate_hosts.py "$@") &
    CHECK_PID=$!
    wait "$CHECK_PID" || rc=$?
    CHECK_PID=
    if [ "$rc" = 0 ]; then
      say "PASSED in $((SECONDS - started)) s (checks $((SECONDS - checks)) s; teardown follows)"
    else
      say "FAILED (exit $rc) after $((SECONDS - started)) s; the hosts' journals: $LOGS"
    fi
    exit "$rc"
    ;;
esac
