#!/usr/bin/env bash
# make bench: the end-to-end benchmark (docs/benchmarks.md, "End to end: goals").
#
# Installs vmcache the way operators do (make install: /opt/vmcache, the
# libvirt hook, /etc/vmcache/vmcache.yaml), starts libvirtd if needed, builds
# (or reuses) the tiny test guest, then runs bench/e2e.py: every arm boots a
# TCG guest running fio on a 2 GiB writethrough raw image inside a memory
# cgroup, the image behind a delay device (bench/delaydev.py, FUSE: ~0.4 ms
# or ~5 ms per page-cache miss), vmcache arms opted in through the domain
# metadata; 3 interleaved rounds. About 50
# minutes with the defaults when no live test holds the hook lock (longer
# when they do: vmcache arms wait for it); prints the goals and a table of
# medians at the end, raw results in .bench/.
#
#   scripts/bench.sh [E2E ARGS]      e.g. --set long, --set peers (~1 h 40 min), --rounds 5,
#                                    --arms reuse-ssd-kernel,reuse-ssd-vmcache
#   VMCACHE_BENCH_ARGS="--set long" make bench
#
# The install (which replaces the libvirt hook) and every vmcache arm hold
# the live tests' hook lock, so no live test's hook is swapped under it.
# Everything it makes (domains vmcache-bench-e2e-*, the cgroups
# /sys/fs/cgroup/memory/vmcache-bench-e2e*, the delay device's daemon and its
# mount, the images and the neighbours' file under /var/lib/vmcache/bench-e2e)
# is removed at the end, also on failure or Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench: run as root (it installs vmcache and runs libvirt domains)" >&2; exit 1; }
scripts/setup.sh
scripts/libvirtd.sh
mkdir -p /run/lock
flock /run/lock/vmcache-live-hook.lock scripts/install.sh   # HOOK_LOCK of tests/live/livelib.py
guest=$(scripts/build-guest.sh)
# shellcheck disable=SC2086 # VMCACHE_BENCH_ARGS is a list of arguments
exec .venv/bin/python bench/e2e.py --guest-dir "$guest" ${VMCACHE_BENCH_ARGS:-} "$@"
