#!/usr/bin/env bash
# Packs what a run on the GPU host needs into .gpu/ (git-ignored), for hosts that have
# Python 3.12 with torch and transformers but no network and no Rust toolchain
# (docs/results.md, "The GPU host"): build here, carry the binaries.
#
#   bash scripts/gpu_pack.sh          # then, on the GPU host: bash scripts/gpu_run.sh
#
# .gpu/ holds (xz-packed, ~40 MB, under a 64 MiB transfer):
#   moongate.xz, libmoongate_kv.so.xz   release builds, stripped
#   kv_bench.xz                         the kv face's HTTP client (benches/kv_face.py)
#   mooncake.tar.xz                     Mooncake 0.3.14's CUDA 13 wheel for CPython 3.12,
#                                       unpacked, without what the runs do not load
#                                       (benchmarks, the EP / PG device libraries)
#   libs.tar.xz                         the shared libraries the wheel links that a bare
#                                       CUDA image may lack (libcurl and its chain,
#                                       libibverbs, libmlx5, libnuma, ...), from this
#                                       machine's Debian packages; gpu_run.sh puts only
#                                       the ones the host lacks on LD_LIBRARY_PATH
# The Python package (clients/python) and the bench (benches/gpu_gate.py) travel with
# the repository itself.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=.gpu
cache=target/gpu-cache
mkdir -p "$out" "$cache"

cargo build --release --locked -p moongate --bin moongate --example kv_bench
cargo build --release --locked -p moongate-kv --lib
for f in moongate libmoongate_kv.so examples/kv_bench; do
  n=$(basename "$f")
  strip --strip-debug -o "$cache/$n" "target/release/$f"
  xz -T0 -6 -c "$cache/$n" >"$out/$n.xz"
done

# Mooncake 0.3.14 (CUDA 13) for the host's CPython 3.12.
wheel=$(ls "$cache"/mooncake_transfer_engine_cuda13-0.3.14-cp312-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_35_x86_64 \
    -d "$cache" mooncake-transfer-engine-cuda13==0.3.14
  wheel=$(ls "$cache"/mooncake_transfer_engine_cuda13-0.3.14-cp312-*.whl | head -1)
fi
rm -rf "$cache/mooncake-unpacked"
mkdir -p "$cache/mooncake-unpacked"
python3 -m zipfile -e "$wheel" "$cache/mooncake-unpacked"
(
  cd "$cache/mooncake-unpacked"
  rm -f mooncake/transfer_engine_bench mooncake/libmooncake_pg*.so mooncake/_ep*.so \
    mooncake/libmooncake_ep_device.so
  rm -rf mooncake/_pg_jit
  tar -cJf "$root/$out/mooncake.tar.xz" mooncake mooncake_transfer_engine_cuda13*.libs
)

# The libraries the wheel links, as resolved here, but glibc's and the compiler's.
venv14=$root/.venv-0.3.14/lib/python3.11/site-packages
[ -d "$venv14/mooncake" ] || bash scripts/bootstrap.sh
libs=$(for f in "$venv14"/mooncake/_store*.so "$venv14"/mooncake/mooncake_master \
         "$venv14"/mooncake/mooncake_client; do
         LD_LIBRARY_PATH="$root/.venv-0.3.14/cuda-stand-in:$venv14/nvidia/cu13/lib" ldd "$f"
       done 2>/dev/null | awk '/=> \// {print $3}' | sort -u \
       | grep -v -e site-packages -e stand-in \
       | grep -v -E '/(libc|libm|libdl|libpthread|librt|libresolv|libgcc_s|libstdc\+\+)\.so')
rm -rf "$cache/libs"
mkdir -p "$cache/libs"
for l in $libs; do cp -L "$l" "$cache/libs/"; done
tar -C "$cache" -cJf "$out/libs.tar.xz" libs
du -ch "$out"/* | tail -1
echo "gpu_pack: .gpu ready; run on the GPU host with: bash scripts/gpu_run.sh [gpu_gate.py args]"
echo "  (or GPU_BENCH=kv_face bash scripts/gpu_run.sh [kv_face.py args]: the remote path)"
