#!/usr/bin/env bash
# Build the tiny test guest from Debian packages: the cloud kernel, and an
# initramfs with busybox-static, fio (with the libraries it links) and
# guest/init. Cached: rebuilt only when guest/init or a package changes.
# Usage: scripts/build-guest.sh [OUTDIR]   (default /var/lib/vmcache/guest)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-/var/lib/vmcache/guest}
kver=$(ls /lib/modules | grep -- '-cloud-amd64$' | sort -V | tail -1)
[ -n "$kver" ] || { echo "build-guest: linux-image-cloud-amd64 is not installed" >&2; exit 1; }
key=$( { cat "$here/guest/init"; echo "$kver"; dpkg-query -W fio busybox-static; } | sha256sum | cut -c1-16)
if [ -f "$out/key" ] && [ "$(cat "$out/key")" = "$key" ] && [ -f "$out/initramfs.cpio" ]; then
  echo "$out"; exit 0
fi
mkdir -p "$out"
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root"/{bin,sbin,dev,proc,sys,tmp,lib/modules,usr/bin}
cp /bin/busybox "$root/bin/busybox"
cp "$here/guest/init" "$root/init"
cp /usr/bin/fio "$root/usr/bin/fio"
# fio and every library it links, at the same paths.
for lib in $(ldd /usr/bin/fio | awk '/=>/ {print $3} /ld-linux/ {print $1}'); do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
for m in virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci virtio_blk button evdev; do
  f=$(modinfo -k "$kver" -n "$m")
  case "$f" in
    *.ko) cp "$f" "$root/lib/modules/$m.ko" ;;
    *.ko.xz) xz -dc "$f" > "$root/lib/modules/$m.ko" ;;
    *.ko.zst) zstd -dc "$f" > "$root/lib/modules/$m.ko" ;;
    *) ;; # built in
  esac
done
(cd "$root" && find . | cpio -o -H newc --quiet) > "$out/initramfs.cpio.tmp"
mv "$out/initramfs.cpio.tmp" "$out/initramfs.cpio"
cp "/boot/vmlinuz-$kver" "$out/vmlinuz"
echo "$key" > "$out/key"
echo "$out"
