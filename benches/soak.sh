#!/usr/bin/env bash
# moongate over time, with faults (benches/soak.py says what runs and what is measured).
# Not CI: 30 minutes by default.
#   bash benches/soak.sh [--minutes N] [--fault-every SECONDS] [--out DIR] [--arms moongate,control]
# Runs two arms side by side (moongate, and a control with Mooncake's clients on the
# masters directly) and ends with one JSON line of both results (requests, wrong_reads,
# lost keys by fault and client, memory growth from when the bounded tables filled,
# faults [{kind, at_s, recovered_s}], errors by kind) and a table of both arms' losses
# (--out DIR/arms.md); exits non-zero when moongate read wrong bytes, lost a kv-face put,
# or lost more master-face puts than the control arm.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/bootstrap.sh
# moongate (its build also builds the plugins the soak swaps) and libmoongate_kv.
cargo build --release --locked -p moongate -p moongate-kv
exec "${MOONGATE_PYTHON:-$root/.venv/bin/python}" benches/soak.py \
  --moongate target/release/moongate "$@"
