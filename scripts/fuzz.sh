#!/usr/bin/env bash
# Runs each cargo-fuzz target for a set time (not CI): the master-face codec frames
# (decode), the kv face's batch records (kv_records), hints bodies (hints) and
# shared-memory requests (shm_request). Each target's entry point is a `fuzz_one` in
# moongate that the unit tests also drive.
#   bash scripts/fuzz.sh [SECONDS per target, default 300] [TARGET ...]
# Needs cargo-fuzz (`cargo install cargo-fuzz --locked`); RUSTC_BOOTSTRAP lets its
# nightly flags run on the stable toolchain. A crash stops the run with the target's
# artifact under proxy/fuzz/artifacts/TARGET/; keep it as a regression test.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
secs=${1:-300}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(decode kv_records hints shm_request)
command -v cargo-fuzz >/dev/null || { echo "cargo-fuzz is not installed: cargo install cargo-fuzz --locked" >&2; exit 1; }
cd "$root/proxy/fuzz"
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t"
  log=$(mktemp)
  echo "== $t for ${secs} s"
  if ! RUSTC_BOOTSTRAP=1 cargo fuzz run "$t" "corpus/$t" -- -max_total_time="$secs" >"$log" 2>&1; then
    tail -n 40 "$log"
    echo "== $t: FOUND A CRASH (artifacts/$t)" >&2
    exit 1
  fi
  # libFuzzer's last status line: runs, coverage, corpus.
  grep -E "^#[0-9]+" "$log" | tail -n 1
  grep -E "Done [0-9]+ runs" "$log" | tail -n 1
  rm -f "$log"
done
