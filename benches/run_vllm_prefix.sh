#!/usr/bin/env bash
# Builds release binaries, installs real vLLM (scripts/vllm_env.sh) and runs
# benches/vllm_prefix.py: a prompt's prefix loaded by moongate's vLLM connector and by
# vLLM's own MooncakeStoreConnector (through moongate's master face) in one run, against
# recompute. Not part of CI (release build, timing).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/bootstrap.sh --demo
bash scripts/vllm_env.sh
cargo build --release --locked --bin moongate
cargo build --release --locked -p moongate-kv --lib
exec .venv-vllm/bin/python benches/vllm_prefix.py "$@"
