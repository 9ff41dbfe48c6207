#!/usr/bin/env bash
# The main job: certify connectors with the conformance suite (`kvspec conform`).
# With no argument it certifies the project's own connectors; pass pkg.module:Factory
# specs to certify others. `kvspec spec` prints the clause table.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
exec kvspec conform "$@"
