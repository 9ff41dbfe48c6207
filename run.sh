#!/usr/bin/env bash
# The main job. Until the conformance suite lands it prints the spec's clause table.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
exec kvspec spec "$@"
