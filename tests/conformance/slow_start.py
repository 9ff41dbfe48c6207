"""A factory whose worker role takes 30 s to build: a worker process that does not start in
time (test_harness.py). Importable by the harness's worker processes, which get the test
process's ``sys.path``."""

from __future__ import annotations

import time

from kvspec.conformance.connectors.null import NullConnector
from kvspec.protocols import EngineConfigView, WorkerConnector

__all__ = ["SlowStartConnector"]


class SlowStartConnector(NullConnector):
    """The null connector, whose ``create_worker`` sleeps 30 s first."""

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        time.sleep(30)
        return super().create_worker(config, rank)
