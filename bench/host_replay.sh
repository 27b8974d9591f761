#!/bin/bash
# The replay's host mode on the cases of docs/benchmarks.md ("Host mode"): traces generated with fixed
# seeds, every case at three caps, memory 2 x cap. Tables on stdout, plots into OUT (default /tmp/vmcache-host-replay).
# Run: bench/host_replay.sh [OUT]   (about 2 minutes; deterministic)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/vmcache-host-replay}
VMC=(.venv/bin/python -m vmcache)
mkdir -p "$OUT"
gen() { "${VMC[@]}" replay --generate "$1" --out "$OUT/$2.csv" --gen-size 1G "${@:3}" >/dev/null; }
gen stream stream --io-size 64K --count 100000 --rate 100 --seed 11
gen zipf zipf --count 100000 --rate 100 --seed 12
gen zoned zoned --count 100000 --rate 100 --seed 13
gen zoned idle --count 500 --rate 0.5 --seed 14
gen moving moving --count 100000 --rate 100 --seed 15
vm() { echo "--vm $OUT/$1.csv,budget=$2,size=1G"; }
run() {
  local name=$1 caps=$2; shift 2
  echo "== $name"
  # shellcheck disable=SC2046
  "${VMC[@]}" replay $(for spec in "$@"; do vm ${spec%%:*} ${spec##*:}; done) --cap "$caps" --plot "$OUT/$name.png"
}
run four-vms 64M,128M,256M stream:512M zipf:512M zoned:512M idle:512M
run stream-zoned 32M,64M,128M stream:256M zoned:256M
run no-stream 64M,128M,256M zipf:256M zoned:128M moving:256M
run stream-last 64M,128M,256M zipf:512M zoned:512M idle:512M stream:512M
