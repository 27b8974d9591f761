#!/usr/bin/env bash
# vmcache on the kernels libvirt hosts run (make test-kernels).
#
#   tests/kernels/run.sh [KERNEL...]    KERNEL: host, 6.1, new, newest (default: all four)
#   tests/kernels/run.sh bench          bench/readcount_cost.py in the newest kernel's VM, where both
#                                       counters load (a benchmark: run it alone, under
#                                       flock -x /run/lock/vmcache-quiet.lock)
#
# tests/kernels/checks.py - exact read counts (ten 4 MiB preads, a block device, the agent's own loads
# not counted, the tracepoint set where the kernel has it), the residency scan against mincore,
# `vmcache watch` pinning a hot range, BPF refused -> one log line - runs:
#
#  - host: on this machine's kernel, with the checkout's .venv (a loop device for the block device);
#  - 6.1: in a TCG VM booting Debian 12's own kernel, linux-image-cloud-amd64 of bookworm (6.1);
#  - new: in a TCG VM booting the newest Debian cloud kernel that installs on bookworm (trixie's, else
#    bookworm-backports': a 6.12), booted with psi=0 (RHEL 9's default) as well;
#  - newest: in a TCG VM booting trixie-backports' kernel (7.x: the first with both counters' events),
#    which does not install on bookworm (it needs trixie's linux-base): extracted from its packages,
#    with an initramfs of busybox and the modules a VM's root needs (tests/kernels/initramfs-init).
#
# The VMs' root is the clean host's cached debootstrap root (tests/host/nspawn.sh) with the new
# kernel installed, made into an ext4 image once and cached in $VMCACHE_HOST_CACHE/kernels (read-only
# in the VMs); each run builds the .deb (scripts/deb.sh), installs it with dpkg in a container over
# that root and puts what changed (the overlay's upper layer) and the checks on a small second disk,
# which tests/kernels/init.sh (on that disk) mounts over the root before the checks run. A third disk of random
# data is the block device. Consoles are kept in $VMCACHE_KERNELS_LOGS (default build/kernels).
# One user of the cache at a time (the clean host's lock, let go before the VMs boot); the VMs run
# under the shared quiet lock.
set -euo pipefail
SAY=kernels
# shellcheck source=tests/host/nspawn.sh
. "$(dirname "$0")/../host/nspawn.sh"
KCACHE=$CACHE/kernels
LOGS=${VMCACHE_KERNELS_LOGS:-$REPO/build/kernels}
VM_TIMEOUT=${VMCACHE_KERNELS_VM_TIMEOUT:-300}
# Bump when the way the VMs' root is built changes (part of its cache key).
KERNELS_RECIPE=1
SUITES=(trixie bookworm-backports)
NEWEST_SUITE=trixie-backports
QUIET_LOCK=/run/lock/vmcache-quiet.lock

RUN=
LOOP=
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  container_cleanup
  if [ -n "$LOOP" ]; then losetup -d "$LOOP" 2>/dev/null || true; fi
  if [ -n "$RUN" ]; then rm -rf "$RUN"; fi
  exit "$rc"
}

# apt-get/apt-cache over Debian's newer suites, in a directory of their own (not this machine's apt).
apt_scratch() {
  local tool=$1
  shift
  "$tool" -q -o Dir::Etc::SourceList="$KCACHE/apt/sources.list" -o Dir::Etc::SourceParts=/nonexistent \
    -o Dir::State::Lists="$KCACHE/apt/lists" -o Dir::Cache="$KCACHE/apt/cache" \
    -o Dir::State::status=/var/lib/dpkg/status -o Debug::NoLocking=1 "$@"
}

# The candidates for the newest kernel, newest suite first: "suite package version" lines.
kernel_candidates() {
  local suite version pkg
  mkdir -p "$KCACHE/apt/lists/partial" "$KCACHE/apt/cache/archives/partial" "$KCACHE/debs"
  for suite in "${SUITES[@]}" "$NEWEST_SUITE"; do echo "deb $MIRROR $suite main"; done > "$KCACHE/apt/sources.new"
  # Package lists younger than a day, of the same suites, are used as they are.
  if ! cmp -s "$KCACHE/apt/sources.new" "$KCACHE/apt/sources.list" \
      || [ -z "$(find "$KCACHE/apt/lists" -maxdepth 1 -name '*Packages*' -mmin -1440 2>/dev/null | head -1)" ]; then
    mv "$KCACHE/apt/sources.new" "$KCACHE/apt/sources.list"
    apt_scratch apt-get update >/dev/null || say "apt-get update of ${SUITES[*]} failed: using the lists there are"
  fi
  rm -f "$KCACHE/apt/sources.new"
  for suite in "${SUITES[@]}"; do
    version=$(apt_scratch apt-cache madison linux-image-cloud-amd64 | awk -v s="$suite" '$0 ~ s"/main" {print $3; exit}')
    [ -n "$version" ] || continue
    pkg=$(apt_scratch apt-cache show "linux-image-cloud-amd64=$version" | sed -n 's/^Depends: \(linux-image-[^ ,]*\).*/\1/p' | head -1)
    [ -n "$pkg" ] && echo "$suite $pkg $version"
  done
}

# The Depends of vmcache's package (debian/control), by name.
package_depends() {
  awk '/^Package: vmcache/ {p = 1} p && /^Depends:/ {d = 1; sub(/^Depends:/, "")} p && d && /^[A-Z][a-z-]*:/ && !/^Depends/ {d = 0}
       p && d {print}' "$REPO/debian/control" | tr ',' '\n' | sed 's/^ *//; s/ .*//' | grep -v '^\$' | grep . | sort -u | tr '\n' ' '
}

# The VMs' root, cached: BASE (its directory) with base.img, the upper layer that the new kernel's and
# the package's dependencies' installs made over $ROOT, both kernels and initrds, and kernels.txt
# ("6.1 VERSION" and "new VERSION").
build_base() {
  local candidates key tmp suite pkg version deb merged k started=$SECONDS
  candidates=$(kernel_candidates)
  [ -n "$candidates" ] || die "no linux-image-cloud-amd64 in ${SUITES[*]} (and none cached)"
  key=$( { echo "$ROOT $KERNELS_RECIPE"; echo "$candidates"; package_depends; cat "$REPO/tests/kernels/root-init"; } \
    | sha256sum | cut -c1-16)
  BASE=$KCACHE/base-$key
  if [ -f "$BASE/complete" ]; then
    say "the VMs' root: $BASE (cached): $(tr '\n' ' ' < "$BASE/kernels.txt")"
    return 0
  fi
  tmp=$BASE.partial
  rm -rf "$tmp"
  mkdir -p "$tmp"
  while read -r suite pkg version; do
    deb=$KCACHE/debs/${pkg}_$version.deb
    if [ ! -f "$deb" ]; then
      rm -rf "$KCACHE/debs/partial" && mkdir -p "$KCACHE/debs/partial"
      (cd "$KCACHE/debs/partial" && apt_scratch apt-get download "$pkg=$version" >/dev/null 2>&1) \
        || { say "$pkg $version ($suite): download failed"; continue; }
      mv "$KCACHE"/debs/partial/*.deb "$deb"
    fi
    overlay "$tmp/layer"
    merged=$tmp/layer/merged
    cp "$deb" "$merged/root/kernel.deb"
    nspawn_run_dir
    if systemd-nspawn -q -D "$merged" --register=no --keep-unit --setenv=DEBIAN_FRONTEND=noninteractive \
        sh -c 'dpkg -i /root/kernel.deb' >"$tmp/dpkg.log" 2>&1; then
      echo "$pkg $version ($suite)" > "$tmp/new.txt"
      break
    fi
    say "$pkg $version ($suite) does not install on bookworm: $(grep -m1 -i 'depend' "$tmp/dpkg.log" || tail -1 "$tmp/dpkg.log")"
    umount "$merged"
    OVERLAYS=()
    rm -rf "$tmp/layer"
  done <<< "$candidates"
  [ -f "$tmp/new.txt" ] || die "no newer Debian kernel installs on bookworm"
  rm -f "$merged/root/kernel.deb"
  say "the VMs' root: apt-get install $(package_depends)(the package's dependencies)"
  # shellcheck disable=SC2046
  systemd-nspawn -q -D "$merged" --register=no --keep-unit --bind="$CACHE/debs:/var/cache/apt/archives" \
    --setenv=DEBIAN_FRONTEND=noninteractive sh -c 'apt-get update -q && apt-get install -y -q "$@"' apt \
    $(package_depends) >"$tmp/apt.log" 2>&1 || { tail -20 "$tmp/apt.log" >&2; die "apt-get install failed"; }
  rm -rf "$merged"/var/lib/apt/lists/*
  # What the VMs do not use, and their image need not carry (the cached root keeps it).
  rm -rf "$merged"/usr/share/{doc,man,locale,javascript,pocketsphinx,icons}/* "$merged"/var/cache/apt/* \
    "$merged"/usr/lib/gcc "$merged"/usr/lib/x86_64-linux-gnu/{libLLVM-*,dri} "$merged"/usr/bin/{prometheus,promtool} \
    "$merged"/usr/bin/x86_64-linux-gnu-lto-dump-*
  mkdir -p "$merged/vmcache-kernels"
  install -m 755 "$REPO/tests/kernels/root-init" "$merged/sbin/vmcache-kernels-init"
  for k in "$merged"/boot/vmlinuz-*; do
    cp "$k" "$tmp/"
    cp "$merged/boot/initrd.img-${k##*/vmlinuz-}" "$tmp/"
  done
  { echo "6.1 $(ls "$merged"/lib/modules | grep -- '^6\.1\.' | head -1)"
    echo "new $(awk '{print $1}' "$tmp/new.txt" | sed 's/^linux-image-//')"; } > "$tmp/kernels.txt"
  say "the VMs' root: an ext4 image of $(du -sh "$merged" 2>/dev/null | cut -f1)"
  mkfs.ext4 -q -F -L vmcache-kernels -d "$merged" "$tmp/base.img" "$(( $(du -sm "$merged" | cut -f1) * 12 / 10 + 256 ))M" \
    >/dev/null
  umount "$merged"
  OVERLAYS=()
  mv "$tmp/layer/upper" "$tmp/upper"
  rm -rf "$tmp/layer" "$tmp/dpkg.log" "$tmp/apt.log"
  touch "$tmp/complete"
  mv "$tmp" "$BASE"
  find "$KCACHE" -maxdepth 1 -name 'base-*' ! -name "base-$key" -exec rm -rf {} +  # one root is kept
  say "the VMs' root: $BASE built in $((SECONDS - started)) s: $(tr '\n' ' ' < "$BASE/kernels.txt")"
}

# NEWEST (a directory, cached): the newest suite's kernel, extracted (vmlinuz-K), and an initramfs for
# it (initrd-K): busybox, tests/kernels/initramfs-init, and virtio_blk and overlay with what they need.
extract_newest() {
  local version k tmp m mod name started=$SECONDS
  version=$(apt_scratch apt-cache madison linux-image-cloud-amd64 | awk -v s="$NEWEST_SUITE" '$0 ~ s"/main" {print $3; exit}')
  [ -n "$version" ] || die "no linux-image-cloud-amd64 in $NEWEST_SUITE"
  k=$(apt_scratch apt-cache show "linux-image-cloud-amd64=$version" | grep -o 'linux-image-[^ ,]*-cloud-amd64' | head -1)
  k=${k#linux-image-}
  NEWEST=$KCACHE/newest-$k-$( { echo "$KERNELS_RECIPE"; cat "$REPO/tests/kernels/initramfs-init" /bin/busybox; } \
    | sha256sum | cut -c1-8)
  if [ -f "$NEWEST/complete" ]; then say "newest: $k (cached)"; return 0; fi
  tmp=$NEWEST.partial
  rm -rf "$tmp"
  mkdir -p "$tmp/debs" "$tmp/x" "$tmp/m/lib" "$tmp/initramfs"/{bin,dev,proc,root}
  # 7.x splits the kernel (linux-binary-K) from its modules (linux-modules-K); before, linux-image-K had both
  for m in "linux-binary-$k" "linux-modules-$k" "linux-image-$k"; do
    (cd "$tmp/debs" && apt_scratch apt-get download "$m=$version" >/dev/null 2>&1) || true
  done
  for m in "$tmp"/debs/*.deb; do dpkg-deb -x "$m" "$tmp/x"; done
  mv "$tmp/x/usr/lib/modules" "$tmp/m/lib/" 2>/dev/null || mv "$tmp/x/lib/modules" "$tmp/m/lib/"
  [ -f "$tmp/m/lib/modules/$k/vmlinuz" ] || cp "$tmp/x/boot/vmlinuz-$k" "$tmp/m/lib/modules/$k/vmlinuz"
  depmod -b "$tmp/m" "$k" 2>/dev/null
  for mod in virtio_blk overlay; do
    for m in $(modprobe -d "$tmp/m" -S "$k" --show-depends "$mod" | awk '$1 == "insmod" {print $2}'); do
      name=$(basename "${m%.ko*}")
      grep -qx "$name" "$tmp/initramfs/modules" 2>/dev/null && continue
      case "$m" in
        *.xz) xz -dc "$m" ;; *.zst) zstd -qdc "$m" ;; *) cat "$m" ;;
      esac > "$tmp/initramfs/$name.ko"
      echo "$name" >> "$tmp/initramfs/modules"
    done
  done
  cp /bin/busybox "$tmp/initramfs/bin/busybox"
  install -m 755 "$REPO/tests/kernels/initramfs-init" "$tmp/initramfs/init"
  (cd "$tmp/initramfs" && find . | cpio -o -H newc --quiet) > "$tmp/initrd-$k"
  mv "$tmp/m/lib/modules/$k/vmlinuz" "$tmp/vmlinuz-$k"
  echo "$k $version ($NEWEST_SUITE), modules in its initramfs: $(tr '\n' ' ' < "$tmp/initramfs/modules")" > "$tmp/kernel.txt"
  rm -rf "$tmp/debs" "$tmp/x" "$tmp/m" "$tmp/initramfs"
  touch "$tmp/complete"
  mv "$tmp" "$NEWEST"
  find "$KCACHE" -maxdepth 1 -name 'newest-*' ! -name "${NEWEST##*/}" -exec rm -rf {} +  # one is kept
  say "newest: $(cat "$NEWEST/kernel.txt"), extracted in $((SECONDS - started)) s"
}

# This run's disk: vmcache from its .deb over the VMs' root (the overlay's upper layer) and the checks.
build_run_disk() {
  local started=$SECONDS dir=$RUN/disk merged=$RUN/disk/merged
  scripts/deb.sh "$RUN/deb" >"$RUN/deb.log" 2>&1 || { tail -20 "$RUN/deb.log" >&2; die "make deb failed"; }
  mkdir -p "$dir/upper" "$dir/work" "$merged"
  mount -t overlay overlay -o "lowerdir=$BASE/upper:$ROOT,upperdir=$dir/upper,workdir=$dir/work" "$merged"
  OVERLAYS+=("$dir")
  cp "$RUN"/deb/vmcache_*_all.deb "$merged/root/vmcache.deb"
  nspawn_run_dir
  systemd-nspawn -q -D "$merged" --register=no --keep-unit --setenv=DEBIAN_FRONTEND=noninteractive \
    sh -c 'dpkg -i /root/vmcache.deb && rm /root/vmcache.deb' >"$RUN/dpkg.log" 2>&1 \
    || { tail -20 "$RUN/dpkg.log" >&2; die "dpkg -i vmcache.deb failed"; }
  install -D -m 644 "$REPO/tests/kernels/checks.py" "$merged/usr/local/lib/vmcache-kernels/checks.py"
  install -D -m 644 "$REPO/tests/kernels/nscheck.py" "$merged/usr/local/lib/vmcache-kernels/tests/kernels/nscheck.py"
  install -D -m 644 -t "$merged/usr/local/lib/vmcache-kernels/tests" "$REPO/tests/__init__.py" "$REPO/tests/pagecache_util.py"
  install -D -m 755 "$REPO/tests/kernels/run-checks" "$merged/usr/local/lib/vmcache-kernels/run-checks"
  install -D -m 644 -t "$merged/usr/local/lib/vmcache-kernels/bench" "$REPO/bench/readcount_cost.py" "$REPO/bench/order.py"
  umount "$merged"
  OVERLAYS=()
  rm -rf "$dir/work" "$merged"
  mkdir "$dir/work"
  install -m 755 "$REPO/tests/kernels/init.sh" "$dir/init.sh"
  mkfs.ext4 -q -F -L vmcache-run -d "$dir" "$RUN/run.img" "$(( $(du -sm "$dir" | cut -f1) + 768 ))M" >/dev/null
  head -c $((64 << 20)) /dev/urandom > "$RUN/block.raw"
  say "this run's disk: $(dpkg-deb -W --showformat='${Package} ${Version}' "$RUN"/deb/vmcache_*_all.deb) in $((SECONDS - started)) s"
}

# Boot the VM of kernel VERSION from KERNEL and INITRD (extra kernel command line after them); its console
# in $LOGS/VERSION.log ($LOGS/bench-VERSION.log for the benchmark, which runs under the caller's lock).
boot() {
  local version=$1 kernel=$2 initrd=$3 extra=$4 log=$LOGS/$1.log started=$SECONDS rc=0 lock=(flock -s "$QUIET_LOCK")
  if [[ " $extra " == *" vmk.run=bench "* ]]; then log=$LOGS/bench-$1.log lock=(); fi
  say "$version: booting in a TCG VM"
  "${lock[@]}" timeout "$VM_TIMEOUT" qemu-system-x86_64 -accel tcg -m 2048 -smp 2 -nodefaults \
    -display none -serial "file:$log" -no-reboot -snapshot \
    -kernel "$kernel" -initrd "$initrd" \
    -append "root=/dev/vda ro console=ttyS0 panic=-1 init=/sbin/vmcache-kernels-init vmk.expect=probe $extra" \
    -drive "file=$BASE/base.img,format=raw,if=virtio,readonly=on" -drive "file=$RUN/run.img,format=raw,if=virtio" \
    -drive "file=$RUN/block.raw,format=raw,if=virtio" || rc=$?
  if [ ${#lock[@]} = 0 ]; then
    grep -a -A30 'load average' "$log" | grep -av '^\[' >&2 || true
    [ "$rc" = 0 ] && grep -aq '^programs left: 0' "$log" || FAILED+=("bench")
    return
  fi
  report "$version" "$log" "$rc" "$((SECONDS - started))"
}

# The vmk: lines of a run's output; fails unless every check passed.
report() {
  local name=$1 log=$2 rc=$3 seconds=$4
  grep -a '^vmk: ' "$log" | sed "s/^vmk: /  /" >&2 || true
  if [ "$rc" = 0 ] && grep -aq '^vmk: done ok=[0-9]* failed=0' "$log"; then
    say "$name: PASSED in $seconds s"
  else
    say "$name: FAILED (exit $rc) after $seconds s; the whole console: $log"
    FAILED+=("$name")
  fi
}

# The checks on this machine's kernel, with the checkout's venv.
host_checks() {
  local log=$LOGS/host.log started=$SECONDS rc=0
  mkdir -p "$RUN/host"
  head -c $((64 << 20)) /dev/urandom > "$RUN/host/block.raw"
  LOOP=$(losetup -f --show "$RUN/host/block.raw")
  say "host: $(uname -r), the checks with $REPO/.venv"
  PATH=$REPO/.venv/bin:$PATH PYTHONPATH=$REPO VMK_WORK=$RUN/host/work VMK_BLOCK_DEVICE=$LOOP VMK_SHARED_HOST=1 \
    timeout "$VM_TIMEOUT" "$REPO/.venv/bin/python" "$REPO/tests/kernels/checks.py" >"$log" 2>&1 || rc=$?
  losetup -d "$LOOP"
  LOOP=
  report host "$log" "$rc" "$((SECONDS - started))"
}

[ "$(id -u)" = 0 ] || die "run as root (mounts, containers, BPF)"
cd "$REPO"
WANT=("$@")
[ ${#WANT[@]} -gt 0 ] || WANT=(host 6.1 new newest)
FAILED=()
started=$SECONDS
trap cleanup EXIT
trap 'say "interrupted"; exit 130' INT TERM HUP
mkdir -p "$LOGS"
RUN=$(mktemp -d /var/tmp/vmcache-kernels.XXXXXX)
for want in "${WANT[@]}"; do
  case "$want" in
    host) host_checks ;;
    6.1|new|newest|bench) ;;
    *) die "unknown kernel $want (host, 6.1, new, newest, bench)" ;;
  esac
done
if [[ " ${WANT[*]} " =~ " "(6\.1|new|newest|bench)" " ]]; then
  host_tools
  host_lock
  build_root
  build_base
  if [[ " ${WANT[*]} " =~ " "(newest|bench)" " ]]; then extract_newest; fi
  build_run_disk
  exec 9>&-   # the cache is read no more: other clean-host runs may go on
  for want in "${WANT[@]}"; do
    case "$want" in
      6.1|new)
        k=$(awk -v w="$want" '$1 == w {print $2}' "$BASE/kernels.txt")
        boot "$k" "$BASE/vmlinuz-$k" "$BASE/initrd.img-$k" "$([ "$want" = new ] && echo psi=0)" ;;
      newest|bench)
        k=$(awk '{print $1}' "$NEWEST/kernel.txt")
        boot "$k" "$NEWEST/vmlinuz-$k" "$NEWEST/initrd-$k" "$([ "$want" = bench ] && echo vmk.run=bench)" ;;
    esac
  done
fi
if [ ${#FAILED[@]} = 0 ]; then
  say "PASSED (${WANT[*]}) in $((SECONDS - started)) s"
else
  say "FAILED: ${FAILED[*]} ($((SECONDS - started)) s)"
  exit 1
fi
