#!/usr/bin/env bash
# make deb: build vmcache_<version>_all.deb with Debian's tooling (dpkg-buildpackage, debhelper).
#
#   scripts/deb.sh [OUTDIR]      default OUTDIR: build/deb
#
# Builds from a copy of the checkout's files (tracked files as they are in the
# work tree, none of .venv or build/), installing the build dependencies of
# debian/control first when some are missing (apt-get build-dep, as root).
# The package's version is debian/changelog's, which must equal
# vmcache.__version__.
# The build fetches qemu.qmp and prometheus-client from PyPI (debian/rules).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:-build/deb}")

version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' vmcache/__init__.py)
deb_version=$(dpkg-parsechangelog -l debian/changelog -S Version 2>/dev/null || head -1 debian/changelog | sed 's/.*(\(.*\)).*/\1/')
if [ "$deb_version" != "$version" ] && [ "${deb_version%-*}" != "$version" ]; then
  echo "deb: debian/changelog is at $deb_version but vmcache.__version__ is $version: add a changelog entry (dch -v $version)" >&2
  exit 1
fi

if ! command -v dpkg-checkbuilddeps >/dev/null || ! dpkg-checkbuilddeps debian/control 2>/dev/null; then
  [ "$(id -u)" = 0 ] || { echo "deb: build dependencies missing (apt-get build-dep ./): install them or run as root" >&2; exit 1; }
  echo "deb: installing the build dependencies of debian/control (apt-get build-dep ./)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q dpkg-dev >/dev/null
  apt-get build-dep -y -q ./ >/dev/null
  dpkg-checkbuilddeps debian/control
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT INT TERM
mkdir "$work/vmcache-$version"
git ls-files -z | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
  | tar --null -T - -cf - | tar -xf - -C "$work/vmcache-$version"
( cd "$work/vmcache-$version" && dpkg-buildpackage -us -uc -b >"$work/build.log" 2>&1 ) \
  || { tail -30 "$work/build.log" >&2; echo "deb: dpkg-buildpackage failed" >&2; exit 1; }
mkdir -p "$OUT"
deb=$(cd "$work" && ls vmcache_*.deb)
mv "$work/$deb" "$OUT/"
echo "deb: $OUT/$deb"
