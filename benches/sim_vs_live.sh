#!/usr/bin/env bash
# Live agrees with offline? Replays the shipped trace live (benches/run_replay.sh: a real
# master, moongate with two experiment arms, lru and prefix-evict, each held to its
# half of the capacity), then simulates the same trace, block size, capacity per arm,
# speed and plugins with `moongate sim --rules live`, and prints both side by side.
# Not part of CI (minutes). Args: SPEED (20) VALUE_SIZE (16384) SEGMENT_MIB (64, per arm)
# LEASE_MS (the master's read lease, live and simulated: 10,000, 0.3.13's default).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
speed=${SPEED:-20}; size=${VALUE_SIZE:-16384}; mib=${SEGMENT_MIB:-64}
lease=${LEASE_MS:-10000}
out=$(mktemp -d)
LEASE_MS=$lease CAPACITY=by-weight PROFILE=release bash benches/run_replay.sh --speed "$speed" \
  --value-size "$size" --segment-mib "$mib" --json "$out/live.json" >"$out/live.log" 2>&1 \
  || { tail -n 40 "$out/live.log"; exit 1; }
target/release/moongate sim --trace benches/traces/mooncake_fast25_synthetic.jsonl \
  --capacity "${mib}MiB" --block-size "$size" --policy lru --policy prefix-evict \
  --speed "$speed" --rules live --lease-ms "$lease" --json "$out/sim-live.json" >/dev/null
target/release/moongate sim --trace benches/traces/mooncake_fast25_synthetic.jsonl \
  --capacity "${mib}MiB" --block-size "$size" --policy lru --policy prefix-evict \
  --json "$out/sim-ideal.json" >/dev/null
py=${MOONGATE_PYTHON:-$root/.venv/bin/python}
"$py" - "$out" <<'PY'
import json, sys
d = sys.argv[1]
live = json.load(open(f"{d}/live.json"))
rows = {}
for name in ("sim-live", "sim-ideal"):
    for r in json.load(open(f"{d}/{name}.json"))["results"]:
        rows[(name, r["policy"])] = r["hit_rate"]
print(f"trace replayed live at speed x{live['speed']}, {live['value_size']} B blocks, "
      f"{live['segment_mib']} MiB per arm (by-weight shares), {live['wall_s']:.0f} s")
print(f"{'arm':>8} {'plugin':>18} {'live':>8} {'sim live rules':>15} {'live - sim':>11} {'sim ideal':>10}")
for arm, plugin in (("lru", "lru.wasm"), ("prefix", "prefix-evict.wasm")):
    a = live["arms"][arm]
    h = a["hits"] / a["blocks"]
    s = rows[("sim-live", plugin)]
    print(f"{arm:>8} {plugin:>18} {h:8.4f} {s:15.4f} {100 * (h - s):+10.1f}p {rows[('sim-ideal', plugin)]:10.4f}")
print(f"references at the same capacity: lru {rows[('sim-ideal', 'lru')]:.4f}, opt {rows[('sim-ideal', 'opt')]:.4f}")
PY
