#!/usr/bin/env bash
# KV events, measured: (1) the publisher's throughput in one process (events_rate: one
# event per key at 100k and 400k events/s, dropped and received counted); (2) what
# events and miss classification add to the master face: the real client through
# moongate with [events] + the key table on, side by side with the same binary without
# them, the bare relay and the direct master, alternating pairs. Not part of CI
# (release build; timings on shared machines are noise). Extra args go to (2).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/bootstrap.sh
cargo build --release --locked --bin moongate --example bare_relay --example events_rate
for rate in 100000 400000; do
  echo "== events_rate $rate events/s"
  target/release/examples/events_rate "$rate" 5
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/events.toml" <<'TOML'
# The key table (miss classification) without the evictor, and KV events.
[events]
enabled = true
endpoint = "tcp://127.0.0.1:0"
replay_endpoint = "tcp://127.0.0.1:0"
TOML
: > "$work/plain.toml"
echo "== master face: 'moongate' = events + key table on, 'baseline' = the same build without"
py=${MOONGATE_PYTHON:-$root/.venv/bin/python}
"$py" benches/e2e_master_face.py --moongate target/release/moongate \
  --moongate-config "$work/events.toml" --baseline target/release/moongate \
  --baseline-config "$work/plain.toml" --relay target/release/examples/bare_relay "$@"
