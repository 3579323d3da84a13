#!/usr/bin/env bash
# Builds release binaries and runs benches/kv_face.py: remote get through moongate's kv
# face vs Mooncake's own client, in one run. Not part of CI (release build, timing noise).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/bootstrap.sh
cargo build --release --locked --bin moongate --example kv_bench
cargo build --release --locked -p moongate-kv
py=${MOONGATE_PYTHON:-$root/.venv/bin/python}
exec "$py" benches/kv_face.py --moongate target/release/moongate \
  --kv-bench target/release/examples/kv_bench "$@"
