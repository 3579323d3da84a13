#!/usr/bin/env bash
# Speed of `moongate sim` (release build): the shipped trace at 2-50 % of its distinct
# blocks for the wasm plugins, with block lookups per second per run (target: 1 M/s for
# the wasm LRU plugin). Not part of CI. Extra args go to `moongate sim`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cargo build --release --locked --bin moongate
out=$(mktemp)
target/release/moongate sim --trace benches/traces/mooncake_fast25_synthetic.jsonl \
  --capacity 2%,5%,10%,20%,50% --policy lru --policy prefix-evict --json "$out" "$@"
py=${MOONGATE_PYTHON:-$root/.venv/bin/python}
"$py" - "$out" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"\n{'policy':>20} {'capacity':>9} {'seconds':>8} {'M lookups/s':>12}")
for x in r["results"]:
    if x["policy"].endswith(".wasm"):
        print(f"{x['policy']:>20} {100 * x['capacity_fraction']:8.1f}% {x['seconds']:8.3f} "
              f"{x['lookups'] / x['seconds'] / 1e6:12.2f}")
PY
