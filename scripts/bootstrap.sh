#!/usr/bin/env bash
# Create or reuse the virtual environment and install what kvspec needs, torch first.
# Sourced by run.sh and test.sh. Honours:
#   KVSPEC_VENV             where the environment lives (default: .venv in the checkout)
#   PYTHON                  the interpreter that creates it (default: python3)
#   KVSPEC_TORCH            the torch requirement to install first (default: torch==2.13.0
#                           without an NVIDIA GPU, the registry's build in the range otherwise)
#   KVSPEC_TORCH_INDEX_URL  an index to take torch from (for example a CPU-only wheel index)
set -euo pipefail

KVSPEC_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KVSPEC_VENV="${KVSPEC_VENV:-$KVSPEC_ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x "$KVSPEC_VENV/bin/python" ]; then
  echo "kvspec: creating virtual environment $KVSPEC_VENV" >&2
  "$PYTHON" -m venv "$KVSPEC_VENV"
fi
VPY="$KVSPEC_VENV/bin/python"

# pip install, quiet, without the noise of unusable local index entries; keeps pip's status.
pipq() { "$VPY" -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

if [ -z "${KVSPEC_TORCH:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    KVSPEC_TORCH="torch>=2.4,<3"
  else
    KVSPEC_TORCH="torch==2.13.0"   # the CPU build where there is no GPU
  fi
fi

# Reinstall only when the requirements changed.
stamp="$KVSPEC_VENV/.kvspec-stamp"
want="$(cat "$KVSPEC_ROOT/pyproject.toml" <(echo "$KVSPEC_TORCH ${KVSPEC_TORCH_INDEX_URL:-}") | "$VPY" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  if ! "$VPY" -c 'import torch' >/dev/null 2>&1; then
    echo "kvspec: installing $KVSPEC_TORCH first" >&2
    if [ -n "${KVSPEC_TORCH_INDEX_URL:-}" ]; then
      pipq --index-url "$KVSPEC_TORCH_INDEX_URL" "$KVSPEC_TORCH"
    else
      pipq "$KVSPEC_TORCH"
    fi
  fi
  echo "kvspec: installing kvspec[dev,nixl]" >&2
  pipq -e "$KVSPEC_ROOT[dev,nixl]"
  "$VPY" -c 'import kvspec, torch' # fail loudly if the install did not take
  echo "$want" > "$stamp"
fi
export PATH="$KVSPEC_VENV/bin:$PATH"
