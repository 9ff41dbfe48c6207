"""The factory of the NIXL backend: ``kvspec.backends.nixl:NixlConnector``.

Declares asynchronous loads, delayed free (the producer holds handed-off blocks until the
consumer read them), no per-layer hooks (GRA-001), failed loads reported as invalid blocks
(WRK-011), every stride order and both K/V packings (LAY-010).
"""

from __future__ import annotations

from typing import ClassVar

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

from ._scheduler import NixlScheduler
from ._worker import NixlWorker

__all__ = ["NixlConnector"]


class NixlConnector(ConnectorFactory):
    """Factory of the NIXL backend (name ``"nixl"``): prefill/decode disaggregation over
    NIXL. Configure the engine's ``role`` as ``PRODUCER`` (prefill) or ``CONSUMER``
    (decode); with ``BOTH`` a request is handed off only when its ``kv_transfer_params``
    say ``{"do_remote_decode": True}``. Settings: ``NixlSettings``.
    Holds no state."""

    scheduler_class: ClassVar[type[NixlScheduler]] = NixlScheduler
    worker_class: ClassVar[type[NixlWorker]] = NixlWorker

    @property
    def name(self) -> str:
        """``"nixl"``."""
        return "nixl"

    @property
    def capabilities(self) -> Capabilities:
        """Async loads, delayed free, ``NO_LAYER_HOOKS``, ``INVALID_BLOCKS``, every layout,
        heterogeneous TP (a consumer rank reads the producer ranks whose KV heads overlap its
        own), full and sliding-window groups (up to 8; several need a layer-outermost
        layout, and a failed READ then fails its request, KVG-005), state groups under
        RUNNING caching beside one full-attention group (the state after the hand-off's
        last whole block, refused across differing state layouts or TP sizes, STG-010,
        STG-011), sleep mode (the KV memory
        deregistered at sleep, a new agent registered at wake, peers re-handshake)."""
        return Capabilities(
            async_loads=True,
            delayed_free=True,
            layer_hooks=HookGraphMode.NO_LAYER_HOOKS,
            accepted_layouts=(),
            accepts_split_kv=True,
            failure_reporting=FailureReporting.INVALID_BLOCKS,
            handles_preemptions=True,
            heterogeneous_tp=True,
            fault_injection=True,  # fail_loads and delay_s on the consumer's READs
            kv_cache_groups=8,
            group_kinds=frozenset({GroupKind.FULL, GroupKind.SLIDING_WINDOW,
                                   GroupKind.STATE}),
            sleep_mode=True,  # deregisters at sleep, a new agent at wake (HSK-006)
        )

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        """Build the scheduler role (``scheduler_class``)."""
        return self.scheduler_class(config)

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        """Build the worker role of ``rank`` (``worker_class``)."""
        return self.worker_class(config, rank)
