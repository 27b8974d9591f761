#!/bin/bash
# The replay's restart of 22 VMs at once (docs/replay.md, "Many VMs restarting at once"): the real traces, three
# slices each, and 16 generated traces of 128 MiB-2 GiB; every VM from the set its first run saved, the warm-ups
# through one host budget (shared) and at a rate each (per-agent). Tables on stdout; traces into OUT.
# Run: bench/restart_replay.sh [OUT] [PREFETCH_RATE]   (default /tmp/vmcache-restart, 8M; 5-7 minutes, deterministic)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/vmcache-restart}
VMC=(.venv/bin/python -m vmcache)
mkdir -p "$OUT"
for t in mssql webserver; do [ -e "$OUT/$t.csv" ] || zcat "../shared/traces/$t.csv.gz" > "$OUT/$t.csv"; done
vms=(--vm "$OUT/mssql.csv,budget=32M,name=mssql-0" --vm "$OUT/mssql.csv,budget=64M,start=1000s,name=mssql-1000"
     --vm "$OUT/mssql.csv,budget=16M,start=2000s,name=mssql-2000" --vm "$OUT/webserver.csv,budget=128M,name=web-0"
     --vm "$OUT/webserver.csv,budget=64M,start=1200s,name=web-1200"
     --vm "$OUT/webserver.csv,budget=32M,start=2400s,name=web-2400")
# generated: kind, image, seed, budget (zoned 2G: 205 MiB of hot zones over its 64 MiB budget)
for g in zoned:128M:1:16M zoned:256M:1:32M zoned:256M:2:32M zoned:512M:1:64M zoned:1G:1:128M zoned:1G:2:128M \
         zoned:2G:1:64M zipf:256M:1:16M zipf:512M:1:32M zipf:1G:1:64M zipf:1G:2:64M zipf:2G:1:128M \
         moving:256M:1:16M moving:512M:1:32M moving:1G:1:64M moving:1G:2:64M; do
  IFS=: read -r kind size seed budget <<< "$g"
  file="$OUT/$kind-$size-$seed.csv"
  [ -e "$file" ] || "${VMC[@]}" replay --generate "$kind" --gen-size "$size" --seed "$seed" --out "$file" >/dev/null
  vms+=(--vm "$file,budget=$budget")
done
"${VMC[@]}" replay --block-size 1M --cache-unit 4K --prefetch-rate "${2:-8M}" --warm-rate 32M --policy warm \
  --cap 1280M "${vms[@]}"
