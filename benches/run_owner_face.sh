#!/usr/bin/env bash
# Builds the release binary and runs benches/owner_face.py: a rank's batch load of
# SSD-resident values in vLLM's owner-client topology, read directly from the owner by
# Mooncake's client and through moongate's owner face (whole, and cut into parts), in
# one run. Not part of CI (release build, timing noise).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/bootstrap.sh
cargo build --release --locked --bin moongate
py=${MOONGATE_PYTHON:-$root/.venv/bin/python}
exec "$py" benches/owner_face.py --moongate target/release/moongate "$@"
