# Sourced by tests/host/cleanhost.sh and tests/host/migrate.sh: the cached
# Debian 12 root and throwaway systemd-nspawn containers booted over it.
#
# The root: `debootstrap --variant=minbase bookworm` plus tests/host/packages
# and scripts/setup.sh's APT_PACKAGES, installed with apt inside it. It is
# cached in $VMCACHE_HOST_CACHE (default /var/cache/vmcache-host) under a key
# made of those lists, so a second run reuses it; .deb files are kept there
# too (seeded from the host's apt cache), so a rebuild downloads little.
# A container runs on an overlayfs over the root: the cache is never written.
#
# Containers are kept by name (several may run at once); container_cleanup
# stops them all and removes what they were built on. The caller takes the
# host lock (host_lock) first: one user of the cache and of nspawn's runtime
# directory at a time.
# shellcheck shell=bash
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CACHE=${VMCACHE_HOST_CACHE:-/var/cache/vmcache-host}
SUITE=bookworm
MIRROR=http://deb.debian.org/debian
# Bump when the way the root is built changes (it is part of the cache key).
ROOT_RECIPE=1
HOST_LOCK=/run/lock/vmcache-host.lock
NSPAWN_RUN=/run/systemd/nspawn
BOOT_TIMEOUT=${VMCACHE_HOST_BOOT_TIMEOUT:-120}
SAY=${SAY:-cleanhost}

say() { echo "$SAY: [$(date +%T)] $*" >&2; }
die() { say "$*"; exit 1; }

# -- the cached root ---------------------------------------------------------------------------

packages() {
  { sed -n '/^APT_PACKAGES=(/,/^)/p' "$REPO/scripts/setup.sh" | sed '1d;$d'
    grep -v '^#' "$REPO/tests/host/packages"; } | tr -s ' \t' '\n' | sed '/^$/d' | sort -u
}

root_key() {
  { echo "$SUITE $ROOT_RECIPE"; packages; } | sha256sum | cut -c1-16
}

# What this needs on the machine itself, installed as scripts/setup.sh does.
host_tools() {
  [ "$(id -u)" = 0 ] || die "run as root (debootstrap, mounts, systemd-nspawn)"
  if ! command -v debootstrap >/dev/null || ! command -v systemd-nspawn >/dev/null; then
    say "installing debootstrap and systemd-container"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap systemd-container >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap systemd-container >/dev/null; } \
      || die "cannot install debootstrap and systemd-container"
  fi
}

# One user of the cache and of $NSPAWN_RUN at a time (fd 9 holds the lock until exit).
host_lock() {
  mkdir -p "$CACHE"
  exec 9>"$HOST_LOCK"
  flock -n 9 || { say "another clean-host run holds $HOST_LOCK: waiting"; flock 9; }
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
  nspawn_run_dir
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

# -- overlays over the root --------------------------------------------------------------------

OVERLAYS=()

# overlay DIR: DIR/merged, a writable view of $ROOT (changes in DIR/upper); removed by container_cleanup.
overlay() {
  local dir=$1
  mkdir -p "$dir/upper" "$dir/work" "$dir/merged"
  mount -t overlay overlay -o "lowerdir=$ROOT,upperdir=$dir/upper,workdir=$dir/work" "$dir/merged"
  OVERLAYS+=("$dir")
}

# This machine's network: TLS goes through a proxy whose CA this machine
# trusts (/usr/local/share/ca-certificates, pip told so in /etc/pip.conf).
# A container that downloads trusts the same, or it reaches neither PyPI nor the mirror.
trust_host_cas() {
  local merged=$1
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$merged/usr/local/share/ca-certificates/"
    chroot "$merged" update-ca-certificates >/dev/null 2>&1
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$merged/etc/pip.conf"
  fi
}

# A clean clone of this checkout's HEAD at MERGED/root/vmcache, as a new user would have it.
clone_repo() {
  git -c advice.detachedHead=false clone -q --no-hardlinks "$REPO" "$1/root/vmcache"
}

# -- containers --------------------------------------------------------------------------------

declare -A NSPAWN_PID=() LEADER=() CONSOLE=()
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

# container_boot NAME MERGED CONSOLE_LOG [nspawn options...]: boot systemd in MERGED as machine NAME
# (its hostname too) and wait until systemd is up; LEADER[NAME] is its PID 1 (as this machine sees it).
container_boot() {
  local name=$1 merged=$2 console=$3 i pid leader=
  shift 3
  nspawn_run_dir
  # cgroups: this machine has cgroup v1 only, and nspawn would hand the
  # container its v1 controllers read-only, where libvirt cannot make a
  # domain's cgroup ("Failed to create v1 controller cpu for group:
  # Read-only file system"). A cgroup2 hierarchy of its own (no controllers:
  # they stay bound to v1) lets systemd and libvirt run as on a v2 host.
  # CAP_IPC_LOCK: root's services have it on a real host (vmcache's mlock needs
  # it beyond RLIMIT_MEMLOCK); nspawn drops it unless asked. bpf and
  # perf_event_open: nspawn's seccomp filter refuses them, where a host's root
  # has them (the read counter's programs; CAP_SYS_ADMIN, which nspawn keeps,
  # allows them).
  SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1 systemd-nspawn -q -D "$merged" -M "$name" --register=no --keep-unit -b \
    --capability=CAP_IPC_LOCK --system-call-filter='bpf perf_event_open' "$@" >"$console" 2>&1 </dev/null &
  pid=$!
  NSPAWN_PID[$name]=$pid
  CONSOLE[$name]=$console
  # The container's PID 1: nspawn's child.
  for i in $(seq 1 100); do
    leader=$(pgrep -P "$pid" | head -1 || true)
    [ -n "$leader" ] && [ "$(cat "/proc/$leader/comm" 2>/dev/null)" = systemd ] && break
    kill -0 "$pid" 2>/dev/null || { cat "$console" >&2; die "$name: nspawn exited"; }
    sleep 0.1
  done
  [ -n "$leader" ] || die "$name: no systemd in the container after 10 s"
  LEADER[$name]=$leader
  # systemctl answers once systemd's private socket is there.
  for i in $(seq 1 $((BOOT_TIMEOUT * 10))); do
    [ -S "/proc/$leader/root/run/systemd/private" ] && break
    kill -0 "$pid" 2>/dev/null || { cat "$console" >&2; die "$name: nspawn exited"; }
    sleep 0.1
  done
  local state
  state=$(in_container "$name" timeout "$BOOT_TIMEOUT" systemctl is-system-running --wait 2>/dev/null || true)
  say "$name booted: systemd says '$state'"
  if [ "$state" != running ]; then
    in_container "$name" systemctl --failed --no-legend --plain >&2 || true
  fi
}

# in_container NAME COMMAND...: run COMMAND in the container's namespaces (not in a unit: for probes).
in_container() {
  local name=$1
  shift
  nsenter -t "${LEADER[$name]}" -a -- env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/root LANG=C.UTF-8 TERM=dumb "$@"
}

# in_unit NAME [systemd-run options] COMMAND...: run COMMAND as a transient service of the
# container's systemd: its own cgroup, the environment of a unit, output back here, its exit status.
in_unit() {
  local name=$1
  shift
  in_container "$name" systemd-run --quiet --pipe --wait --collect --service-type=exec \
    -p TimeoutStartSec=infinity --setenv=HOME=/root --setenv=LANG=C.UTF-8 "$@"
}

# container_reboot NAME: `systemctl reboot` in it and wait until it has gone down. systemd-nspawn
# boots a rebooted container again by itself, except with --keep-unit (container_boot's), where it
# exits 133 for its unit to restart it (systemd-nspawn@.service: RestartForceExitStatus=133): here the
# caller boots the same root again (container_boot), after whatever a real reboot would also do.
container_reboot() {
  local name=$1 pid=${NSPAWN_PID[$1]} i rc=0
  in_container "$name" systemctl reboot
  for i in $(seq 1 $((BOOT_TIMEOUT * 10))); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && die "$name: still up ${BOOT_TIMEOUT} s after systemctl reboot"
  wait "$pid" || rc=$?
  unset "NSPAWN_PID[$name]"
  [ "$rc" = 133 ] || { tail -20 "${CONSOLE[$name]}" >&2; die "$name: nspawn exited $rc after systemctl reboot, not 133"; }
  say "$name went down for its reboot (nspawn exit status 133)"
}

# container_stop NAME: power it off (nspawn asks its systemd to), kill it after 30 s.
container_stop() {
  local name=$1 pid=${NSPAWN_PID[$1]:-} i
  [ -n "$pid" ] || return 0
  unset "NSPAWN_PID[$name]"
  kill -0 "$pid" 2>/dev/null || return 0
  say "stopping $name (nspawn pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  say "$name did not power off in 30 s: killing it"
  kill -KILL "$pid" 2>/dev/null || true
  for i in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
}

# Stop every container, unmount every overlay (and what was mounted under it), drop nspawn's tmpfs.
container_cleanup() {
  local name dir
  for name in "${!NSPAWN_PID[@]}"; do container_stop "$name"; done
  for dir in "${OVERLAYS[@]}"; do
    if mountpoint -q "$dir/merged"; then umount -R "$dir/merged" 2>/dev/null || umount -l "$dir/merged"; fi
  done
  OVERLAYS=()
  if [ "$MOUNTED_NSPAWN_RUN" = 1 ]; then umount "$NSPAWN_RUN" || umount -l "$NSPAWN_RUN"; MOUNTED_NSPAWN_RUN=0; fi
}
