"""``python -m kvspec.conformance.harness._worker_process IN_FD OUT_FD``: the entry point of a
worker process (``worker_main`` of ``_worker_groups``, which starts the process)."""

from __future__ import annotations

import sys

from ._worker_groups import worker_main

if __name__ == "__main__":  # pragma: no cover - runs in a worker process
    worker_main(sys.argv[1:])
