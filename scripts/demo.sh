#!/usr/bin/env bash
# moongate's main job in one command: start a real mooncake_master, moongate in front
# of it with the embedded default policy, push a small real workload through moongate
# with the real Mooncake client, print what moongate saw, and stop everything.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

bash scripts/bootstrap.sh --demo
cargo build --locked --bin moongate
py=${MOONGATE_PYTHON:-$root/.venv/bin/python}
source scripts/lib.sh
listen=$(free_port); admin=$(free_port); kv=$(free_port)

wait_until() { # what, seconds, command...
  local what=$1 secs=$2; shift 2
  for _ in $(seq 1 $((secs * 10))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "demo: $what did not come up; logs:" >&2; tail -n 30 "$work"/*.log >&2; exit 1
}

start_master
echo "demo: started mooncake_master (rpc 127.0.0.1:$rpc, metadata 127.0.0.1:$http)"

echo "demo: starting moongate (master face 127.0.0.1:$listen, admin 127.0.0.1:$admin," \
  "kv face 127.0.0.1:$kv with a 64 MiB segment of its own)"
printf '[kv]\nsegment_bytes = 67108864\n' >"$work/moongate.toml"
target/debug/moongate run --config "$work/moongate.toml" --listen "127.0.0.1:$listen" \
  --upstream "127.0.0.1:$rpc" --admin "127.0.0.1:$admin" \
  --kv "127.0.0.1:$kv" --metadata "http://127.0.0.1:$http/metadata" >"$work/moongate.log" 2>&1 &
pids+=($!)
wait_until "moongate readiness (master answering)" 30 curl -sf "http://127.0.0.1:$admin/ready"

echo "demo: real Mooncake client -> moongate -> master: 200 puts, 250 lookups, 100 gets"
"$py" tests/py/scenario.py --role demo --master "127.0.0.1:$listen" \
  --metadata "http://127.0.0.1:$http/metadata" --out "$work/demo.json" 2>"$work/client.log"

echo "demo: an engine without Mooncake's client -> moongate's kv face: put, get, exists,"
echo "      batch put and batch get (examples/python/kv_client.py, 1 MiB value)"
wait_until "moongate's own segment" 30 grep -q "own segment mounted" "$work/moongate.log"
"$py" examples/python/kv_client.py --addr "127.0.0.1:$kv" | sed 's/^/  /'

echo
echo "demo: what moongate saw (GET http://127.0.0.1:$admin/metrics):"
curl -s "http://127.0.0.1:$admin/metrics" | grep -E \
  '^moongate_master_requests_total\{method="(PutStart|PutEnd|BatchExistKey|GetReplicaList|Ping)"\}|^moongate_master_errors_total.* [1-9]|^moongate_master_request_duration_seconds_(sum|count)\{method="PutStart"\}|^moongate_master_connections_total|^moongate_upstream_ready|^moongate_policy_(calls_total|decisions_total)\{.*\} [1-9]|^moongate_kv_(requests|transfers)_total\{.*\} [1-9]' \
  | sed 's/^/  /'
echo
echo "demo: the policy in force (GET /plugins):"
curl -s "http://127.0.0.1:$admin/plugins" | sed "s/^/  /"; echo
echo "demo: done"
