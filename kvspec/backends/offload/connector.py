"""The factory of the host-memory offloading backend: ``kvspec.backends.offload:OffloadConnector``.

Declares asynchronous loads, delayed free, no per-layer hooks (GRA-001: safe under FULL
graphs, DRY-003), failed loads reported as invalid blocks (WRK-011), every stride order
and both K/V packings (LAY-010).
"""

from __future__ import annotations

from typing import ClassVar

from kvspec.protocols import (
    Capabilities,
    ConnectorFactory,
    EngineConfigView,
    FailureReporting,
    HookGraphMode,
    SchedulerConnector,
    WorkerConnector,
)

from ._scheduler import OffloadScheduler
from ._worker import OffloadWorker

__all__ = ["OffloadConnector"]


class OffloadConnector(ConnectorFactory):
    """Factory of the offloading backend (name ``"offload"``).

    The scheduler role (:class:`~kvspec.backends.offload.OffloadScheduler`) places blocks in
    the workers' host pools and evicts with LRU or ARC; each rank's worker role
    (:class:`~kvspec.backends.offload.OffloadWorker`) holds its pool and moves blocks with
    vectorised gathers and scatters on one background thread. Configuration is read from
    ``config.extra`` (:class:`~kvspec.backends.offload.OffloadSettings`). Holds no state.
    """

    scheduler_class: ClassVar[type[OffloadScheduler]] = OffloadScheduler
    worker_class: ClassVar[type[OffloadWorker]] = OffloadWorker

    @property
    def name(self) -> str:
        """``"offload"``."""
        return "offload"

    @property
    def capabilities(self) -> Capabilities:
        """Async loads, delayed free, ``NO_LAYER_HOOKS``, ``INVALID_BLOCKS``, every layout,
        preemption fences (WRK-012)."""
        return Capabilities(
            async_loads=True,
            delayed_free=True,
            layer_hooks=HookGraphMode.NO_LAYER_HOOKS,
            accepted_layouts=(),
            accepts_split_kv=True,
            failure_reporting=FailureReporting.INVALID_BLOCKS,
            handles_preemptions=True,
        )

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        """Build the scheduler role (:attr:`scheduler_class`)."""
        return self.scheduler_class(config)

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        """Build the worker role of ``rank`` (:attr:`worker_class`)."""
        return self.worker_class(config, rank)
