"""The factory of the host-memory offloading backend: ``kvspec.backends.offload:OffloadConnector``.

Declares asynchronous loads, delayed free, no per-layer hooks (GRA-001: safe under FULL
graphs, DRY-003), failed loads reported as invalid blocks (WRK-011), every stride order
and both K/V packings (LAY-010), and hybrid models: a full-attention group beside
sliding-window groups (KVG-002; with several groups a layer-outermost order, and failed
loads per request, KVG-005). ``SyncLoadOffloadConnector`` loads synchronously instead
(``sync_loads``); it and ``LayerwiseOffloadConnector`` move one group.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvspec.protocols import (
    Capabilities,
    ConnectorFactory,
    EngineConfigView,
    FailureReporting,
    GroupKind,
    HookGraphMode,
    SchedulerConnector,
    WorkerConnector,
)

from ._scheduler import OffloadScheduler
from ._worker import OffloadWorker

__all__ = ["LayerwiseOffloadConnector", "OffloadConnector", "SyncLoadOffloadConnector"]


_FULL_ONLY = frozenset({GroupKind.FULL})


class OffloadConnector(ConnectorFactory):
    """Factory of the offloading backend (name ``"offload"``).

    The scheduler role (``OffloadScheduler``) places blocks in
    the workers' host pools and evicts with LRU or ARC; each rank's worker role
    (``OffloadWorker``) holds its pool and moves blocks with
    vectorised gathers and scatters on one background thread. Configuration is read from
    ``config.extra`` (``OffloadSettings``). Holds no state.
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
        preemption fences (WRK-012), full and sliding-window groups (up to 8) and state
        groups under RUNNING caching (their states stored at block boundaries, STG-003), sleep mode with
        the host tier kept across the sleep (WRK-018, WRK-019)."""
        return Capabilities(
            async_loads=True,
            delayed_free=True,
            layer_hooks=HookGraphMode.NO_LAYER_HOOKS,
            accepted_layouts=(),
            accepts_split_kv=True,
            failure_reporting=FailureReporting.INVALID_BLOCKS,
            handles_preemptions=True,
            fault_injection=True,
            kv_cache_groups=8,
            group_kinds=frozenset({GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.STATE}),
            sleep_mode=True,
        )

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        """Build the scheduler role (``scheduler_class``)."""
        return self.scheduler_class(config)

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        """Build the worker role of ``rank`` (``worker_class``)."""
        return self.worker_class(config, rank)


class LayerwiseOffloadConnector(OffloadConnector):
    """The offloading backend with the capturable per-layer store path (name
    ``"offload-layerwise"``): stores are gathered inside the forward by ``save_kv_layer``
    into a persistent device staging buffer, from a persistent index filled before the
    forward, and copied into the host pool after it (``kvspec.backends.offload._stage``).
    Declares ``CAPTURABLE`` hooks, so FULL graphs keep them (GRA-010); everything else as
    ``OffloadConnector``."""

    @property
    def name(self) -> str:
        """``"offload-layerwise"``."""
        return "offload-layerwise"

    @property
    def capabilities(self) -> Capabilities:
        """As ``OffloadConnector``, with ``CAPTURABLE`` per-layer hooks, one group."""
        return attrs.evolve(super().capabilities, layer_hooks=HookGraphMode.CAPTURABLE,
                            kv_cache_groups=1, group_kinds=_FULL_ONLY)

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        """Build the scheduler role; a match that reaches a store in flight waits for its
        report (SCH-002): the forward gathers a store across steps, so a load of one in
        flight could find it incomplete and fail (SCH-031)."""
        return self.scheduler_class(config, serve_pending=False)

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        """Build the worker role of ``rank`` with ``store_path="layerwise"``."""
        return self.worker_class(config, rank, store_path="layerwise")


class SyncLoadOffloadConnector(OffloadConnector):
    """The offloading backend with synchronous loads (name ``"offload-sync"``): both roles
    run with ``config.extra["sync_loads"] = True`` (``OffloadSettings``). A match is
    ``(n, False)`` and its load is done by ``start_load_kv``, before the step's forward
    reads the KV (WRK-004), and never reported in ``finished_recving``; failed blocks are
    named invalid (WRK-011). A hit then costs the engine no step of waiting for the load.
    A large load on host memory is copied layer by layer by a loader thread while the
    forward runs, and ``wait_for_layer_load`` waits for each layer (WRK-005): hence
    ``EAGER`` per-layer hooks (PIECEWISE graphs only, GRA-002). Declares no async loads;
    everything else as ``OffloadConnector``."""

    @property
    def name(self) -> str:
        """``"offload-sync"``."""
        return "offload-sync"

    @property
    def capabilities(self) -> Capabilities:
        """As ``OffloadConnector``, without async loads, with ``EAGER`` per-layer hooks, one
        group (a failed sync load names block ids, which several groups forbid, KVG-005)."""
        return attrs.evolve(super().capabilities, async_loads=False,
                            layer_hooks=HookGraphMode.EAGER, kv_cache_groups=1,
                            group_kinds=_FULL_ONLY)

    @staticmethod
    def _sync(config: EngineConfigView) -> EngineConfigView:
        if isinstance(config, EngineConfigView):  # else the roles refuse it (ERR-002)
            config = attrs.evolve(config, extra={**config.extra, "sync_loads": True})
        return config

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        """Build the scheduler role with ``sync_loads``."""
        return super().create_scheduler(self._sync(config))

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        """Build the worker role of ``rank`` with ``sync_loads``."""
        return super().create_worker(self._sync(config), rank)
