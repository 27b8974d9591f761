#!/usr/bin/env bash
# A clean Debian 12 host with systemd as PID 1, inside this machine (make test-host).
#
#   tests/host/cleanhost.sh root            build (or reuse) the cached root, print its path
#   tests/host/cleanhost.sh run [--no-deb] [--full]
#                                           boot a throwaway copy of it and run tests/host/inside.sh
#   tests/host/cleanhost.sh shell           boot one and open a shell in it (debugging)
#
# The root and the containers: tests/host/nspawn.sh (debootstrap'd bookworm
# plus the test packages, cached in $VMCACHE_HOST_CACHE, default
# /var/cache/vmcache-host, under a key made of the package lists).
#
# A run: an overlayfs over the cached root (the cache is never written), a
# clean `git clone` of this checkout's HEAD copied to /root/vmcache, then
# `systemd-nspawn -b` boots it (systemd PID 1, its own libvirtd started by
# its units; nspawn shares this machine's network, for Debian's mirror and
# PyPI) and tests/host/inside.sh runs in it as a transient systemd service.
# With the Debian package (not with --no-deb) it is rebooted half-way:
# inside.sh --until-reboot leaves two autostarted opted-in domains with
# saved hot sets, `systemctl reboot` takes the container down, the images'
# pages are evicted from this machine's page cache (checked: none left,
# tests/host/evict.py), the same root boots again and inside.sh
# --after-reboot checks that each domain came back warm from the host's
# copy of its set, then goes on.
# Everything (container, overlay, mounts) is torn down on exit, also on
# failure or Ctrl-C. One run at a time per machine (flock).
set -euo pipefail
# shellcheck source=tests/host/nspawn.sh
. "$(dirname "$0")/nspawn.sh"
RUN_TIMEOUT=${VMCACHE_HOST_TIMEOUT:-3600}
NAME=vmcache-host

RUN_DIR=
CHECK_PID=

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ -n "$CHECK_PID" ]; then kill -TERM "$CHECK_PID" 2>/dev/null || true; fi
  if [ -n "$RUN_DIR" ]; then cat "$RUN_DIR"/console*.log > "$CACHE/last-run-console.log" 2>/dev/null || true; fi
  container_cleanup
  if [ -n "$RUN_DIR" ]; then rm -rf "$RUN_DIR"; fi
  exit "$rc"
}

# Boot a throwaway container over the cached root.
boot() {
  RUN_DIR=$(mktemp -d "$CACHE/run.XXXXXX")
  overlay "$RUN_DIR"
  clone_repo "$RUN_DIR/merged"
  trust_host_cas "$RUN_DIR/merged"
  say "booting $NAME: $(git -C "$REPO" log -1 --format='%h %s' | cut -c1-72)"
  container_boot "$NAME" "$RUN_DIR/merged" "$RUN_DIR/console.log"
}

# Reboot it: down with `systemctl reboot`, its images' pages out of this machine's page cache (a
# container shares it: without this its reboot would find them cached), the same root up again.
reboot_cold() {
  local images=$RUN_DIR/upper/var/lib/libvirt/images/vmcache-host/reboot
  container_reboot "$NAME"
  [ -d "$images" ] || die "no $images to evict"
  # shellcheck disable=SC2046
  PYTHONPATH=$REPO python3 "$REPO/tests/host/evict.py" $(find "$images" -type f) >&2 || die "images still cached"
  container_boot "$NAME" "$RUN_DIR/merged" "$RUN_DIR/console-rebooted.log"
}

# check ARGS...: tests/host/inside.sh ARGS in the container, as a transient unit (so in the
# background and waited for: a signal interrupts `wait` at once and the trap tears the container
# down, where a foreground child would delay it); its exit status.
check() {
  local rc=0
  in_unit "$NAME" --working-directory=/root/vmcache -p RuntimeMaxSec="$RUN_TIMEOUT" \
    --unit=vmcache-clean-host-check bash tests/host/inside.sh "$@" &
  CHECK_PID=$!
  wait "$CHECK_PID" || rc=$?
  CHECK_PID=
  return "$rc"
}

case "${1:-}" in
  root|shell|run) ;;
  *) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
esac
host_tools
host_lock
trap cleanup EXIT
trap 'say "interrupted"; exit 130' INT TERM HUP
build_root
case "$1" in
  root) echo "$ROOT" ;;
  shell)
    boot
    in_container "$NAME" bash -l || true
    ;;
  run)
    shift
    started=$SECONDS
    args=()
    while [ $# -gt 0 ]; do
      case "$1" in
        --full) args+=(--full); shift ;;
        --no-deb) args+=(--no-deb); shift ;;
        *) die "run: unknown option $1" ;;
      esac
    done
    boot
    rc=0
    if [[ " ${args[*]} " == *" --no-deb "* ]]; then
      check "${args[@]}" || rc=$?
    else
      check --until-reboot "${args[@]}" || rc=$?
      if [ "$rc" = 0 ]; then
        rebooted=$SECONDS
        reboot_cold
        say "rebooted in $((SECONDS - rebooted)) s"
        check --after-reboot "${args[@]}" || rc=$?
      fi
    fi
    in_container "$NAME" journalctl --no-pager > "$CACHE/last-run-journal.log" 2>&1 || true
    if [ "$rc" = 0 ]; then
      say "PASSED in $((SECONDS - started)) s (boot, checks, teardown follows)"
    else
      say "FAILED (exit $rc) after $((SECONDS - started)) s; the container's journal: $CACHE/last-run-journal.log"
    fi
    exit "$rc"
    ;;
esac
