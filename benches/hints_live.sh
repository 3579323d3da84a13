#!/usr/bin/env bash
# Do hints keep their gain live? Replays the shipped trace live (benches/run_replay.sh: a
# real master, moongate with two experiment arms, lru and hint-lru, each held to its
# half of the capacity by by-weight shares) while benches/replay sends the hints of
# SPEC to moongate's POST /hints as the trace runs; then simulates the same trace, block
# size, capacity per arm, speed, plugins and hints with `moongate sim --rules live`, and
# prints both side by side, with the gain over lru in points and as a share of the
# simulator's LRU-to-Belady gap. Not part of CI (minutes).
# Args (env): TRACE (the shipped trace; benches/hints_heldout.py's stretched parts are
# traces too) HINTS (queue:64,last:0.5) SPEED (20) VALUE_SIZE (16384) SEGMENT_MIB (64, per
# arm: about 9 % of the trace's distinct blocks at 16 KiB) LIMIT (0: the whole trace)
# LEASE_MS (the master's read lease, live and simulated; default 10,000 / SPEED: the
# 0.3.13 master's 10 s in trace time, as a deployment serving the trace in real time
# has it; LEASE_MS=10000 keeps the master's default in wall time, which at speed 20
# spares every block read in the last 200 s of trace and leaves policies little to
# choose from).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
hints=${HINTS:-queue:64,last:0.5}; speed=${SPEED:-20}; size=${VALUE_SIZE:-16384}
mib=${SEGMENT_MIB:-64}; limit=${LIMIT:-0}
out=$(mktemp -d)
trace=${TRACE:-benches/traces/mooncake_fast25_synthetic.jsonl}
# The replay names every upcoming read's in_ms, so hints.ttl_ms (when a hint naming no
# time is due) is unused; it is set to the simulator's 60,000 trace-ms in wall time all
# the same. Past due, hints hold one turnover of the cache, live and simulated; done
# hints have no cap.
ttl=$(awk -v s="$speed" 'BEGIN { printf "%d", 60000 / s }')
lease=${LEASE_MS:-$(awk -v s="$speed" 'BEGIN { printf "%d", 10000 / s }')}
B=hint:hint-lru HINTS_TTL_MS=$ttl LEASE_MS=$lease CAPACITY=by-weight PROFILE=release bash benches/run_replay.sh \
  --speed "$speed" --value-size "$size" --segment-mib "$mib" --limit "$limit" \
  --hints "$hints" --json "$out/live.json" --trace "$trace" >"$out/live.log" 2>&1 \
  || { tail -n 40 "$out/live.log"; exit 1; }
if [ "$limit" != 0 ]; then head -n "$limit" "$trace" >"$out/trace.jsonl"; trace=$out/trace.jsonl; fi
sim() {
  target/release/moongate sim --trace "$trace" --capacity "${mib}MiB" --block-size "$size" --policy lru --policy hint-lru "$@" \
    --hints "$hints" >/dev/null
}
sim --speed "$speed" --rules live --lease-ms "$lease" --json "$out/sim-live.json"
sim --json "$out/sim-ideal.json"
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
      f"{live['segment_mib']} MiB per arm (by-weight shares), {live['wall_s']:.0f} s, "
      f"hints {live['hints']['spec']}")
print(f"{'arm':>6} {'plugin':>14} {'live':>8} {'sim live rules':>15} {'sim ideal':>10}")
h = {}
for arm, plugin in (("lru", "lru.wasm"), ("hint", "hint-lru.wasm")):
    a = live["arms"][arm]
    h[arm] = a["read_ok"] / a["blocks"]
    print(f"{arm:>6} {plugin:>14} {h[arm]:8.4f} {rows[('sim-live', plugin)]:15.4f} "
          f"{rows[('sim-ideal', plugin)]:10.4f}")
lru, opt = rows[("sim-live", "lru")], rows[("sim-live", "opt")]
gap = max(opt - lru, 1e-9)
sim_gain = rows[("sim-live", "hint-lru.wasm")] - rows[("sim-live", "lru.wasm")]
live_gain = h["hint"] - h["lru"]
print(f"gain over lru: live {100 * live_gain:+.2f} points ({100 * live_gain / gap:+.1f} % of the "
      f"gap), sim live rules {100 * sim_gain:+.2f} points ({100 * sim_gain / gap:+.1f} %); "
      f"references (sim live rules): lru {lru:.4f}, opt {opt:.4f}")
print(f"hints sent: {live['hints']}")
print(f"reports: {d}")
PY
