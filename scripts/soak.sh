#!/usr/bin/env bash
# make soak: about 10 minutes of three domains with agents, random guest writes,
# periodic libvirtd restarts and agent kills; prints a JSON report (bench/soak.py).
# Not part of `make test`. Extra arguments go to bench/soak.py (e.g. --duration 120).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/libvirtd.sh
exec .venv/bin/python -m bench.soak "$@"
