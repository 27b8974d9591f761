#!/usr/bin/env bash
# A clean Debian 12 host with systemd as PID 1, inside this machine (make test-host).
#
#   tests/host/cleanhost.sh root            build (or reuse) the cached root, print its path
#   tests/host/cleanhost.sh run [--no-deb] [--full]
#                                           boot a throwaway copy of it and run tests/host/inside.sh
#   tests/host/cleanhost.sh shell           boot one and open a shell in it (debugging)
#
# The root: `debootstrap --variant=minbase bookworm` plus tests/host/packages
# and scripts/setup.sh's APT_PACKAGES, installed with apt inside it. It is
# cached in $VMCACHE_HOST_CACHE (default /var/cache/vmcache-host) under a key
# made of those lists, so a second run reuses it; .deb files are kept there
# too (seeded from the host's apt cache), so a rebuild downloads little.
#
# A run: an overlayfs over the cached root (the cache is never written), a
# clean `git clone` of this checkout's HEAD copied to /root/vmcache, then
# `systemd-nspawn -b` boots it (systemd PID 1, its own libvirtd started by
# its units; nspawn shares this machine's network, for Debian's mirror and
# PyPI) and tests/host/inside.sh runs in it as a transient systemd service.
# Everything (container, overlay, mounts) is torn down on exit, also on
# failure or Ctrl-C. One run at a time per machine (flock).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
CACHE=${VMCACHE_HOST_CACHE:-/var/cache/vmcache-host}
SUITE=bookworm
MIRROR=http://deb.debian.org/debian
# Bump when the way the root is built changes (it is part of the cache key).
ROOT_RECIPE=1
LOCK=/run/lock/vmcache-host.lock
NSPAWN_RUN=/run/systemd/nspawn
BOOT_TIMEOUT=${VMCACHE_HOST_BOOT_TIMEOUT:-120}
RUN_TIMEOUT=${VMCACHE_HOST_TIMEOUT:-3600}

say() { echo "cleanhost: $*" >&2; }
die() { say "$*"; exit 1; }

packages() {
  { sed -n '/^APT_PACKAGES=(/,/^)/p' "$REPO/scripts/setup.sh" | sed '1d;$d'
    grep -v '^#' "$REPO/tests/host/packages"; } | tr -s ' \t' '\n' | sed '/^$/d' | sort -u
}

root_key() {
  { echo "$SUITE $ROOT_RECIPE"; packages; } | sha256sum | cut -c1-16
}

# The cached root for the current package list (ROOT=its path); built when missing.
build_root() {
  local key root tmp started
  key=$(root_key)
  root=$CACHE/root-$key
  if [ -f "$root/.vmcache-host-complete" ]; then
    say "root: $root (cached)"
    ROOT=$root
    return 0
  fi
  started=$SECONDS
  tmp=$root.partial
  rm -rf "$tmp"
  mkdir -p "$tmp" "$CACHE/debs/partial"
  # Seed the .deb cache from the host's (hard links; nothing is downloaded twice).
  find /var/cache/apt/archives -maxdepth 1 -name '*.deb' -exec cp -aln -t "$CACHE/debs/" {} + 2>/dev/null || true
  say "root: debootstrap $SUITE into $tmp"
  debootstrap --variant=minbase --cache-dir="$CACHE/debs" --include=systemd,systemd-sysv,dbus \
    "$SUITE" "$tmp" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
    || { tail -20 "$CACHE/debootstrap.log" >&2; die "debootstrap failed (log: $CACHE/debootstrap.log)"; }
  # apt configured as on this machine (its mirrors and settings).
  rm -f "$tmp/etc/apt/sources.list"
  cp /etc/apt/sources.list.d/*.sources "$tmp/etc/apt/sources.list.d/" 2>/dev/null || cp /etc/apt/sources.list "$tmp/etc/apt/"
  cp /etc/apt/apt.conf.d/99artifact-registry "$tmp/etc/apt/apt.conf.d/" 2>/dev/null || true
  printf '#!/bin/sh\nexit 101\n' > "$tmp/usr/sbin/policy-rc.d"   # no service starts while installing
  chmod 755 "$tmp/usr/sbin/policy-rc.d"
  say "root: apt-get install $(packages | wc -l) packages and their dependencies"
  # shellcheck disable=SC2046
  systemd-nspawn -q -D "$tmp" --register=no --keep-unit --bind="$CACHE/debs:/var/cache/apt/archives" \
    --setenv=DEBIAN_FRONTEND=noninteractive \
    sh -c 'apt-get update -q && apt-get install -y -q -o Dpkg::Options::=--force-confnew "$@"' apt $(packages) \
    >"$CACHE/apt.log" 2>&1 \
    || { tail -20 "$CACHE/apt.log" >&2; die "apt-get install in the root failed (log: $CACHE/apt.log)"; }
  rm -f "$tmp/usr/sbin/policy-rc.d"
  rm -rf "$tmp/var/lib/apt/lists/"*   # a new user's apt starts with `apt-get update`
  echo "vmcache-host" > "$tmp/etc/hostname"
  packages > "$tmp/.vmcache-host-packages"
  touch "$tmp/.vmcache-host-complete"
  mv "$tmp" "$root"
  say "root: $root built in $((SECONDS - started)) s ($(du -sh "$root" | cut -f1))"
  # Older roots (other package lists) are dropped: one root is kept.
  find "$CACHE" -maxdepth 1 -name 'root-*' ! -name "root-$key" -exec rm -rf {} +
  ROOT=$root
}

# -- running a container ---------------------------------------------------------------------

RUN_DIR=
NSPAWN_PID=
CHECK_PID=
MOUNTED_NSPAWN_RUN=0

# nspawn keeps its state in /run/systemd/nspawn and refuses unless that is a
# tmpfs (here /run is not one): mount one for as long as we need it.
nspawn_run_dir() {
  if ! mountpoint -q "$NSPAWN_RUN"; then
    mkdir -p "$NSPAWN_RUN"
    mount -t tmpfs -o mode=755 tmpfs "$NSPAWN_RUN"
    MOUNTED_NSPAWN_RUN=1
  fi
}

cleanup() {
  local rc=$? i
  trap - EXIT INT TERM
  if [ -n "$CHECK_PID" ]; then kill -TERM "$CHECK_PID" 2>/dev/null || true; fi
  if [ -n "$NSPAWN_PID" ] && kill -0 "$NSPAWN_PID" 2>/dev/null; then
    say "stopping the container (nspawn pid $NSPAWN_PID)"
    kill -TERM "$NSPAWN_PID" 2>/dev/null || true   # nspawn asks its systemd to power off
    for i in $(seq 1 300); do kill -0 "$NSPAWN_PID" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$NSPAWN_PID" 2>/dev/null; then
      say "the container did not power off in 30 s: killing it"
      kill -KILL "$NSPAWN_PID" 2>/dev/null || true
      for i in $(seq 1 100); do kill -0 "$NSPAWN_PID" 2>/dev/null || break; sleep 0.1; done
    fi
  fi
  if [ -n "$RUN_DIR" ]; then
    cp "$RUN_DIR/console.log" "$CACHE/last-run-console.log" 2>/dev/null || true
    if mountpoint -q "$RUN_DIR/merged"; then umount "$RUN_DIR/merged" || umount -l "$RUN_DIR/merged"; fi
    rm -rf "$RUN_DIR"
  fi
  if [ "$MOUNTED_NSPAWN_RUN" = 1 ]; then umount "$NSPAWN_RUN" || umount -l "$NSPAWN_RUN"; fi
  exit "$rc"
}

# Boot a throwaway container over the cached root; sets NSPAWN_PID, LEADER.
boot() {
  local root=$1 name=$2 i
  RUN_DIR=$(mktemp -d "$CACHE/run.XXXXXX")
  mkdir -p "$RUN_DIR/upper" "$RUN_DIR/work" "$RUN_DIR/merged"
  mount -t overlay overlay -o "lowerdir=$root,upperdir=$RUN_DIR/upper,workdir=$RUN_DIR/work" "$RUN_DIR/merged"
  # A clean clone of this checkout's HEAD, as a new user would have it (no .venv, nothing untracked).
  git -c advice.detachedHead=false clone -q --no-hardlinks "$REPO" "$RUN_DIR/merged/root/vmcache"
  # This machine's network: TLS goes through a proxy whose CA this machine
  # trusts (/usr/local/share/ca-certificates, pip told so in /etc/pip.conf).
  # The container trusts the same, or it reaches neither PyPI nor the mirror.
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$RUN_DIR/merged/usr/local/share/ca-certificates/"
    chroot "$RUN_DIR/merged" update-ca-certificates >/dev/null 2>&1
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$RUN_DIR/merged/etc/pip.conf"
  fi
  say "booting $name: $(git -C "$REPO" log -1 --format='%h %s' | cut -c1-72)"
  nspawn_run_dir
  # cgroups: this machine has cgroup v1 only, and nspawn would hand the
  # container its v1 controllers read-only, where libvirt cannot make a
  # domain's cgroup ("Failed to create v1 controller cpu for group:
  # Read-only file system"). A cgroup2 hierarchy of its own (no controllers:
  # they stay bound to v1) lets systemd and libvirt run as on a v2 host.
  export SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1
  # CAP_IPC_LOCK: root's services have it on a real host (vmcache's mlock needs
  # it beyond RLIMIT_MEMLOCK); nspawn drops it unless asked.
  systemd-nspawn -q -D "$RUN_DIR/merged" -M "$name" --register=no --keep-unit -b \
    --capability=CAP_IPC_LOCK >"$RUN_DIR/console.log" 2>&1 </dev/null &
  NSPAWN_PID=$!
  # The container's PID 1: nspawn's child.
  LEADER=
  for i in $(seq 1 100); do
    LEADER=$(pgrep -P "$NSPAWN_PID" | head -1 || true)
    [ -n "$LEADER" ] && [ "$(cat "/proc/$LEADER/comm" 2>/dev/null)" = systemd ] && break
    kill -0 "$NSPAWN_PID" 2>/dev/null || { cat "$RUN_DIR/console.log" >&2; die "nspawn exited"; }
    sleep 0.1
  done
  [ -n "$LEADER" ] || die "no systemd in the container after 10 s"
  # systemctl answers once systemd's private socket is there.
  for i in $(seq 1 $((BOOT_TIMEOUT * 10))); do
    [ -S "/proc/$LEADER/root/run/systemd/private" ] && break
    kill -0 "$NSPAWN_PID" 2>/dev/null || { cat "$RUN_DIR/console.log" >&2; die "nspawn exited"; }
    sleep 0.1
  done
  local state
  state=$(in_container timeout "$BOOT_TIMEOUT" systemctl is-system-running --wait 2>/dev/null || true)
  say "booted: systemd says '$state'"
  if [ "$state" != running ]; then
    in_container systemctl --failed --no-legend --plain >&2 || true
  fi
}

# Run a command in the container's namespaces (not in a unit: for probes).
in_container() {
  nsenter -t "$LEADER" -a -- env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
    LANG=C.UTF-8 TERM=dumb "$@"
}

# Run a command as a transient service of the container's systemd: its own
# cgroup, the environment of a unit, output back here, its exit status.
in_unit() {
  in_container systemd-run --quiet --pipe --wait --collect --service-type=exec \
    -p TimeoutStartSec=infinity --setenv=HOME=/root --setenv=LANG=C.UTF-8 \
    --working-directory=/root/vmcache "$@"
}

case "${1:-}" in
  root|shell|run) ;;
  *) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
esac
[ "$(id -u)" = 0 ] || die "run as root (debootstrap, mounts, systemd-nspawn)"
# What this needs on the machine itself, installed as scripts/setup.sh does.
if ! command -v debootstrap >/dev/null || ! command -v systemd-nspawn >/dev/null; then
  say "installing debootstrap and systemd-container"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap systemd-container >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap systemd-container >/dev/null; } \
    || die "cannot install debootstrap and systemd-container"
fi
mkdir -p "$CACHE"
exec 9>"$LOCK"
flock -n 9 || { say "another clean-host run holds $LOCK: waiting"; flock 9; }
trap cleanup EXIT
trap 'say "interrupted"; exit 130' INT TERM HUP
nspawn_run_dir
build_root
case "$1" in
  root) echo "$ROOT" ;;
  shell)
    boot "$ROOT" vmcache-host
    in_container bash -l || true
    ;;
  run)
    shift
    started=$SECONDS
    boot "$ROOT" vmcache-host
    args=()
    while [ $# -gt 0 ]; do
      case "$1" in
        --full) args+=(--full); shift ;;
        --no-deb) args+=(--no-deb); shift ;;
        *) die "run: unknown option $1" ;;
      esac
    done
    rc=0
    # In the background and waited for: a signal interrupts `wait` at once (the
    # trap tears the container down), where a foreground child would delay it.
    in_unit -p RuntimeMaxSec="$RUN_TIMEOUT" --unit=vmcache-clean-host-check \
      bash tests/host/inside.sh "${args[@]}" &
    CHECK_PID=$!
    wait "$CHECK_PID" || rc=$?
    CHECK_PID=
    in_container journalctl -b --no-pager > "$CACHE/last-run-journal.log" 2>&1 || true
    if [ "$rc" = 0 ]; then
      say "PASSED in $((SECONDS - started)) s (boot, checks, teardown follows)"
    else
      say "FAILED (exit $rc) after $((SECONDS - started)) s; the container's journal: $CACHE/last-run-journal.log"
    fi
    exit "$rc"
    ;;
esac
