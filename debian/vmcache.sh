#!/bin/sh
# /usr/bin/vmcache of the Debian package: vmcache in its private venv.
exec /usr/lib/vmcache/venv/bin/python -I -m vmcache "$@"
