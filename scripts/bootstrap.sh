#!/usr/bin/env bash
# Installs everything moongate's demo, tests and benchmarks need on a fresh Debian
# machine, and nothing else. Idempotent: a second run only checks.
#
#   - Debian: libibverbs1 and librdmacm1 (the Mooncake wheel links against them even
#     when no RDMA device exists); protobuf-compiler (the etcd client crate compiles
#     etcd's protos at build time); etcd-server (the HA tests run a real etcd);
#     prometheus, with promtool (a test scrapes a live moongate with a real Prometheus,
#     evaluates the shipped alert rules and every dashboard query); valgrind (CI counts
#     the instructions moongate spends per master-face call against a ceiling, and
#     checks the C++ engine gate with memcheck); cmake and g++ (the C++ engine gate).
#   - A Python virtualenv in .venv with the pinned Mooncake wheel, which ships the real
#     `mooncake_master` binary and the real store client.
#   - .venv-vllm: real vLLM, its CPU build (scripts/vllm_env.sh; the vLLM connector
#     tests run it, ~3.5 minutes and 6.3 GB on a fresh machine).
#   - One virtualenv per other supported release (.venv-0.3.11.post1,
#     .venv-0.3.12.post1, .venv-0.3.14: masters and clients), for the per-release and
#     version-bridge tests. The 0.3.12.post1 "non-cuda" wheel links libcudart.so.12,
#     which PyPI's nvidia-cuda-runtime-cu12 supplies (the tests put it on
#     LD_LIBRARY_PATH). 0.3.14 exists only as a CUDA 13 wheel: its master runs as is;
#     its client links libcudart.so.13 (PyPI's nvidia-cuda-runtime), the NVIDIA
#     driver's libcuda.so.1 (no package ships it: a stand-in that answers "no device"
#     is built, scripts/cuda_driver_stand_in.sh) and libmlx5 (Debian's
#     ibverbs-providers).
#
# `bootstrap.sh --demo` installs only what `scripts/demo.sh` needs: the two RDMA
# libraries the wheel links, protobuf-compiler (the build), curl, the pinned wheel in
# .venv and the wasm32-wasip2 target; none of the test servers or other releases.
#
# Env: MOONGATE_VENV overrides the virtualenv path.
set -euo pipefail
demo=false
case "${1:-}" in
  --demo) demo=true ;;
  "") ;;
  *) echo "usage: bootstrap.sh [--demo]" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${MOONGATE_VENV:-$root/.venv}
MOONCAKE_PKG="mooncake-transfer-engine-non-cuda==0.3.13.post1"

need_apt=()
if $demo; then
  want=(libibverbs1 librdmacm1 curl protobuf-compiler)
else
  want=(libibverbs1 librdmacm1 ibverbs-providers curl protobuf-compiler etcd-server prometheus
        docker-registry minisign systemd valgrind cmake g++)
fi
for p in "${want[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || need_apt+=("$p")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "bootstrap: installing Debian packages: ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "bootstrap: creating virtualenv $venv"
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import mooncake.store" >/dev/null 2>&1 \
   || [ "$("$venv/bin/pip" show mooncake-transfer-engine-non-cuda 2>/dev/null | sed -n 's/^Version: //p')" != "0.3.13.post1" ]; then
  echo "bootstrap: installing $MOONCAKE_PKG"
  "$venv/bin/pip" install -q --disable-pip-version-check "$MOONCAKE_PKG"
fi
finish() {
  if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2; then
    echo "bootstrap: adding the wasm32-wasip2 target (policy plugins)"
    rustup target add wasm32-wasip2
  fi
}
if $demo; then
  finish
  echo "bootstrap: ok for the demo (python: $venv/bin/python)"
  exit 0
fi

# The KV-events test subscribes as vLLM's example subscriber does (pyzmq + msgspec).
# deploy/k8s/ is validated against the Kubernetes API schemas (bundled by this package);
# the registry-login test writes the registry's htpasswd file with bcrypt.
test_extras() {
  if ! "$venv/bin/python" -c "import kubernetes_validate, bcrypt" >/dev/null 2>&1; then
    echo "bootstrap: installing kubernetes-validate and bcrypt"
    "$venv/bin/pip" install -q --disable-pip-version-check "kubernetes-validate==1.37.0" "bcrypt==4.3.0"
  fi
  # The Python package test installs clients/python as a user would (pip, setuptools'
  # wheel build, no network at that point).
  if ! "$venv/bin/python" -c "import wheel" >/dev/null 2>&1; then
    echo "bootstrap: installing wheel"
    "$venv/bin/pip" install -q --disable-pip-version-check "wheel==0.45.1"
  fi
  if ! "$venv/bin/python" -c "import zmq, msgspec" >/dev/null 2>&1; then
    echo "bootstrap: installing pyzmq and msgspec"
    "$venv/bin/pip" install -q --disable-pip-version-check "pyzmq==27.3.0" "msgspec==0.23.0"
  fi
}

older_release() {
  local v=$1 extra=${2:-} dir="$root/.venv-$1"
  if [ ! -x "$dir/bin/python" ]; then
    echo "bootstrap: creating virtualenv $dir"
    python3 -m venv "$dir"
  fi
  if [ "$("$dir/bin/pip" show mooncake-transfer-engine-non-cuda 2>/dev/null | sed -n 's/^Version: //p')" != "$v" ] \
     || { [ -n "$extra" ] && ! "$dir/bin/pip" show "${extra%%==*}" >/dev/null 2>&1; }; then
    echo "bootstrap: installing mooncake-transfer-engine-non-cuda==$v $extra"
    # shellcheck disable=SC2086
    "$dir/bin/pip" install -q --disable-pip-version-check "mooncake-transfer-engine-non-cuda==$v" $extra
  fi
}
# 0.3.14: only a CUDA 13 wheel exists, installed without its dependencies (the
# client's Python imports need none of them for the store API the tests use).
v14="$root/.venv-0.3.14"
v14site="$v14/lib/python3.11/site-packages"
release_0_3_14() {
  if [ ! -x "$v14site/mooncake/mooncake_master" ]; then
    echo "bootstrap: installing Mooncake 0.3.14 (mooncake-transfer-engine-cuda13==0.3.14, no deps)"
    [ -x "$v14/bin/python" ] || python3 -m venv "$v14"
    "$v14/bin/pip" install -q --disable-pip-version-check --no-deps "mooncake-transfer-engine-cuda13==0.3.14"
  fi
  if [ ! -e "$v14site/nvidia/cu13/lib/libcudart.so.13" ]; then
    echo "bootstrap: installing the CUDA 13 runtime for the 0.3.14 client (nvidia-cuda-runtime==13.5.37)"
    "$v14/bin/pip" install -q --disable-pip-version-check --no-deps "nvidia-cuda-runtime==13.5.37"
  fi
  if [ ! -e "$v14/cuda-stand-in/libcuda.so.1" ]; then
    bash "$root/scripts/cuda_driver_stand_in.sh" "$v14site/mooncake" "$v14/cuda-stand-in"
  fi
  if ! LD_LIBRARY_PATH="$v14/cuda-stand-in:$v14site/nvidia/cu13/lib" \
       "$v14/bin/python" -c "import mooncake.store" >/dev/null 2>&1; then
    echo "bootstrap: the 0.3.14 client does not import with its stand-ins:" >&2
    LD_LIBRARY_PATH="$v14/cuda-stand-in:$v14site/nvidia/cu13/lib" "$v14/bin/python" -c "import mooncake.store" >&2 || true
    return 1
  fi
}
# Separate virtualenvs (and the main one's extras) install at once: pip spends most of
# its time downloading and unpacking, and one after another took ~3 minutes on a fresh
# machine.
jobs_=()
test_extras & jobs_+=($!)
older_release 0.3.11.post1 & jobs_+=($!)
older_release 0.3.12.post1 "nvidia-cuda-runtime-cu12==12.9.79" & jobs_+=($!)
release_0_3_14 & jobs_+=($!)
# Real vLLM (its CPU build) for the vLLM connector tests: a virtualenv of its own.
bash "$root/scripts/vllm_env.sh" & jobs_+=($!)
failed=0
for j in "${jobs_[@]}"; do
  wait "$j" || failed=1
done
if [ "$failed" != 0 ]; then
  echo "bootstrap: installing the test virtualenvs failed (see above)" >&2
  exit 1
fi

master=$("$venv/bin/python" - <<'PY'
import os, mooncake
print(os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master"))
PY
)
if [ ! -x "$master" ]; then
  echo "bootstrap: mooncake_master not found at $master" >&2
  exit 1
fi
finish
echo "bootstrap: ok (python: $venv/bin/python, master: $master)"
