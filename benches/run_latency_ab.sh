#!/usr/bin/env bash
# Builds moongate, the bare relay and the paired-latency tool in release mode and runs
# benches/latency_ab.py: the master face's added latency over a bare relay, call by call.
# Not part of CI (release builds take minutes; CI counts instructions instead). Extra args
# go to the script, e.g. `--baseline /tmp/moongate-old --calls 4000 --repeat 3`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/bootstrap.sh
# PROFILE=dist measures the build deploy/Containerfile ships (fat LTO: ~15 min to build
# here); the relay and the tool stay release.
profile=${PROFILE:-release}
cargo build --release --locked --example bare_relay --example latency_ab
cargo build --profile "$profile" --locked --bin moongate
py=${MOONGATE_PYTHON:-$root/.venv/bin/python}
exec "$py" benches/latency_ab.py --moongate "target/$profile/moongate" \
    --relay target/release/examples/bare_relay --tool target/release/examples/latency_ab "$@"
