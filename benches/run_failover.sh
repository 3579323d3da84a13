#!/usr/bin/env bash
# Builds moongate in release mode and runs the master failover benchmark (direct vs
# through moongate, alternating SIGKILLs of the HA leader). Not part of CI. Extra args go
# to the script, e.g. `benches/run_failover.sh --kills 5 --json /tmp/failover.json`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/bootstrap.sh
cargo build --release --locked --bin moongate
py=${MOONGATE_PYTHON:-$root/.venv/bin/python}
exec "$py" benches/failover.py --moongate target/release/moongate "$@"
