# Sourced by scripts that run a real master and moongate by hand (demo, replay):
# ports, a work directory removed on exit (KEEP=1 keeps it), processes stopped on exit,
# and mooncake_master on loopback. Expects $root and $py set by the caller.
free_port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  if [ -n "${KEEP:-}" ]; then echo "logs kept in $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT
export MC_TCP_BIND_ADDRESS=127.0.0.1

# start_master [FLAG...]: sets $rpc, $http (metadata) and $mport (metrics), logs to
# $work/master.log; FLAGs go to mooncake_master as they are.
start_master() {
  local bin
  bin=$("$py" -c 'import os, mooncake; print(os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master"))')
  rpc=$(free_port); http=$(free_port); mport=$(free_port)
  "$bin" --rpc_port="$rpc" --rpc_address=127.0.0.1 --enable_http_metadata_server=true \
    --http_metadata_server_host=127.0.0.1 --http_metadata_server_port="$http" \
    --metrics_port="$mport" --metrics_host=127.0.0.1 "$@" >"$work/master.log" 2>&1 &
  pids+=($!)
}
