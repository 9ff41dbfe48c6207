"""The reference engine harness: a small real engine that drives any connector.

``Engine(factory, HarnessConfig(...)).run(Workload(...))`` serves a workload through the
connector exactly as docs/spec/state-machines.md orders it and raises
``ContractViolation`` at the first clause the connector breaks.
"""

from __future__ import annotations

from .config import HarnessConfig
from .engine import Engine, RunResult
from .pd import run_disaggregated, serve_pair
from .workload import RequestSpec, Workload, workloads

__all__ = [
    "Engine", "HarnessConfig", "RequestSpec", "RunResult", "Workload", "run_disaggregated", "serve_pair",
    "workloads",
]
