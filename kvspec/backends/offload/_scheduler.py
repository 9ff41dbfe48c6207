"""Settings, metadata and the scheduler role of the host-memory offloading backend.

The scheduler role owns placement: it maps each stored block (keyed by the engine's chained,
salted block hash, SCH-020) to a slot of the workers' host pools, evicts under the slot
budget with LRU or ARC, pins the slots of in-flight loads, and tells the workers, in the
step's ``OffloadMetadata``, "store block b into slot s" and "load slot s into block b".
"""

from __future__ import annotations

import array
import json
import logging
import math
import struct
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

import attrs
from typing_extensions import Self

from kvspec.protocols.metadata import decode_json_envelope

from kvspec.protocols import (
    AllocatedBlocks,
    BlockRemoved,
    BlockStored,
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
    UnknownRequestError,
)

from .._checks import check_blocks, check_count, check_output, check_request
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
_META_VERSION = 1


# ----------------------------------------------------------------------------- settings


def _number(extra: Mapping[str, Any], name: str, default: float, *, positive: bool,
            maximum: float | None = None) -> float:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
        value
    ) or value < 0 or (positive and value == 0) or (maximum is not None and value > maximum):
        raise InvalidArgumentError(
            f"config.extra[{name!r}] is {value!r}; expected a finite number "
            f"{'> 0' if positive else '>= 0'}"
            + (f" and <= {maximum}" if maximum is not None else ""),
            clause="ERR-002",
        )
    return float(value)


def _int(extra: Mapping[str, Any], name: str, default: int) -> int:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(
            f"config.extra[{name!r}] is {value!r}; expected an int >= 1", clause="ERR-002"
        )
    return value


@attrs.frozen
class OffloadSettings:
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
            stored in the step after the one that computed them, while it runs (the rest
            when it finishes); ``"finished"``: every block is stored when the request
            finishes. ``extra["offload_store"]``.
    """

    offload_bytes: int = 64 << 20
    offload_slots: int = 256
    eviction: str = "lru"
    io_timeout_s: float = 30.0
    load_delay_s: float = 0.0
    load_fault_rate: float = 0.0
    fault_seed: int = 0
    stage_blocks: int = 32
    store_when: str = "computed"

    @classmethod
    def from_config(cls, config: EngineConfigView) -> OffloadSettings:
        """Read the settings from ``config.extra``.

        Raises:
            InvalidArgumentError: a value is malformed (ERR-002).
        """
        if not isinstance(config, EngineConfigView):
            raise InvalidArgumentError(
                f"config must be an EngineConfigView, got {type(config).__name__}",
                clause="ERR-002",
            )
        extra = config.extra
        eviction = extra.get("eviction", "lru")
        if eviction not in ("lru", "arc"):
            raise InvalidArgumentError(
                f"config.extra['eviction'] is {eviction!r}; expected 'lru' or 'arc'",
                clause="ERR-002",
            )
        store_when = extra.get("offload_store", "computed")
        if store_when not in ("computed", "finished"):
            raise InvalidArgumentError(
                f"config.extra['offload_store'] is {store_when!r}; expected 'computed' or "
                "'finished'", clause="ERR-002",
            )
        seed = extra.get("fault_seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidArgumentError(
                f"config.extra['fault_seed'] is {seed!r}; expected an int", clause="ERR-002"
            )
        return cls(
            offload_bytes=_int(extra, "offload_bytes", 64 << 20),
            offload_slots=_int(extra, "offload_slots", 256),
            eviction=str(eviction),
            io_timeout_s=_number(extra, "io_timeout_s", 30.0, positive=True),
            load_delay_s=_number(extra, "load_delay_s", 0.0, positive=False),
            load_fault_rate=_number(extra, "load_fault_rate", 0.0, positive=False, maximum=1.0),
            fault_seed=seed,
            stage_blocks=_int(extra, "offload_stage_blocks", 32),
            store_when=str(store_when),
        )


# ------------------------------------------------------------------------------ metadata


def _malformed(detail: str) -> NoReturn:
    raise MalformedMetadataError(f"offload metadata is malformed: {detail}", clause="ERR-005")


_INT = frozenset({int})


def _column(
    value: object, what: str, minimum: int, *, distinct: bool, typed: bool = False
) -> tuple[int, ...]:
    """Check one column of a job: a non-empty tuple of ints >= ``minimum`` (distinct ones,
    ignoring -1, when ``distinct``); ``typed`` skips the element type check (the decoder's
    columns are ints by construction). Runs at C speed: no per-element Python code."""
    if type(value) is not tuple or not value:
        raise InvalidArgumentError(f"{what} must be a non-empty tuple of ints, got {value!r}")
    if not typed and not set(map(type, value)) <= _INT:
        bad = next(v for v in value if type(v) is not int)
        raise InvalidArgumentError(f"{what} holds {bad!r}; expected ints")
    if min(value) < minimum:
        raise InvalidArgumentError(f"{what} holds {min(value)}; expected ints >= {minimum}")
    if distinct:
        unique = set(value)
        unique.discard(-1)
        if len(unique) != len(value) - value.count(-1):
            raise InvalidArgumentError(f"{what} names the same value twice")
    return value


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

    Raises:
        InvalidArgumentError: a field is malformed, or the columns differ in length
            (InvalidBlockIdError for a block id, ERR-003).
    """

    request_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    tags: tuple[int, ...]
    is_load: bool

    def __attrs_post_init__(self) -> None:
        self._check(typed=False)

    def _check(self, *, typed: bool) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidArgumentError(
                f"request_id must be a non-empty str, got {self.request_id!r}"
            )
        if not isinstance(self.is_load, bool):
            raise InvalidArgumentError(f"is_load must be a bool, got {self.is_load!r}")
        what = f"job of {self.request_id!r}"
        try:
            _column(self.block_ids, f"block_ids of {what}", 0, distinct=True, typed=typed)
        except InvalidArgumentError as e:
            raise InvalidBlockIdError(e.message, clause="ERR-003") from None
        _column(self.slots, f"slots of {what}", -1 if self.is_load else 0, distinct=True,
                typed=typed)
        _column(self.tags, f"tags of {what}", 0, distinct=False, typed=typed)
        if not len(self.block_ids) == len(self.slots) == len(self.tags):
            raise InvalidArgumentError(
                f"{what} has {len(self.block_ids)} block ids, {len(self.slots)} slots and "
                f"{len(self.tags)} tags; expected one of each per block"
            )

    @classmethod
    def _build(
        cls, request_id: str, block_ids: tuple[int, ...], slots: tuple[int, ...],
        tags: tuple[int, ...], is_load: bool, *, typed: bool | None,
    ) -> TransferJob:
        """Construct with the element type check skipped (``typed`` True: the columns are
        ints by construction, as the decoder's are) or every check skipped (``typed``
        None: the scheduler's own jobs, built from checked inputs)."""
        job = object.__new__(cls)
        for name, value in (("request_id", request_id), ("block_ids", block_ids),
                            ("slots", slots), ("tags", tags), ("is_load", is_load)):
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


_META_KEYS = frozenset({"kind", "version", "loads", "stores", "aborted_loads"})
_JOB_KEYS = frozenset({"request_id", "blocks"})
_MAGIC = b"KVSO"
_HEADER = struct.Struct("<4sI")  # magic, header length
_MAX_HEADER = 1 << 24


def _int64s(values: Sequence[int]) -> bytes:
    """``values`` as little-endian int64s."""
    buf = array.array("q", values)
    if sys.byteorder != "little":  # pragma: no cover - no big-endian platform runs torch CI
        buf.byteswap()
    return buf.tobytes()


def _from_int64s(raw: bytes | memoryview) -> tuple[int, ...]:
    buf = array.array("q")
    buf.frombytes(raw)
    if sys.byteorder != "little":  # pragma: no cover
        buf.byteswap()
    return tuple(buf)


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

    Encodes to a JSON header and int64 columns (``encode``); ``decode`` accepts
    exactly that and validates every field (ERR-005, ERR-006).

    Raises:
        InvalidArgumentError: a field is malformed, or a request appears twice in a list.
    """

    loads: tuple[TransferJob, ...] = ()
    stores: tuple[TransferJob, ...] = ()
    aborted_loads: tuple[str, ...] = ()

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
        if not isinstance(self.aborted_loads, tuple) or not all(
            isinstance(r, str) and r for r in self.aborted_loads
        ) or len(set(self.aborted_loads)) != len(self.aborted_loads):
            raise InvalidArgumentError(
                f"aborted_loads must be a tuple of distinct request ids, got "
                f"{self.aborted_loads!r}"
            )

    @property
    def is_empty(self) -> bool:
        """True when the metadata describes nothing."""
        return not (self.loads or self.stores or self.aborted_loads)

    def encode(self) -> bytes:
        """Encode as plain data, no pickle (ERR-006): the magic ``b"KVSO"``, the length of a
        UTF-8 JSON header (``uint32`` little-endian), the header
        ``{"kind", "version", "loads", "stores", "aborted_loads"}`` (each job
        ``{"request_id", "blocks"}``, its block count), then for each job, loads first,
        its ``block_ids``, ``slots`` and ``tags`` columns as little-endian int64s. A
        256-block job encodes and decodes in microseconds."""
        def jobs(js: tuple[TransferJob, ...]) -> list[dict[str, Any]]:
            return [{"request_id": j.request_id, "blocks": len(j)} for j in js]

        header = json.dumps(
            {
                "kind": _META_KIND, "version": _META_VERSION, "loads": jobs(self.loads),
                "stores": jobs(self.stores), "aborted_loads": list(self.aborted_loads),
            },
            sort_keys=True, separators=(",", ":"),
        ).encode()
        parts = [_HEADER.pack(_MAGIC, len(header)), header]
        for j in (*self.loads, *self.stores):
            parts.append(_int64s(j.block_ids + j.slots + j.tags))
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes) -> Self:
        """Decode and validate bytes from ``encode``.

        Raises:
            MalformedMetadataError: ``data`` is not exactly what ``encode`` writes, or a
                field is out of range (ERR-005).
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            _malformed(f"expected bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) < _HEADER.size:
            _malformed(f"{len(data)} bytes; expected at least the {_HEADER.size}-byte prefix")
        magic, size = _HEADER.unpack_from(data)
        if magic != _MAGIC or size > min(_MAX_HEADER, len(data) - _HEADER.size):
            _malformed(f"prefix {magic!r} with a {size}-byte header in {len(data)} bytes; "
                       f"expected {_MAGIC!r} and a header that fits")
        obj = decode_json_envelope(
            data[_HEADER.size:_HEADER.size + size], kind=_META_KIND, version=_META_VERSION,
            keys=_META_KEYS, lists=("loads", "stores", "aborted_loads"), fail=_malformed,
        )
        counts = []
        for name in ("loads", "stores"):
            for i, value in enumerate(obj[name]):
                n = value.get("blocks") if isinstance(value, dict) else None
                if not isinstance(value, dict) or set(value) != _JOB_KEYS or type(n) is not int or (
                    n < 1
                ):
                    _malformed(f"{name}[{i}] is {value!r}; expected {{'request_id': str, "
                               "'blocks': int >= 1}")
                counts.append(n)
        payload = memoryview(data)[_HEADER.size + size:]
        if len(payload) != 24 * sum(counts):
            _malformed(f"{len(payload)} payload bytes; the header's {sum(counts)} blocks "
                       f"need {24 * sum(counts)} (three int64 columns)")
        columns = iter(counts)
        offset = 0

        def job(value: dict[str, Any], is_load: bool) -> TransferJob:
            nonlocal offset
            n = next(columns)
            values = _from_int64s(payload[offset:offset + 24 * n])
            offset += 24 * n
            return TransferJob._build(value["request_id"], values[:n], values[n:2 * n],
                                      values[2 * n:], is_load, typed=True)

        try:
            return cls(
                loads=tuple(job(v, True) for v in obj["loads"]),
                stores=tuple(job(v, False) for v in obj["stores"]),
                aborted_loads=tuple(obj["aborted_loads"]),
            )
        except MalformedMetadataError:
            raise
        except InvalidArgumentError as e:
            _malformed(e.message)


# ----------------------------------------------------------------------------- scheduler


def _id_set(ids: Iterable[str]) -> frozenset[str]:
    out = frozenset(ids)
    if not all(isinstance(i, str) and i for i in out):
        raise InvalidArgumentError(f"request ids must be non-empty str, got {sorted(map(repr, out))}",
                                   clause="ERR-002")
    return out


_MAX_FAILED_BYTES = 1 << 24


@attrs.frozen
class FailedStores:
    """Worker metadata of the offload backend: the stores of this step that failed on a
    rank (WRK-016). Ranks combine by union: a block one rank could not store is not stored.

    Attributes:
        request_ids: The requests whose store failed.
    """

    request_ids: frozenset[str] = attrs.field(converter=_id_set)

    def aggregate(self, other: FailedStores) -> FailedStores:
        """The union of both ranks' failed stores."""
        if not isinstance(other, FailedStores):
            raise InvalidArgumentError(
                f"cannot aggregate FailedStores with {type(other).__name__}", clause="EVT-007"
            )
        return FailedStores(self.request_ids | other.request_ids)

    def encode(self) -> bytes:
        """A JSON list of the request ids, sorted, to cross a process boundary (EVT-009)."""
        return json.dumps(sorted(self.request_ids), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> FailedStores:
        """Decode ``encode`` output.

        Raises:
            MalformedMetadataError: anything else (ERR-005).
        """
        try:
            value = json.loads(data) if len(data) <= _MAX_FAILED_BYTES else None
            if not isinstance(value, list) or not value:
                raise InvalidArgumentError(f"expected a non-empty list, got {value!r:.80}")
            return cls(frozenset(value))
        except (ValueError, RecursionError, TypeError, InvalidArgumentError) as e:
            raise MalformedMetadataError(
                f"FailedStores is malformed: {e}", clause="ERR-005"
            ) from None


@attrs.frozen
class _Record:
    """A load or store awaiting the aggregated report: the job and its blocks' keys."""

    job: TransferJob
    keys: tuple[bytes, ...]
    positions: tuple[int, ...] = ()  # stores: the blocks' positions in the request
    request: RequestView | None = None  # stores: for the BlockStored events


class _Running:
    """A running request as the eager stores see it: its view (prompt block hashes), its
    block ids so far, and the first block position not yet considered for a store."""

    __slots__ = ("request", "block_ids", "upto")

    def __init__(self, request: RequestView, block_ids: Iterable[int]) -> None:
        self.request = request
        self.block_ids = list(block_ids)
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

    Each store job carries a fresh tag that the workers record per slot; a load carries the
    tag it expects, so a slot whose content changed fails instead of loading wrong bytes.
    Per-block work is a handful of C-level container operations: planning a 256-block
    store or load costs tens of microseconds (``kvspec bench offload`` measures it).
    """

    def __init__(self, config: EngineConfigView) -> None:
        self._settings = OffloadSettings.from_config(config)
        self._config = config
        self._block_size = config.block_size
        self._capacity = self._settings.offload_slots
        self._policy: EvictionPolicy = make_policy(self._settings.eviction, self._capacity)
        self._index: dict[bytes, int] = {}  # stored on every rank: key -> slot
        self._slot_tag: list[int] = [0] * self._capacity  # tag of each slot's store
        self._next_tag = 1
        self._free: list[int] = list(range(self._capacity - 1, -1, -1))  # descending
        self._free_sorted = True
        self._pinning: dict[str, tuple[int, ...]] = {}  # in-flight load -> slots it reads
        self._zombies: set[int] = set()  # dropped while pinned: freed when unpinned
        self._storing: set[bytes] = set()
        self._known: set[str] = set()
        self._asked: dict[str, int] = {}
        self._loading: dict[str, _Record] = {}
        self._saving: dict[str, list[_Record]] = {}  # reported together at the finish
        self._running: dict[str, _Running] = {}  # store_when="computed" only
        self._pending_loads: list[TransferJob] = []
        self._pending_stores: list[TransferJob] = []
        self._pending_aborts: list[str] = []
        self._events: list[KVCacheEvent | _Record] = []  # stores: events built on take
        self._counters: Counter[str] = Counter()

    # -- introspection ----------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Scheduler counters since construction: ``lookups``, ``hit_blocks`` (loads
        planned), ``miss_blocks`` (blocks stored because they were not), ``evictions``,
        ``stores_skipped`` (no unpinned slot), ``load_failures`` (blocks), and gauges
        ``resident_blocks``, ``pinned_slots``, ``capacity_slots``."""
        out = {k: int(v) for k, v in self._counters.items()}
        for name in ("lookups", "hit_blocks", "miss_blocks", "evictions", "stores_skipped",
                     "load_failures"):
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
        stop = start
        while stop < end and keys[stop] in index:
            stop += 1
        return max(0, stop - start) * bs

    def on_new_request(self, request: RequestView) -> None:
        """Remember the request (SCH-028)."""
        self._known.add(check_request(request).request_id)

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Return ``(n, n > 0)``: tokens of stored blocks after the computed ones (SCH-001,
        SCH-004, SCH-005, SCH-007, SCH-020). Reads only the stored index; remembers
        ``num_computed_tokens`` as where a following allocation's external tokens start."""
        check_request(request)
        check_count("num_computed_tokens", num_computed_tokens)
        count = self._match(request, num_computed_tokens)
        self._known.add(request.request_id)
        self._asked[request.request_id] = num_computed_tokens
        self._counters["lookups"] += 1
        return count, count > 0

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
        ids = blocks.block_ids(0)
        if last > len(all_keys) or last > len(ids):
            raise InvalidArgumentError(
                f"request {rid!r}: external blocks [{first}, {last}) exceed its "
                f"{len(all_keys)} full blocks or its {len(ids)} allocated blocks",
                clause="SCH-010",
            )
        keys = tuple(all_keys[first:last])
        get = self._index.get
        slots = tuple([get(k, -1) for k in keys])
        tag = self._slot_tag
        tags = tuple([tag[s] if s >= 0 else 0 for s in slots])
        hits = [s for s in slots if s >= 0]
        self._policy.touch_many(keys)  # absent keys are ignored
        self._counters["hit_blocks"] += len(hits)
        job = TransferJob._build(rid, tuple(ids[first:last]), slots, tags, True, typed=None)
        self._pending_loads.append(job)
        self._loading[rid] = _Record(job, keys)
        if hits:
            self._pinning[rid] = tuple(hits)
        self._asked.pop(rid, None)

    # -- placement --------------------------------------------------------------------------

    def _pinned_slots(self) -> set[int]:
        """Slots read by in-flight loads (computed when needed: pinning and unpinning a
        load are then one dict operation each, whatever its size)."""
        return set().union(*self._pinning.values())

    def _release_slot(self, slot: int) -> None:
        self._free.append(slot)
        self._free_sorted = False

    def _drop(self, key: bytes, *, evicted: bool) -> None:
        """Forget stored ``key``: free its slot now, or when its last load ends."""
        slot = self._index.pop(key)
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
        bs = self._block_size
        tokens = request.all_token_ids
        hashes = request.block_hashes
        runs: list[tuple[int, int]] = []
        for i in record.positions:
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        events = []
        for first, last in runs:
            try:
                events.append(BlockStored(
                    block_hashes=hashes[first:last],
                    parent_block_hash=hashes[first - 1] if first else None,
                    token_ids=tokens[first * bs: last * bs], block_size=bs,
                    lora_id=request.lora_id, medium=MEDIUM,
                ))
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
        (SCH-021).

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
        AllocatedBlocks.single(block_ids).check_budget(self._config.num_blocks)
        self._known.discard(rid)
        self._asked.pop(rid, None)
        self._running.pop(rid, None)
        stored_before = rid in self._saving  # eager stores: reported with the finish
        if rid in self._loading:
            self._pending_aborts.append(rid)
            return stored_before, None
        full = min(len(request.block_hashes), request.num_computed_tokens // self._block_size,
                   len(block_ids))
        planned = self._plan_store(request, tuple(block_ids), 0, full)
        return planned or stored_before, None

    def _plan_store(
        self, request: RequestView, block_ids: Sequence[int], start: int, full: int
    ) -> bool:
        """Plan a store of the request's blocks at positions ``[start, full)`` that are
        neither stored nor being stored; True if one was planned."""
        rid = request.request_id
        keys = request.block_hashes
        index, storing = self._index, self._storing
        positions = [i for i in range(start, full)
                     if keys[i] not in index and keys[i] not in storing]
        new_keys = [keys[i] for i in positions]
        if len(set(new_keys)) != len(new_keys):  # a block repeated inside the request
            seen: set[bytes] = set()
            unique = []
            for i in positions:
                if keys[i] not in seen:
                    seen.add(keys[i])
                    unique.append(i)
            positions = unique
            new_keys = [keys[i] for i in positions]
        removed: list[bytes] = []
        slots = self._take_slots(len(positions), new_keys, removed) if positions else []
        if removed:
            self._events.append(BlockRemoved(block_hashes=removed, medium=MEDIUM))
        if len(slots) < len(positions):
            self._counters["stores_skipped"] += len(positions) - len(slots)
            del positions[len(slots):]
            del new_keys[len(slots):]
        if not positions:
            return False
        tag = self._next_tag
        self._next_tag += 1
        job = TransferJob._build(
            rid, tuple([block_ids[i] for i in positions]), tuple(slots), (tag,) * len(slots),
            False, typed=None,
        )
        self._pending_stores.append(job)
        self._storing.update(new_keys)
        record = _Record(job, tuple(new_keys), tuple(positions), request)
        self._saving.setdefault(rid, []).append(record)
        self._counters["miss_blocks"] += len(positions)
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
            if new.request_id in self._known:
                r = running[new.request_id] = _Running(new.request, new.blocks.block_ids(0))
                todo.append((r, new.num_computed_tokens))
        for cached in scheduler_output.scheduled_cached_reqs:
            known = running.get(cached.request_id)
            if known is None:
                continue
            if cached.resumed_from_preemption:  # its blocks were replaced
                known.block_ids = list(cached.new_blocks.block_ids(0))
                known.upto = 0
            else:
                known.block_ids.extend(cached.new_blocks.block_ids(0))
            todo.append((known, cached.num_computed_tokens))
        for r, computed in todo:
            full = min(len(r.request.block_hashes), computed // bs, len(r.block_ids))
            if full > r.upto:
                start, r.upto = r.upto, full
                self._plan_store(r.request, r.block_ids, start, full)

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
        meta = OffloadMetadata(
            loads=tuple(self._pending_loads), stores=tuple(self._pending_stores),
            aborted_loads=tuple(self._pending_aborts),
        )
        self._pending_loads.clear()
        self._pending_stores.clear()
        self._pending_aborts.clear()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Make the stores in ``finished_sending`` stored (queueing ``BlockStored``), except
        those a rank reported failed (``FailedStores``: their slots are freed and
        nothing is advertised), and
        unpin the loads in ``finished_recving``, dropping the blocks of failed loads named in
        ``invalid_block_ids`` (all of the load's blocks if none is named).

        Raises:
            UnknownRequestError: the output reports a transfer this role is not waiting
                for; nothing changes then (SCH-028).
        """
        check_output(output)
        stray = sorted(
            {f"{r} (sending)" for r in output.finished_sending if r not in self._saving}
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
        if removed:
            self._events.append(BlockRemoved(block_hashes=removed, medium=MEDIUM))
        insert_many = self._policy.insert_many
        meta = output.worker_metadata
        failed_stores = meta.request_ids if isinstance(meta, FailedStores) else frozenset()
        for rid in sorted(output.finished_sending):
            for record in self._saving.pop(rid):
                job = record.job
                self._storing.difference_update(record.keys)
                if rid in failed_stores:  # never advertised, never matched: slots back
                    for slot in job.slots:
                        self._release_slot(slot)
                    self._counters["store_failures"] += len(job)
                    continue
                tag = job.tags[0]
                self._index.update(zip(record.keys, job.slots))
                slot_tag = self._slot_tag
                for slot in job.slots:
                    slot_tag[slot] = tag
                insert_many(record.keys)
                self._events.append(record)  # its BlockStored events, built by take_events

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
            self._known, self._asked, self._loading, self._saving, self._storing, self._running,
            self._pending_loads, self._pending_stores, self._pending_aborts, self._events,
            self._index, self._pinning, self._zombies,
        ):
            state.clear()
