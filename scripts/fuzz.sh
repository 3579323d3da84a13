#!/usr/bin/env bash
# Runs each cargo-fuzz target for a set time (not CI): the master-face codec frames
# (decode), the kv face's batch records (kv_records), hints bodies (hints) and
# shared-memory requests (shm_request). Each target's entry point is a `fuzz_one` in
# moongate that the unit tests also drive.
#   bash scripts/fuzz.sh [SECONDS per target, default 300] [TARGET ...]
#   FUZZ_PARALLEL=2 bash scripts/fuzz.sh 1800     # two targets at a time (one core each)
# Needs cargo-fuzz (`cargo install cargo-fuzz --locked`); RUSTC_BOOTSTRAP lets its
# nightly flags run on the stable toolchain. The corpus grows in proxy/fuzz/corpus/TARGET
# (git-ignored) and is reused by the next run. A crash fails the run, with the target's
# artifact under proxy/fuzz/artifacts/TARGET/: keep it as a regression test. Each
# target's log is proxy/fuzz/logs/TARGET.log; the end prints one line per target: its
# runs, coverage, corpus size and what it found.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
secs=${1:-300}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(decode kv_records hints shm_request)
parallel=${FUZZ_PARALLEL:-1}
command -v cargo-fuzz >/dev/null || { echo "cargo-fuzz is not installed: cargo install cargo-fuzz --locked" >&2; exit 1; }
cd "$root/proxy/fuzz"
mkdir -p logs
# Built once before any runs, so that parallel runs do not race on the build.
for t in "${targets[@]}"; do RUSTC_BOOTSTRAP=1 cargo fuzz build "$t"; done

one() {
  local t=$1 log=logs/$1.log
  mkdir -p "corpus/$t"
  local start=$(date +%s) rc=0
  RUSTC_BOOTSTRAP=1 cargo fuzz run "$t" "corpus/$t" -- -max_total_time="$secs" >"$log" 2>&1 || rc=$?
  local took=$(( $(date +%s) - start ))
  # libFuzzer's last status line: runs, coverage, features, corpus.
  local last=$(grep -E "^#[0-9]+" "$log" | tail -n 1)
  local found=$(ls "artifacts/$t" 2>/dev/null | wc -l)
  echo "== $t: ${took} s, rc $rc, corpus $(ls "corpus/$t" | wc -l) files" \
       "($(du -sk "corpus/$t" | cut -f1) KiB), artifacts $found; last: $last"
  return $rc
}

fail=0
pids=()
for t in "${targets[@]}"; do
  one "$t" &
  pids+=($!)
  if [ ${#pids[@]} -ge "$parallel" ]; then
    wait "${pids[0]}" || fail=1
    pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p" || fail=1; done
if [ $fail -ne 0 ]; then
  echo "fuzz: A TARGET FOUND A CRASH (see proxy/fuzz/logs and proxy/fuzz/artifacts)" >&2
  exit 1
fi
