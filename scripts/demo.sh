#!/usr/bin/env bash
# moongate's main job in one command: start a real mooncake_master, moongate in front
# of it with the embedded default policy, push a small real workload through moongate
# with the real Mooncake client, print what moongate saw, and stop everything.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

bash scripts/bootstrap.sh
cargo build --locked --bin moongate
py=${MOONGATE_PYTHON:-$root/.venv/bin/python}
master_bin=$("$py" -c 'import os, mooncake; print(os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master"))')

free_port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
rpc=$(free_port); http=$(free_port); mport=$(free_port); listen=$(free_port); admin=$(free_port)
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
export MC_TCP_BIND_ADDRESS=127.0.0.1

wait_until() { # what, seconds, command...
  local what=$1 secs=$2; shift 2
  for _ in $(seq 1 $((secs * 10))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "demo: $what did not come up; logs:" >&2; tail -n 30 "$work"/*.log >&2; exit 1
}

echo "demo: starting mooncake_master (rpc 127.0.0.1:$rpc, metadata 127.0.0.1:$http)"
"$master_bin" --rpc_port="$rpc" --rpc_address=127.0.0.1 --enable_http_metadata_server=true \
  --http_metadata_server_host=127.0.0.1 --http_metadata_server_port="$http" \
  --metrics_port="$mport" >"$work/master.log" 2>&1 &
pids+=($!)

echo "demo: starting moongate (master face 127.0.0.1:$listen, admin 127.0.0.1:$admin)"
target/debug/moongate run --listen "127.0.0.1:$listen" --upstream "127.0.0.1:$rpc" \
  --admin "127.0.0.1:$admin" >"$work/moongate.log" 2>&1 &
pids+=($!)
wait_until "moongate readiness (master answering)" 30 curl -sf "http://127.0.0.1:$admin/ready"

echo "demo: real Mooncake client -> moongate -> master: 200 puts, 250 lookups, 100 gets"
"$py" tests/py/scenario.py --role demo --master "127.0.0.1:$listen" \
  --metadata "http://127.0.0.1:$http/metadata" --out "$work/demo.json" 2>"$work/client.log"

echo
echo "demo: what moongate saw (GET http://127.0.0.1:$admin/metrics):"
curl -s "http://127.0.0.1:$admin/metrics" | grep -E \
  '^moongate_master_requests_total\{method="(PutStart|PutEnd|BatchExistKey|GetReplicaList|Ping)"\}|^moongate_master_errors_total.* [1-9]|^moongate_master_request_duration_seconds_(sum|count)\{method="PutStart"\}|^moongate_master_connections_total|^moongate_upstream_ready|^moongate_policy_(calls_total|decisions_total)\{.*\} [1-9]' \
  | sed 's/^/  /'
echo
echo "demo: the policy in force (GET /plugins):"
curl -s "http://127.0.0.1:$admin/plugins" | sed "s/^/  /"; echo
echo "demo: done"
