"""``python -m kvspec.conformance.harness._worker_main IN_FD OUT_FD``: a worker process."""

from __future__ import annotations

import sys

from ._workers import worker_main

if __name__ == "__main__":  # pragma: no cover - runs in a worker process
    worker_main(sys.argv[1:])
