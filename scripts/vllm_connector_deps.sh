#!/usr/bin/env bash
# Install into the vLLM-CPU environment (scripts/vllm_env.sh) the optional packages that some of
# vLLM's own KV connectors import, without ever letting pip replace the CPU torch or move any
# package that is already installed:
#   - lmcache (LMCacheConnectorV1, LMCacheMPConnector; also `lmcache server`), installed with
#     --no-deps; its pure-Python requirements that are missing are then installed one by one.
#     The CUDA-only ones (cupy-cuda*, cuda-python, cufile-python, nvtx) are left out. A
#     requirement whose pinned range cannot be met beside what is installed is retried without
#     the range, and skipped (with a note) when no wheel fits at all;
#   - mooncake-transfer-engine-non-cuda (MooncakeConnector, MooncakeStoreConnector; TCP
#     transport, no CUDA), msgpack (MoRIIOConnector, Mooncake), orjson (HF3FS metadata server).
# Every install runs under two constraint files: the environment's torch pin
# (kvspec-constraints.txt, torch==2.13.0) and a `pip freeze` of the environment taken just
# before, so nothing already present is up- or downgraded. Only wheels are accepted.
# Idempotent: a second run finds everything present and installs nothing.
# Honours KVSPEC_VLLM_VENV (default .venv-vllm in the checkout), KVSPEC_LMCACHE_VERSION (default
# 0.5.6) and KVSPEC_MOONCAKE_VERSION (default 0.3.13.post1).
set -euo pipefail

KVSPEC_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KVSPEC_VLLM_VENV="${KVSPEC_VLLM_VENV:-$KVSPEC_ROOT/.venv-vllm}"
LMCACHE_VERSION="${KVSPEC_LMCACHE_VERSION:-0.5.6}"
MOONCAKE_VERSION="${KVSPEC_MOONCAKE_VERSION:-0.3.13.post1}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

VPY="$KVSPEC_VLLM_VENV/bin/python"
if [ ! -x "$VPY" ]; then
  echo "vllm_connector_deps: no environment at $KVSPEC_VLLM_VENV (build it with scripts/vllm_env.sh)" >&2
  exit 1
fi
torch_pin="$KVSPEC_VLLM_VENV/kvspec-constraints.txt"
[ -s "$torch_pin" ] || echo "torch==2.13.0" > "$torch_pin"
freeze="$KVSPEC_VLLM_VENV/kvspec-connector-freeze.txt"
log="$KVSPEC_VLLM_VENV/kvspec-connector-deps.log"
: > "$log"

"$VPY" -W ignore -c 'import torch, sys; sys.exit(0 if torch.__version__.endswith("+cpu") else "torch is not the CPU build: " + torch.__version__)'

# Write the freeze of the environment as it is now (editable and direct-URL lines dropped:
# pip does not take them as constraints).
refreeze() {
  "$VPY" -m pip freeze --all --exclude-editable 2>/dev/null | grep -vE '^(-e |#)| @ ' > "$freeze"
}

# pip install under both constraint files, wheels only; pip's chatter goes to the log.
vpip() {
  "$VPY" -m pip install -q --only-binary=:all: -c "$torch_pin" -c "$freeze" "$@" >>"$log" 2>&1
}

# Is a distribution installed? (exit 0 if yes)
have() {
  "$VPY" - "$1" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    version(sys.argv[1])
except PackageNotFoundError:
    sys.exit(1)
PY
}

# Install one requirement: as given, else without its version range, else skip with a note.
install_one() {
  local req="$1" name="$2"
  refreeze
  if vpip "$req"; then
    echo "vllm_connector_deps: installed $req" >&2
  elif [ "$req" != "$name" ] && vpip "$name"; then
    echo "vllm_connector_deps: installed $name ($req cannot be met beside the installed packages)" >&2
  else
    echo "vllm_connector_deps: skipped $req (no wheel fits beside the installed packages; see $log)" >&2
  fi
}

# 1. lmcache itself, without its dependencies.
if [ "$(
  "$VPY" -c 'from importlib.metadata import version; print(version("lmcache"))' 2>/dev/null || true
)" != "$LMCACHE_VERSION" ]; then
  refreeze
  grep -v '^lmcache==' "$freeze" > "$freeze.tmp" && mv "$freeze.tmp" "$freeze"
  vpip --no-deps "lmcache==$LMCACHE_VERSION"
  echo "vllm_connector_deps: installed lmcache==$LMCACHE_VERSION (--no-deps)" >&2
fi

# 2. lmcache's requirements that are missing, minus the CUDA-only ones and torch.
missing="$("$VPY" - <<'PY'
import re
from importlib.metadata import PackageNotFoundError, distribution, version
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
cuda_only = re.compile(r"^(torch|cupy(-cuda.*)?|cuda-python|cuda-bindings|cufile-python|nvtx|nvidia-.*)$")
for raw in distribution("lmcache").requires or []:
    req = Requirement(raw)
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    if cuda_only.match(name):
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        version(req.name)
        continue  # installed: stays at its version
    except PackageNotFoundError:
        pass
    req.marker = None
    print(f"{req}\t{req.name}")
PY
)"
while IFS=$'\t' read -r req name; do
  [ -n "$req" ] || continue
  install_one "$req" "$name"
done <<< "$missing"

# 3. Mooncake (CPU build, TCP transport) and the small CPU packages other connectors import.
for spec in "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION" msgpack orjson; do
  name="${spec%%==*}"
  have "$name" || install_one "$spec" "$name"
done

# 4. Mooncake's engine.so and store.so link libibverbs.so.1 even in the non-CUDA build (the
#    TCP transport needs no RDMA device, only the library). Debian ships it as libibverbs1.
if ! PATH="$PATH:/sbin:/usr/sbin" ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -qq --no-install-recommends libibverbs1 >>"$log" 2>&1 \
      || { apt-get update -qq >>"$log" 2>&1 && apt-get install -y -qq --no-install-recommends libibverbs1 >>"$log" 2>&1; }
    echo "vllm_connector_deps: installed libibverbs1 (apt)" >&2
  else
    echo "vllm_connector_deps: libibverbs.so.1 is missing and cannot be installed here (needs root and apt-get: libibverbs1); mooncake will not import" >&2
    exit 1
  fi
fi

# 5. What must import now. `lmcache` and `mooncake.engine` load native code built for this
#    torch / glibc; a failure here is real.
export LMCACHE_DISABLE_BANNER=1 LMCACHE_LOG_LEVEL=WARNING
"$VPY" -W ignore - <<'PY'
import importlib
import torch
assert torch.__version__.endswith("+cpu"), torch.__version__
for mod in ("lmcache", "lmcache.v1.multiprocess.custom_types", "mooncake.engine", "msgpack", "orjson"):
    importlib.import_module(mod)
PY
"$KVSPEC_VLLM_VENV/bin/lmcache" server --help >/dev/null
echo "vllm_connector_deps: done ($KVSPEC_VLLM_VENV)" >&2
