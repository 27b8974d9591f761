#!/usr/bin/env bash
# make bench: the end-to-end benchmark (docs/benchmarks.md, "End to end").
#
# Installs vmcache the way operators do (make install: /opt/vmcache, the
# libvirt hook, /etc/vmcache/vmcache.yaml), starts libvirtd if needed, builds
# (or reuses) the tiny test guest, then runs bench/e2e.py: every arm boots a
# TCG guest running fio on a 2 GiB writethrough raw image inside a memory
# cgroup, vmcache arms opted in through the domain metadata. About 40 minutes
# with the defaults; prints a table at the end, raw results in .bench/.
#
#   scripts/bench.sh [E2E ARGS]      e.g. --runtime 120, --arms zoned-qd1-kernel,zoned-qd1-vmcache
#   VMCACHE_BENCH_ARGS="--runtime 120" make bench
#
# Everything it makes (domains vmcache-bench-e2e-*, the cgroup
# /sys/fs/cgroup/memory/vmcache-bench-e2e, the image and the noisy
# neighbour's file under /var/lib/vmcache/bench-e2e) is removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench: run as root (it installs vmcache and runs libvirt domains)" >&2; exit 1; }
scripts/setup.sh
scripts/libvirtd.sh
scripts/install.sh
guest=$(scripts/build-guest.sh)
# shellcheck disable=SC2086 # VMCACHE_BENCH_ARGS is a list of arguments
exec .venv/bin/python bench/e2e.py --guest-dir "$guest" ${VMCACHE_BENCH_ARGS:-} "$@"
