#!/usr/bin/env bash
# Builds release binaries and runs benches/kv_small.py: views and reservations at the
# value sizes engines store (64 KiB - 4 MiB) through the Python package, against a plain
# copy in the same process. Not part of CI (release build, timing).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/bootstrap.sh --demo
cargo build --release --locked --bin moongate
cargo build --release --locked -p moongate-kv --lib
exec .venv/bin/python benches/kv_small.py "$@"
