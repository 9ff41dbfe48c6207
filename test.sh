#!/usr/bin/env bash
# The tests: pytest, the conformance suite on the project's connectors, mypy --strict on
# kvspec, and the strict docs build.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
echo "== pytest" && python -m pytest -q -p no:cacheprovider "$@"
echo "== conformance suite on the project's own connectors" && kvspec conform --report "${TMPDIR:-/tmp}/kvspec-conformance.json"
echo "== mypy --strict kvspec" && python -m mypy --strict kvspec
echo "== spec pages match the registry" && kvspec spec --check-docs docs/spec
echo "== mkdocs build --strict" && NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict -q -d "${TMPDIR:-/tmp}/kvspec-site"
echo "== all checks passed"
