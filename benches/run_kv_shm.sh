#!/usr/bin/env bash
# Builds release binaries and runs benches/kv_shm.py: moongate's shared-memory path
# (libmoongate_kv) against Mooncake's dummy and embedded clients, in one run. Not part
# of CI (release build, timing noise).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/bootstrap.sh
# Two builds: with --bin, cargo builds only that binary, and the library would be stale.
cargo build --release --locked --bin moongate
cargo build --release --locked -p moongate-kv --lib
py=${MOONGATE_PYTHON:-$root/.venv/bin/python}
exec "$py" benches/kv_shm.py --moongate target/release/moongate \
  --lib target/release/libmoongate_kv.so "$@"
