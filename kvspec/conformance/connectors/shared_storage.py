"""The shared-storage connector: saves finished requests' blocks to files, loads them later.

A reference connector with asynchronous loads and delayed frees. Every process of every
engine shares one directory (``StorageSettings``) and the file store of ``.storage``.
A stored block, from hook to file:

1. ``SharedStorageScheduler.request_finished`` plans a ``SaveJob`` of the request's computed
   blocks not stored yet, and delays their free (SCH-016);
2. ``build_connector_meta`` hands it to every worker in ``SharedStorageMetadata``;
3. ``SharedStorageWorker.start_load_kv`` (or ``clear_connector_metadata`` in a step without a
   forward) snapshots the blocks, and the background thread writes one file per block
   (``_write_blocks``);
4. ``get_finished`` reports the save; the scheduler's ``update_connector_output`` writes the
   blocks' markers and emits ``BlockStored``;
5. ``get_num_new_matched_tokens`` matches the block (asynchronously, leaving one prompt token
   to compute: SCH-005), ``update_state_after_alloc`` plans a ``LoadJob``, and the background
   thread reads the file back (``_load_blocks``). A failed or timed-out load is reported with
   its blocks invalid (WRK-011, WRK-014); the scheduler unmarks them, to be stored again.

Prefill/decode hand-off: a ``TransferRole.PRODUCER`` engine's ``request_finished`` returns
``kv_transfer_params = {"kvspec.shared_storage": {"blocks": n}}`` (the first ``n`` blocks
are stored or being stored); a request arriving with them has its match deferred (SCH-002)
until they are all marked stored, for at most ``handoff_timeout_s``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, Literal

import attrs
import msgspec
import torch
from typing_extensions import Self

from kvspec.protocols import (
    AllocatedBlocks, BlockStored, Capabilities, ConnectorFactory, ConnectorMetadata,
    ConnectorStats, EngineConfigView, FailureReporting, FaultPlan, ForwardContextView,
    HookGraphMode, InvalidArgumentError, KVCacheEvent, KVCacheLayout,
    KVConnectorOutput, KVSpecError, MetadataSlot, RequestView, SchedulerConnector,
    SchedulerOutputView, SupportsAggregate, TransferRole, UnknownRequestError, WorkerConnector,
)

from ._transfers import IoThread, Transfer
from .storage import (
    KVBlocks, StorageSettings, block_path, check_pairs, decode_metadata, mark_stored,
    marked_events, marker_path, removed_event, stored_events, unmark, write_block_file,
)

__all__ = [
    "HANDOFF_PARAM", "LoadJob", "SaveJob", "SharedStorageConnector", "SharedStorageMetadata",
    "SharedStorageScheduler", "SharedStorageWorker", "StorageSettings", "block_path",
    "marker_path",
]

HANDOFF_PARAM = "kvspec.shared_storage"
"""The ``kv_transfer_params`` key of a producer's hand-off: ``{"blocks": n}``."""

_log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------ metadata

_Pairs = tuple[tuple[int, str], ...]


class _Job(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: str
    blocks: _Pairs  # (block_id, key) pairs, in token order

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidArgumentError(f"request_id must be a non-empty str, got "
                                       f"{self.request_id!r}")
        check_pairs(self.blocks, f"{type(self).__name__}.blocks", non_empty=True)


class LoadJob(_Job, frozen=True, forbid_unknown_fields=True):
    """Load stored blocks into engine blocks for one request. Construction raises
    InvalidArgumentError (InvalidBlockIdError for a block id) for a malformed field."""


class SaveJob(_Job, frozen=True, forbid_unknown_fields=True):
    """Store engine blocks under keys for one finished request; with ``report`` the workers
    report it in ``finished_sending`` once the files are written (the free was delayed)."""

    report: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.report, bool):
            raise InvalidArgumentError(f"SaveJob.report must be a bool, got {self.report!r}")


class _SaveWire(msgspec.Struct, forbid_unknown_fields=True):
    request_id: str
    blocks: _Pairs
    report: bool  # required on the wire


class _Wire(msgspec.Struct, forbid_unknown_fields=True):  # what encode writes, all required
    kind: Literal["kvspec.shared_storage"]
    version: Literal[1]
    loads: tuple[LoadJob, ...]
    saves: tuple[_SaveWire, ...]
    aborted_loads: tuple[str, ...]


class SharedStorageMetadata(msgspec.Struct, frozen=True):
    """One step's transfers, from the scheduler role to every worker (SCH-011, SCH-013).

    Each request appears at most once per list. ``aborted_loads``: requests aborted while
    their load was in flight (SCH-021), which the workers still report in
    ``finished_recving``. Encodes to a JSON object ``{"kind", "version", "loads", "saves",
    "aborted_loads"}``; ``decode`` accepts exactly that (ERR-005, ERR-006).
    """

    loads: tuple[LoadJob, ...] = ()
    saves: tuple[SaveJob, ...] = ()
    aborted_loads: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, ids in (("loads", [j.request_id for j in self.loads]),
                          ("saves", [j.request_id for j in self.saves]),
                          ("aborted_loads", list(self.aborted_loads))):
            if len(set(ids)) != len(ids) or not all(isinstance(i, str) and i for i in ids):
                raise InvalidArgumentError(f"{name} names a request twice or an empty id: "
                                           f"{ids!r}", clause="SCH-013")

    @property
    def is_empty(self) -> bool:
        """True when the metadata describes nothing."""
        return not (self.loads or self.saves or self.aborted_loads)

    def encode(self) -> bytes:
        """Encode as UTF-8 JSON (ERR-006)."""
        return msgspec.json.encode({
            "kind": "kvspec.shared_storage", "version": 1, "loads": self.loads,
            "saves": self.saves, "aborted_loads": self.aborted_loads,
        })

    @classmethod
    def decode(cls, data: bytes) -> Self:
        """Decode and validate bytes from ``encode``; MalformedMetadataError (ERR-005) for
        anything else."""
        return decode_metadata(data, _Wire, "shared-storage metadata", lambda w: cls(
            w.loads, tuple(SaveJob(s.request_id, s.blocks, s.report) for s in w.saves),
            w.aborted_loads))


# ----------------------------------------------------------------------------- scheduler


@attrs.frozen
class _SaveRecord:
    """A save the scheduler waits for: its keys and the events to emit when it is done."""

    keys: tuple[str, ...]
    events: tuple[BlockStored, ...]


class SharedStorageScheduler(SchedulerConnector):
    """Scheduler role of the shared-storage connector. See the module docstring."""

    def __init__(self, config: EngineConfigView) -> None:
        self._settings = StorageSettings.from_config(config)
        self._config = config
        self._block_size = config.block_size
        self._dir = self._settings.directory
        os.makedirs(self._dir, exist_ok=True)
        self._known: set[str] = set()
        self._asked: dict[str, int] = {}  # where a request's external tokens start
        self._loading: dict[str, LoadJob] = {}  # awaiting the aggregated finished_recving
        self._saving: dict[str, _SaveRecord] = {}  # awaiting the aggregated finished_sending
        self._saving_keys: set[str] = set()
        self._pending_loads: list[LoadJob] = []
        self._pending_saves: list[SaveJob] = []
        self._pending_aborts: list[str] = []
        self._events: list[KVCacheEvent] = []
        self._handoff_until: dict[str, float] = {}  # when a hand-off's deferral ends
        self._clock = time.monotonic()  # the step's time: a step's matches agree (SCH-001)

    def _block_keys(self, request: RequestView) -> tuple[str, ...]:
        """Storage keys of the request's full blocks: its salted block hashes (SCH-020)."""
        return tuple(h.hex() for h in request.block_hashes)

    def _match_limit(self, request: RequestView) -> int:
        """How many leading blocks a match may reach: one prompt token stays (SCH-005)."""
        return (request.num_prompt_tokens - 1) // self._block_size

    def _known_id(self, request: RequestView, hook: str) -> str:
        if request.request_id not in self._known:
            raise UnknownRequestError(
                f"{hook} for request {request.request_id!r}, which this connector never saw or "
                "already finished (SCH-015)", request_id=request.request_id, clause="SCH-028")
        return request.request_id

    def _finish(self, request: RequestView) -> str:
        """Forget a finishing request (SCH-028 if unknown); return its id."""
        rid = self._known_id(request, "request_finished")
        self._known.discard(rid)
        self._asked.pop(rid, None)
        self._handoff_until.pop(rid, None)
        return rid

    def _is_stored(self, key: str) -> bool:
        """True when block ``key`` is stored by every rank (its marker exists)."""
        return os.path.exists(marker_path(self._dir, key))

    def _match(self, request: RequestView, num_computed_tokens: int) -> int:
        """Tokens of consecutive stored blocks from ``num_computed_tokens``, block aligned."""
        bs, keys = self._block_size, self._block_keys(request)
        start = stop = num_computed_tokens // bs
        end = min(len(keys), self._match_limit(request)) if num_computed_tokens % bs == 0 else 0
        while stop < end and self._is_stored(keys[stop]):
            stop += 1
        return (stop - start) * bs

    @staticmethod
    def _announced_blocks(request: RequestView) -> int | None:
        """The block count of a producer's hand-off in the request's params (a client's:
        anything but ``{"blocks": int >= 0}`` counts as none)."""
        entry = (request.kv_transfer_params or {}).get(HANDOFF_PARAM)
        blocks = entry.get("blocks") if isinstance(entry, Mapping) else None
        ok = isinstance(blocks, int) and not isinstance(blocks, bool) and blocks >= 0
        return blocks if ok else None

    def _deferred(self, request: RequestView, num_computed_tokens: int, count: int) -> bool:
        """True while the match waits (SCH-002): a handed-off request's announced blocks are
        not all stored yet (until its deferral ends), or the block after the match is in a
        save whose report is awaited (SCH-031), which an idle gap would otherwise miss."""
        bs = self._block_size
        if num_computed_tokens % bs:
            return False
        keys, limit = self._block_keys(request), self._match_limit(request)
        announced = self._announced_blocks(request)
        until = self._handoff_until.get(request.request_id)
        if announced is not None and until is not None and self._clock < until and (
                num_computed_tokens + count < min(announced, limit, len(keys)) * bs):
            return True
        i = (num_computed_tokens + count) // bs
        return i < min(len(keys), limit) and any(keys[i] in r.keys for r in self._saving.values())

    def on_new_request(self, request: RequestView) -> None:
        """Remember the request's id (SCH-028), and when a hand-off's deferral ends."""
        self._known.add(request.request_id)
        if self._announced_blocks(request) is not None:
            self._handoff_until[request.request_id] = (
                time.monotonic() + self._settings.handoff_timeout_s)

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Return ``(n, n > 0)``: ``n`` tokens of stored blocks after the computed ones, or
        ``(None, False)`` (SCH-002) while a hand-off is awaited or the match reaches a block
        this engine is still saving (SCH-031). Reads only the markers (SCH-001); remembers
        ``num_computed_tokens``: where a following allocation's external tokens start."""
        count = self._match(request, num_computed_tokens)
        self._known.add(request.request_id)
        self._asked[request.request_id] = num_computed_tokens
        return (None, False) if self._deferred(request, num_computed_tokens, count) else (
            count, count > 0)

    def update_state_after_alloc(
        self, request: RequestView, blocks: AllocatedBlocks, num_external_tokens: int
    ) -> None:
        """Plan a load of the external tokens' blocks, which start where the latest match
        started (SCH-008..010). UnknownRequestError for a request never seen (SCH-028),
        InvalidBlockIdError for a block outside the budget (LAY-012)."""
        rid = self._known_id(request, "update_state_after_alloc")
        if num_external_tokens == 0:
            return
        blocks.check_budget(self._config.num_blocks)
        if rid in self._loading:
            raise InvalidArgumentError(
                f"request {rid!r} already has a load in flight; expected no second load "
                "before finished_recving", clause="SCH-009")
        start = self._asked.get(rid, request.num_computed_tokens)
        first, last = start // self._block_size, (start + num_external_tokens) // self._block_size
        keys, ids = self._block_keys(request), blocks.block_ids(0)
        job = LoadJob(rid, tuple((ids[i], keys[i]) for i in range(first, last)))
        self._pending_loads.append(job)
        self._loading[rid] = job
        self._asked.pop(rid, None)

    def request_finished(
        self, request: RequestView, block_ids: tuple[int, ...]
    ) -> tuple[bool, Mapping[str, Any] | None]:
        """Plan a save of the request's computed blocks that no marker and no other save
        covers, and delay the free then: ``(True, params)`` (SCH-016); else ``(False,
        params)``. ``params``: the hand-off on a producer engine, else None. A request whose
        load is in flight is not saved: ``(False, None)``, and the next metadata names it in
        ``aborted_loads`` (SCH-021). UnknownRequestError for a request never seen or
        already finished (SCH-028)."""
        rid = self._finish(request)
        if rid in self._loading:
            self._pending_aborts.append(rid)
            return False, None
        keys = self._block_keys(request)
        full = min(len(keys), request.num_computed_tokens // self._block_size, len(block_ids))
        params = ({HANDOFF_PARAM: {"blocks": full}}
                  if full and self._config.role is TransferRole.PRODUCER else None)
        positions = [i for i in range(full)
                     if keys[i] not in self._saving_keys and not self._is_stored(keys[i])]
        if not positions:
            return False, params
        self._pending_saves.append(SaveJob(rid, tuple((block_ids[i], keys[i]) for i in positions)))
        record = _SaveRecord(tuple(keys[i] for i in positions),
                             stored_events(request, keys, positions, self._block_size))
        self._saving_keys.update(record.keys)
        self._saving[rid] = record
        return True, params

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ConnectorMetadata:
        """Describe the loads, saves and aborted loads planned since the last call, once each
        (SCH-011, SCH-013). Never waits (SCH-014)."""
        self._clock = time.monotonic()
        meta = SharedStorageMetadata(tuple(self._pending_loads), tuple(self._pending_saves),
                                     tuple(self._pending_aborts))
        self._pending_loads, self._pending_saves, self._pending_aborts = [], [], []
        return meta

    def _mark_done(self, keys: tuple[str, ...], events: Iterable[BlockStored]) -> None:
        """Mark a reported save's blocks stored (those every rank wrote); queue events."""
        self._saving_keys.difference_update(keys)
        marked = mark_stored(self._dir, keys, self._config.world_size)
        self._events.extend(marked_events(events, marked))

    def _unmark(self, keys: Sequence[str]) -> None:
        """Unmark blocks whose load failed, so they are stored again."""
        self._events.extend(removed_event(unmark(self._dir, keys)))

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Mark the saves reported in ``finished_sending`` stored; forget the loads reported
        in ``finished_recving``, unmarking the blocks of failed ones named in
        ``invalid_block_ids`` (all the load's blocks if none is named). UnknownRequestError,
        changing nothing, if it reports a transfer this role does not await (SCH-028)."""
        stray = sorted(
            {f"{r} (sending)" for r in output.finished_sending if r not in self._saving}
            | {f"{r} (recving)" for r in output.finished_recving if r not in self._loading})
        if stray:
            raise UnknownRequestError(
                f"the output reports {stray}, which this connector is not waiting for",
                request_id=stray[0].rsplit(" ", 1)[0], clause="SCH-028")
        for rid in sorted(output.finished_recving):
            job = self._loading.pop(rid)
            if rid in output.failed_recving:
                bad = [k for b, k in job.blocks if b in output.invalid_block_ids]
                self._unmark(bad or [k for _, k in job.blocks])
        for rid in sorted(output.finished_sending):
            record = self._saving.pop(rid)
            self._mark_done(record.keys, record.events)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The ``BlockStored`` / ``BlockRemoved`` events since the last call (EVT-004)."""
        events, self._events = tuple(self._events), []
        return events

    def shutdown(self) -> None:
        """Forget every request and pending job; idempotent (SCH-027)."""
        for state in (self._known, self._asked, self._loading, self._saving, self._saving_keys,
                      self._pending_loads, self._pending_saves, self._pending_aborts,
                      self._events, self._handoff_until):
            state.clear()


# -------------------------------------------------------------------------------- worker


class SharedStorageWorker(WorkerConnector):
    """Worker role of the shared-storage connector: rank ``r`` reads and writes only
    ``<key>.rank<r>`` files, on one background thread (``IoThread``)."""

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        self._settings = StorageSettings.from_config(config)
        self._rank = rank
        self._faults = FaultPlan.from_config(config)  # the conformance suite's fault seam
        self._timeout_s = self._faults.deadline(self._settings.io_timeout_s)
        self._dir = self._settings.directory
        self._slot: MetadataSlot[SharedStorageMetadata] = MetadataSlot(SharedStorageMetadata)
        self._started = False
        self._kv: KVBlocks | None = None
        self._pool: IoThread | None = None
        self._closing = threading.Event()
        self._closed = False
        self._loads: dict[str, Transfer] = {}
        self._saves: dict[str, Transfer] = {}
        self._failed: frozenset[str] = frozenset()
        self._invalid: frozenset[int] = frozenset()
        self._stats_lock = threading.Lock()
        self._counters: dict[str, int] = {}

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout
    ) -> None:
        """Keep the caches as ``KVBlocks`` (LayoutMismatchError if they do not match
        ``layout``: LAY-008) and start the background thread; only once (WRK-001)."""
        if self._kv is not None or self._closed:
            raise InvalidArgumentError("register_kv_caches called twice (or after shutdown)",
                                       clause="WRK-001")
        self._kv = KVBlocks(kv_caches, layout)
        os.makedirs(self._dir, exist_ok=True)
        self._pool = IoThread(f"kvspec-shared-storage-rank{self._rank}")

    def unregister_kv_caches(self) -> None:
        """Before the engine sleeps: wait (bounded) for every load and save still in
        flight, then drop the reference to the KV tensors (WRK-018). The files stay: what
        was stored before the sleep is served after it. Idempotent."""
        if self._kv is None or self._closed:
            return
        for t in (*self._loads.values(), *self._saves.values()):
            t.wait()
        self._kv = None

    def restore_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout
    ) -> None:
        """At wake: read and write the tensors given from now on (WRK-019). Idempotent.

        Raises:
            LayoutMismatchError: a tensor does not match ``layout`` (LAY-008).
        """
        if self._kv is not None or self._closed or self._pool is None:
            return
        self._kv = KVBlocks(kv_caches, layout)

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        """Bind the step's metadata (WRK-003); InvalidArgumentError if it is not
        ``SharedStorageMetadata``."""
        self._slot.bind(metadata)  # type: ignore[arg-type]  # the slot checks the type
        self._started = False

    def clear_connector_metadata(self) -> None:
        """Start the bound metadata's transfers if ``start_load_kv`` did not (a step without
        a forward), then forget the metadata (WRK-003)."""
        if self._slot.is_bound and not self._started:
            self._start(self._slot.get("clear_connector_metadata"))
        self._slot.clear()

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        """Submit the bound metadata's loads and saves (WRK-004); dummy forwards move
        nothing (DRY-006). MetadataNotBoundError if none is bound (DRY-001)."""
        meta = self._slot.get("start_load_kv")
        if not forward_context.kind.is_dummy:
            self._start(meta)

    def _start(self, meta: SharedStorageMetadata) -> None:
        """Check the metadata (it came from another process) and submit its transfers:
        loads to the background thread; saves snapshotted here (the engine holds their
        blocks until ``finished_sending``) and written in the background. Aborted loads
        need nothing: they are reported when they end, as any load (SCH-021)."""
        self._started = True
        if meta.is_empty:
            return
        kv, pool = self._kv, self._pool
        if kv is None or pool is None or self._closed:
            raise InvalidArgumentError("the metadata names transfers but no KV caches are "
                                       "registered (or the worker is shut down)", clause="WRK-001")
        for job in (*meta.loads, *meta.saves):
            kv.check_budget(job.blocks, f"request {job.request_id!r}")
            if job.request_id in (self._loads if isinstance(job, LoadJob) else self._saves):
                raise InvalidArgumentError(
                    f"request {job.request_id!r} already has a transfer of this direction in "
                    "flight; expected each transfer described once", clause="SCH-013")
        timeout = self._timeout_s
        for load in meta.loads:
            t = Transfer(load.request_id, tuple(b for b, _ in load.blocks), timeout, True)
            t.future = pool.submit(self._load_blocks, t, load.blocks)
            self._loads[load.request_id] = t
        for save in meta.saves:
            t = Transfer(save.request_id, tuple(b for b, _ in save.blocks), timeout, save.report)
            snapshot = kv.snapshot(t.block_ids)
            t.future = pool.submit(self._write_blocks, t, tuple(k for _, k in save.blocks),
                                   snapshot)
            self._saves[save.request_id] = t

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self._counters[name] = self._counters.get(name, 0) + n

    def _load_blocks(self, job: Transfer, blocks: tuple[tuple[int, str], ...]) -> tuple[int, ...]:
        """Background thread: read each block into memory of its own, then copy it in
        unless the load was cancelled meanwhile: a read that hangs past the deadline (a
        slow or stuck file system) writes nothing late (WRK-017). Return the ids that
        failed."""
        kv = self._kv
        assert kv is not None
        delay = max(self._settings.load_delay_s, self._faults.delay_s)
        if delay:
            self._closing.wait(delay)  # returns early at shutdown
        failed: list[int] = []
        for block, key in blocks:
            if self._closing.is_set() or job.cancelled.is_set() or self._faults.fail_loads:
                failed.append(block)
                continue
            try:
                src = kv.read(self._dir, key, self._rank)
                if self._faults.stall_s and block == blocks[0][0]:  # the read hangs
                    self._closing.wait(self._faults.stall_s)
                if not job.copy(lambda: kv.copy_in(block, src)):  # noqa: B023 (runs now)
                    failed.append(block)
            except (OSError, KVSpecError, RuntimeError, ValueError) as e:
                _log.info("rank %d: load of block %s into %d failed: %s", self._rank, key, block, e)
                failed.append(block)
        self._count("blocks_loaded", len(blocks) - len(failed))
        self._count("blocks_load_failed", len(failed))
        return tuple(failed)

    def _write_blocks(
        self, job: Transfer, keys: tuple[str, ...], snapshot: torch.Tensor
    ) -> tuple[int, ...]:
        """Background thread: write each snapshotted block; return the ids not written."""
        if self._faults.delay_s:
            self._closing.wait(self._faults.delay_s)  # returns early at shutdown
        failed: list[int] = []
        for i, (block, key) in enumerate(zip(job.block_ids, keys)):
            if self._closing.is_set() or job.cancelled.is_set() or self._faults.fail_stores:
                failed.append(block)
                continue
            try:
                write_block_file(block_path(self._dir, key, self._rank), key, self._rank,
                                 snapshot[i])
            except (OSError, KVSpecError, RuntimeError, ValueError) as e:
                _log.warning("rank %d: save of block %s failed: %s", self._rank, key, e)
                failed.append(block)
        self._count("blocks_saved", len(keys) - len(failed))
        return tuple(failed)

    def get_finished(
        self, finished_req_ids: frozenset[str]
    ) -> tuple[frozenset[str], frozenset[str]]:
        """Return the saves (sending) and loads (recving) that completed since the last call,
        each once (WRK-009, WRK-010); loads that failed or timed out count as completed
        (WRK-011, WRK-014)."""
        now = time.monotonic()
        sending, recving, failed, invalid = set[str](), set[str](), set[str](), set[int]()
        for rid, job in list(self._loads.items()):
            bad = job.outcome(now)
            if bad is not None:
                del self._loads[rid]
                recving.add(rid)
                if bad:
                    failed.add(rid)
                    invalid.update(bad)
        for rid, job in list(self._saves.items()):
            if job.outcome(now) is not None:
                del self._saves[rid]
                if job.report:
                    sending.add(rid)
        self._failed, self._invalid = frozenset(failed), frozenset(invalid)
        return frozenset(sending), frozenset(recving)

    def get_failed_recving(self) -> frozenset[str]:
        """The loads of the last ``get_finished`` that failed (WRK-011)."""
        failed, self._failed = self._failed, frozenset()
        return failed

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        """The blocks of the last ``get_finished``'s failed loads (WRK-011, EVT-003)."""
        invalid, self._invalid = self._invalid, frozenset()
        return invalid

    def get_kv_connector_stats(self) -> SupportsAggregate | None:
        """Blocks loaded, failed and saved since the last call, or None."""
        with self._stats_lock:
            counters, self._counters = self._counters, {}
        return ConnectorStats(counters) if any(counters.values()) else None

    def wait_for_save(self) -> None:
        """Return at once: saves were snapshotted in ``start_load_kv`` (WRK-007)."""
        return None

    def handle_preemptions(self, preempted_req_ids: frozenset[str]) -> None:
        """Wait, bounded by each transfer's deadline, for transfers of preempted requests;
        cancel those still running (WRK-012, WRK-014). They are reported as usual."""
        for rid in preempted_req_ids:
            for job in (self._loads.get(rid), self._saves.get(rid)):
                if job is not None:
                    job.wait()

    def shutdown(self) -> None:
        """Cancel queued work, wait a bounded time for the running job and the thread, and
        drop every reference to the KV caches; idempotent (WRK-015, ERR-009)."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop((*self._loads.values(), *self._saves.values()), self._settings.io_timeout_s)
        self._loads, self._saves, self._kv = {}, {}, None
        self._slot.clear()


class SharedStorageConnector(ConnectorFactory):
    """Factory of the shared-storage connector (``kvspec.conformance.connectors:
    SharedStorageConnector``). Holds no state: the roles share only the directory."""

    scheduler_class: ClassVar[type[SharedStorageScheduler]] = SharedStorageScheduler
    worker_class: ClassVar[type[SharedStorageWorker]] = SharedStorageWorker

    @property
    def name(self) -> str:
        """``"shared-storage"``."""
        return "shared-storage"

    @property
    def capabilities(self) -> Capabilities:
        """Async loads, delayed free, ``NO_LAYER_HOOKS``, ``INVALID_BLOCKS``, all layouts."""
        return Capabilities(
            async_loads=True, delayed_free=True, layer_hooks=HookGraphMode.NO_LAYER_HOOKS,
            accepted_layouts=(), accepts_split_kv=True,
            failure_reporting=FailureReporting.INVALID_BLOCKS, fault_injection=True,
            sleep_mode=True)

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        """Build the scheduler role (``scheduler_class``)."""
        return self.scheduler_class(config)

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        """Build the worker role of ``rank`` (``worker_class``)."""
        return self.worker_class(config, rank)
