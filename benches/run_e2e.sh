#!/usr/bin/env bash
# Builds moongate in release mode and runs the end-to-end master-face benchmark
# (direct vs through moongate, alternating pairs). Not part of CI: release builds take
# minutes and timings on shared CI machines are noise. Extra args go to the script,
# e.g. `benches/run_e2e.sh --pairs 5 --json /tmp/e2e.json`.
# `--baseline PATH` runs a second moongate build (e.g. an earlier commit's) side by side.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/bootstrap.sh
cargo build --release --locked --bin moongate --example bare_relay
py=${MOONGATE_PYTHON:-$root/.venv/bin/python}
exec "$py" benches/e2e_master_face.py --moongate target/release/moongate --relay target/release/examples/bare_relay "$@"
