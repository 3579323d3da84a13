#!/usr/bin/env bash
# On the GPU host: unpacks .gpu/ (scripts/gpu_pack.sh made it here), puts on
# LD_LIBRARY_PATH only the libraries the host lacks, finds the CUDA 13 runtime torch
# ships, and runs benches/gpu_gate.py with the given arguments (results under $OUT, or
# /tmp/gpu_gate).
#
#   bash scripts/gpu_run.sh [--parts micro,cuda,gate] [--shapes 8b,70b10] [--tokens ...]
#
# GPU_BINARIES=DIR takes moongate.xz and libmoongate_kv.so.xz from DIR instead, and
# GPU_PYTHON=DIR the Python package (an earlier build's, for A/B runs on one card).
# GPU_BENCH=kv_face runs benches/kv_face.py (the remote path: the host's cores, no GPU)
# with the carried binaries and the given arguments instead.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
pack=$root/.gpu
work=${GPU_WORK:-/tmp/moongate-gpu}
mkdir -p "$work"
python3 - "$pack" "$work" "${GPU_BINARIES:-$pack}" <<'EOF'
import lzma, os, shutil, sys, tarfile
pack, work, binaries = sys.argv[1:]
for f in ["moongate", "libmoongate_kv.so", "kv_bench"]:
    if not os.path.exists(os.path.join(binaries, f + ".xz")):
        continue
    with lzma.open(os.path.join(binaries, f + ".xz")) as src, open(os.path.join(work, f), "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.chmod(os.path.join(work, f), 0o755)
for t in ["mooncake.tar.xz", "libs.tar.xz"]:
    with tarfile.open(os.path.join(pack, t)) as tf:
        tf.extractall(work)
# A wheel is a zip: its executables come out without their mode bits.
for f in ["mooncake_master", "mooncake_client"]:
    p = os.path.join(work, "mooncake", f)
    if os.path.exists(p):
        os.chmod(p, 0o755)
EOF
# Only what the host lacks: its own copies of the rest win.
mkdir -p "$work/missing"
for l in "$work"/libs/*; do
  n=$(basename "$l")
  ldconfig -p | grep -q " $n " || ln -sf "$l" "$work/missing/$n"
done
cudart=$(python3 - <<'EOF'
import glob, os, site
for d in site.getsitepackages():
    for p in glob.glob(os.path.join(d, "nvidia", "**", "libcudart.so.13"), recursive=True):
        print(os.path.dirname(p)); raise SystemExit
EOF
)
export LD_LIBRARY_PATH="$work/missing${cudart:+:$cudart}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$work:${GPU_PYTHON:-$root/clients/python}${PYTHONPATH:+:$PYTHONPATH}"
export MOONGATE_KV_LIB=$work/libmoongate_kv.so
export MC_TCP_BIND_ADDRESS=127.0.0.1
echo "gpu_run: missing libraries carried: $(ls "$work/missing" | tr '\n' ' ')"
echo "gpu_run: CUDA runtime from ${cudart:-the system}"
if [ "${GPU_BENCH:-}" = kv_face ]; then
  exec python3 benches/kv_face.py --moongate "$work/moongate" --kv-bench "$work/kv_bench" \
    --lib "$work/libmoongate_kv.so" "$@"
fi
exec python3 benches/gpu_gate.py --pack "$work" --out "${OUT:-/tmp/gpu_gate}" "$@"
