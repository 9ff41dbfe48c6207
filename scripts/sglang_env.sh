#!/usr/bin/env bash
# Create or reuse the SGLang environment the HiCache storage suite (`kvspec conform hicache:...`,
# tests/sglang) runs in. Sourced by test.sh (or run directly); prints nothing on reuse. SGLang's
# own requirements pin a CUDA torch and a CUDA kernel stack, so `pip install sglang` cannot work
# on a CPU machine; the recipe never lets pip fetch a CUDA torch or any CUDA package:
#   1. a fresh venv, torch==2.13.0 (the CPU build) first;
#   2. sglang==0.5.23 without its dependencies;
#   3. scripts/sglang-requirements.txt (SGLang's pure-Python requirements at its own pins, minus
#      CUDA and vision packages) under a constraint pinning torch==2.13.0;
#   4. xgrammar==0.2.7 and triton==3.9.0 without dependencies (SGLang imports triton
#      unconditionally; a mock triton would break torch's inductor);
#   5. kvspec itself, editable and without dependencies, plus its light runtime and test deps;
#      and nixl 1.5.1 for SGLang's `nixl` backend (`kvspec conform hicache:nixl`): the `nixl`
#      meta package without dependencies plus `nixl-cu13` under the torch constraint (its only
#      requirements are numpy and torch). The meta package requires both nixl-cu12 and
#      nixl-cu13 (about 60 MB each) but, where torch has no CUDA, imports nixl_cu13 first, so
#      nixl-cu12 is left out; neither brings a CUDA pip package, and the POSIX plugin runs on
#      the CPU.
#   6. a stand-in `torchvision` package, written into the venv's site-packages: the registry's
#      torchvision does not load beside torch 2.13 CPU (`operator torchvision::nms does not
#      exist`), yet SGLang's storage path imports it at module level (mem_cache.memory_pool ->
#      sglang.srt.configs -> multimodal helpers -> torchvision.transforms). The stand-in says
#      it is version 0.0 (transformers parses that); any other attribute is a placeholder
#      whose call raises ImportError, so no image code can run on it unnoticed.
# Honours KVSPEC_SGLANG_VENV (default .venv-sglang in the checkout) and PYTHON. Exports
# KVSPEC_SGLANG_PYTHON, the environment's interpreter.
set -euo pipefail

KVSPEC_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KVSPEC_SGLANG_VENV="${KVSPEC_SGLANG_VENV:-$KVSPEC_ROOT/.venv-sglang}"
KVSPEC_SGLANG_VERSION="0.5.23"
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

sstamp="$KVSPEC_SGLANG_VENV/.kvspec-sglang-stamp"
swant="$(cat "$KVSPEC_ROOT/scripts/sglang_env.sh" "$KVSPEC_ROOT/scripts/sglang-requirements.txt" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$sstamp" 2>/dev/null || true)" != "$swant" ]; then
  start=$(date +%s)
  echo "kvspec: building the SGLang $KVSPEC_SGLANG_VERSION environment in $KVSPEC_SGLANG_VENV (about 2-3 minutes, 3.5 GB)" >&2
  [ -x "$KVSPEC_SGLANG_VENV/bin/python" ] || "$PYTHON" -m venv "$KVSPEC_SGLANG_VENV"
  SVPY="$KVSPEC_SGLANG_VENV/bin/python"
  # pip's notes on what was left out on purpose (torch pins, CUDA packages) are noise here.
  spip() { "$SVPY" -m pip install -q "$@" 2> >(grep -v -e "is ignored: it is neither" \
    -e "requires .*which is not installed" -e "which is incompatible" \
    -e "dependency resolver does not currently take into account" >&2); }
  constraints="$KVSPEC_SGLANG_VENV/kvspec-constraints.txt"
  echo "torch==2.13.0" > "$constraints"
  "$SVPY" -c 'import torch' >/dev/null 2>&1 || spip torch==2.13.0
  "$SVPY" -W ignore -c 'import torch, sys; sys.exit(0 if torch.__version__.endswith("+cpu") else "torch is not the CPU build: " + torch.__version__)'
  spip --no-deps "sglang==$KVSPEC_SGLANG_VERSION"
  spip -c "$constraints" -r "$KVSPEC_ROOT/scripts/sglang-requirements.txt"
  spip --no-deps xgrammar==0.2.7 triton==3.9.0
  spip --no-deps -e "$KVSPEC_ROOT"
  spip -c "$constraints" attrs msgspec typing-extensions safetensors pytest hypothesis
  spip --no-deps nixl==1.5.1
  spip -c "$constraints" nixl-cu13==1.5.1
  "$SVPY" - <<'PY'
# The torchvision stand-in (step 6); a real torchvision, if one is importable, is left alone.
import importlib.util, pathlib, sysconfig
root = pathlib.Path(sysconfig.get_paths()["purelib"]) / "torchvision"
marker = "# kvspec's import-time stand-in for torchvision"
init = root / "__init__.py"
if importlib.util.find_spec("torchvision") is None or init.read_text().startswith(marker):
    stub = marker + """ (scripts/sglang_env.sh, step 6).
__version__ = "0.0"
class _Unavailable:
    def __init__(self, name): self._name = name
    def __getattr__(self, attr): return _Unavailable(self._name + "." + attr)
    def __call__(self, *args, **kwargs):
        raise ImportError(self._name + ": torchvision is a stand-in in kvspec's SGLang environment")
def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable(__name__ + "." + name)
"""
    for sub in ("", "transforms", "transforms/v2", "io"):
        (root / sub).mkdir(parents=True, exist_ok=True)
        (root / sub / "__init__.py").write_text(stub)
    for mod in ("transforms/functional.py", "transforms/v2/functional.py"):
        (root / mod).write_text(stub)
PY
  "$SVPY" -W ignore::UserWarning - <<'PY'
import importlib.metadata as md, sys, torch
assert torch.__version__.endswith("+cpu"), torch.__version__
cuda = sorted(d.metadata["Name"] for d in md.distributions()
              if d.metadata["Name"].lower().startswith(("nvidia-", "cuda-"))
              and d.metadata["Name"].lower() != "nvidia-ml-py")  # pure-Python NVML binding
if cuda:
    sys.exit(f"CUDA packages got in: {cuda}")
import sglang.srt.mem_cache.storage.backend_factory, sglang.srt.mem_cache.memory_pool_host, kvspec
import nixl._api
PY
  echo "$swant" > "$sstamp"
  echo "kvspec: SGLang environment ready in $(( $(date +%s) - start )) s" >&2
fi
export KVSPEC_SGLANG_PYTHON="$KVSPEC_SGLANG_VENV/bin/python"
