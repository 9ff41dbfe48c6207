"""The layerwise-storage connector: per-layer loads and saves that can be captured in graphs.

It keeps blocks in the shared-storage connector's store (``.storage``) but moves them layer
by layer, inside the forward, with device work only (``HookGraphMode.CAPTURABLE``), on
buffers allocated once (``persistent_buffers``, GRA-005) and filled at binding (GRA-007).
A stored block, from hook to file:

1. ``LayerwiseStorageScheduler.build_connector_meta`` plans the saves of the prompt blocks the
   step fills (at most ``max_blocks_per_step``, ``S``);
2. the worker's ``bind_connector_metadata`` writes their ids into ``save_idx``; each layer's
   ``save_kv_layer`` gathers them into the save staging (capturable: GRA-004);
3. ``wait_for_save`` copies the staging to the host (which waits for the forward, WRK-007)
   and writes one file per block;
4. the step's output (``update_connector_output``, in step order) marks them stored;
5. a later match is synchronous, capped at ``S`` blocks a step. ``bind_connector_metadata``
   reads the files into the load staging and sets ``load_idx`` / ``load_mask``; each
   ``wait_for_layer_load`` scatters them into its layer. A missing or corrupt file keeps its
   mask off (the block is untouched) and is reported as a load error (SCH-024).

The hooks run fixed-shape device work with no host sync and no decision taken from the step
(GRA-004), so FULL graphs capture them once and replay them (GRA-006). Padding entries repeat
the first real entry, so duplicate indices in a scatter write the same bytes.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

import attrs
import msgspec
import torch

from kvspec.protocols import (
    AllocatedBlocks, BlockStored, Capabilities, ConnectorFactory, ConnectorMetadata,
    ConnectorStats, EngineConfigView, FailureReporting, ForwardContextView, HookGraphMode,
    InvalidArgumentError, KVCacheLayout, KVConnectorOutput, KVSpecError, MetadataSlot,
    RequestView, SchedulerConnector, SchedulerOutputView, SupportsAggregate, WorkerConnector,
)

from .shared_storage import SharedStorageScheduler
from .storage import (
    KVBlocks, StorageSettings, block_path, check_pairs, decode_metadata, stored_events,
    write_block_file,
)

__all__ = [
    "DEFAULT_MAX_BLOCKS_PER_STEP", "LayerwiseMetadata", "LayerwiseSettings",
    "LayerwiseStorageConnector", "LayerwiseStorageScheduler", "LayerwiseStorageWorker",
]

DEFAULT_MAX_BLOCKS_PER_STEP = 64
"""Default of ``config.extra["max_blocks_per_step"]``: blocks loaded (and saved) per step."""

_log = logging.getLogger(__name__)


class LayerwiseSettings(StorageSettings, frozen=True):
    """``StorageSettings`` plus ``extra["max_blocks_per_step"]`` (an int >= 1): ``S``, the
    size of the persistent buffers, the most blocks one step loads, and the most it saves."""

    max_blocks_per_step: Annotated[int, msgspec.Meta(ge=1)] = DEFAULT_MAX_BLOCKS_PER_STEP


_Pairs = tuple[tuple[int, str], ...]


class _Wire(msgspec.Struct, forbid_unknown_fields=True):  # what encode writes, all required
    kind: Literal["kvspec.layerwise_storage"]
    version: Literal[1]
    loads: _Pairs
    saves: _Pairs
    dummy: bool


class LayerwiseMetadata(msgspec.Struct, frozen=True):
    """One step's per-layer transfers: ``(block_id, key)`` pairs to load and to save (block
    ids distinct; saved keys distinct); ``dummy`` for the job-less metadata of
    ``build_dummy_connector_meta`` (DRY-006). Encodes to a JSON object ``{"kind", "version",
    "loads", "saves", "dummy"}``; ``decode`` accepts exactly that (ERR-005, ERR-006)."""

    loads: _Pairs = ()
    saves: _Pairs = ()
    dummy: bool = False

    def __post_init__(self) -> None:
        check_pairs(self.loads, "loads")
        check_pairs(self.saves, "saves", unique_keys=True)
        if not isinstance(self.dummy, bool):
            raise InvalidArgumentError(f"dummy must be a bool, got {self.dummy!r}")
        if self.dummy and (self.loads or self.saves):
            raise InvalidArgumentError("dummy metadata names a transfer", clause="DRY-006")

    @property
    def is_empty(self) -> bool:
        """True when the metadata describes no transfer."""
        return not (self.loads or self.saves)

    def encode(self) -> bytes:
        """Encode as UTF-8 JSON (ERR-006)."""
        return msgspec.json.encode({"kind": "kvspec.layerwise_storage", "version": 1,
                                    "loads": self.loads, "saves": self.saves, "dummy": self.dummy})

    @classmethod
    def decode(cls, data: bytes) -> LayerwiseMetadata:
        """Decode bytes from ``encode``; MalformedMetadataError for anything else (ERR-005)."""
        return decode_metadata(data, _Wire, "layerwise-storage metadata",
                               lambda w: cls(w.loads, w.saves, w.dummy))


_Load = tuple[str, int, int, str]  # (request id, block index, block id, key)
_Step = tuple[tuple[_Load, ...], tuple[str, ...], tuple[BlockStored, ...]]  # loads, saves


class LayerwiseStorageScheduler(SharedStorageScheduler):
    """Scheduler role of the layerwise-storage connector: the shared-storage scheduler's
    matching, keys, markers and events, with synchronous loads and per-step saves."""

    def __init__(self, config: EngineConfigView) -> None:
        super().__init__(config)
        self._max_blocks = LayerwiseSettings.from_config(config).max_blocks_per_step
        self._views: dict[str, RequestView] = {}  # of the requests scheduled
        self._block_ids: dict[str, list[int]] = {}
        self._save_from: dict[str, int] = {}  # next block index whose save is considered
        self._planned: list[_Load] = []  # loads for the next metadata
        self._steps: collections.deque[_Step] = collections.deque()  # awaiting their output

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Return ``(n, False)``: the base's match, synchronous (loads complete in the step's
        forward, SCH-004), capped so that the step's loads fit ``S`` blocks."""
        count, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        room = max(0, self._max_blocks - len(self._planned)) * self._block_size
        return (None if count is None else min(count, room)), False

    def update_state_after_alloc(
        self, request: RequestView, blocks: AllocatedBlocks, num_external_tokens: int
    ) -> None:
        """Plan a load of the external tokens' blocks into the next metadata (SCH-008..010);
        InvalidArgumentError if they exceed ``S``."""
        rid, n = request.request_id, num_external_tokens
        start = self._asked.get(rid, request.num_computed_tokens)
        if len(self._planned) + -(-n // self._block_size) > self._max_blocks:
            raise InvalidArgumentError(
                f"request {rid!r}: {n} external tokens exceed what this step's loads can hold "
                f"(max_blocks_per_step={self._max_blocks})", clause="SCH-010")
        before = len(self._pending_loads)
        super().update_state_after_alloc(request, blocks, n)
        if len(self._pending_loads) > before:
            job = self._pending_loads.pop()
            self._loading.pop(rid, None)  # synchronous: complete when the step's forward is
            first = start // self._block_size
            self._planned.extend(
                (rid, first + i, block, key) for i, (block, key) in enumerate(job.blocks))

    def request_finished(
        self, request: RequestView, block_ids: tuple[int, ...]
    ) -> tuple[bool, Mapping[str, Any] | None]:
        """Forget the request and its planned load; ``(False, None)``: its saves happened in
        its steps' forwards (SCH-017). UnknownRequestError if unknown (SCH-028)."""
        rid = self._finish(request)
        self._forget(rid)
        self._views.pop(rid, None)
        self._planned = [p for p in self._planned if p[0] != rid]
        return False, None

    def _forget(self, rid: str) -> None:  # its blocks: preempted or finished
        self._block_ids.pop(rid, None)
        self._save_from.pop(rid, None)

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ConnectorMetadata:
        """Describe the loads planned since the last call and the saves of the prompt blocks
        this step fills, once each (SCH-011, SCH-013). Never waits (SCH-014)."""
        out = scheduler_output
        self._clock = time.monotonic()
        bs = self._block_size
        for rid in out.preempted_req_ids:  # their blocks are reused; they come back as new
            self._forget(rid)
        computed: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            self._views[new.request_id] = new.request
        for rid, nc, ids, fresh in (
            *((n.request_id, n.num_computed_tokens, n.blocks.block_ids(0), True)
              for n in out.scheduled_new_reqs),
            *((c.request_id, c.num_computed_tokens, c.new_blocks.block_ids(0),
               c.resumed_from_preemption) for c in out.scheduled_cached_reqs),
        ):
            if fresh or rid not in self._block_ids:  # new, resumed: all its blocks
                self._block_ids[rid], self._save_from[rid] = list(ids), nc // bs
            else:
                self._block_ids[rid].extend(ids)
                self._save_from.setdefault(rid, nc // bs)
            computed[rid] = nc
        loads, self._planned = tuple(self._planned), []
        saves, events = self._plan_saves(out, computed)
        keys = tuple(k for _, k in saves)
        self._steps.append((loads, keys, events))
        self._saving_keys.update(keys)
        return LayerwiseMetadata(loads=tuple((b, k) for _, _, b, k in loads), saves=saves)

    def _plan_saves(
        self, out: SchedulerOutputView, computed: Mapping[str, int]
    ) -> tuple[tuple[tuple[int, str], ...], tuple[BlockStored, ...]]:
        """The step's saves: per scheduled request, from its save cursor to the last prompt
        block the step fills, the blocks neither stored nor being stored; at most ``S`` in
        all (the rest wait for the request's next step)."""
        bs, budget = self._block_size, self._max_blocks
        pairs: dict[int, str] = {}  # block id -> key
        events: list[BlockStored] = []
        for rid, nc in computed.items():
            view, ids = self._views.get(rid), self._block_ids.get(rid)
            if view is None or ids is None:
                continue
            keys = self._block_keys(view)
            end = min((nc + out.num_scheduled_tokens[rid]) // bs,
                      view.num_prompt_tokens // bs, len(keys), len(ids))
            i = self._save_from.get(rid, nc // bs)
            positions: list[int] = []
            while i < end:
                key, block = keys[i], ids[i]
                if not (key in pairs.values() or key in self._saving_keys or block in pairs
                        or self._is_stored(key)):
                    if budget == 0:
                        break
                    budget -= 1
                    pairs[block] = key
                    positions.append(i)
                i += 1
            self._save_from[rid] = i
            events.extend(stored_events(view, keys, positions, bs))
        return tuple(pairs.items()), tuple(events)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Settle the oldest unsettled step (outputs come in step order, SCH-019): unmark its
        loads named in ``invalid_block_ids`` (saved again once recomputed), then mark its
        saves stored. The base refuses reported transfers: none is awaited (SCH-028)."""
        super().update_connector_output(output)
        if not self._steps:
            return
        loads, save_keys, save_events = self._steps.popleft()
        failed = [p for p in loads if p[2] in output.invalid_block_ids]
        self._unmark([key for _, _, _, key in failed])
        for rid, index, _, _ in failed:
            if rid in self._save_from:
                self._save_from[rid] = min(self._save_from[rid], index)
        self._mark_done(save_keys, save_events)

    def shutdown(self) -> None:
        """Forget every request, planned job and unsettled step; idempotent (SCH-027)."""
        super().shutdown()
        for state in (self._views, self._block_ids, self._save_from, self._planned, self._steps):
            state.clear()


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size (no copy): moves are byte exact for
    every dtype, and select/scatter kernels exist for it on every device."""
    as_int = _INT_OF_SIZE.get(t.element_size())
    return t if as_int is None or t.dtype == as_int else t.view(as_int)


@attrs.frozen(eq=False)
class _SlotViews:
    """Fixed views for one layer storage, built at registration (no per-call Python)."""
    slot: int  # the storage's index along the layout's L dim (LAY-011)
    kv: torch.Tensor  # the layer tensor, as integers
    load_src: torch.Tensor  # the load staging of this storage, laid out like kv along dim
    save_dst: torch.Tensor  # the save staging of this storage, laid out like kv along dim
    mask: torch.Tensor  # load_mask viewed to broadcast against load_src


class LayerwiseStorageWorker(WorkerConnector):
    """Worker role of the layerwise-storage connector: rank ``r`` reads its files in
    ``bind_connector_metadata`` and writes them in ``wait_for_save``, on the calling thread;
    the per-layer hooks only run device work on the persistent buffers."""

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        settings = LayerwiseSettings.from_config(config)
        self._rank = rank
        self._dir = settings.directory
        self._max_blocks = settings.max_blocks_per_step
        self._slot: MetadataSlot[LayerwiseMetadata] = MetadataSlot(LayerwiseMetadata)
        self._kv: KVBlocks | None = None
        self._moves: dict[str, int | None] = {}  # layer name -> storage it moves, or None
        self._views: list[_SlotViews] = []
        self._buf: dict[str, torch.Tensor] = {}  # persistent_buffers
        self._dim = 0  # the block dim of the layer tensors
        self._save_keys: tuple[str, ...] = ()
        self._errors: set[int] = set()
        self._counters: dict[str, int] = {}
        self._closed = False

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout
    ) -> None:
        """Keep the caches as ``KVBlocks`` (LayoutMismatchError if they do not match
        ``layout``: LAY-008) and allocate the persistent buffers; only once (WRK-001).
        ``kv_caches`` is in layer order."""
        if self._kv is not None or self._closed:
            raise InvalidArgumentError("register_kv_caches called twice (or after shutdown)",
                                       clause="WRK-001")
        kv = KVBlocks(kv_caches, layout)
        for name, slot in zip(kv_caches, layout.layer_slots):  # the first layer moves
            self._moves[name] = None if slot in self._moves.values() else slot
        s, staged, dev = self._max_blocks, (self._max_blocks, *kv.shape), kv.tensors[0].device
        buf = {name: torch.zeros(shape, dtype=dtype, device=dev) for name, shape, dtype in (
            ("load_idx", s, torch.int64), ("load_mask", s, torch.bool),
            ("save_idx", s, torch.int64), ("load_staging", staged, kv.dtype),
            ("save_staging", staged, kv.dtype))}
        mask = buf["load_mask"].view((1, s, 1, 1, 1) if kv.split else (s, 1, 1, 1))
        for slot, tensor in enumerate(kv.tensors):
            load_src, save_dst = (_bits(buf[f"{d}_staging"][:, slot]) for d in ("load", "save"))
            if kv.split:  # staging rows are (2, H, N, D) blocks; the layer is (2, B, H, N, D)
                load_src, save_dst = load_src.movedim(0, 1), save_dst.movedim(0, 1)
            self._views.append(_SlotViews(slot, _bits(tensor), load_src, save_dst, mask))
        os.makedirs(self._dir, exist_ok=True)
        self._buf, self._kv, self._dim = buf, kv, kv.dim

    @property
    def persistent_buffers(self) -> Mapping[str, torch.Tensor]:
        """The hooks' buffers (GRA-005): ``load_idx``, ``save_idx`` (int64 ``[S]``),
        ``load_mask`` (bool ``[S]``), ``load_staging``, ``save_staging`` (``S`` blocks)."""
        return dict(self._buf)

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        """Bind the step's (or a dummy forward's) metadata and fill the persistent buffers in
        place from it, reading the loads' files into the load staging (WRK-003, GRA-005).
        It came from another process: InvalidArgumentError if it is not
        ``LayerwiseMetadata``, names more than ``S`` loads or saves or names transfers before
        ``register_kv_caches``; InvalidBlockIdError for a block outside the budget (LAY-012)."""
        self._slot.clear()  # bound again below, once the metadata is known to be usable
        self._save_keys = ()
        if not isinstance(metadata, LayerwiseMetadata):
            raise InvalidArgumentError(
                f"expected LayerwiseMetadata, got {type(metadata).__name__}", clause="WRK-003")
        meta, buf, kv, s = metadata, self._buf, self._kv, self._max_blocks
        if kv is None:
            if meta.is_empty:
                self._slot.bind(meta)
                return
            raise InvalidArgumentError("the metadata names transfers but no KV caches are "
                                       "registered (or the worker is shut down)", clause="WRK-001")
        for what, pairs in (("loads", meta.loads), ("saves", meta.saves)):
            if len(pairs) > s:
                raise InvalidArgumentError(
                    f"the metadata names {len(pairs)} {what}; this worker's buffers hold "
                    f"max_blocks_per_step={s}", clause="ERR-002")
            kv.check_budget(pairs, what)
        ok: list[bool] = []
        for i, (block, key) in enumerate(meta.loads):
            try:
                buf["load_staging"][i].copy_(kv.read(self._dir, key, self._rank))
                ok.append(True)
            except (OSError, KVSpecError, RuntimeError, ValueError) as e:
                _log.info("rank %d: load of block %s into %d failed: %s", self._rank, key, block, e)
                self._errors.add(block)
                ok.append(False)
        n = len(ok)
        if 0 < n < s and ok[0]:  # padding repeats entry 0, its bytes included
            buf["load_staging"][n:].copy_(buf["load_staging"][:1].expand(s - n, *kv.shape))
        buf["load_idx"].copy_(_padded([b for b, _ in meta.loads], s))
        buf["load_mask"].copy_(torch.tensor(ok + [bool(ok and ok[0])] * (s - n), dtype=torch.bool))
        buf["save_idx"].copy_(_padded([b for b, _ in meta.saves], s))
        self._save_keys = tuple(k for _, k in meta.saves)
        self._count("blocks_loaded", ok.count(True))
        self._count("blocks_load_failed", ok.count(False))
        self._slot.bind(meta)

    def clear_connector_metadata(self) -> None:
        """Forget the bound metadata (WRK-003)."""
        self._slot.clear()
        self._save_keys = ()

    def build_dummy_connector_meta(self, forward_context: ForwardContextView) -> ConnectorMetadata:
        """Metadata with no transfer (DRY-005..007): the hooks run and move nothing."""
        return LayerwiseMetadata(dummy=True)

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        """Nothing to start: the loads are staged at binding (WRK-004)."""
        self._slot.get("start_load_kv")  # DRY-001

    def _slot_views(self, layer_name: str, hook: str) -> _SlotViews | None:
        """The views ``layer_name`` moves (None: it shares an earlier layer's storage)."""
        self._slot.get(hook)
        if not self._buf:
            raise InvalidArgumentError(
                f"{hook} before register_kv_caches (or after shutdown)", clause="WRK-001")
        if layer_name not in self._moves:
            raise InvalidArgumentError(f"{hook}: unknown layer {layer_name!r}; expected one of "
                                       f"{list(self._moves)}", clause="ERR-002")
        slot = self._moves[layer_name]
        return None if slot is None else self._views[slot]

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Write the staged loads into ``layer_name`` (WRK-005): ``kv[idx] = where(mask,
        staging, kv[idx])`` along the block dim for all ``S`` entries, on the persistent
        buffers only, capturable (GRA-004, GRA-005)."""
        views = self._slot_views(layer_name, "wait_for_layer_load")
        if views is None:
            return
        idx = self._buf["load_idx"]
        current = views.kv.index_select(self._dim, idx)
        views.kv.index_copy_(self._dim, idx, torch.where(views.mask, views.load_src, current))

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, forward_context: ForwardContextView
    ) -> None:
        """Stage the blocks to save from ``kv_layer`` (WRK-006): one fixed-shape gather into
        the save staging, capturable (GRA-004); ``kv_layer`` is shaped like the layer's."""
        views = self._slot_views(layer_name, "save_kv_layer")
        if views is None:
            return
        if kv_layer.shape != views.kv.shape:
            raise InvalidArgumentError(f"save_kv_layer({layer_name!r}): kv_layer is not of the "
                                       f"layer's shape {tuple(views.kv.shape)}", clause="WRK-006")
        views.save_dst.copy_(_bits(kv_layer).index_select(self._dim, self._buf["save_idx"]))

    def wait_for_save(self) -> None:
        """Copy the staged saves to the host (which waits for the forward, WRK-007) and write
        their files. One that cannot be written is logged: its later load fails (WRK-011)."""
        self._slot.get("wait_for_save")
        keys, self._save_keys = self._save_keys, ()
        if not keys:
            return
        host = self._buf["save_staging"][: len(keys)].to("cpu").contiguous()
        written = 0
        for i, key in enumerate(keys):
            try:
                write_block_file(block_path(self._dir, key, self._rank), key, self._rank, host[i])
                written += 1
            except (OSError, KVSpecError, RuntimeError, ValueError) as e:
                _log.warning("rank %d: save of block %s failed: %s", self._rank, key, e)
        self._count("blocks_saved", written)
        self._count("blocks_save_failed", len(keys) - written)

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        """Block ids whose file could not be loaded since the last call (WRK-011, EVT-003)."""
        errors, self._errors = frozenset(self._errors), set()
        return errors

    def get_kv_connector_stats(self) -> SupportsAggregate | None:
        """Blocks loaded, saved and failed since the last call, or None."""
        counters, self._counters = self._counters, {}
        return ConnectorStats(counters) if any(counters.values()) else None

    def shutdown(self) -> None:
        """Drop every reference to the KV caches and the buffers; idempotent (WRK-015)."""
        self._closed = True
        self._slot.clear()
        self._kv, self._views, self._buf, self._save_keys = None, [], {}, ()
        self._errors.clear()

    def _count(self, name: str, n: int) -> None:
        if n:
            self._counters[name] = self._counters.get(name, 0) + n


def _padded(ids: list[int], size: int) -> torch.Tensor:
    """``ids`` padded to ``size`` entries with its first id (0 if empty), as int64."""
    return torch.tensor(ids + [ids[0] if ids else 0] * (size - len(ids)), dtype=torch.int64)


class LayerwiseStorageConnector(ConnectorFactory):
    """Factory of the layerwise-storage connector (``kvspec.conformance.connectors.layerwise:
    LayerwiseStorageConnector``). Holds no state: the roles share only the directory."""

    scheduler_class: ClassVar[type[LayerwiseStorageScheduler]] = LayerwiseStorageScheduler
    worker_class: ClassVar[type[LayerwiseStorageWorker]] = LayerwiseStorageWorker

    @property
    def name(self) -> str:
        """``"layerwise-storage"``."""
        return "layerwise-storage"

    @property
    def capabilities(self) -> Capabilities:
        """Sync loads, no delayed free, ``CAPTURABLE`` hooks, ``INVALID_BLOCKS``, all layouts."""
        return Capabilities(
            async_loads=False, delayed_free=False, layer_hooks=HookGraphMode.CAPTURABLE,
            accepted_layouts=(), accepts_split_kv=True,
            failure_reporting=FailureReporting.INVALID_BLOCKS)

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        """Build the scheduler role (``scheduler_class``)."""
        return self.scheduler_class(config)

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        """Build the worker role of ``rank`` (``worker_class``)."""
        return self.worker_class(config, rank)
