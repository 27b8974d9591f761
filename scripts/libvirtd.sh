#!/usr/bin/env bash
# Make sure libvirtd answers on qemu:///system. Where systemd runs, start its
# units; otherwise (these sandboxes) start virtlogd and libvirtd as daemons.
# In a sandbox without systemd QEMU must run as root with no security driver:
# that is a test-environment setting, applied only on that path.
set -euo pipefail
if virsh -c qemu:///system version >/dev/null 2>&1; then exit 0; fi
if [ -d /run/systemd/system ]; then
  systemctl start virtlogd.socket libvirtd.socket libvirtd.service
else
  conf=/etc/libvirt/qemu.conf
  if ! grep -q '^# vmcache-sandbox' "$conf" 2>/dev/null; then
    echo "libvirtd: sandbox without systemd: QEMU runs as root, security_driver none ($conf)"
    printf '# vmcache-sandbox: test environment settings\nuser = "root"\ngroup = "root"\nsecurity_driver = "none"\n' >> "$conf"
  fi
  mkdir -p /var/run/libvirt /var/log/libvirt /var/lib/libvirt/images
  # The daemons outlive this script: they must not inherit its descriptors
  # beyond stdio. A lock the caller holds (`flock LOCK make bench`) would
  # stay held by libvirtd for good.
  daemon() {
    ( for fd in /proc/self/fd/*; do
        n=${fd##*/}
        if [ "$n" -gt 2 ] 2>/dev/null; then eval "exec $n>&-" 2>/dev/null || true; fi
      done
      exec "$@" )
  }
  # --ns: a libvirtd in a container (systemd-nspawn) is not this host's
  pgrep --ns $$ -x virtlogd >/dev/null || daemon virtlogd -d
  pgrep --ns $$ -x libvirtd >/dev/null || daemon libvirtd -d
fi
for _ in $(seq 1 100); do
  virsh -c qemu:///system version >/dev/null 2>&1 && exit 0
  sleep 0.1
done
echo "libvirtd: did not come up" >&2
exit 1
