#!/usr/bin/env bash
# Builds release binaries and runs benches/decisions.py: the cost of each master-face
# decision point (default, on-put rewrite, on-lookup steering, batch split) against a
# bare relay, side by side in one run. Not part of CI (release build, timing noise).
# Extra args go to the script, e.g. `--rounds 5 --json /tmp/decisions.json`.
# `--baseline PATH` also runs every moongate side on a second build, in the same run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/bootstrap.sh
cargo build --release --locked --bin moongate --example bare_relay
py=${MOONGATE_PYTHON:-$root/.venv/bin/python}
exec "$py" benches/decisions.py --moongate target/release/moongate \
  --relay target/release/examples/bare_relay --plugins target/plugins "$@"
