#!/usr/bin/env bash
# Trace replay A/B: a real mooncake_master, moongate in front of it with an experiment
# of two eviction policies (lru vs prefix-evict, assigned by client) and moongate-driven
# eviction on the master's usage, and benches/replay driving the shipped trace through
# it with the real client. Prints the per-arm table; --json OUT keeps the report.
# Extra args go to benches/replay (e.g. --limit 500 --speed 50 --value-size 16384).
# Not part of CI (minutes); tests/all/replay_live.rs runs a short slice of it. KEEP=1 keeps
# the master and moongate logs. PROFILE=release measures a release build. CAPACITY=by-weight
# gives each arm its own half of the capacity (default: one shared pool). B=NAME:PLUGIN
# replaces the second arm (default prefix:prefix-evict); HINTS_TTL_MS sets hints.ttl_ms
# (for --hints: how long an upcoming hint outlives its due time; 60,000 trace-ms divided
# by --speed). A --trace in the extra args replaces the shipped trace. LEASE_MS sets the
# master's read lease (--default_kv_lease_ttl) and moongate's eviction.lease_ms with it
# (default: the master's own, 10,000 in 0.3.13).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/bootstrap.sh
profile=${PROFILE:-debug}
if [ "$profile" = release ]; then cargo build --release --locked --bin moongate; else cargo build --locked --bin moongate; fi
py=${MOONGATE_PYTHON:-$root/.venv/bin/python}
b_arm=${B:-prefix:prefix-evict}; b_name=${b_arm%%:*}; b_plugin=${b_arm#*:}
source scripts/lib.sh
lease=${LEASE_MS:-}
start_master ${lease:+--default_kv_lease_ttl="$lease"}
listen=$(free_port); admin=$(free_port)
cat >"$work/moongate.toml" <<TOML
[master_face]
listen = "127.0.0.1:$listen"
upstream = "127.0.0.1:$rpc"
[admin]
listen = "127.0.0.1:$admin"
[eviction]
enabled = true
master_metrics_url = "http://127.0.0.1:$mport/metrics"
high_watermark = 0.8
low_watermark = 0.7
interval_ms = 100
max_removals_per_interval = 2000
${lease:+lease_ms = $lease}
[[policy.plugins]]
name = "lru"
path = "$root/target/plugins/lru.wasm"
[[policy.plugins]]
name = "$b_plugin"
path = "$root/target/plugins/$b_plugin.wasm"
[experiment]
assign = "client"
capacity = "${CAPACITY:-shared}"
arms = [ { name = "lru", plugin = "lru", weight = 50 },
         { name = "$b_name", plugin = "$b_plugin", weight = 50 } ]
[hints]
ttl_ms = ${HINTS_TTL_MS:-60000}
TOML
RUST_LOG=${RUST_LOG:-info} target/$profile/moongate run --config "$work/moongate.toml" >"$work/moongate.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$admin/ready" >/dev/null && break; sleep 0.1; done
curl -sf "http://127.0.0.1:$admin/ready" >/dev/null || { tail -n 30 "$work"/*.log; exit 1; }
benches/replay --trace benches/traces/mooncake_fast25_synthetic.jsonl \
  --master "127.0.0.1:$listen" --metadata "http://127.0.0.1:$http/metadata" \
  --admin "127.0.0.1:$admin" --master-metrics "http://127.0.0.1:$mport/metrics" "$@"
