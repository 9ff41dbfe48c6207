"""The worker role of a KV connector: one instance per worker rank, in the worker process."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch

from .errors import UnsupportedOperationError
from .events import KVCacheEvent, KVConnectorOutput, SupportsAggregate
from .layout import KVCacheLayout, StateLayout
from .metadata import ConnectorMetadata, HandshakeMetadata
from .views import ForwardContextView

__all__ = ["WorkerConnector"]


@runtime_checkable
class WorkerConnector(Protocol):
    """The connector's worker role.

    Subclass it to inherit the documented defaults of the optional methods, or implement every
    method to satisfy it structurally. The engine calls the hooks of one forward in this
    order (docs/spec/state-machines.md): ``bind_connector_metadata``, ``start_load_kv``,
    per layer ``wait_for_layer_load`` then ``save_kv_layer``, ``wait_for_save``,
    ``clear_connector_metadata``; then the output hooks (``get_finished`` and friends, gathered
    by ``build_connector_output``). Which of these run in dummy and graph forwards is
    decided by ``kvspec.protocols.plan_forward`` from the connector's declared
    ``HookGraphMode`` (DRY and GRA clauses).
    """

    # -- required -------------------------------------------------------------------------

    @abstractmethod
    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout
    ) -> None:
        """Receive this rank's KV-cache tensors, by layer name, and their layout descriptor.

        When: exactly once, after the caches are allocated and before the first forward that
        can move KV (WRK-001); never during the profile run (DRY-002).

        May assume: the descriptor is true of every tensor (LAY-006); ``layout.num_blocks`` is
        the budget and ``layout.block_capacity`` may be larger (LAY-003).

        Must never: assume anything the descriptor does not state (LAY-007), re-stride or
        re-allocate the tensors (WRK-002, LAY-009), or move storage shared by several layers
        more than once per block (LAY-011).
        """

    @abstractmethod
    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        """Bind the metadata of the forward about to run (WRK-003).

        When: before every forward in which a hook runs: with the step's metadata for real
        and replayed steps, with the connector's own dummy metadata for dummy runs of a
        capturable connector (DRY-005). Runs outside any captured region (GRA-007); a
        capturable connector copies per-step state into its persistent buffers here (GRA-005).
        """

    @abstractmethod
    def clear_connector_metadata(self) -> None:
        """Forget the bound metadata, after ``wait_for_save`` (WRK-003)."""

    @abstractmethod
    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        """Start the loads the bound metadata describes.

        When: once per forward in which hooks run, after binding and before the first layer
        (WRK-004), outside any captured region (GRA-007).
        Must: write only blocks the metadata names (WRK-002, SCH-010); loads may complete
        asynchronously.
        """

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until no save still reads a block the next step may overwrite (WRK-007).

        When: after the last layer, before ``clear_connector_metadata``, outside any captured
        region (GRA-007). Any wait is bounded (WRK-014). In a speculative step (a drafter,
        SPD-001) it comes after the output hooks and the draft passes: a save it completes
        is reported in a later step's output, never in this step's and never dropped
        (SPD-004).
        """

    # -- optional, with defaults ------------------------------------------------------------

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until the loads into ``layer_name`` are complete (WRK-005).

        When: for connectors with per-layer hooks, once per layer per forward, in layer
        order, before the layer's attention. Under FULL graphs a capturable connector's call
        is captured once and replayed (GRA-004). Never called for ``NO_LAYER_HOOKS``
        connectors (DRY-003). A draft layer (``EngineConfigView.draft_layer_names``) is
        called once per draft pass, after the step's output hooks (SPD-001, SPD-002).
        Default: does nothing.
        """
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, forward_context: ForwardContextView
    ) -> None:
        """Start saving the KV just written to ``layer_name`` (WRK-006).

        When: for connectors with per-layer hooks, once per layer per forward, in layer
        order, after the layer's KV for the scheduled tokens is written. ``kv_layer`` is the
        layer's registered tensor. Same graph rules as ``wait_for_layer_load``. A draft
        layer is called once per draft pass of a speculative step, after the output hooks:
        what is saved for it is its content after the last pass, once (SPD-002), and the
        draft layers' KV belongs to the prefix like the target's (SPD-003). Only blocks whose
        every token was accepted are stored (SPD-005).
        Default: does nothing.
        """
        return None

    def handle_preemptions(self, preempted_req_ids: frozenset[str]) -> None:
        """Fence in-flight transfers of preempted requests (WRK-012).

        When: before the forward of the step that preempts them, before their blocks are
        reused. Must return only when no transfer still reads or writes their blocks.
        Default: does nothing (right for connectors without asynchronous saves).
        """
        return None

    def get_finished(
        self, finished_req_ids: frozenset[str]
    ) -> tuple[frozenset[str], frozenset[str]]:
        """Return ``(finished_sending, finished_recving)`` request ids since the last call.

        When: once per executed step after the forward, or in its place (WRK-008);
        ``finished_req_ids`` are the requests that finished in this step. In a speculative
        step it runs after the target layers and before the draft passes and
        ``wait_for_save`` (SPD-001): it must not report a save that has not completed yet
        (SPD-004).
        Must: report each request at most once per direction (WRK-009), and only requests
        it was told about (WRK-010); a failed receive is reported too (WRK-011).
        Default: nothing finished (right for connectors without async transfers).
        """
        return frozenset(), frozenset()

    def get_failed_recving(self) -> frozenset[str]:
        """Return requests whose receive failed, a subset of this step's finished_recving.

        Called right after ``get_finished`` in the same step (WRK-011, EVT-002).
        Default: none.
        """
        return frozenset()

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        """Return block ids whose load failed since the last call (WRK-011, EVT-003).

        Default: none.
        """
        return frozenset()

    def get_kv_connector_stats(self) -> SupportsAggregate | None:
        """Return transfer stats since the last call, reducible across ranks (EVT-006).

        Default: None.
        """
        return None

    def get_kv_connector_kv_cache_events(self) -> tuple[KVCacheEvent, ...]:
        """Return KV-cache events since the last call, each once (EVT-004).

        Default: none.
        """
        return ()

    def build_connector_worker_meta(self) -> SupportsAggregate | None:
        """Return worker metadata for the scheduler role, reducible across ranks (WRK-016).

        Default: None.
        """
        return None

    def get_finished_count_override(self) -> int | None:
        """Return an expected report count for requests first reported in this step (EXE-008).

        Default: None.
        """
        return None

    def build_connector_output(self, finished_req_ids: frozenset[str]) -> KVConnectorOutput:
        """Gather this step's output: the engine's single call for the output hooks.

        When: once per executed step (WRK-008); never for a dummy run (DRY-008). In a
        speculative step: before the draft passes and ``wait_for_save`` (SPD-001); the
        output must be built afresh, never an object cached before drafting (SPD-004).
        Default: calls ``get_finished``, ``get_failed_recving``,
        ``get_block_ids_with_load_errors``, ``get_kv_connector_stats``,
        ``get_kv_connector_kv_cache_events``, ``build_connector_worker_meta`` and
        ``get_finished_count_override``, in that order, into one validated output.
        """
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorOutput(
            finished_sending=sending,
            finished_recving=recving,
            failed_recving=self.get_failed_recving(),
            invalid_block_ids=self.get_block_ids_with_load_errors(),
            stats=self.get_kv_connector_stats(),
            events=self.get_kv_connector_kv_cache_events(),
            worker_metadata=self.build_connector_worker_meta(),
            expected_finished_count=self.get_finished_count_override(),
        )

    def build_dummy_connector_meta(self, forward_context: ForwardContextView) -> ConnectorMetadata:
        """Build, in this worker, metadata for a dummy forward that moves nothing.

        When: only for connectors that declare capturable hooks, before every warm-up and
        capture forward (DRY-005), in the worker process without calling the scheduler role
        (DRY-007). The result must describe no transfer (DRY-006) and must set up the same
        persistent buffers a real step uses, so that what is captured is what replays.
        Default: raises UnsupportedOperationError: only capturable connectors implement it.
        """
        raise UnsupportedOperationError(
            f"{type(self).__name__} does not build dummy metadata; only connectors that "
            "declare HookGraphMode.CAPTURABLE implement build_dummy_connector_meta",
            clause="DRY-005",
        )

    def register_state_caches(
        self, state_caches: Mapping[str, torch.Tensor], layouts: Mapping[int, StateLayout]
    ) -> None:
        """Receive this rank's state-layer tensors, by layer name, and each state group's
        layout, by group index into ``EngineConfigView.kv_cache_groups`` (STG-001).

        When: only with a ``GroupKind.STATE`` group (a connector that does not declare
        STATE is refused first, KVG-002): exactly once, right after ``register_kv_caches``,
        before the first forward that can move KV; again after every ``restore_kv_caches``
        with the re-allocated tensors. ``register_kv_caches`` then holds the attention
        layers only, and ``EngineConfigView.num_layers`` counts those.
        May assume: every layer of a state group is in ``state_caches`` and its group's
        layout is true of its tensor (``StateLayout.check_tensor``); the engine calls no
        per-layer hook for state layers (STG-005), so state moves only in step-level hooks.
        Must never: re-stride or re-allocate the tensors (WRK-002), or write a step's load
        targets before that step's ``start_load_kv`` (STG-009).
        Default: raises UnsupportedOperationError: only connectors that declare
        ``GroupKind.STATE`` implement it.
        """
        raise UnsupportedOperationError(
            f"{type(self).__name__} does not declare GroupKind.STATE and cannot register "
            "state caches", clause="STG-001",
        )

    def unregister_kv_caches(self) -> None:
        """Drop every registration of the KV tensors before the engine sleeps (WRK-018).

        When: only for connectors that declare ``Capabilities.sleep_mode`` (WRK-020), after
        ``register_kv_caches``, once the engine has drained: no request is running or
        waiting for remote KV, every delayed free was reported in ``finished_sending``
        (SCH-016), no step is in flight and no metadata is bound. The scheduler role keeps
        its state; the worker is not shut down.
        May assume: no hook of this rank runs until ``restore_kv_caches`` except
        ``unregister_kv_caches`` again and ``shutdown``.
        Must: return only when nothing of this rank (a transfer, a background thread, a
        registration with a transfer library, a prepared descriptor) can still read or
        write the tensors registered so far, which the engine frees right after; keep what
        does not live in them (a host tier, its index, peers' information) if it wants
        to serve it after wake. Be idempotent.
        Must never: touch the registered tensors after returning (WRK-018).
        Default: raises UnsupportedOperationError: only sleep-capable connectors implement it.
        """
        raise UnsupportedOperationError(
            f"{type(self).__name__} does not declare Capabilities.sleep_mode and cannot "
            "unregister its KV caches", clause="WRK-020",
        )

    def restore_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout
    ) -> None:
        """Register the KV tensors the engine re-allocated at wake (WRK-019).

        When: after ``unregister_kv_caches``, before the first step after wake and before
        the engine collects ``get_handshake_metadata`` again (HSK-006). ``kv_caches`` has
        the same layer names and ``layout`` the same geometry as at ``register_kv_caches``
        (LAY-006); the tensors may lie at new addresses (kvspec's harness re-allocates them)
        or at the same ones over new memory (vLLM's cumem allocator remaps the same virtual
        range). Their contents are undefined: the engine recomputes or reloads what it needs.
        Must: use only these tensors from now on, and register them wherever the old ones
        were (a transfer library, a pinned region); keep serving what it kept in its own
        memory (WRK-013 holds for every load after wake). Be idempotent: a second call
        without an ``unregister_kv_caches`` between does nothing.
        Must never: read or write a tensor registered before the sleep (WRK-019).
        Default: raises UnsupportedOperationError.
        """
        raise UnsupportedOperationError(
            f"{type(self).__name__} does not declare Capabilities.sleep_mode and cannot "
            "restore its KV caches", clause="WRK-020",
        )

    def get_handshake_metadata(self) -> HandshakeMetadata | None:
        """Return what peers need to reach this rank, or None (HSK-001, HSK-002).

        When: once after ``register_kv_caches``, before the first step, and again after
        every ``restore_kv_caches`` (HSK-006): the metadata then describes the restored
        tensors and registrations; what was published before the sleep is invalid.
        Default: None.
        """
        return None

    def shutdown(self) -> None:
        """Release every registration, buffer, thread and process of this rank (WRK-015).

        Must be idempotent and finish within a bounded time.
        Default: does nothing.
        """
        return None
