#!/usr/bin/env bash
# The GPU checks of docs/conformance.md ("GPU results"), in one run on a CUDA machine whose
# python3 has torch (a CUDA build): kvspec's other dependencies come as wheels in .whl/
# (docs/conformance.md, "GPU results", says how to fetch them), kvspec itself from this checkout.
#
#   1. pytest -m gpu           the CUDA twins of the graph tests and the emulator agreement
#   2. kvspec bench offload    store/load vs pinned copies (--device cuda)
#   3. kvspec bench graphs     one step under FULL (hooks captured) vs PIECEWISE (hooks eager)
#   4. kvspec conform --device cuda, the whole suite (its graph tests: eager, PIECEWISE, FULL,
#                              lazy capture mid-serving) for offload-layerwise, layerwise and
#                              offload ($SUITES), then NIXL where nixl is installed (VRAM
#                              registration), while time is left (DEADLINE_S)
#
# Logs go to $RESULTS (default /tmp/kvspec-gpu), packed at the end into $OUT/results.tgz
# with summary.txt beside it (default ./gpu-results). Each step is bounded by `timeout`;
# a failing step does not stop the next. On a machine without CUDA, step 1 skips, the
# others say CUDA is unavailable (KVSPEC_DEVICE=cpu runs the script's plumbing there).
set -u
OUT=${OUT:-$PWD/gpu-results}
RESULTS=${RESULTS:-/tmp/kvspec-gpu}
rm -rf "$RESULTS"
mkdir -p "$OUT" "$RESULTS"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DEVICE=${KVSPEC_DEVICE:-cuda}
if [ -z "${KVSPEC_NO_WHEELS:-}" ] && compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvspec-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/kvspec-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PLUGIN="-p kvspec.conformance.plugin.hooks -p no:cacheprovider"
# the suite's own entry point registers the plugin once installed; from a checkout, -p does
$PY -c "import importlib.metadata as m, sys; sys.exit(0 if any(e.name == 'kvspec' for e in m.entry_points(group='pytest11')) else 1)" \
    && PLUGIN="-p no:cacheprovider"

DEADLINE=${DEADLINE_S:-0}  # seconds for the whole script (0: none); steps shrink to fit

step() {  # step NAME SECONDS CMD...: run CMD bounded, log to $RESULTS/NAME.log, record rc
    local name=$1 limit=$2; shift 2
    if [ "$DEADLINE" -gt 0 ]; then
        local left=$((DEADLINE - SECONDS - 15))
        if [ "$left" -lt 20 ]; then
            echo "$name skipped: ${left}s left" | tee -a "$RESULTS/summary.txt"
            return
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    local t0=$SECONDS
    echo "== $name (limit ${limit}s)"
    timeout -k 5 "$limit" "$@" >"$RESULTS/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$RESULTS/summary.txt"
    tail -n 6 "$RESULTS/$name.log"
    # what is packed so far comes back even if the run is cut off later
    tar czf "$OUT/results.tgz" -C "$RESULTS" . && cp "$RESULTS/summary.txt" "$OUT/summary.txt"
}

{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.is_available() and torch.cuda.get_device_name(0))"
} | tee "$RESULTS/device.txt"

step gpu-tests 120 $PY -m pytest $PLUGIN -m gpu tests -q -rs \
    --junitxml="$RESULTS/gpu-tests.xml"
step bench-offload 60 $PY -m kvspec.cli bench offload --device "$DEVICE" \
    --repeats "${OFFLOAD_REPEATS:-9}"
step bench-graphs 60 $PY -m kvspec.cli bench graphs --device "$DEVICE" \
    --repeats "${GRAPHS_REPEATS:-50}"
# The whole suite (its graph tests: eager, PIECEWISE, FULL, lazy capture mid-serving) on the
# device: the two capturable-hooks connectors, then the offload backend's stream path.
for spec in ${SUITES:-kvspec.backends.offload:LayerwiseOffloadConnector \
            kvspec.conformance.connectors.layerwise:LayerwiseStorageConnector \
            kvspec.backends.offload:OffloadConnector}; do
    name=suite-${spec##*:}
    step "$name" 120 $PY -m kvspec.cli conform --device "$DEVICE" "$spec" \
        --report "$RESULTS/$name.json" -- -q -rs
done
# NIXL with the KV caches in GPU memory (VRAM registration), where nixl is installed
if $PY -c "import nixl" 2>/dev/null; then
    step suite-NixlConnector 150 $PY -m kvspec.cli conform --device "$DEVICE" \
        kvspec.backends.nixl:NixlConnector --report "$RESULTS/suite-NixlConnector.json" -- -q -rs
fi
echo "== summary"
cat "$RESULTS/summary.txt"
