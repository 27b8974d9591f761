#!/usr/bin/env bash
# Install everything vmcache needs on a Debian 12 host, idempotently:
# Debian packages (QEMU, libvirt, libnbd's Python module, fio, vmtouch, a
# kernel and busybox for the test guest, FUSE and pyfuse3 for the bench's
# delay device) and a venv in .venv that sees
# Debian's python3-libnbd (--system-site-packages).
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  qemu-system-x86 qemu-utils qemu-block-extra
  libvirt-daemon-system libvirt-clients libvirt-dev pkg-config
  python3 python3-venv python3-dev python3-libnbd libnbd-bin
  fio vmtouch busybox-static linux-image-cloud-amd64 cpio gzip
  fuse3 python3-pyfuse3
  gcc make util-linux procps kmod strace openssl
  prometheus
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q -o Dpkg::Options::=--force-confnew "${missing[@]}"
fi

# Debian's python3 (not a pyenv shim): python3-libnbd exists only for it.
PY=/usr/bin/python3
stamp=.venv/.vmcache-setup
want="$(sha256sum setup.cfg pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: creating .venv"
  [ -x .venv/bin/python ] || "$PY" -m venv --system-site-packages .venv
  .venv/bin/pip install -q --upgrade pip
  # libvirt-python is built against the host's libvirt (libvirt-dev).
  .venv/bin/pip install -q -e '.[test]'
  echo "$want" > "$stamp"
fi
.venv/bin/python -c 'import nbd, libvirt, qemu.qmp, numpy, scipy, pyfuse3, trio' \
  || { echo "setup: the venv cannot import its dependencies" >&2; exit 1; }
