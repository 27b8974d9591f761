#!/usr/bin/env bash
# Install vmcache on this host (make install), or remove it (make uninstall).
#
#   scripts/install.sh [--prefix DIR] [--no-reload]
#   scripts/install.sh --uninstall [--prefix DIR] [--no-reload]
#   scripts/install.sh --hook-only --python PY --config PATH [--hooks-dir DIR] [--no-reload] [--uninstall]
#   scripts/install.sh --stop-agents
#
# Full install: a venv in PREFIX/venv (default /opt/vmcache) made from
# /usr/bin/python3 --system-site-packages with `pip install .`; the
# /usr/local/bin/vmcache symlink; /etc/vmcache/vmcache.yaml if absent; the
# systemd units vmcache-agent@.service and vmcache.service (enabled: `systemctl
# reload vmcache` runs `vmcache reconcile`) where systemd runs; the libvirt
# hook; then a reconcile (agents for running domains that should have one).
#
# The hook goes to HOOKS_DIR/qemu (default /etc/libvirt/hooks) unless another
# program's hook is there: that one is never overwritten, vmcache then goes
# to HOOKS_DIR/qemu.d/vmcache (libvirt >= 6.5 runs both). libvirtd looks for
# hook scripts only when it starts or reloads, so after adding one this
# script reloads libvirtd (SIGHUP; running domains are not touched) unless
# --no-reload, in which case it says what to run.
#
# --hook-only installs just the hook, running PY with config PATH (tests, the
# Debian package). --stop-agents stops every running agent (systemd units and
# detached agents) and nothing else (the Debian package's prerm).
set -euo pipefail
cd "$(dirname "$0")/.."

PREFIX=/opt/vmcache
HOOKS_DIR=/etc/libvirt/hooks
CONFIG=/etc/vmcache/vmcache.yaml
PYTHON=
HOOK_ONLY=0
STOP_AGENTS=0
UNINSTALL=0
RELOAD=1
MARKER=vmcache-hook
UNIT=vmcache-agent@.service
RECONCILE_UNIT=vmcache.service
UNIT_DIR=/etc/systemd/system
LOGROTATE=/etc/logrotate.d/vmcache

while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) PREFIX=$2; shift 2 ;;
    --hooks-dir) HOOKS_DIR=$2; shift 2 ;;
    --python) PYTHON=$2; shift 2 ;;
    --config) CONFIG=$2; shift 2 ;;
    --hook-only) HOOK_ONLY=1; shift ;;
    --stop-agents) STOP_AGENTS=1; shift ;;
    --uninstall) UNINSTALL=1; shift ;;
    --no-reload) RELOAD=0; shift ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "install: unknown option $1" >&2; exit 2 ;;
  esac
done
[ -n "$PYTHON" ] || PYTHON="$PREFIX/venv/bin/python"

say() { echo "install: $*"; }
have_systemd() { [ -d /run/systemd/system ]; }

is_ours() { [ -f "$1" ] && grep -q "$MARKER" "$1"; }

libvirt_at_least_6_5() {
  local v
  v=$(libvirtd --version 2>/dev/null | awk '{print $NF}') || return 1
  [ -n "$v" ] || return 1
  printf '6.5.0\n%s\n' "$v" | sort -V -C
}

# Where the hook goes: an existing vmcache hook is updated in place; else
# HOOKS_DIR/qemu when free, else qemu.d/vmcache.
hook_target() {
  if is_ours "$HOOKS_DIR/qemu.d/vmcache"; then echo "$HOOKS_DIR/qemu.d/vmcache"
  elif [ ! -e "$HOOKS_DIR/qemu" ] || is_ours "$HOOKS_DIR/qemu"; then echo "$HOOKS_DIR/qemu"
  else echo "$HOOKS_DIR/qemu.d/vmcache"
  fi
}

reload_libvirtd() {
  local why=$1
  if [ "$RELOAD" = 0 ]; then
    say "$why: reload libvirtd so it sees it (running domains are not affected):"
    if have_systemd; then say "  systemctl reload libvirtd"; else say "  kill -HUP \$(cat /run/libvirtd.pid)"; fi
    return 0
  fi
  if have_systemd; then
    systemctl try-reload-or-restart libvirtd.service virtqemud.service 2>/dev/null || true
    say "$why: reloaded libvirtd"
  elif [ -s /run/libvirtd.pid ] && kill -0 "$(cat /run/libvirtd.pid)" 2>/dev/null; then
    kill -HUP "$(cat /run/libvirtd.pid)"
    say "$why: reloaded libvirtd (SIGHUP)"
  else
    say "$why: libvirtd is not running; it will see the hook when it starts"
  fi
}

install_hook() {
  local target new tmp
  target=$(hook_target)
  if [ "$target" = "$HOOKS_DIR/qemu.d/vmcache" ] && [ ! -e "$target" ]; then
    if ! libvirt_at_least_6_5; then
      say "$HOOKS_DIR/qemu belongs to another program and libvirt is older than 6.5 (no qemu.d):" >&2
      say "  not installed; call '$PYTHON -m vmcache.hook --config $CONFIG \"\$@\"' from that hook" >&2
      return 1
    fi
    say "$HOOKS_DIR/qemu belongs to another program: left alone, vmcache's hook goes to $target"
  fi
  new=0
  [ -e "$target" ] || new=1
  mkdir -p "$(dirname "$target")"
  tmp=$(mktemp "$(dirname "$target")/.vmcache-hook.XXXXXX")
  sed -e "s|^VMCACHE_PYTHON=.*|VMCACHE_PYTHON=$PYTHON|" -e "s|^VMCACHE_CONFIG=.*|VMCACHE_CONFIG=$CONFIG|" \
    hooks/qemu > "$tmp"
  chmod 755 "$tmp"
  mv -f "$tmp" "$target"
  say "hook: $target (python $PYTHON, config $CONFIG)"
  if [ "$new" = 1 ]; then reload_libvirtd "new hook $target"; fi
}

uninstall_hook() {
  local f removed=0
  for f in "$HOOKS_DIR/qemu.d/vmcache" "$HOOKS_DIR/qemu"; do
    if is_ours "$f"; then rm -f "$f"; say "removed hook $f"; removed=1; fi
  done
  rmdir "$HOOKS_DIR/qemu.d" 2>/dev/null || true
  if [ -e "$HOOKS_DIR/qemu" ] && ! is_ours "$HOOKS_DIR/qemu"; then say "left $HOOKS_DIR/qemu alone (not vmcache's)"; fi
  if [ "$removed" = 1 ]; then reload_libvirtd "hook removed"; fi
}

stop_agents() {
  local f pid
  if have_systemd; then
    systemctl stop 'vmcache-agent@*.service' 2>/dev/null || true
  fi
  for f in /run/vmcache/agents/*.pid; do
    [ -e "$f" ] || continue
    # a held lock means a live agent (it inherited the locked pidfile)
    if ! flock -n "$f" true; then
      pid=$(cat "$f")
      if [ -n "$pid" ] && tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q -- '--domain '; then
        kill -TERM "$pid" && say "stopped agent pid $pid ($f)"
      fi
    fi
  done
}

if [ "$STOP_AGENTS" = 1 ]; then
  stop_agents
  exit 0
fi

if [ "$HOOK_ONLY" = 1 ]; then
  if [ "$UNINSTALL" = 1 ]; then uninstall_hook; else install_hook; fi
  exit 0
fi

[ "$(id -u)" = 0 ] || { echo "install: run as root" >&2; exit 1; }

if [ "$UNINSTALL" = 1 ]; then
  uninstall_hook
  stop_agents
  if [ -f "$UNIT_DIR/$RECONCILE_UNIT" ]; then
    have_systemd && systemctl disable -q "$RECONCILE_UNIT" 2>/dev/null || true
    rm -f "$UNIT_DIR/$RECONCILE_UNIT"
    say "removed $UNIT_DIR/$RECONCILE_UNIT"
  fi
  if [ -f "$UNIT_DIR/$UNIT" ]; then
    rm -f "$UNIT_DIR/$UNIT"
    have_systemd && systemctl daemon-reload
    say "removed $UNIT_DIR/$UNIT"
  fi
  if [ -f "$LOGROTATE" ] && grep -q 'vmcache' "$LOGROTATE"; then
    rm -f "$LOGROTATE"
    say "removed $LOGROTATE"
  fi
  if [ "$(readlink /usr/local/bin/vmcache 2>/dev/null)" = "$PREFIX/venv/bin/vmcache" ]; then
    rm -f /usr/local/bin/vmcache
    say "removed /usr/local/bin/vmcache"
  fi
  rm -rf "$PREFIX"
  say "removed $PREFIX; kept $CONFIG (your settings)"
  exit 0
fi

# venv with vmcache installed (not editable: the hook must not depend on this checkout)
if [ ! -x "$PREFIX/venv/bin/python" ]; then
  say "creating $PREFIX/venv"
  /usr/bin/python3 -m venv --system-site-packages "$PREFIX/venv"
fi
"$PREFIX/venv/bin/pip" install -q --upgrade pip
"$PREFIX/venv/bin/pip" install -q --upgrade .
mkdir -p "$PREFIX/docs"
cp docs/*.md "$PREFIX/docs/"
ln -sfn "$PREFIX/venv/bin/vmcache" /usr/local/bin/vmcache
say "vmcache: /usr/local/bin/vmcache -> $PREFIX/venv/bin/vmcache"

if [ -e "$CONFIG" ]; then
  say "kept $CONFIG (the shipped defaults are in hooks/vmcache.yaml)"
else
  install -D -m 644 hooks/vmcache.yaml "$CONFIG"
  say "config: $CONFIG (defaults)"
fi
"$PREFIX/venv/bin/python" -c 'import sys; from vmcache.host.configfile import load_host_config; load_host_config(sys.argv[1])' "$CONFIG" \
  || say "WARNING: $CONFIG is not valid (see above): agents will refuse to start until it is fixed"

if [ -d "$(dirname "$LOGROTATE")" ]; then
  install -m 644 hooks/vmcache.logrotate "$LOGROTATE"
  say "log rotation: $LOGROTATE (files of agents without systemd, and of the hook without syslog)"
fi

if have_systemd; then
  install -D -m 644 "hooks/$UNIT" "$UNIT_DIR/$UNIT"
  install -D -m 644 "hooks/$RECONCILE_UNIT" "$UNIT_DIR/$RECONCILE_UNIT"
  systemctl daemon-reload
  systemctl enable -q "$RECONCILE_UNIT"
  say "units: $UNIT_DIR/$UNIT, $UNIT_DIR/$RECONCILE_UNIT (enabled)"
else
  say "no systemd here: agents run as detached processes (pidfiles in /run/vmcache/agents)"
fi

install_hook
# Agents for the running domains that should have one (metadata, host rules).
if have_systemd; then
  systemctl reload-or-restart "$RECONCILE_UNIT" || say "WARNING: systemctl reload-or-restart $RECONCILE_UNIT failed"
else
  /usr/local/bin/vmcache reconcile --host-config "$CONFIG" || say "WARNING: vmcache reconcile failed (see above)"
fi
