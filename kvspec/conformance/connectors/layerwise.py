"""The layerwise-storage connector: per-layer loads and saves that can be captured in graphs.

A reference connector with capturable per-layer hooks (``HookGraphMode.CAPTURABLE``): it
stores blocks in the shared-storage connector's files and markers (same directory, same keys,
same file format, so either connector reads what the other wrote), but it moves them layer by
layer, inside the forward, with device work only.

Storage
    Exactly ``shared_storage``'s: block ``key`` (the hex of
    the engine's salted chained block hash, SCH-020) of rank ``r`` is the file
    ``block_path`` and counts as stored once
    the marker ``marker_path`` exists.

Scheduler role (``LayerwiseStorageScheduler``)
    Matches like the shared-storage scheduler (whose matching it inherits) but synchronously:
    ``(n, False)``, with ``n`` capped so that one step loads at most ``max_blocks_per_step``
    blocks. A match with external tokens becomes a load in the next metadata. Each step it
    also plans the saves of the prompt blocks that the step's scheduled tokens fill, block
    hash known and not stored yet, at most ``max_blocks_per_step`` of them (the rest follow
    in the request's next scheduled steps). The workers write every save before the step
    ends, so when the step's output arrives (``update_connector_output``, in step order) the
    scheduler writes the markers of that step's saves and emits ``BlockStored``; blocks whose
    load failed lose their marker (``BlockRemoved``) and are saved again once recomputed.
    ``request_finished`` is always ``(False, None)``: nothing reads a block after its step.

Worker role (``LayerwiseStorageWorker``)
    ``register_kv_caches`` allocates every per-step buffer once (GRA-005): ``load_idx`` and
    ``save_idx`` (int64 ``[S]``), ``load_mask`` (bool ``[S]``), and a load and a save staging
    tensor of ``S`` blocks of every layer storage, ``S = max_blocks_per_step``.
    ``bind_connector_metadata`` (eager, GRA-007) fills them in place: block ids, padded to
    ``S`` with the first id (or 0); the loads' files read into the load staging; the mask True
    exactly for the loads whose file was read. A missing or corrupt file leaves the mask off,
    so that block is not touched, and its id is reported by ``get_block_ids_with_load_errors``
    (the engine recomputes it, SCH-024).
    ``wait_for_layer_load`` and ``save_kv_layer`` are pure device work of fixed shape on those
    buffers, with no host sync and no decision taken from the step (GRA-004): a gather of the
    ``S`` indexed blocks, a masked select against the staging, a scatter back
    (``index_select`` / ``where`` / ``index_copy_``); and a gather into the save staging. Under
    FULL graphs they are captured once with dummy metadata and replayed with each step's
    buffers (GRA-006). ``wait_for_save`` (eager) copies the first ``n`` staged saves to the host,
    which waits for the forward's device work (WRK-007), and writes their files.
    ``build_dummy_connector_meta`` returns metadata with no job, built in the worker (DRY-005,
    DRY-006, DRY-007): bound, it makes the hooks rewrite block 0's own bytes, and save nothing.

    Padding entries repeat the first real entry (same block, same mask, same staged bytes),
    so every write of one block in one scatter carries the same bytes, whatever order a device
    applies duplicate indices in. Layers that share storage (LAY-011) are moved once, by the
    first layer of their group; the others' hooks do nothing (a decision fixed at
    registration, not per step).

Configuration (``config.extra``): as the shared-storage connector (``storage_dir`` or
``kvspec.tmpdir``), plus ``max_blocks_per_step`` (int >= 1, default
``DEFAULT_MAX_BLOCKS_PER_STEP``): the size ``S`` of the persistent buffers, the most
blocks one step loads, and the most it saves.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any, ClassVar, NoReturn

import attrs
import torch
from typing_extensions import Self

from kvspec.protocols.metadata import decode_json_envelope
from kvspec.protocols import (
    AllocatedBlocks,
    BlockStored,
    Capabilities,
    ConnectorFactory,
    ConnectorMetadata,
    ConnectorStats,
    EngineConfigView,
    FailureReporting,
    ForwardContextView,
    HookGraphMode,
    InvalidArgumentError,
    InvalidBlockIdError,
    KVCacheLayout,
    KVConnectorOutput,
    KVPacking,
    KVSpecError,
    MalformedMetadataError,
    MetadataSlot,
    RequestView,
    SchedulerConnector,
    SchedulerOutputView,
    SupportsAggregate,
    UnknownRequestError,
    WorkerConnector,
)

from ._checks import check_count, check_request
from .shared_storage import SharedStorageScheduler, StorageSettings, block_path

# Private helpers of the shared-storage connector, imported rather than copied: both
# connectors must agree on key syntax, the block file format and the marker records.
from .shared_storage import _check_key  # key syntax (lowercase hex)
from .shared_storage import _read_block_file  # block file format, read side
from .shared_storage import _SaveRecord  # keys + BlockStored events, for _mark_done
from .shared_storage import _write_block_file  # block file format, write side

__all__ = [
    "DEFAULT_MAX_BLOCKS_PER_STEP",
    "LayerwiseMetadata",
    "LayerwiseStorageConnector",
    "LayerwiseStorageScheduler",
    "LayerwiseStorageWorker",
]

DEFAULT_MAX_BLOCKS_PER_STEP = 64
"""Default of ``config.extra["max_blocks_per_step"]``: blocks loaded (and saved) per step."""

_log = logging.getLogger(__name__)

_META_KIND = "kvspec.layerwise_storage"
_META_VERSION = 1
_META_KEYS = frozenset({"kind", "version", "loads", "saves", "dummy"})


def _max_blocks(config: EngineConfigView) -> int:
    """``config.extra["max_blocks_per_step"]``, validated."""
    value = config.extra.get("max_blocks_per_step", DEFAULT_MAX_BLOCKS_PER_STEP)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(
            f"config.extra['max_blocks_per_step'] is {value!r}; expected an int >= 1 (the "
            "size of the layerwise connector's persistent buffers)",
            clause="ERR-002",
        )
    return value


# ------------------------------------------------------------------------------ metadata


def _check_pairs(value: object, what: str, *, unique_keys: bool) -> tuple[tuple[int, str], ...]:
    """Validate a tuple of ``(block_id, key)`` pairs with distinct block ids."""
    if not isinstance(value, tuple):
        raise InvalidArgumentError(
            f"{what} must be a tuple of (block_id, key) pairs, got {value!r}"
        )
    blocks: set[int] = set()
    keys: set[str] = set()
    for item in value:
        if not isinstance(item, tuple) or len(item) != 2:
            raise InvalidArgumentError(f"{what} holds {item!r}; expected a (block_id, key) pair")
        block, key = item
        if isinstance(block, bool) or not isinstance(block, int) or block < 0:
            raise InvalidBlockIdError(
                f"{what} holds block id {block!r}; expected an int >= 0", clause="ERR-003"
            )
        if block in blocks:
            raise InvalidArgumentError(
                f"{what} names block {block} twice; expected each block moved once per step",
                clause="SCH-013",
            )
        blocks.add(block)
        _check_key(key, f"{what} key")
        if unique_keys and key in keys:
            raise InvalidArgumentError(
                f"{what} names key {key} twice; expected each block stored once", clause="SCH-013"
            )
        keys.add(key)
    return value


def _malformed(detail: str) -> NoReturn:
    raise MalformedMetadataError(
        f"layerwise-storage metadata is malformed: {detail}", clause="ERR-005"
    )


def _wire_pairs(value: object, what: str) -> tuple[tuple[Any, Any], ...]:
    if not isinstance(value, list):
        _malformed(f"{what} is {type(value).__name__}; expected a list of [block_id, key]")
    out: list[tuple[Any, Any]] = []
    for item in value:
        if not isinstance(item, list) or len(item) != 2:
            _malformed(f"{what} holds {item!r}; expected [block_id, key]")
        out.append((item[0], item[1]))
    return tuple(out)


@attrs.frozen
class LayerwiseMetadata:
    """One step's per-layer transfers, from the scheduler role (or, for dummy forwards, the
    worker itself) to every worker.

    Attributes:
        loads: ``(block_id, key)`` pairs: load stored block ``key`` into engine block
            ``block_id`` during the forward, layer by layer. Block ids are distinct.
        saves: ``(block_id, key)`` pairs: store engine block ``block_id`` under ``key``
            from the KV the forward writes. Block ids and keys are distinct.
        dummy: True for metadata from ``build_dummy_connector_meta``; such metadata has no
            job (DRY-006).

    Encodes to a JSON object ``{"kind", "version", "loads", "saves", "dummy"}``;
    ``decode`` accepts exactly that and validates every field (ERR-005, ERR-006).

    Raises:
        InvalidArgumentError: a field is malformed (InvalidBlockIdError for a block id), or
            dummy metadata names a job.
    """

    loads: tuple[tuple[int, str], ...] = ()
    saves: tuple[tuple[int, str], ...] = ()
    dummy: bool = False

    def __attrs_post_init__(self) -> None:
        _check_pairs(self.loads, "loads", unique_keys=False)
        _check_pairs(self.saves, "saves", unique_keys=True)
        if not isinstance(self.dummy, bool):
            raise InvalidArgumentError(f"dummy must be a bool, got {self.dummy!r}")
        if self.dummy and (self.loads or self.saves):
            raise InvalidArgumentError(
                "dummy metadata must describe no transfer", clause="DRY-006"
            )

    @property
    def is_empty(self) -> bool:
        """True when the metadata describes no transfer."""
        return not (self.loads or self.saves)

    def encode(self) -> bytes:
        """Encode as UTF-8 JSON (ERR-006)."""
        return json.dumps(
            {
                "kind": _META_KIND,
                "version": _META_VERSION,
                "loads": [list(p) for p in self.loads],
                "saves": [list(p) for p in self.saves],
                "dummy": self.dummy,
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        """Decode and validate bytes from ``encode``.

        Raises:
            MalformedMetadataError: ``data`` is not exactly what ``encode`` writes, or a
                field is out of range (ERR-005).
        """
        obj = decode_json_envelope(
            data, kind=_META_KIND, version=_META_VERSION, keys=_META_KEYS,
            lists=(), fail=_malformed,
        )
        try:
            return cls(
                loads=_wire_pairs(obj["loads"], "loads"),
                saves=_wire_pairs(obj["saves"], "saves"),
                dummy=obj["dummy"],
            )
        except MalformedMetadataError:
            raise
        except InvalidArgumentError as e:
            _malformed(e.message)


# ----------------------------------------------------------------------------- scheduler


@attrs.frozen
class _StepRecord:
    """What one built step moves, kept until its output arrives."""

    loads: tuple[tuple[str, int, int, str], ...]  # (request id, block index, block id, key)
    saves: _SaveRecord


class LayerwiseStorageScheduler(SharedStorageScheduler):
    """Scheduler role of the layerwise-storage connector. See the module docstring.

    Inherits the shared-storage scheduler's matching (stored-block lookup, hand-off
    deferral), key derivation, request bookkeeping, marker writing and events; replaces its
    asynchronous loads and finish-time saves with synchronous loads and per-step saves.
    """

    def __init__(self, config: EngineConfigView) -> None:
        super().__init__(config)
        self._max_blocks = _max_blocks(config)
        self._views: dict[str, RequestView] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._save_from: dict[str, int] = {}  # next block index whose save is considered
        self._planned: list[tuple[str, int, int, str]] = []  # loads for the next metadata
        self._steps: collections.deque[_StepRecord] = collections.deque()

    # -- seams of the base ------------------------------------------------------------------

    def _is_async(self, count: int) -> bool:
        """Loads complete inside the step's forward: never asynchronous (SCH-004)."""
        return False

    # -- matching ---------------------------------------------------------------------------

    def on_new_request(self, request: RequestView) -> None:
        """Remember the request and its view (SCH-028)."""
        super().on_new_request(request)
        self._views[request.request_id] = request

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Return ``(n, False)``: the shared-storage match, capped so that the step's loads
        fit ``max_blocks_per_step`` blocks; ``(None, False)`` while a hand-off is awaited or
        a save the match reaches is in flight (SCH-031).

        Like the base, the answer depends only on the request, the count, the markers and
        the loads already planned for this step (SCH-001).
        """
        count, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if count is None:
            return None, False
        room = max(0, self._max_blocks - len(self._planned)) * self._block_size
        return min(count, room), False

    def update_state_after_alloc(
        self, request: RequestView, blocks: AllocatedBlocks, num_external_tokens: int
    ) -> None:
        """Remember the request's blocks; plan a load of the external tokens' blocks, if
        any, into the next metadata (SCH-008..010).

        Raises:
            UnknownRequestError: the request was never seen (SCH-028).
            InvalidBlockIdError: a block id is outside the budget (LAY-012).
            InvalidArgumentError: the external tokens are not whole blocks, do not fit
                ``blocks``, exceed the step's ``max_blocks_per_step``, or the request already
                has a load planned in this step (SCH-009).
        """
        check_request(request)
        n = check_count("num_external_tokens", num_external_tokens)
        rid = request.request_id
        start = self._asked.get(rid, request.num_computed_tokens)
        if n:
            if any(p[0] == rid for p in self._planned):
                raise InvalidArgumentError(
                    f"request {rid!r} already has a load planned in this step; expected no "
                    "second load",
                    clause="SCH-009",
                )
            need = -(-n // self._block_size)
            if len(self._planned) + need > self._max_blocks:
                raise InvalidArgumentError(
                    f"request {rid!r}: {need} external blocks on top of the {len(self._planned)} "
                    f"already planned exceed max_blocks_per_step={self._max_blocks}; expected at "
                    "most what get_num_new_matched_tokens answered",
                    clause="SCH-010",
                )
        before = len(self._pending_loads)
        super().update_state_after_alloc(request, blocks, n)
        self._views[rid] = request
        self._block_ids[rid] = list(blocks.block_ids(0))
        if len(self._pending_loads) > before:
            job = self._pending_loads.pop()
            self._loading.pop(rid, None)  # synchronous: complete when the step's forward is
            first = start // self._block_size
            self._planned.extend(
                (rid, first + i, block, key) for i, (block, key) in enumerate(job.blocks)
            )

    # -- finishing --------------------------------------------------------------------------

    def request_finished(
        self, request: RequestView, block_ids: tuple[int, ...]
    ) -> tuple[bool, Mapping[str, Any] | None]:
        """Forget the request; return ``(False, None)``: its saves happened in its steps'
        forwards, so nothing reads its blocks after this (SCH-017).

        A load planned for it and not yet in any metadata is dropped.

        Raises:
            UnknownRequestError: the request was never seen or already finished (SCH-028).
            InvalidBlockIdError: a block id is outside the budget (LAY-012).
        """
        check_request(request)
        rid = request.request_id
        if rid not in self._known:
            raise UnknownRequestError(
                f"request_finished for request {rid!r}, which this connector never saw or "
                "already finished; expected exactly one call per request (SCH-015)",
                request_id=rid,
                clause="SCH-028",
            )
        AllocatedBlocks.single(block_ids).check_budget(self._config.num_blocks)
        self._known.discard(rid)
        self._asked.pop(rid, None)
        self._handoff_until.pop(rid, None)
        self._forget(rid)
        self._views.pop(rid, None)
        self._planned = [p for p in self._planned if p[0] != rid]
        return False, None

    def _forget(self, rid: str) -> None:
        self._block_ids.pop(rid, None)
        self._save_from.pop(rid, None)

    # -- per step ---------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ConnectorMetadata:
        """Describe the loads planned since the last call and the saves of the prompt blocks
        this step fills, once each (SCH-011, SCH-013). Never waits (SCH-014)."""
        if not isinstance(scheduler_output, SchedulerOutputView):
            raise InvalidArgumentError(
                f"scheduler_output must be a SchedulerOutputView, got "
                f"{type(scheduler_output).__name__}",
                clause="ERR-002",
            )
        out = scheduler_output
        self._clock = time.monotonic()
        bs = self._block_size
        for rid in out.preempted_req_ids:  # their blocks are reused; they come back as new
            self._forget(rid)
        computed: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            rid = new.request_id
            self._views[rid] = new.request
            self._block_ids[rid] = list(new.blocks.block_ids(0))
            self._save_from[rid] = new.num_computed_tokens // bs
            computed[rid] = new.num_computed_tokens
        for cached in out.scheduled_cached_reqs:
            rid = cached.request_id
            ids = cached.new_blocks.block_ids(0)
            if cached.resumed_from_preemption or rid not in self._block_ids:
                self._block_ids[rid] = list(ids)
                self._save_from[rid] = cached.num_computed_tokens // bs
            else:
                self._block_ids[rid].extend(ids)
                self._save_from.setdefault(rid, cached.num_computed_tokens // bs)
            computed[rid] = cached.num_computed_tokens
        loads, self._planned = tuple(self._planned), []
        saves, record = self._plan_saves(out, computed)
        self._steps.append(_StepRecord(loads, record))
        self._saving_keys.update(record.keys)
        return LayerwiseMetadata(loads=tuple((b, k) for _, _, b, k in loads), saves=saves)

    def _plan_saves(
        self, out: SchedulerOutputView, computed: Mapping[str, int]
    ) -> tuple[tuple[tuple[int, str], ...], _SaveRecord]:
        """The step's saves: per scheduled request, from its save cursor to the last prompt
        block the step fills, the blocks with a known hash neither stored nor being stored;
        at most ``max_blocks_per_step`` in all (the rest wait for the request's next step)."""
        bs = self._block_size
        budget = self._max_blocks
        pairs: list[tuple[int, str]] = []
        taken_keys: set[str] = set()
        taken_blocks: set[int] = set()
        events: list[BlockStored] = []
        for rid, nc in computed.items():
            view, ids = self._views.get(rid), self._block_ids.get(rid)
            if view is None or ids is None:
                continue
            keys = self._block_keys(view)
            end = min(
                (nc + out.num_scheduled_tokens[rid]) // bs,
                view.num_prompt_tokens // bs, len(keys), len(ids),
            )
            i = self._save_from.get(rid, nc // bs)
            positions: list[int] = []
            while i < end:
                key, block = keys[i], ids[i]
                if not (key in taken_keys or key in self._saving_keys or block in taken_blocks
                        or self._is_stored(key)):
                    if budget == 0:
                        break
                    budget -= 1
                    pairs.append((block, key))
                    positions.append(i)
                    taken_keys.add(key)
                    taken_blocks.add(block)
                i += 1
            self._save_from[rid] = i
            events.extend(self._stored_events(view, keys, positions))
        record = _SaveRecord(tuple(k for _, k in pairs), tuple(events))
        return tuple(pairs), record

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Settle the oldest built step not settled yet (outputs arrive in step order,
        SCH-019): remove the markers of its loads named in ``invalid_block_ids`` (their
        requests save those blocks again once recomputed), then write the markers of its
        saves and queue their ``BlockStored`` events.

        Raises:
            UnknownRequestError: the output reports a finished transfer; this connector
                never awaits one (SCH-028).
        """
        if not isinstance(output, KVConnectorOutput):
            raise InvalidArgumentError(
                f"output must be a KVConnectorOutput, got {type(output).__name__}",
                clause="ERR-002",
            )
        stray = sorted(
            {f"{r} (sending)" for r in output.finished_sending}
            | {f"{r} (recving)" for r in output.finished_recving}
        )
        if stray:
            raise UnknownRequestError(
                f"the output reports {stray}; the layerwise connector's transfers finish "
                "inside the step and are never reported",
                request_id=stray[0].rsplit(" ", 1)[0],
                clause="SCH-028",
            )
        if not self._steps:
            return
        record = self._steps.popleft()
        failed = [p for p in record.loads if p[2] in output.invalid_block_ids]
        if failed:
            self._unmark([key for _, _, _, key in failed])
            for rid, index, _, _ in failed:
                if rid in self._save_from:
                    self._save_from[rid] = min(self._save_from[rid], index)
        self._mark_done(record.saves)

    def shutdown(self) -> None:
        """Forget every request, planned job and unsettled step; idempotent (SCH-027)."""
        super().shutdown()
        for state in (self._views, self._block_ids, self._save_from, self._planned, self._steps):
            state.clear()


# -------------------------------------------------------------------------------- worker

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size (no copy): moves are byte exact for
    every dtype, and select/scatter kernels exist for it on every device."""
    as_int = _INT_OF_SIZE.get(t.element_size())
    return t if as_int is None or t.dtype == as_int else t.view(as_int)


@attrs.frozen(eq=False)
class _Buffers:
    """The persistent per-step buffers (GRA-005), allocated once at registration."""

    load_idx: torch.Tensor  # int64 [S]
    load_mask: torch.Tensor  # bool [S]
    save_idx: torch.Tensor  # int64 [S]
    load_staging: torch.Tensor  # [S, storages, *block], the KV dtype
    save_staging: torch.Tensor  # [S, storages, *block], the KV dtype


@attrs.frozen(eq=False)
class _SlotViews:
    """Fixed views for one layer storage, built at registration (no per-call Python)."""

    slot: int  # the storage's index along the layout's L dim (LAY-011)
    kv: torch.Tensor  # the layer tensor, as integers
    load_src: torch.Tensor  # the load staging of this storage, laid out like kv along dim
    save_dst: torch.Tensor  # the save staging of this storage, laid out like kv along dim
    mask: torch.Tensor  # load_mask viewed to broadcast against load_src


class LayerwiseStorageWorker(WorkerConnector):
    """Worker role of the layerwise-storage connector. See the module docstring.

    Rank ``r`` reads and writes only ``<key>.rank<r>`` files, on the calling thread: loads in
    ``bind_connector_metadata``, saves in ``wait_for_save``. The per-layer hooks only run
    device work on the persistent buffers.
    """

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        self._settings = StorageSettings.from_config(config)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < config.world_size:
            raise InvalidArgumentError(
                f"rank must be an int in [0, {config.world_size}), got {rank!r}",
                clause="ERR-002",
            )
        self._rank = rank
        self._dir = self._settings.directory
        self._max_blocks = _max_blocks(config)
        self._slot: MetadataSlot[LayerwiseMetadata] = MetadataSlot(LayerwiseMetadata)
        self._layout: KVCacheLayout | None = None
        self._moves: dict[str, int | None] = {}  # layer name -> storage it moves, or None
        self._tensors: list[torch.Tensor] = []  # one per distinct layer storage (LAY-011)
        self._views: list[_SlotViews] = []
        self._split = False
        self._dim = 0
        self._block_shape: tuple[int, ...] = ()
        self._buf: _Buffers | None = None
        self._loaded_ok: tuple[bool, ...] = ()  # per load of the bound metadata
        self._save_keys: tuple[str, ...] = ()
        self._errors: set[int] = set()
        self._counters: dict[str, int] = {}
        self._closed = False

    # -- registration -----------------------------------------------------------------------

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout
    ) -> None:
        """Check the tensors against ``layout`` and allocate the persistent buffers, once.

        ``kv_caches`` is in layer order. Only the first layer of each distinct storage moves
        blocks (LAY-011); tensors are indexed, never re-strided (LAY-009).

        Raises:
            InvalidArgumentError: called twice (WRK-001), or arguments of the wrong type.
            LayoutMismatchError: a tensor does not match ``layout`` (LAY-008).
        """
        if self._layout is not None or self._closed:
            raise InvalidArgumentError(
                "register_kv_caches called twice (or after shutdown); expected exactly one "
                "registration per worker",
                clause="WRK-001",
            )
        if not isinstance(layout, KVCacheLayout):
            raise InvalidArgumentError(
                f"layout must be a KVCacheLayout, got {type(layout).__name__}", clause="LAY-007"
            )
        if not isinstance(kv_caches, Mapping):
            raise InvalidArgumentError(
                f"kv_caches must map layer names to tensors, got {type(kv_caches).__name__}",
                clause="WRK-001",
            )
        names, tensors = list(kv_caches), list(kv_caches.values())
        layout.check_layer_tensors(tensors)
        for name, tensor, slot in zip(names, tensors, layout.layer_slots):
            if slot < len(self._tensors):
                self._moves[name] = None
            else:
                self._moves[name] = slot
                self._tensors.append(tensor)
        self._split = layout.packing is KVPacking.SPLIT
        self._dim = 1 if self._split else 0
        per_layer = layout.storage_shape[1:]
        block = (2, *per_layer[2:]) if self._split else per_layer[1:]
        self._block_shape = (len(self._tensors), *block)
        s, device = self._max_blocks, tensors[0].device
        staging = (s, *self._block_shape)
        buf = _Buffers(
            load_idx=torch.zeros(s, dtype=torch.int64, device=device),
            load_mask=torch.zeros(s, dtype=torch.bool, device=device),
            save_idx=torch.zeros(s, dtype=torch.int64, device=device),
            load_staging=torch.zeros(staging, dtype=layout.dtype, device=device),
            save_staging=torch.zeros(staging, dtype=layout.dtype, device=device),
        )
        mask_shape = (1, s, 1, 1, 1) if self._split else (s, 1, 1, 1)
        for slot, tensor in enumerate(self._tensors):
            load_src, save_dst = _bits(buf.load_staging[:, slot]), _bits(buf.save_staging[:, slot])
            if self._split:  # staging rows are (2, H, N, D) blocks; the layer is (2, B, H, N, D)
                load_src, save_dst = load_src.movedim(0, 1), save_dst.movedim(0, 1)
            mask = buf.load_mask.view(mask_shape)
            self._views.append(_SlotViews(slot, _bits(tensor), load_src, save_dst, mask))
        os.makedirs(self._dir, exist_ok=True)
        self._buf = buf
        self._layout = layout

    @property
    def persistent_buffers(self) -> Mapping[str, torch.Tensor]:
        """The buffers the captured hooks read and write, by name (GRA-005): ``load_idx``,
        ``load_mask``, ``save_idx``, ``load_staging``, ``save_staging``. Allocated once in
        ``register_kv_caches`` and only updated in place afterwards; empty before that and
        after shutdown."""
        buf = self._buf
        if buf is None:
            return {}
        return {f.name: getattr(buf, f.name) for f in attrs.fields(_Buffers)}

    # -- metadata ---------------------------------------------------------------------------

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        """Bind the step's (or a dummy forward's) metadata and fill the persistent buffers in
        place from it; read the loads' files into the load staging (WRK-003, GRA-005).

        A load whose file is missing or does not hold the block keeps its mask off (the
        block is left as it is) and its block id is reported by
        ``get_block_ids_with_load_errors``.

        Raises:
            InvalidArgumentError: ``metadata`` is not ``LayerwiseMetadata``, names more
                than ``max_blocks_per_step`` loads or saves, or names transfers before
                ``register_kv_caches``.
            InvalidBlockIdError: a block id is outside the budget (LAY-012).
        """
        self._slot.clear()  # bound again below, once the metadata is known to be usable
        self._loaded_ok, self._save_keys = (), ()
        if not isinstance(metadata, LayerwiseMetadata):
            raise InvalidArgumentError(
                f"expected LayerwiseMetadata, got {type(metadata).__name__}", clause="WRK-003"
            )
        meta = metadata
        buf, layout = self._buf, self._layout
        if buf is None or layout is None:
            if meta.is_empty:
                self._slot.bind(meta)
                return
            raise InvalidArgumentError(
                "the metadata names transfers but no KV caches are registered (or the worker "
                "is shut down); expected register_kv_caches before the first transfer",
                clause="WRK-001",
            )
        s = self._max_blocks
        for what, pairs in (("loads", meta.loads), ("saves", meta.saves)):
            if len(pairs) > s:
                raise InvalidArgumentError(
                    f"the metadata names {len(pairs)} {what}; this worker's buffers hold "
                    f"max_blocks_per_step={s}",
                    clause="ERR-002",
                )
            for block, _ in pairs:
                if block >= layout.num_blocks:
                    raise InvalidBlockIdError(
                        f"{what} names block id {block}, outside the block budget "
                        f"[0, {layout.num_blocks})",
                        clause="LAY-012",
                    )
        ok: list[bool] = []
        for i, (block, key) in enumerate(meta.loads):
            try:
                data = _read_block_file(
                    block_path(self._dir, key, self._rank), key, self._rank,
                    layout.dtype, self._block_shape,
                )
                buf.load_staging[i].copy_(data.view(layout.dtype).reshape(self._block_shape))
                ok.append(True)
            except (OSError, KVSpecError, RuntimeError, ValueError) as e:
                _log.info("rank %d: load of block %s into %d failed: %s", self._rank, key, block, e)
                self._errors.add(block)
                ok.append(False)
        n = len(ok)
        if 0 < n < s and ok[0]:  # padding repeats entry 0, its bytes included
            buf.load_staging[n:].copy_(buf.load_staging[:1].expand(s - n, *self._block_shape))
        load_ids = [b for b, _ in meta.loads]
        buf.load_idx.copy_(_padded(load_ids, s))
        buf.load_mask.copy_(torch.tensor(ok + [bool(ok and ok[0])] * (s - n), dtype=torch.bool))
        buf.save_idx.copy_(_padded([b for b, _ in meta.saves], s))
        self._loaded_ok = tuple(ok)
        self._save_keys = tuple(k for _, k in meta.saves)
        self._count("blocks_loaded", ok.count(True))
        self._count("blocks_load_failed", ok.count(False))
        self._slot.bind(meta)

    def clear_connector_metadata(self) -> None:
        """Forget the bound metadata (WRK-003)."""
        self._slot.clear()
        self._loaded_ok, self._save_keys = (), ()

    def build_dummy_connector_meta(self, forward_context: ForwardContextView) -> ConnectorMetadata:
        """Metadata with no transfer, built here without the scheduler role (DRY-005..007).

        Bound, it fills the same persistent buffers as a real step: every mask off, every
        index 0, no save; the hooks then run the same device work and move nothing.
        """
        if not isinstance(forward_context, ForwardContextView):
            raise InvalidArgumentError(
                f"forward_context must be a ForwardContextView, got "
                f"{type(forward_context).__name__}",
                clause="ERR-002",
            )
        return LayerwiseMetadata(dummy=True)

    # -- the forward ------------------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        """Nothing to start: the loads' bytes are staged at binding and land layer by layer
        in ``wait_for_layer_load`` (WRK-004).

        Raises:
            MetadataNotBoundError: no metadata is bound (DRY-001).
        """
        self._slot.get("start_load_kv")

    def _slot_views(self, layer_name: str, hook: str) -> _SlotViews | None:
        """The views ``layer_name`` moves, or None for a layer sharing an earlier layer's
        storage. Depends only on the registration, never on the step (GRA-004)."""
        self._slot.get(hook)
        if self._buf is None:
            raise InvalidArgumentError(
                f"{hook} before register_kv_caches (or after shutdown)", clause="WRK-001"
            )
        try:
            slot = self._moves[layer_name]
        except KeyError:
            raise InvalidArgumentError(
                f"{hook}: unknown layer {layer_name!r}; expected one of the registered "
                f"layers {list(self._moves)}",
                clause="ERR-002",
            ) from None
        return None if slot is None else self._views[slot]

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Write the staged loads into ``layer_name`` (WRK-005): device work of fixed shape
        on the persistent buffers only, capturable (GRA-004, GRA-005).

        ``kv[idx] = where(mask, staging, kv[idx])`` along the block dim, for all ``S`` entries.

        Raises:
            MetadataNotBoundError: no metadata is bound (DRY-001).
            InvalidArgumentError: ``layer_name`` was not registered.
        """
        views = self._slot_views(layer_name, "wait_for_layer_load")
        if views is None:
            return
        idx = self._buffers().load_idx
        current = views.kv.index_select(self._dim, idx)
        views.kv.index_copy_(self._dim, idx, torch.where(views.mask, views.load_src, current))

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, forward_context: ForwardContextView
    ) -> None:
        """Stage the blocks to save from ``kv_layer`` (WRK-006): one gather of fixed shape
        into the persistent save staging, capturable (GRA-004, GRA-005).

        Raises:
            MetadataNotBoundError: no metadata is bound (DRY-001).
            InvalidArgumentError: ``layer_name`` was not registered, or ``kv_layer`` is not
                shaped like its registered tensor.
        """
        views = self._slot_views(layer_name, "save_kv_layer")
        if views is None:
            return
        if not isinstance(kv_layer, torch.Tensor) or kv_layer.shape != views.kv.shape:
            raise InvalidArgumentError(
                f"save_kv_layer({layer_name!r}): kv_layer must be the layer's registered "
                f"tensor of shape {tuple(views.kv.shape)}",
                clause="WRK-006",
            )
        views.save_dst.copy_(_bits(kv_layer).index_select(self._dim, self._buffers().save_idx))

    def wait_for_save(self) -> None:
        """Copy the staged saves to the host (which waits for the forward's device work,
        WRK-007) and write their files, on this thread. A file that cannot be written is
        logged and skipped: a later load of it fails and is reported (WRK-011).

        Raises:
            MetadataNotBoundError: no metadata is bound (DRY-001).
        """
        self._slot.get("wait_for_save")
        keys, self._save_keys = self._save_keys, ()
        if not keys:
            return
        host = self._buffers().save_staging[: len(keys)].to("cpu").contiguous()
        written = 0
        for i, key in enumerate(keys):
            try:
                _write_block_file(block_path(self._dir, key, self._rank), key, self._rank, host[i])
                written += 1
            except (OSError, KVSpecError, RuntimeError, ValueError) as e:
                _log.warning("rank %d: save of block %s failed: %s", self._rank, key, e)
        self._count("blocks_saved", written)
        self._count("blocks_save_failed", len(keys) - written)

    # -- output -----------------------------------------------------------------------------

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        """Block ids whose file could not be loaded since the last call, each once
        (WRK-011, EVT-003); they were left untouched."""
        errors, self._errors = frozenset(self._errors), set()
        return errors

    def get_kv_connector_stats(self) -> SupportsAggregate | None:
        """Blocks loaded, failed to load, saved and failed to save since the last call, or
        None if none."""
        counters, self._counters = self._counters, {}
        return ConnectorStats(counters) if any(counters.values()) else None

    def shutdown(self) -> None:
        """Drop every reference to the KV caches and the buffers; idempotent (WRK-015)."""
        self._closed = True
        self._slot.clear()
        self._tensors, self._views, self._buf = [], [], None
        self._loaded_ok, self._save_keys = (), ()
        self._errors.clear()

    # -- helpers ----------------------------------------------------------------------------

    def _buffers(self) -> _Buffers:
        buf = self._buf
        if buf is None:
            raise InvalidArgumentError(
                "no KV caches are registered (or the worker is shut down)", clause="WRK-001"
            )
        return buf

    def _count(self, name: str, n: int) -> None:
        if n:
            self._counters[name] = self._counters.get(name, 0) + n


def _padded(ids: list[int], size: int) -> torch.Tensor:
    """``ids`` padded to ``size`` entries with its first id (0 if empty), as int64."""
    return torch.tensor(ids + [ids[0] if ids else 0] * (size - len(ids)), dtype=torch.int64)


# ------------------------------------------------------------------------------- factory


class LayerwiseStorageConnector(ConnectorFactory):
    """Factory of the layerwise-storage connector
    (``kvspec.conformance.connectors.layerwise:LayerwiseStorageConnector``).

    Declares synchronous loads, no delayed free, capturable per-layer hooks, failed loads
    reported as invalid blocks, every stride order and both K/V packings. Holds no state:
    the roles share only the storage directory.
    """

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
            async_loads=False,
            delayed_free=False,
            layer_hooks=HookGraphMode.CAPTURABLE,
            accepted_layouts=(),
            accepts_split_kv=True,
            failure_reporting=FailureReporting.INVALID_BLOCKS,
        )

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        """Build the scheduler role (``scheduler_class``)."""
        return self.scheduler_class(config)

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        """Build the worker role of ``rank`` (``worker_class``)."""
        return self.worker_class(config, rank)

