"""Settings, metadata and the scheduler role of the host-memory offloading backend.

The scheduler role owns placement: it maps each stored block (keyed by the engine's chained,
salted block hash, SCH-020) to a slot of the workers' host pools, evicts under the slot
budget with LRU or ARC, pins the slots of in-flight loads, and tells the workers, in the
step's ``OffloadMetadata``, "store block b into slot s" and "load slot s into block b".
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from itertools import repeat, takewhile
from operator import itemgetter
from typing import Annotated, Any, Literal, NamedTuple, NoReturn

import attrs
import msgspec
from typing_extensions import Self

from kvspec.protocols import (
    NULL_BLOCK_ID,
    AllocatedBlocks,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CapabilityError,
    ConnectorMetadata,
    EngineConfigView,
    InvalidArgumentError,
    InvalidBlockIdError,
    KVCacheEvent,
    KVConnectorOutput,
    MalformedMetadataError,
    RequestView,
    SchedulerConnector,
    SchedulerOutputView,
    StateCaching,
    UnknownRequestError,
)

from .._checks import check_block_ids, check_blocks, check_count, check_output, check_request
from .._groups import spine_of, whole_prefix
from .._settings import Finite, Positive, PositiveSeconds, read_settings
from ._eviction import EvictionPolicy, make_policy

__all__ = [
    "MEDIUM",
    "OffloadMetadata",
    "OffloadScheduler",
    "OffloadSettings",
    "TransferJob",
]

_log = logging.getLogger(__name__)

MEDIUM = "CPU"
"""The ``medium`` of the backend's ``BlockStored`` / ``BlockRemoved`` events (EVT-005)."""

_META_KIND = "kvspec.offload"
_META_VERSION = 4


# ----------------------------------------------------------------------------- settings


class OffloadSettings(msgspec.Struct, frozen=True):
    """The offloading backend's configuration, read from ``EngineConfigView.extra``.

    Attributes:
        offload_bytes: Host bytes per rank the pool may use; ``extra["offload_bytes"]``,
            default 64 MiB. The worker refuses a pool that does not fit (ERR-002).
        offload_slots: Pool capacity in blocks, the same on every rank;
            ``extra["offload_slots"]``, default 256.
        eviction: ``"lru"`` (default) or ``"arc"``; ``extra["eviction"]``.
        io_timeout_s: A transfer not finished this long after submission ends as failed
            (WRK-014); ``extra["io_timeout_s"]``, default 30.
        load_delay_s: Seconds the worker thread waits before each load (tests keep loads in
            flight with it); ``extra["load_delay_s"]``, default 0.
        load_fault_rate: Probability in ``[0, 1]`` that a worker fails a loaded block
            (fault injection, WRK-011); ``extra["load_fault_rate"]``, default 0.
        fault_seed: Seed of the fault injection (plus the rank); ``extra["fault_seed"]``.
        stage_blocks: Blocks one forward stores through the capturable per-layer store
            path (``store_path="layerwise"``), the rest waiting for the next forward;
            ``extra["offload_stage_blocks"]``, default 32. Sizes the device staging buffer.
        store_when: ``"computed"`` (default): a running request's full prompt blocks are
            stored in the step after the one that computed them (with several KV-cache
            groups, in the step that computes them, KVG-007), while it runs (the rest
            when it finishes); ``"finished"``: every block is stored when the request
            finishes. ``extra["offload_store"]``.
        sync_loads: False (default): loads are asynchronous, matched ``(n, True)`` and
            reported in ``finished_recving`` (SCH-009, SCH-023); True: matched
            ``(n, False)`` and done by ``start_load_kv`` before the forward reads the KV
            (WRK-004), never reported, a failed block only named invalid (WRK-011,
            SCH-024). A hit then costs no extra engine step. ``extra["sync_loads"]``.
    """

    offload_bytes: Positive = 64 << 20
    offload_slots: Positive = 256
    eviction: Literal["lru", "arc"] = "lru"
    io_timeout_s: PositiveSeconds = 30.0
    load_delay_s: Finite = 0.0
    load_fault_rate: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    fault_seed: int = 0
    stage_blocks: Positive = msgspec.field(default=32, name="offload_stage_blocks")
    store_when: Literal["computed", "finished"] = msgspec.field(default="computed",
                                                                name="offload_store")
    sync_loads: bool = False

    @classmethod
    def from_config(cls, config: EngineConfigView) -> OffloadSettings:
        """Read the settings from ``config.extra`` (the keys named above; an attribute's
        key is its name unless said otherwise).

        Raises:
            InvalidArgumentError: a value is malformed (ERR-002).
        """
        return read_settings(config, cls)


# ------------------------------------------------------------------------------ metadata


def _malformed(detail: str) -> NoReturn:
    raise MalformedMetadataError(f"offload metadata is malformed: {detail}", clause="ERR-005")


_INT = frozenset({int})


def _column(job: TransferJob, name: str, minimum: int, *, distinct: bool, typed: bool) -> None:
    """Check column ``name`` of ``job``: a non-empty tuple of ints >= ``minimum`` (distinct
    ones, ignoring -1, when ``distinct``); ``typed`` skips the element type and range checks
    (the decoder's columns are ints >= ``minimum`` by construction). Runs at C speed: no
    per-element Python code."""
    value = getattr(job, name)
    if not typed:
        if type(value) is not tuple or not value:
            raise InvalidArgumentError(
                f"{name} of job of {job.request_id!r} must be a non-empty tuple of ints, "
                f"got {value!r}"
            )
        if not set(map(type, value)) <= _INT:
            bad = next(v for v in value if type(v) is not int)
            raise InvalidArgumentError(
                f"{name} of job of {job.request_id!r} holds {bad!r}; expected ints"
            )
        if min(value) < minimum:
            raise InvalidArgumentError(f"{name} of job of {job.request_id!r} holds "
                                       f"{min(value)}; expected ints >= {minimum}")
    if distinct:
        unique = set(value)
        if len(unique) != len(value) and len(unique - {-1}) != len(value) - value.count(-1):
            raise InvalidArgumentError(
                f"{name} of job of {job.request_id!r} names the same value twice"
            )


@attrs.frozen
class TransferJob:
    """One request's blocks to move between the KV caches and the host pool, as columns.

    Attributes:
        request_id: The request.
        block_ids: Engine block ids in token order, distinct.
        slots: The pool slot of each block, distinct. In a load a slot of -1 means the
            block was evicted after the match: the workers fail it (WRK-011).
        tags: The content tag of each slot: a store writes ``tags[i]`` into slot
            ``slots[i]``; a load expects it there, and fails the block otherwise (a slot
            overwritten, never stored, or whose store failed on this rank, WRK-011). The
            scheduler tags each store job with a fresh number.
        is_load: True for a load (pool to KV caches), False for a store.
        groups: With several KV-cache groups (KVG-001), every group's block id at each of
            the job's positions, in group order: ``block_ids`` is the full-attention
            group's column; ``NULL_BLOCK_ID`` marks a position a group skipped (or, in a
            store, one whose block the engine may have freed), which is never moved
            (KVG-004). Empty with one group.

    Raises:
        InvalidArgumentError: a field is malformed, or the columns differ in length
            (InvalidBlockIdError for a block id, ERR-003).
    """

    request_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    tags: tuple[int, ...]
    is_load: bool
    groups: tuple[tuple[int, ...], ...] = ()

    def __attrs_post_init__(self) -> None:
        self._check(typed=False)

    def _check(self, *, typed: bool) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidArgumentError(
                f"request_id must be a non-empty str, got {self.request_id!r}"
            )
        if not isinstance(self.is_load, bool):
            raise InvalidArgumentError(f"is_load must be a bool, got {self.is_load!r}")
        try:
            _column(self, "block_ids", 0, distinct=True, typed=typed)
        except InvalidArgumentError as e:
            raise InvalidBlockIdError(e.message, clause="ERR-003") from None
        _column(self, "slots", -1 if self.is_load else 0, distinct=True, typed=typed)
        _column(self, "tags", 0, distinct=False, typed=typed)
        if not len(self.block_ids) == len(self.slots) == len(self.tags):
            raise InvalidArgumentError(
                f"job of {self.request_id!r} has {len(self.block_ids)} block ids, "
                f"{len(self.slots)} slots and {len(self.tags)} tags; expected one of each "
                "per block"
            )
        groups = self.groups
        if type(groups) is not tuple or (groups and len(groups) < 2):
            raise InvalidArgumentError(
                f"groups of job of {self.request_id!r} must be a tuple of two or more "
                f"columns, or empty, got {groups!r}", clause="KVG-001")
        for column in groups:
            if type(column) is not tuple or len(column) != len(self.block_ids) or not (
                    typed or set(map(type, column)) <= _INT) or min(column) < 0:
                raise InvalidBlockIdError(
                    f"a group column of job of {self.request_id!r} is {column!r}; expected "
                    f"{len(self.block_ids)} block ids >= 0", clause="ERR-003")
            real = [b for b in column if b != NULL_BLOCK_ID]
            if len(set(real)) != len(real):
                raise InvalidBlockIdError(
                    f"a group column of job of {self.request_id!r} names a block twice",
                    clause="ERR-003")
        if groups and self.block_ids not in groups:
            raise InvalidArgumentError(
                f"job of {self.request_id!r}: block_ids must be one of its group columns",
                clause="KVG-001")

    @classmethod
    def _build(
        cls, request_id: str, block_ids: tuple[int, ...], slots: tuple[int, ...],
        tags: tuple[int, ...], is_load: bool, *, typed: bool | None,
        groups: tuple[tuple[int, ...], ...] = (),
    ) -> TransferJob:
        """Construct with the element type and range checks skipped (``typed`` True: the
        columns are ints in range by construction, as the decoder's are) or every check
        skipped (``typed`` None: the scheduler's own jobs, built from checked inputs)."""
        job = object.__new__(cls)
        for name, value in (("request_id", request_id), ("block_ids", block_ids),
                            ("slots", slots), ("tags", tags), ("is_load", is_load),
                            ("groups", groups)):
            object.__setattr__(job, name, value)
        if typed is not None:
            job._check(typed=typed)
        return job

    @classmethod
    def of(
        cls, request_id: str, blocks: Sequence[tuple[int, int, int]], is_load: bool
    ) -> TransferJob:
        """Build a job from ``(block_id, slot, tag)`` triples (convenient in tests)."""
        return cls(
            request_id, tuple(b for b, _, _ in blocks), tuple(s for _, s, _ in blocks),
            tuple(t for _, _, t in blocks), is_load,
        )

    def __len__(self) -> int:
        return len(self.block_ids)


_INT64_MAX = (1 << 63) - 1
_ReqId = Annotated[str, msgspec.Meta(min_length=1)]
_Int = Annotated[int, msgspec.Meta(ge=0, le=_INT64_MAX)]
_Column = Annotated[tuple[_Int, ...], msgspec.Meta(min_length=1)]
_LoadSlots = Annotated[
    tuple[Annotated[int, msgspec.Meta(ge=-1, le=_INT64_MAX)], ...], msgspec.Meta(min_length=1)
]
_Tags = _Int | _Column  # an int: every block's tag
_Groups = tuple[tuple[_Int, ...], ...]  # empty with one KV-cache group
# The layout ``OffloadMetadata.encode`` writes: kind, version (``_META_KIND``,
# ``_META_VERSION``), loads, stores, aborted loads, held requests.
_WIRE_DECODER = msgspec.msgpack.Decoder(tuple[
    Literal["kvspec.offload"], Literal[4],
    tuple[tuple[_ReqId, _Column, _LoadSlots, _Tags, _Groups], ...],  # loads
    tuple[tuple[_ReqId, _Column, _Column, _Tags, _Groups], ...],  # stores: no slot -1
    tuple[_ReqId, ...],  # aborted loads
    tuple[_ReqId, ...],  # held
])
_WIRE_ENCODER = msgspec.msgpack.Encoder()


def _wire_job(job: TransferJob) -> tuple[str, tuple[int, ...], tuple[int, ...], object,
                                         tuple[tuple[int, ...], ...]]:
    """``job`` as ``encode`` writes it: its tags as one int when they are all the same."""
    tags = job.tags
    return job.request_id, job.block_ids, job.slots, (
        tags[0] if tags.count(tags[0]) == len(tags) else tags
    ), job.groups


def _job(wire: tuple[str, tuple[int, ...], tuple[int, ...], int | tuple[int, ...],
                     tuple[tuple[int, ...], ...]],
         is_load: bool) -> TransferJob:
    """A decoded job, checked: the decoder typed its columns (non-empty, ints in range),
    so what is left is one length and distinct block ids and slots (what
    ``TransferJob._check`` does on typed columns, without its per-column calls)."""
    request_id, block_ids, slots, wire_tags, groups = wire
    n = len(block_ids)
    tags = (wire_tags,) * n if isinstance(wire_tags, int) else wire_tags
    if groups or not (len(slots) == len(tags) == n and len(set(block_ids)) == n and (
            len(set(slots)) == n or is_load and len(set(slots) - {-1}) == n - slots.count(-1))):
        # Not the common case: let the full check say what is wrong.
        return TransferJob._build(request_id, block_ids, slots, tags, is_load, typed=True,
                                  groups=groups)
    return TransferJob._build(request_id, block_ids, slots, tags, is_load, typed=None)


@attrs.frozen
class OffloadMetadata:
    """One step's transfers, from the scheduler role to every worker (SCH-011, SCH-013).

    Attributes:
        loads: Loads to start (``is_load`` True); each request at most once.
        stores: Stores to start (``is_load`` False); each request at most once. Their
            blocks are held by a delayed free until the workers report ``finished_sending``
            (SCH-016).
        aborted_loads: Requests finished while their load was in flight (SCH-021); the
            workers still report each in ``finished_recving`` once.
        held: Finished requests whose blocks the scheduler role holds because a rank
            reported their load late (``FailedStores.late_loads``, WRK-017): every worker
            reports each in ``finished_sending`` once no copy of it runs on its rank.

    Encodes to MessagePack through msgspec (``encode``); ``decode`` accepts exactly that
    and validates every field (ERR-005, ERR-006).

    Raises:
        InvalidArgumentError: a field is malformed, or a request appears twice in a list.
    """

    loads: tuple[TransferJob, ...] = ()
    stores: tuple[TransferJob, ...] = ()
    aborted_loads: tuple[str, ...] = ()
    held: tuple[str, ...] = ()

    def __attrs_post_init__(self) -> None:
        for name, load in (("loads", True), ("stores", False)):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(
                isinstance(j, TransferJob) and j.is_load is load for j in value
            ):
                raise InvalidArgumentError(
                    f"{name} must be a tuple of TransferJob with is_load={load}, got {value!r}"
                )
            ids = [j.request_id for j in value]
            if len(set(ids)) != len(ids):
                raise InvalidArgumentError(f"{name} names a request twice", clause="SCH-013")
        for name in ("aborted_loads", "held"):
            ids = getattr(self, name)
            if not isinstance(ids, tuple) or not all(
                isinstance(r, str) and r for r in ids
            ) or len(set(ids)) != len(ids):
                raise InvalidArgumentError(
                    f"{name} must be a tuple of distinct request ids, got {ids!r}")

    @classmethod
    def _trusted(cls, loads: tuple[TransferJob, ...], stores: tuple[TransferJob, ...],
                 aborted_loads: tuple[str, ...], held: tuple[str, ...] = ()) -> Self:
        """Build from jobs the caller built and checked (the scheduler's own, or the
        decoder's after it checked that no request repeats), without checking again."""
        meta = object.__new__(cls)
        object.__setattr__(meta, "loads", loads)
        object.__setattr__(meta, "stores", stores)
        object.__setattr__(meta, "aborted_loads", aborted_loads)
        object.__setattr__(meta, "held", held)
        return meta

    @property
    def is_empty(self) -> bool:
        """True when the metadata describes nothing."""
        return not (self.loads or self.stores or self.aborted_loads or self.held)

    def encode(self) -> bytes:
        """Encode as plain data, no pickle (ERR-006): one MessagePack array
        ``["kvspec.offload", 4, loads, stores, aborted_loads, held]``, each job an array
        ``[request_id, block_ids, slots, tags, groups]`` of its columns (arrays of ints;
        ``tags`` one int when every block has that tag, as in every job the scheduler
        builds from one store; ``groups`` an array of columns, empty with one group)."""
        return _WIRE_ENCODER.encode((
            _META_KIND, _META_VERSION, [_wire_job(j) for j in self.loads],
            [_wire_job(j) for j in self.stores], self.aborted_loads, self.held,
        ))

    @classmethod
    def decode(cls, data: bytes) -> Self:
        """Decode and validate bytes from ``encode``: msgspec's typed decoder checks the
        layout and every value's type and range (request ids non-empty; block ids, tags and
        store slots int64s >= 0, load slots >= -1), then each job is checked for distinct
        block ids and slots and columns of one length. The worker checks block ids and
        slots against its pool when it plans the copies (LAY-012, ERR-002).

        Raises:
            MalformedMetadataError: ``data`` is not exactly what ``encode`` writes, or a
                field is out of range (ERR-005).
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            _malformed(f"expected bytes, got {type(data).__name__}")
        try:
            _, _, loads, stores, aborted, held = _WIRE_DECODER.decode(data)
            for name, wire in (("loads", loads), ("stores", stores), ("aborted_loads", aborted),
                               ("held", held)):
                if len(wire) > 1 and len({w if type(w) is str else w[0] for w in wire}) != len(
                        wire):
                    _malformed(f"{name} names a request twice (SCH-013)")
            return cls._trusted(tuple([_job(j, True) for j in loads]),
                                tuple([_job(j, False) for j in stores]), aborted, held)
        except MalformedMetadataError:
            raise
        except InvalidArgumentError as e:
            _malformed(e.message)
        except (msgspec.MsgspecError, ValueError) as e:  # ValueError: a str not UTF-8
            _malformed(str(e))


# ----------------------------------------------------------------------------- scheduler


def _id_set(ids: Iterable[str]) -> frozenset[str]:
    if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Iterable):
        raise InvalidArgumentError(
            f"request ids must be a set or frozenset of request ids (str), got "
            f"{type(ids).__name__} {ids!r:.80}", clause="ERR-002")
    out = frozenset(ids)
    if not all(isinstance(i, str) and i for i in out):
        raise InvalidArgumentError(f"request ids must be non-empty str, got {sorted(map(repr, out))}",
                                   clause="ERR-002")
    return out


_MAX_FAILED_BYTES = 1 << 24


def _pick(container: Mapping[Any, int] | Sequence[int], keys: Sequence[Any]) -> tuple[int, ...]:
    """``container[k]`` for each of ``keys`` (at least one), at C speed.

    Raises:
        KeyError: a key is missing.
    """
    picked = itemgetter(*keys)(container)
    return picked if len(keys) > 1 else (picked,)


class _LateWire(msgspec.Struct, forbid_unknown_fields=True):
    """``FailedStores`` on the wire when it names late loads (a JSON object)."""

    late_loads: Annotated[list[_ReqId], msgspec.Meta(min_length=1)]
    failed_stores: list[_ReqId] = []


@attrs.frozen
class FailedStores:
    """Worker metadata of the offload backend (WRK-016): the stores of this step that failed
    on a rank, and the loads whose copy was still running when they were reported failed
    (late loads, WRK-017). Ranks combine by union: a block one rank could not store is not
    stored, and a request whose copy is late on any rank keeps its blocks held.

    Attributes:
        request_ids: The requests whose store failed.
        late_loads: The requests whose load was reported failed at its deadline while its
            copy still ran: the scheduler role holds their blocks with a delayed free when
            they finish (``OffloadMetadata.held``), until every rank reports them in
            ``finished_sending`` once the copy ended.
    """

    request_ids: frozenset[str] = attrs.field(converter=_id_set)
    late_loads: frozenset[str] = attrs.field(default=frozenset(), converter=_id_set)

    def aggregate(self, other: FailedStores) -> FailedStores:
        """The union of both ranks' failed stores and late loads."""
        if not isinstance(other, FailedStores):
            raise InvalidArgumentError(
                f"cannot aggregate FailedStores with {type(other).__name__}", clause="EVT-007"
            )
        return FailedStores(self.request_ids | other.request_ids,
                            self.late_loads | other.late_loads)

    def encode(self) -> bytes:
        """JSON, to cross a process boundary (EVT-009): the sorted list of failed stores;
        with late loads, an object ``{"late_loads": [...], "failed_stores": [...]}``."""
        if not self.late_loads:
            return msgspec.json.encode(sorted(self.request_ids))
        return msgspec.json.encode(_LateWire(sorted(self.late_loads), sorted(self.request_ids)))

    @classmethod
    def decode(cls, data: bytes) -> FailedStores:
        """Decode ``encode`` output.

        Raises:
            MalformedMetadataError: anything else (ERR-005).
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MalformedMetadataError(
                f"FailedStores must be decoded from bytes, got {type(data).__name__}",
                clause="ERR-005")
        if len(data) > _MAX_FAILED_BYTES:
            raise MalformedMetadataError(
                f"FailedStores is {len(data)} bytes; expected at most {_MAX_FAILED_BYTES}",
                clause="ERR-005")
        try:
            wire = _FAILED_DECODER.decode(data)
        except (msgspec.MsgspecError, ValueError) as e:  # ValueError: a str not UTF-8
            raise MalformedMetadataError(
                f"FailedStores is malformed: {e}; expected a non-empty JSON list of request "
                "ids, or an object of late_loads (non-empty) and failed_stores",
                clause="ERR-005"
            ) from None
        if isinstance(wire, _LateWire):
            return cls(frozenset(wire.failed_stores), frozenset(wire.late_loads))
        return cls(frozenset(wire))


_FAILED_DECODER = msgspec.json.Decoder(
    Annotated[list[_ReqId], msgspec.Meta(min_length=1)] | _LateWire)


class _Record(NamedTuple):
    """A load or store awaiting the aggregated report: the job and its blocks' keys."""

    job: TransferJob
    keys: tuple[bytes, ...]
    positions: Sequence[int] = ()  # stores: the blocks' positions in the request
    request: RequestView | None = None  # stores: for the BlockStored events
    run: bool = False  # stores: the slots are ascending and consecutive


class _Running:
    """A running request as the eager stores see it: its view (prompt block hashes), its
    block ids so far, and the first block position not yet considered for a store."""

    __slots__ = ("request", "block_ids", "groups", "upto")

    def __init__(self, request: RequestView, blocks: AllocatedBlocks, spine: int) -> None:
        self.request = request
        self.groups = [list(ids) for ids in blocks.groups]  # as allocated: stale once freed
        self.block_ids = self.groups[spine]
        self.upto = 0

    def extend(self, blocks: AllocatedBlocks, *, replace: bool) -> None:
        """Add a step's new blocks (``replace``: a resumed request's, which replace all)."""
        for ids, new in zip(self.groups, blocks.groups):
            if replace:
                ids[:] = new
            else:
                ids.extend(new)
        if replace:
            self.upto = 0


class OffloadScheduler(SchedulerConnector):
    """Scheduler role of the offloading backend: lookup, placement, eviction, pinning.

    Matching (SCH-001, SCH-004..007, SCH-020): consecutive blocks after the computed tokens
    whose salted hashes are stored on every rank, block aligned, leaving one prompt token;
    ``(n, n > 0)``; no side effect. Loads are planned in ``update_state_after_alloc`` and
    pin their slots until the aggregated ``finished_recving`` (SCH-009, SCH-010). Stores are
    planned for the full computed blocks not stored or being stored: with
    ``store_when="computed"`` (the default), a running request's prompt blocks in the step
    after the one that computed them (the workers copy them while the request runs, and
    fence those copies when it is preempted, WRK-012), and in ``request_finished`` whatever
    is left; with ``"finished"``, everything in ``request_finished``. Stores go
    into free slots (the lowest first, so a job's slots are usually consecutive) or slots
    freed by evicting unpinned blocks; a request with a store is finished with a delayed
    free until the aggregated ``finished_sending`` (SCH-016), when all its blocks become
    stored and ``BlockStored``
    events are queued (EVT-004, EVT-005). Evictions and failed loads queue ``BlockRemoved``.

    With ``sync_loads`` the match is ``(n, False)``: the load goes to the workers in the
    next metadata and is done before that step's forward, so its slots are unpinned once
    the metadata is built (the workers finish it before any later store starts); blocks of
    a failed one come back in ``invalid_block_ids`` only, and are dropped as above.

    Each store job carries a fresh tag that the workers record per slot; a load carries the
    tag it expects, so a slot whose content changed fails instead of loading wrong bytes.
    Blocks whose store is still in flight match too (SCH-031): their load carries that
    store's slot and tag, and the workers run it after the store, so a request that comes
    before the store is reported (no engine step in between) is served, and a failed store
    fails the load. With ``serve_pending=False`` (the layerwise store path) or
    ``sync_loads``, a match that reaches a store in flight is deferred (``(None, False)``)
    until the store is reported instead.
    Per-block work is a handful of C-level container operations: planning a 256-block
    store or load costs tens of microseconds (``kvspec bench offload`` measures it).

    ``reset_cache`` (SCH-032) drops the whole index and answers True: nothing stored or
    being stored before it is matched again, and nothing a request known at the reset
    computed is stored after it.

    Several KV-cache groups (KVG-001): one full-attention group (the *spine*, whose
    block positions are the keys) beside full or sliding-window groups. A slot holds every
    group's bytes of one position; a position whose sliding-window block was already freed
    is stored without it (*partial*), and a match of ``N`` tokens needs only the blocks
    each group attends to (KVG-003, ``KVCacheGroup.needed_blocks``) to be whole. With
    ``store_when="computed"`` a running request's blocks are stored in the step that
    computes them (the workers copy them after its forward, in ``wait_for_save``, before
    the engine can free a window block at the next schedule); loads name every group's
    ids and skip the null block (KVG-004); a failed load fails the whole request
    (``failed_recving``, KVG-005). Synchronous loads and loads of stores in flight are
    not offered with several groups.
    """

    def __init__(self, config: EngineConfigView, *, serve_pending: bool = True) -> None:
        self._settings = OffloadSettings.from_config(config)
        # A store in flight is matchable as an asynchronous load the workers run after it
        # (SCH-031); with synchronous loads (they run before any queued store), or when
        # the workers gather stores in the forward (``serve_pending=False``), a match that
        # reaches a store in flight is deferred until the store is reported instead.
        self._serve_pending = serve_pending and not self._settings.sync_loads
        groups = config.kv_cache_groups
        self._groups = groups if len(groups) > 1 else ()
        self._spine = 0
        if self._groups:
            self._spine = spine_of(config, "offload", states=True)
            if self._settings.sync_loads:
                raise CapabilityError(
                    "the offload backend moves several KV-cache groups only with "
                    "asynchronous loads (failures per request, KVG-005)", clause="KVG-002")
            self._serve_pending = False  # a store runs after its step's forward
        # State groups (STG-001): a slot also holds each state group's state after the
        # slot's block when the store read it at that boundary (``_with_state``); a match
        # ends only at such a key (STG-003).
        self._state_ids = frozenset(config.state_group_ids) if self._groups else frozenset()
        self._with_state: set[bytes] = set()
        self._partial: set[bytes] = set()  # stored (or storing) without some group's bytes
        self._inflight: dict[bytes, tuple[int, int]] = {}  # storing: key -> (slot, tag)
        self._config = config
        self._block_size = config.block_size
        self._capacity = self._settings.offload_slots
        self._policy: EvictionPolicy = make_policy(self._settings.eviction, self._capacity)
        self._index: dict[bytes, int] = {}  # stored on every rank: key -> slot
        self._slot_tag: list[int] = [0] * self._capacity  # tag of each slot's store
        self._next_tag = 1
        self._free: list[int] = list(range(self._capacity - 1, -1, -1))  # descending
        self._free_sorted = True
        self._pinning: dict[str, tuple[int, ...]] = {}  # in-flight load -> its slots, -1s too
        self._zombies: set[int] = set()  # dropped while pinned: freed when unpinned
        self._known: set[str] = set()
        self._asked: dict[str, int] = {}
        self._loading: dict[str, _Record] = {}
        self._saving: dict[str, list[_Record]] = {}  # reported together at the finish
        self._running: dict[str, _Running] = {}  # store_when="computed" only
        self._pending_loads: list[TransferJob] = []
        self._pending_stores: list[TransferJob] = []
        self._pending_aborts: list[str] = []
        self._late: set[str] = set()  # running requests a rank reported a late load of
        self._holding: set[str] = set()  # finished, held for a late load (WRK-017)
        self._pending_held: list[str] = []
        self._sync_loaded: dict[int, tuple[bytes, int]] = {}  # block id -> last sync load
        self._events: list[KVCacheEvent | _Record] = []  # stores: events built on take
        self._counters: Counter[str] = Counter()
        self._stale_tags: set[int] = set()  # stores in flight at a reset: never indexed
        self._no_store: set[str] = set()  # requests known at a reset: never stored

    # -- introspection ----------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Scheduler counters since construction: ``lookups``, ``hit_blocks`` (loads
        planned), ``miss_blocks`` (blocks stored because they were not), ``evictions``,
        ``stores_skipped`` (no unpinned slot), ``load_failures`` (blocks),
        ``pending_hit_blocks`` (loads of blocks whose store was in flight, SCH-031),
        ``store_failures`` (blocks), ``resets`` (``reset_cache`` calls), ``stale_stores``
        (blocks whose store was in flight at a reset, never indexed), and gauges ``resident_blocks``, ``pinned_slots``,
        ``capacity_slots``."""
        out = {k: int(v) for k, v in self._counters.items()}
        for name in ("lookups", "hit_blocks", "miss_blocks", "evictions", "stores_skipped",
                     "load_failures", "pending_hit_blocks", "store_failures"):
            out.setdefault(name, 0)
        out["resident_blocks"] = len(self._index)
        out["pinned_slots"] = len(self._pinned_slots())
        out["capacity_slots"] = self._capacity
        return out

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy (for tests and benchmarks; do not mutate)."""
        return self._policy

    def slot_of(self, key: bytes) -> int | None:
        """The slot holding stored block ``key`` (a block hash), or None."""
        return self._index.get(key)

    # -- matching ---------------------------------------------------------------------------

    def _match(self, request: RequestView, num_computed_tokens: int) -> int:
        bs = self._block_size
        if num_computed_tokens % bs:
            return 0
        keys = request.block_hashes
        start = num_computed_tokens // bs
        end = min(len(keys), (request.num_prompt_tokens - 1) // bs)
        index = self._index
        if self._inflight and self._serve_pending:  # stores not reported yet count too
            inflight = self._inflight
            stored = takewhile(lambda k: k in index or k in inflight, keys[start:end])
        else:
            stored = takewhile(index.__contains__, keys[start:end])  # the stored prefix
        n = len(list(stored))
        if self._partial and n:
            n = self._whole(keys, start, n)
        if self._state_ids:  # STG-003: only where the state after exactly n blocks is held
            with_state = self._with_state
            while n and keys[start + n - 1] not in with_state:
                n -= 1
                if self._partial and n:
                    n = self._whole(keys, start, n)
        return n * bs

    def _whole(self, keys: Sequence[bytes], start: int, n: int) -> int:
        """``whole_prefix`` over the attention groups (a state group's bytes are checked
        apart, ``_with_state``)."""
        partial, states = self._partial, self._state_ids
        return whole_prefix(self._groups, self._spine, start, n, self._block_size,
                            lambda j, i: j not in states and keys[i] in partial)

    def _awaits_store(self, request: RequestView, num_computed_tokens: int, count: int) -> bool:
        """Without loads of stores in flight: True when the block after the match is in a
        store of a finished request, so the match is deferred (SCH-002) until that store is
        reported (SCH-031): the waiting request keeps the engine stepping, and the report
        comes. A running (or preempted) request's stores are reported only when it
        finishes, so waiting for one of those could wait for ever: not deferred."""
        if self._serve_pending or not self._inflight or num_computed_tokens % self._block_size:
            return False
        i = (num_computed_tokens + count) // self._block_size
        keys = request.block_hashes
        if i >= min(len(keys), (request.num_prompt_tokens - 1) // self._block_size) \
                or keys[i] not in self._inflight:
            return False
        return any(keys[i] in record.keys for rid, records in self._saving.items()
                   if rid not in self._known for record in records)

    def on_new_request(self, request: RequestView) -> None:
        """Remember the request (SCH-028)."""
        self._known.add(check_request(request).request_id)

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Return ``(n, n > 0)``, or ``(n, False)`` with ``sync_loads``: tokens of stored
        blocks after the computed ones (SCH-001, SCH-004, SCH-005, SCH-007, SCH-020). Reads
        only the stored index; remembers ``num_computed_tokens`` as where a following
        allocation's external tokens start."""
        check_request(request)
        check_count("num_computed_tokens", num_computed_tokens)
        count = self._match(request, num_computed_tokens)
        self._known.add(request.request_id)
        self._asked[request.request_id] = num_computed_tokens
        self._counters["lookups"] += 1
        if self._awaits_store(request, num_computed_tokens, count):
            return None, False
        return count, count > 0 and not self._settings.sync_loads

    def update_state_after_alloc(
        self, request: RequestView, blocks: AllocatedBlocks, num_external_tokens: int
    ) -> None:
        """Plan a load of the external tokens' blocks and pin their slots (SCH-008..010).

        A block evicted since the match is sent with slot -1: the workers fail it and the
        engine recomputes it (WRK-011).

        Raises:
            UnknownRequestError: the request was never seen (SCH-028).
            InvalidBlockIdError: a block id is outside the budget (LAY-012).
            InvalidArgumentError: the external tokens are not whole blocks or do not fit,
                or a load for the request is already in flight (SCH-009).
        """
        check_request(request)
        rid = request.request_id
        if rid not in self._known:
            raise UnknownRequestError(
                f"update_state_after_alloc for request {rid!r}, which this connector never "
                "saw", request_id=rid, clause="SCH-028",
            )
        check_blocks(blocks)
        if check_count("num_external_tokens", num_external_tokens) == 0:
            return
        blocks.check_budget(self._config.num_blocks)
        bs = self._block_size
        start = self._asked.get(rid, request.num_computed_tokens)
        if start % bs or num_external_tokens % bs:
            raise InvalidArgumentError(
                f"request {rid!r}: external tokens [{start}, {start + num_external_tokens}) "
                f"are not whole blocks of {bs}", clause="SCH-007",
            )
        if rid in self._loading:
            raise InvalidArgumentError(
                f"request {rid!r} already has a load in flight", clause="SCH-009"
            )
        first, last = start // bs, (start + num_external_tokens) // bs
        all_keys = request.block_hashes
        ids = blocks.block_ids(self._spine)
        shortest = min(len(g) for j, g in enumerate(blocks.groups)
                       if j not in self._state_ids) if self._groups else len(ids)
        if last > len(all_keys) or last > shortest:
            raise InvalidArgumentError(
                f"request {rid!r}: external blocks [{first}, {last}) exceed its "
                f"{len(all_keys)} full blocks or its {shortest} allocated blocks",
                clause="SCH-010",
            )
        keys = tuple(all_keys[first:last])
        try:
            slots = _pick(self._index, keys)
            hits = len(slots)
            tags = _pick(self._slot_tag, slots)
        except KeyError:  # in flight, or evicted since the match (slot -1: the block fails)
            slots, tags = self._pending_slots(keys)
            hits = len(slots) - slots.count(-1)
        self._policy.touch_many(keys)  # absent keys are ignored
        self._counters["hit_blocks"] += hits
        columns: tuple[tuple[int, ...], ...] = ()
        if self._groups:
            columns = tuple(self._state_column(j, g, range(first, last), last * bs)
                            if j in self._state_ids else tuple(g[first:last])
                            for j, g in enumerate(blocks.groups))
            if self._state_ids and keys[-1] not in self._with_state:
                slots = (-1,) * len(slots)  # its state is gone: the load fails (STG-003)
            if self._partial:  # a block the engine wants that was stored without it fails
                others = [c for g, c in enumerate(columns)
                          if g != self._spine and g not in self._state_ids]
                slots = tuple(-1 if keys[i] in self._partial and any(
                    c[i] != NULL_BLOCK_ID for c in others) else s for i, s in enumerate(slots))
        job = TransferJob._build(rid, tuple(ids[first:last]), slots, tags, True, typed=None,
                                 groups=columns)
        self._pending_loads.append(job)
        self._pinning[rid] = slots  # -1 pins nothing
        self._asked.pop(rid, None)
        if self._settings.sync_loads:  # never reported: its failed blocks name their keys
            self._sync_loaded.update(zip(job.block_ids, zip(keys, slots)))
        else:
            self._loading[rid] = _Record(job, keys)

    def _state_column(self, group: int, ids: Sequence[int], positions: Sequence[int],
                      end: int) -> tuple[int, ...]:
        """State group ``group``'s column of a job over block ``positions``: the block
        holding the state after ``end`` tokens (index ``ceil(end / block_size) - 1`` of the
        group's list, STG-002) at the position whose block ends at ``end``, the null block
        everywhere else (KVG-004). All null when ``end`` is not a block boundary among the
        positions or the group's list has no block there."""
        column = [NULL_BLOCK_ID] * len(positions)
        at = end // self._block_size - 1
        index = self._config.kv_cache_groups[group].state_index(end) if end else None
        if end % self._block_size == 0 and index is not None and index < len(ids) \
                and at in positions:
            column[list(positions).index(at)] = ids[index]
        return tuple(column)

    def _pending_slots(self, keys: Sequence[bytes]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Slots and expected tags of ``keys``: stored ones, ones whose store is in flight
        (the store's slot and tag: a worker loads it after that store, and fails it if the
        store failed, SCH-031), and -1 for the others (slot -1 reads the last slot's tag:
        workers never compare it)."""
        index, inflight, slot_tag = self._index, self._inflight, self._slot_tag
        slots: list[int] = []
        tags: list[int] = []
        for key in keys:
            slot = index.get(key)
            if slot is not None:
                slots.append(slot)
                tags.append(slot_tag[slot])
            elif self._serve_pending and key in inflight:
                slot, tag = inflight[key]
                slots.append(slot)
                tags.append(tag)
                self._counters["pending_hit_blocks"] += 1
            else:
                slots.append(-1)
                tags.append(slot_tag[-1])
        return tuple(slots), tuple(tags)

    # -- placement --------------------------------------------------------------------------

    def _pinned_slots(self) -> set[int]:
        """Slots read by in-flight loads (computed when needed: pinning and unpinning a
        load are then one dict operation each, whatever its size)."""
        return set().union(*self._pinning.values()) - {-1}

    def _release_slot(self, slot: int) -> None:
        self._free.append(slot)
        self._free_sorted = False

    def _drop(self, key: bytes, *, evicted: bool) -> None:
        """Forget stored ``key``: free its slot now, or when its last load ends."""
        slot = self._index.pop(key)
        self._partial.discard(key)
        self._with_state.discard(key)
        if not evicted:
            self._policy.remove(key)
        if slot in self._pinned_slots():
            self._zombies.add(slot)
        else:
            self._release_slot(slot)

    def _take_slots(self, n: int, keys: Sequence[bytes], removed: list[bytes]) -> list[int]:
        """Up to ``n`` slots, the lowest free ones first (ascending), then slots freed by
        evicting unpinned stored blocks."""
        free = self._free
        if not self._free_sorted:
            free.sort(reverse=True)
            self._free_sorted = True
        take = min(n, len(free))
        slots = free[len(free) - take:]
        del free[len(free) - take:]
        slots.reverse()
        while len(slots) < n:
            pinned = self._pinned_slots()
            index = self._index
            victim = self._policy.evict(lambda k: index.get(k) in pinned,
                                        incoming=keys[len(slots)])
            if victim is None:
                break
            self._drop(victim, evicted=True)
            self._counters["evictions"] += 1
            removed.append(victim)
            if free:
                slots.append(free.pop())
        return slots

    def _unpin(self, rid: str) -> None:
        """End ``rid``'s pins; free the slots dropped while pinned that nothing pins now."""
        self._pinning.pop(rid, None)
        if self._zombies:
            for slot in self._zombies - self._pinned_slots():
                self._zombies.discard(slot)
                self._release_slot(slot)

    # -- finishing --------------------------------------------------------------------------

    def _stored_events(self, record: _Record) -> tuple[BlockStored, ...]:
        """One BlockStored per run of consecutive stored positions (EVT-005)."""
        request = record.request
        assert request is not None
        positions = record.positions  # increasing
        runs = [(positions[0], positions[-1] + 1)]  # the usual case: one run
        if positions[-1] - positions[0] != len(positions) - 1:
            runs = []
            for i in positions:
                if runs and runs[-1][1] == i:
                    runs[-1] = (runs[-1][0], i + 1)
                else:
                    runs.append((i, i + 1))
        events = []
        for first, last in runs:
            try:
                events.append(BlockStored.from_request(request, first, last,
                                                       self._block_size, medium=MEDIUM))
            except InvalidArgumentError:
                _log.debug("no BlockStored event for request %s", request.request_id)
        return tuple(events)

    def request_finished(
        self, request: RequestView, block_ids: tuple[int, ...]
    ) -> tuple[bool, Mapping[str, Any] | None]:
        """Plan the deferred store of the request's full computed blocks that are neither
        stored nor being stored, and delay the free while it, or a store planned while the
        request ran, is unreported: ``(True, None)`` (SCH-015, SCH-016); else
        ``(False, None)``.

        Slots come from the free list, else from evicting unpinned stored blocks (queued
        ``BlockRemoved``); blocks that find no slot are not stored. A request whose load is
        still in flight is not stored, and the next metadata names it in ``aborted_loads``
        (SCH-021). A request a rank reported a late load of (its copy may still write the
        blocks) is held too: ``(True, None)``, and the next metadata names it in ``held``
        (WRK-017).

        Raises:
            UnknownRequestError: the request was never seen or already finished (SCH-028).
            InvalidBlockIdError: a block id is outside the budget (LAY-012).
        """
        check_request(request)
        rid = request.request_id
        if rid not in self._known:
            raise UnknownRequestError(
                f"request_finished for request {rid!r}, which this connector never saw or "
                "already finished (SCH-015)", request_id=rid, clause="SCH-028",
            )
        block_ids = check_block_ids(block_ids, self._config.num_blocks)
        if self._groups:
            raise InvalidArgumentError(
                f"request_finished for request {rid!r} on an engine with "
                f"{len(self._groups)} KV-cache groups; expected request_finished_all_groups "
                "(KVG-006)", clause="KVG-006")
        return self._finish(request, block_ids, ())

    def request_finished_all_groups(
        self, request: RequestView, blocks: AllocatedBlocks
    ) -> tuple[bool, Mapping[str, Any] | None]:
        """``request_finished`` with every group's blocks (KVG-006): the blocks left to
        store are stored with each group's block at their position, null positions
        (KVG-004) left out (those keys are stored partial).

        Raises:
            As ``request_finished``; InvalidArgumentError when ``blocks`` does not have the
            engine's groups (KVG-006).
        """
        if not self._groups:
            return super().request_finished_all_groups(request, blocks)
        check_request(request)
        check_blocks(blocks)
        if blocks.num_groups != len(self._groups):
            raise InvalidArgumentError(
                f"request {request.request_id!r} finished with {blocks.num_groups} groups of "
                f"blocks; the engine has {len(self._groups)}", clause="KVG-006")
        blocks.check_budget(self._config.num_blocks)
        if request.request_id not in self._known:
            return self.request_finished(request, blocks.block_ids(self._spine))  # raises
        return self._finish(request, blocks.block_ids(self._spine), blocks.groups)

    def _finish(self, request: RequestView, block_ids: tuple[int, ...],
                groups: tuple[tuple[int, ...], ...]) -> tuple[bool, Mapping[str, Any] | None]:
        rid = request.request_id
        self._known.discard(rid)
        self._asked.pop(rid, None)
        self._running.pop(rid, None)
        stored_before = rid in self._saving  # eager stores: reported with the finish
        if rid in self._loading:
            self._no_store.discard(rid)
            self._pending_aborts.append(rid)
            return stored_before, None
        held = rid in self._late  # a copy may still write its blocks: hold them (WRK-017)
        if held:
            self._late.discard(rid)
            self._holding.add(rid)
            self._pending_held.append(rid)
        if rid in self._no_store:  # its KV was computed (or loaded) before a reset
            self._no_store.discard(rid)
            return stored_before or held, None
        full = min(len(request.block_hashes), request.num_computed_tokens // self._block_size,
                   len(block_ids), *(len(g) for j, g in enumerate(groups)
                                     if j not in self._state_ids))
        planned = self._plan_store(request, block_ids, 0, full, groups, (0,) * len(groups),
                                   request.num_computed_tokens)
        return planned or stored_before or held, None

    def _plan_store(
        self, request: RequestView, block_ids: Sequence[int], start: int, full: int,
        groups: Sequence[Sequence[int]] = (), valid_from: Sequence[int] = (),
        state_end: int = 0,
    ) -> bool:
        """Plan a store of the request's blocks at positions ``[start, full)`` that are
        neither stored nor being stored; True if one was planned. With several groups,
        ``groups`` holds each group's block ids and ``valid_from`` the first position whose
        id the engine still holds (a sliding window's earlier ones may be freed): other
        positions and null blocks are left out of that group's column. A state group's
        column names its block only at the position that ends at ``state_end`` tokens, the
        tokens computed when the workers read the store (STG-006)."""
        rid = request.request_id
        index, storing = self._index, self._inflight
        keys: Sequence[bytes] = request.block_hashes[start:full]
        positions: Sequence[int] = range(start, full)
        ids: Sequence[int] = block_ids[start:full]
        new = set(keys)
        if len(new) != len(keys) or not (storing.keys().isdisjoint(new)
                                         and index.keys().isdisjoint(new)):
            if index.keys() >= new:  # all stored already: a request that hit finishing
                return False
            # some block repeated, being stored or stored: keep the first of the others
            new = set()
            kept = []
            for i, key in zip(positions, keys):
                if key not in index and key not in storing and key not in new:
                    new.add(key)
                    kept.append(i)
            positions = kept
            keys = [request.block_hashes[i] for i in positions]
            ids = [block_ids[i] for i in positions]
        removed: list[bytes] = []
        slots = self._take_slots(len(keys), keys, removed) if keys else []
        if removed:
            self._events.append(BlockRemoved(block_hashes=removed, medium=MEDIUM))
        n = len(slots)
        if n < len(keys):
            self._counters["stores_skipped"] += len(keys) - n
        if not n:
            return False
        # Without evictions every slot came from the free list's lowest, in ascending order.
        run = not removed and slots[-1] - slots[0] == n - 1
        tag = self._next_tag
        self._next_tag += 1
        columns: tuple[tuple[int, ...], ...] = ()
        if groups:
            states = self._state_ids
            columns = tuple(
                self._state_column(j, ids_g, positions[:n], state_end) if j in states else
                tuple(ids_g[p] if p >= first else NULL_BLOCK_ID for p in positions[:n])
                for j, (ids_g, first) in enumerate(zip(groups, valid_from)))
            attention = [c for j, c in enumerate(columns) if j not in states]
            self._partial.update(k for k, *col in zip(keys[:n], *attention)
                                 if NULL_BLOCK_ID in col)
        job = TransferJob._build(rid, tuple(ids[:n]), tuple(slots), (tag,) * n, False,
                                 typed=None, groups=columns)
        self._pending_stores.append(job)
        storing.update(zip(keys[:n], zip(slots, repeat(tag))))
        record = _Record(job, tuple(keys[:n]), positions[:n], request, run)
        self._saving.setdefault(rid, []).append(record)
        self._counters["miss_blocks"] += n
        return True

    def _store_running(self, scheduler_output: SchedulerOutputView) -> None:
        """``store_when="computed"``: plan the stores of the scheduled requests' full
        prompt blocks that earlier steps computed (their forwards ran before this step's
        transfers start, and a running request's full blocks are never written again)."""
        running = self._running
        for rid in scheduler_output.preempted_req_ids:
            running.pop(rid, None)  # blocks freed; a resumed request comes back as new
        bs = self._block_size
        todo: list[tuple[_Running, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            if new.request_id in self._known and new.request_id not in self._no_store:
                r = running[new.request_id] = _Running(new.request, new.blocks, self._spine)
                todo.append((r, new.num_computed_tokens))
        for cached in scheduler_output.scheduled_cached_reqs:
            known = running.get(cached.request_id)
            if known is None:
                continue
            known.extend(cached.new_blocks, replace=cached.resumed_from_preemption)
            todo.append((known, cached.num_computed_tokens))
        groups = self._groups
        scheduled = scheduler_output.num_scheduled_tokens
        for r, computed in todo:
            # With several groups a block is stored in the step that computes it: the
            # workers copy it after the forward, before the next schedule can free a
            # window block (KVG-004); with one, in the step after.
            upto = computed + scheduled.get(r.request.request_id, 0) if groups else computed
            full = min(len(r.request.block_hashes), upto // bs,
                       *(len(g) for j, g in enumerate(r.groups) if j not in self._state_ids))
            if full > r.upto:
                start, r.upto = r.upto, full
                self._plan_store(r.request, r.block_ids, start, full, r.groups if groups else (),
                                 tuple(g.first_needed_token(computed) // bs for g in groups),
                                 upto)

    # -- per step ---------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ConnectorMetadata:
        """Describe the loads, stores and aborted loads planned since the last call, once
        each (SCH-011, SCH-013). Never waits (SCH-014)."""
        if not isinstance(scheduler_output, SchedulerOutputView):
            raise InvalidArgumentError(
                f"scheduler_output must be a SchedulerOutputView, got "
                f"{type(scheduler_output).__name__}", clause="ERR-002",
            )
        if self._settings.store_when == "computed":
            self._store_running(scheduler_output)
        loads, stores = tuple(self._pending_loads), tuple(self._pending_stores)
        for name, jobs in (("loads", loads), ("stores", stores)):
            if len(jobs) > 1 and len({j.request_id for j in jobs}) != len(jobs):
                raise InvalidArgumentError(f"{name} names a request twice", clause="SCH-013")
        meta = OffloadMetadata._trusted(loads, stores, tuple(self._pending_aborts),
                                        tuple(self._pending_held))
        if self._settings.sync_loads:  # done in this step, before any later store runs
            for job in self._pending_loads:
                self._unpin(job.request_id)
        self._pending_loads.clear()
        self._pending_stores.clear()
        self._pending_aborts.clear()
        self._pending_held.clear()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Make the stores in ``finished_sending`` stored (queueing ``BlockStored``), except
        those a rank reported failed (``FailedStores``: their slots are freed and
        nothing is advertised), and
        unpin the loads in ``finished_recving``, dropping the blocks of failed loads named in
        ``invalid_block_ids`` (all of the load's blocks if none is named). With
        ``sync_loads``, invalid blocks of the synchronous loads drop their stored blocks
        the same way (WRK-011, SCH-024). Remember the requests named in
        ``FailedStores.late_loads``, to hold their blocks when they finish, and end the
        hold of the held ones in ``finished_sending`` (WRK-017).

        Raises:
            UnknownRequestError: the output reports a transfer this role is not waiting
                for; nothing changes then (SCH-028).
        """
        check_output(output)
        stray = sorted(
            {f"{r} (sending)" for r in output.finished_sending
             if r not in self._saving and r not in self._holding}
            | {f"{r} (recving)" for r in output.finished_recving if r not in self._loading}
        )
        if stray:
            raise UnknownRequestError(
                f"the output reports {stray}, which this connector is not waiting for",
                request_id=stray[0].rsplit(" ", 1)[0], clause="SCH-028",
            )
        removed: list[bytes] = []
        for rid in sorted(output.finished_recving):
            record = self._loading.pop(rid)
            job = record.job
            if rid in output.failed_recving:
                invalid = output.invalid_block_ids
                named = [i for i, b in enumerate(job.block_ids) if b in invalid]
                for i in named or range(len(job)):
                    self._counters["load_failures"] += 1
                    key, slot = record.keys[i], job.slots[i]
                    if slot >= 0 and self._index.get(key) == slot:
                        self._drop(key, evicted=False)
                        removed.append(key)
            self._unpin(rid)
        for block in output.invalid_block_ids if self._sync_loaded else ():  # sync loads
            key, slot = self._sync_loaded.pop(block, (b"", -1))
            if slot >= 0:
                self._counters["load_failures"] += 1
                if self._index.get(key) == slot:
                    self._drop(key, evicted=False)
                    removed.append(key)
        if removed:
            self._events.append(BlockRemoved(block_hashes=removed, medium=MEDIUM))
        insert_many = self._policy.insert_many
        meta = output.worker_metadata
        failed_stores = meta.request_ids if isinstance(meta, FailedStores) else frozenset()
        if isinstance(meta, FailedStores) and meta.late_loads:
            self._note_late(meta.late_loads)
        for rid in sorted(output.finished_sending):
            self._holding.discard(rid)
            for record in self._saving.pop(rid, ()):
                job = record.job
                stale = bool(self._stale_tags) and job.tags[0] in self._stale_tags
                if stale:  # in flight at a reset: its keys were forgotten then (SCH-032)
                    self._stale_tags.discard(job.tags[0])
                else:
                    inflight = self._inflight
                    if len(inflight) == len(record.keys):  # the only store in flight
                        inflight.clear()
                    else:
                        for key in record.keys:
                            del inflight[key]
                if stale or rid in failed_stores:  # never advertised: slots back, once unpinned
                    if not stale:
                        self._partial.difference_update(record.keys)
                    pinned = self._pinned_slots() if self._pinning else set()
                    for slot in job.slots:
                        if slot in pinned:  # a load of the pending store reads it (and fails)
                            self._zombies.add(slot)
                        else:
                            self._release_slot(slot)
                    self._counters["stale_stores" if stale else "store_failures"] += len(job)
                    continue
                tag, slots = job.tags[0], job.slots
                self._index.update(zip(record.keys, slots))
                if self._state_ids:  # keys whose slot holds every state group's state
                    states = [job.groups[g] for g in sorted(self._state_ids)]
                    self._with_state.update(k for k, *col in zip(record.keys, *states)
                                            if NULL_BLOCK_ID not in col)
                if record.run:  # one run: at C speed
                    first, n = slots[0], len(slots)
                    self._slot_tag[first:first + n] = (tag,) * n
                else:
                    for slot in slots:
                        self._slot_tag[slot] = tag
                insert_many(record.keys)
                self._events.append(record)  # its BlockStored events, built by take_events

    def reset_cache(self) -> bool:
        """Forget every stored block and answer True (SCH-032): the host tier's index is
        dropped (slots free now, or when the last in-flight load reading them ends), stores
        in flight are never indexed (their slots come back when they are reported), the
        requests known now (whose KV was computed or loaded before the reset) are never
        stored, and the events not yet taken become one ``AllBlocksCleared``. Loads planned
        before the reset still run; every transfer in flight is still reported once.
        """
        for key in list(self._index):
            self._drop(key, evicted=False)
        for records in self._saving.values():
            self._stale_tags.update(record.job.tags[0] for record in records)
        self._inflight.clear()
        self._partial.clear()
        self._with_state.clear()
        self._sync_loaded.clear()
        self._running.clear()
        self._no_store = set(self._known)
        self._events = [AllBlocksCleared()]
        self._counters["resets"] += 1
        return True

    def _note_late(self, late: frozenset[str]) -> None:
        """Remember the running requests a rank reported a late load of: their blocks are
        held when they finish (WRK-017). A request already finished can no longer be held
        (it finished before the report reached this role): logged and counted."""
        for rid in late:
            if rid in self._known:
                self._late.add(rid)
            else:
                self._counters["late_loads_unheld"] += 1
                _log.warning("request %s finished before a rank reported its load late; its "
                             "blocks could not be held", rid)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Return the ``BlockStored`` / ``BlockRemoved`` events since the last call, once
        each (EVT-004)."""
        pending, self._events = self._events, []
        events: list[KVCacheEvent] = []
        for item in pending:
            if isinstance(item, _Record):
                events.extend(self._stored_events(item))
            else:
                events.append(item)
        return tuple(events)

    def shutdown(self) -> None:
        """Forget every request, pending job and stored block; idempotent (SCH-027)."""
        for state in (
            self._known, self._asked, self._loading, self._saving, self._inflight, self._running,
            self._pending_loads, self._pending_stores, self._pending_aborts, self._events,
            self._late, self._holding, self._pending_held,
            self._index, self._pinning, self._zombies, self._sync_loaded, self._partial,
            self._stale_tags, self._no_store,
        ):
            state.clear()
