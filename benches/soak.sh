#!/usr/bin/env bash
# moongate over time, with faults (benches/soak.py says what runs and what is measured).
# Not CI: 30 minutes by default.
#   bash benches/soak.sh [--minutes N] [--fault-every SECONDS] [--out DIR]
# Ends with one JSON line: requests, wrong_reads, lost_puts, evicted, rss_growth_pct,
# fd_growth_pct, faults [{kind, at_s, recovered_s}], errors by kind; exits non-zero when
# a read was wrong or an acknowledged put was lost other than by eviction.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/bootstrap.sh
# moongate (its build also builds the plugins the soak swaps) and libmoongate_kv.
cargo build --release --locked -p moongate -p moongate-kv
exec "${MOONGATE_PYTHON:-$root/.venv/bin/python}" benches/soak.py \
  --moongate target/release/moongate "$@"
