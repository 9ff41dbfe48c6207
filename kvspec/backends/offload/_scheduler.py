"""Settings, metadata and the scheduler role of the host-memory offloading backend.

The scheduler role owns placement: it maps each stored block (keyed by the engine's chained,
salted block hash, SCH-020) to a slot of the workers' host pools, evicts under the slot
budget with LRU or ARC, pins the slots of in-flight loads, and tells the workers, in the
step's :class:`OffloadMetadata`, "store block b into slot s" and "load slot s into block b".
"""

from __future__ import annotations

import json
import logging
import math
import re
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

_KEY_RE = re.compile(r"(?:[0-9a-f]{2}){1,256}")
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
    """

    offload_bytes: int = 64 << 20
    offload_slots: int = 256
    eviction: str = "lru"
    io_timeout_s: float = 30.0
    load_delay_s: float = 0.0
    load_fault_rate: float = 0.0
    fault_seed: int = 0

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
        )


# ------------------------------------------------------------------------------ metadata


def _malformed(detail: str) -> NoReturn:
    raise MalformedMetadataError(f"offload metadata is malformed: {detail}", clause="ERR-005")


def _check_blocks(value: object, what: str, min_slot: int) -> tuple[tuple[int, int, str], ...]:
    if not isinstance(value, tuple) or not value:
        raise InvalidArgumentError(
            f"{what} must be a non-empty tuple of (block_id, slot, key), got {value!r}"
        )
    seen_blocks: set[int] = set()
    seen_slots: set[int] = set()
    for item in value:
        if not isinstance(item, tuple) or len(item) != 3:
            raise InvalidArgumentError(f"{what} holds {item!r}; expected (block_id, slot, key)")
        block, slot, key = item
        if isinstance(block, bool) or not isinstance(block, int) or block < 0:
            raise InvalidBlockIdError(
                f"{what} holds block id {block!r}; expected an int >= 0", clause="ERR-003"
            )
        if isinstance(slot, bool) or not isinstance(slot, int) or slot < min_slot:
            raise InvalidArgumentError(f"{what} holds slot {slot!r}; expected an int >= {min_slot}")
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise InvalidArgumentError(f"{what} holds key {key!r}; expected lowercase hex")
        if block in seen_blocks or (slot >= 0 and slot in seen_slots):
            raise InvalidArgumentError(f"{what} names block {block} or slot {slot} twice")
        seen_blocks.add(block)
        seen_slots.add(slot)
    return value


@attrs.frozen
class TransferJob:
    """One request's blocks to move between the KV caches and the host pool.

    Attributes:
        request_id: The request.
        blocks: ``(block_id, slot, key)`` triples in token order: engine block, pool slot
            and the block's storage key (hex of its salted hash, SCH-020). In a load a slot
            of -1 means the block was evicted after the match: the workers fail it (WRK-011).
        is_load: True for a load (pool to KV caches), False for a store.

    Raises:
        InvalidArgumentError: a field is malformed (InvalidBlockIdError for a block id).
    """

    request_id: str
    blocks: tuple[tuple[int, int, str], ...]
    is_load: bool

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidArgumentError(
                f"request_id must be a non-empty str, got {self.request_id!r}"
            )
        if not isinstance(self.is_load, bool):
            raise InvalidArgumentError(f"is_load must be a bool, got {self.is_load!r}")
        _check_blocks(self.blocks, f"blocks of {self.request_id!r}", -1 if self.is_load else 0)

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The engine block ids, in token order."""
        return tuple(b for b, _, _ in self.blocks)


_META_KEYS = frozenset({"kind", "version", "loads", "stores", "aborted_loads"})
_JOB_KEYS = frozenset({"request_id", "blocks"})


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

    Encodes to the JSON object ``{"kind", "version", "loads", "stores", "aborted_loads"}``;
    :meth:`decode` accepts exactly that and validates every field (ERR-005, ERR-006).

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
        """Encode as UTF-8 JSON, no pickle (ERR-006)."""
        def jobs(js: tuple[TransferJob, ...]) -> list[dict[str, Any]]:
            return [{"request_id": j.request_id, "blocks": [list(b) for b in j.blocks]}
                    for j in js]

        return json.dumps(
            {
                "kind": _META_KIND, "version": _META_VERSION, "loads": jobs(self.loads),
                "stores": jobs(self.stores), "aborted_loads": list(self.aborted_loads),
            },
            sort_keys=True, separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        """Decode and validate bytes from :meth:`encode`.

        Raises:
            MalformedMetadataError: ``data`` is not exactly what :meth:`encode` writes, or a
                field is out of range (ERR-005).
        """
        obj = decode_json_envelope(
            data, kind=_META_KIND, version=_META_VERSION, keys=_META_KEYS,
            lists=("loads", "stores", "aborted_loads"), fail=_malformed,
        )

        def job(value: object, what: str, is_load: bool) -> TransferJob:
            if not isinstance(value, dict) or set(value) != _JOB_KEYS:
                _malformed(f"{what} is {value!r}; expected keys {sorted(_JOB_KEYS)}")
            blocks = value["blocks"]
            if not isinstance(blocks, list) or not all(
                isinstance(b, list) and len(b) == 3 for b in blocks
            ):
                _malformed(f"{what}.blocks is {blocks!r}; expected [[block, slot, key], ...]")
            return TransferJob(value["request_id"], tuple(tuple(b) for b in blocks), is_load)

        try:
            return cls(
                loads=tuple(job(v, f"loads[{i}]", True) for i, v in enumerate(obj["loads"])),
                stores=tuple(
                    job(v, f"stores[{i}]", False) for i, v in enumerate(obj["stores"])
                ),
                aborted_loads=tuple(obj["aborted_loads"]),
            )
        except MalformedMetadataError:
            raise
        except InvalidArgumentError as e:
            _malformed(e.message)



# ----------------------------------------------------------------------------- scheduler


def _check_request(request: object) -> RequestView:
    if not isinstance(request, RequestView):
        raise InvalidArgumentError(
            f"request must be a RequestView, got {type(request).__name__}", clause="ERR-002"
        )
    return request


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"{name} must be an int >= 0, got {value!r}", clause="ERR-002")
    return value


@attrs.frozen
class _StoreRecord:
    """A store awaiting the aggregated ``finished_sending``: keys, slots, events."""

    keys: tuple[str, ...]
    slots: tuple[int, ...]
    events: tuple[BlockStored, ...]


class OffloadScheduler(SchedulerConnector):
    """Scheduler role of the offloading backend: lookup, placement, eviction, pinning.

    Matching (SCH-001, SCH-004..007, SCH-020): consecutive blocks after the computed tokens
    whose salted hashes are stored on every rank, block aligned, leaving one prompt token;
    ``(n, n > 0)``; no side effect. Loads are planned in ``update_state_after_alloc`` and
    pin their slots until the aggregated ``finished_recving`` (SCH-009, SCH-010). Stores are
    planned in ``request_finished`` for the full computed blocks not stored or being stored,
    into free slots or slots freed by evicting unpinned blocks; the free is delayed until
    the aggregated ``finished_sending`` (SCH-016), when the blocks become stored and
    ``BlockStored`` events are queued (EVT-004, EVT-005). Evictions and failed loads queue
    ``BlockRemoved``.
    """

    def __init__(self, config: EngineConfigView) -> None:
        self._settings = OffloadSettings.from_config(config)
        self._config = config
        self._block_size = config.block_size
        self._capacity = self._settings.offload_slots
        self._policy: EvictionPolicy = make_policy(self._settings.eviction, self._capacity)
        self._index: dict[str, int] = {}  # stored on every rank: key -> slot
        self._free: list[int] = list(range(self._capacity - 1, -1, -1))
        self._pins: Counter[int] = Counter()  # slot -> in-flight loads reading it
        self._zombies: set[int] = set()  # dropped while pinned: freed when unpinned
        self._storing: set[str] = set()
        self._known: set[str] = set()
        self._asked: dict[str, int] = {}
        self._loading: dict[str, TransferJob] = {}
        self._saving: dict[str, _StoreRecord] = {}
        self._pending_loads: list[TransferJob] = []
        self._pending_stores: list[TransferJob] = []
        self._pending_aborts: list[str] = []
        self._events: list[KVCacheEvent] = []
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
        out["pinned_slots"] = sum(1 for v in self._pins.values() if v > 0)
        out["capacity_slots"] = self._capacity
        return out

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy (for tests and benchmarks; do not mutate)."""
        return self._policy

    def slot_of(self, key: str) -> int | None:
        """The slot holding stored block ``key``, or None."""
        return self._index.get(key)

    # -- matching ---------------------------------------------------------------------------

    @staticmethod
    def _keys(request: RequestView) -> tuple[str, ...]:
        return tuple(h.hex() for h in request.block_hashes)

    def _match(self, request: RequestView, num_computed_tokens: int) -> int:
        bs = self._block_size
        if num_computed_tokens % bs:
            return 0
        keys = self._keys(request)
        start = num_computed_tokens // bs
        end = min(len(keys), (request.num_prompt_tokens - 1) // bs)
        stop = start
        while stop < end and keys[stop] in self._index:
            stop += 1
        return max(0, stop - start) * bs

    def on_new_request(self, request: RequestView) -> None:
        """Remember the request (SCH-028)."""
        self._known.add(_check_request(request).request_id)

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Return ``(n, n > 0)``: tokens of stored blocks after the computed ones (SCH-001,
        SCH-004, SCH-005, SCH-007, SCH-020). Reads only the stored index; remembers
        ``num_computed_tokens`` as where a following allocation's external tokens start."""
        _check_request(request)
        _check_count("num_computed_tokens", num_computed_tokens)
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
        _check_request(request)
        rid = request.request_id
        if rid not in self._known:
            raise UnknownRequestError(
                f"update_state_after_alloc for request {rid!r}, which this connector never "
                "saw", request_id=rid, clause="SCH-028",
            )
        if not isinstance(blocks, AllocatedBlocks):
            raise InvalidArgumentError(
                f"blocks must be AllocatedBlocks, got {type(blocks).__name__}", clause="ERR-002"
            )
        if _check_count("num_external_tokens", num_external_tokens) == 0:
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
        keys = self._keys(request)
        ids = blocks.block_ids(0)
        if last > len(keys) or last > len(ids):
            raise InvalidArgumentError(
                f"request {rid!r}: external blocks [{first}, {last}) exceed its "
                f"{len(keys)} full blocks or its {len(ids)} allocated blocks", clause="SCH-010",
            )
        triples = []
        for i in range(first, last):
            slot = self._index.get(keys[i], -1)
            if slot >= 0:
                self._pins[slot] += 1
                self._policy.touch(keys[i])
                self._counters["hit_blocks"] += 1
            triples.append((ids[i], slot, keys[i]))
        job = TransferJob(rid, tuple(triples), True)
        self._pending_loads.append(job)
        self._loading[rid] = job
        self._asked.pop(rid, None)

    # -- placement --------------------------------------------------------------------------

    def _is_pinned(self, key: str) -> bool:
        slot = self._index.get(key)
        return slot is not None and self._pins[slot] > 0

    def _drop(self, key: str, *, evicted: bool) -> None:
        """Forget stored ``key``: free its slot now, or when its last load ends."""
        slot = self._index.pop(key)
        if not evicted:
            self._policy.remove(key)
        if self._pins[slot] > 0:
            self._zombies.add(slot)
        else:
            self._free.append(slot)

    def _take_slot(self, key: str, removed: list[bytes]) -> int | None:
        """A free slot for ``key``, evicting an unpinned stored block if needed."""
        if not self._free:
            victim = self._policy.evict(self._is_pinned, incoming=key)
            if victim is None:
                return None
            self._drop(victim, evicted=True)
            self._counters["evictions"] += 1
            removed.append(bytes.fromhex(victim))
        return self._free.pop() if self._free else None

    def _unpin(self, slot: int) -> None:
        if slot < 0:
            return
        self._pins[slot] -= 1
        if self._pins[slot] <= 0:
            del self._pins[slot]
            if slot in self._zombies:
                self._zombies.discard(slot)
                self._free.append(slot)

    # -- finishing --------------------------------------------------------------------------

    def _stored_events(
        self, request: RequestView, keys: tuple[str, ...], positions: Sequence[int]
    ) -> tuple[BlockStored, ...]:
        """One BlockStored per run of consecutive stored positions (EVT-005)."""
        bs = self._block_size
        tokens = request.all_token_ids
        runs: list[list[int]] = []
        for i in positions:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        events = []
        for run in runs:
            first, last = run[0], run[-1] + 1
            try:
                events.append(BlockStored(
                    block_hashes=[bytes.fromhex(keys[i]) for i in run],
                    parent_block_hash=bytes.fromhex(keys[first - 1]) if first else None,
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
        stored nor being stored, and delay the free while it runs (SCH-015, SCH-016).

        Slots come from the free list, else from evicting unpinned stored blocks (queued
        ``BlockRemoved``); blocks that find no slot are not stored. A request whose load is
        still in flight is not stored: ``(False, None)``, and the next metadata names it in
        ``aborted_loads`` (SCH-021).

        Raises:
            UnknownRequestError: the request was never seen or already finished (SCH-028).
            InvalidBlockIdError: a block id is outside the budget (LAY-012).
        """
        _check_request(request)
        rid = request.request_id
        if rid not in self._known:
            raise UnknownRequestError(
                f"request_finished for request {rid!r}, which this connector never saw or "
                "already finished (SCH-015)", request_id=rid, clause="SCH-028",
            )
        AllocatedBlocks.single(block_ids).check_budget(self._config.num_blocks)
        self._known.discard(rid)
        self._asked.pop(rid, None)
        if rid in self._loading:
            self._pending_aborts.append(rid)
            return False, None
        block_ids = tuple(block_ids)
        keys = self._keys(request)
        full = min(len(keys), request.num_computed_tokens // self._block_size, len(block_ids))
        positions: list[int] = []
        slots: list[int] = []
        removed: list[bytes] = []
        seen: set[str] = set()
        for i in range(full):
            key = keys[i]
            if key in self._index or key in self._storing or key in seen:
                continue
            slot = self._take_slot(key, removed)
            if slot is None:
                self._counters["stores_skipped"] += full - i
                break
            seen.add(key)
            positions.append(i)
            slots.append(slot)
        if removed:
            self._events.append(BlockRemoved(block_hashes=removed, medium=MEDIUM))
        if not positions:
            return False, None
        job = TransferJob(
            rid, tuple((block_ids[i], s, keys[i]) for i, s in zip(positions, slots)), False
        )
        record = _StoreRecord(
            tuple(keys[i] for i in positions), tuple(slots),
            self._stored_events(request, keys, positions),
        )
        self._pending_stores.append(job)
        self._storing.update(record.keys)
        self._saving[rid] = record
        self._counters["miss_blocks"] += len(positions)
        return True, None

    # -- per step ---------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ConnectorMetadata:
        """Describe the loads, stores and aborted loads planned since the last call, once
        each (SCH-011, SCH-013). Never waits (SCH-014)."""
        if not isinstance(scheduler_output, SchedulerOutputView):
            raise InvalidArgumentError(
                f"scheduler_output must be a SchedulerOutputView, got "
                f"{type(scheduler_output).__name__}", clause="ERR-002",
            )
        meta = OffloadMetadata(
            loads=tuple(self._pending_loads), stores=tuple(self._pending_stores),
            aborted_loads=tuple(self._pending_aborts),
        )
        self._pending_loads.clear()
        self._pending_stores.clear()
        self._pending_aborts.clear()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Make the stores in ``finished_sending`` stored (queueing ``BlockStored``), and
        unpin the loads in ``finished_recving``, dropping the blocks of failed loads named in
        ``invalid_block_ids`` (all of the load's blocks if none is named).

        Raises:
            UnknownRequestError: the output reports a transfer this role is not waiting
                for; nothing changes then (SCH-028).
        """
        if not isinstance(output, KVConnectorOutput):
            raise InvalidArgumentError(
                f"output must be a KVConnectorOutput, got {type(output).__name__}",
                clause="ERR-002",
            )
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
            job = self._loading.pop(rid)
            if rid in output.failed_recving:
                named = [t for t in job.blocks if t[0] in output.invalid_block_ids]
                for _, slot, key in named or job.blocks:
                    self._counters["load_failures"] += 1
                    if slot >= 0 and self._index.get(key) == slot:
                        self._drop(key, evicted=False)
                        removed.append(bytes.fromhex(key))
            for _, slot, _ in job.blocks:
                self._unpin(slot)
        if removed:
            self._events.append(BlockRemoved(block_hashes=removed, medium=MEDIUM))
        for rid in sorted(output.finished_sending):
            record = self._saving.pop(rid)
            for key, slot in zip(record.keys, record.slots):
                self._storing.discard(key)
                self._index[key] = slot
                self._policy.insert(key)
            self._events.extend(record.events)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Return the ``BlockStored`` / ``BlockRemoved`` events since the last call, once
        each (EVT-004)."""
        events, self._events = tuple(self._events), []
        return events

    def shutdown(self) -> None:
        """Forget every request, pending job and stored block; idempotent (SCH-027)."""
        for state in (
            self._known, self._asked, self._loading, self._saving, self._storing,
            self._pending_loads, self._pending_stores, self._pending_aborts, self._events,
            self._index, self._pins, self._zombies,
        ):
            state.clear()
