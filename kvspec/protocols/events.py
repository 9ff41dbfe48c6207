"""What a worker rank hands back to the engine each step, and the events inside it.

Every worker rank returns one ``KVConnectorOutput`` per model step. It names the
requests whose asynchronous sends and receives finished on that rank, the blocks whose
load failed, the connector's statistics, the KV-cache events the connector produced and
connector-specific worker metadata. The executor combines the outputs of all ranks with
an aggregator (see ``kvspec.protocols.aggregation``) before the scheduler sees them.

Clauses enforced here:

* EVT-001 -- an output is immutable and validated when it is constructed.
* EVT-002 -- a failed receive is a finished receive: ``failed_recving`` is a subset of
  ``finished_recving``.
* EVT-003 -- invalid block ids are non-negative ints, reported no later than the step
  that reports the owning request's finished receive.
* EVT-004 -- each KV-cache event is delivered exactly once (taking events drains them).
* EVT-005 -- the fields of each KV-cache event are well formed.
* EVT-006 -- connector statistics reduce associatively (and commutatively for
  ``ConnectorStats``).
* EVT-007 -- worker metadata reduces associatively.
* EVT-008 -- ``expected_finished_count`` is at least 1 when set.
* EVT-009 -- outputs cross a process boundary only through the safe wire codec
  (``KVConnectorOutput.to_wire`` / ``KVConnectorOutput.from_wire``); nothing
  is ever unpickled from a peer (ERR-006).

This module imports nothing of kvspec but ``kvspec.protocols.errors``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import NoReturn, Protocol, Union, cast, runtime_checkable

import attrs
from typing_extensions import Self, TypeAlias

from kvspec.protocols.errors import (
    InvalidArgumentError,
    InvalidBlockIdError,
    MalformedMetadataError,
)
from kvspec.protocols.views import RequestView

__all__ = [
    "EMPTY_OUTPUT",
    "WIRE_VERSION",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "ConnectorStats",
    "Direction",
    "KVCacheEvent",
    "KVConnectorOutput",
    "SupportsAggregate",
    "WorkerMetadata",
]


class Direction(enum.Enum):
    """The direction of an asynchronous KV transfer, as the engine accounts for it.

    ``SEND``: the engine delayed freeing a finished request's blocks because the
    connector is still reading them (``request_finished`` returned True); the blocks
    are freed once every expected rank reports the request in ``finished_sending``.

    ``RECV``: the engine is waiting for remote KV to be loaded into a request's blocks;
    the request is scheduled again once every expected rank reports it in
    ``finished_recving``.
    """

    SEND = "send"
    RECV = "recv"


@runtime_checkable
class SupportsAggregate(Protocol):
    """A value that several worker ranks produce and the executor reduces to one.

    Connector statistics and connector-specific worker metadata both satisfy this
    Protocol. The executor calls ``aggregate`` on the values of all ranks that carry
    one, in rank order (EXE-006, EXE-007).

    Obligations of an implementation:

    * ``aggregate`` MUST return a new value that combines ``self`` and ``other`` and
      MUST NOT mutate either operand.
    * The reduction MUST be associative (EVT-006 for statistics, EVT-007 for worker
      metadata): ``a.aggregate(b).aggregate(c)`` equals
      ``a.aggregate(b.aggregate(c))``. The executor may group ranks differently (for
      example across pipeline stages), so a non-associative reduction gives results
      that depend on the deployment.
    * It MAY assume ``other`` comes from a rank of the same connector (same type);
      it MUST raise an error rather than silently drop data it cannot combine.
    * The value MUST NOT require unpickling to cross a process boundary (ERR-006,
      EVT-009): a value that is not a ``ConnectorStats`` provides the same codec as
      connector metadata, ``encode() -> bytes`` and a classmethod ``decode(data)`` that
      returns an equal value (the harness carries it from worker processes so, and
      reports a value without it).
    """

    def aggregate(self, other: Self) -> Self:
        """Return the combination of ``self`` and ``other``; mutate neither (EVT-006)."""
        ...


WorkerMetadata: TypeAlias = SupportsAggregate
"""Connector-specific metadata a worker rank returns each step (EVT-007).

It is any ``SupportsAggregate`` value: the executor reduces the values of all
ranks with ``aggregate`` in rank order and hands the result to the scheduler-side
connector. kvspec does not interpret it.
"""

BlockHash: TypeAlias = Union[int, bytes]
"""The hash of one full KV-cache block, as the engine's prefix cache computes it.

An ``int`` (any value, never a ``bool``) or a non-empty ``bytes`` digest (EVT-005).
"""


# --------------------------------------------------------------------------- helpers


def _type_name(value: object) -> str:
    return type(value).__name__


_BYTES = frozenset({bytes})
_INT = frozenset({int})
_STR = frozenset({str})


def _check_hash(value: object, what: str) -> int | bytes:
    if isinstance(value, bool) or not isinstance(value, (int, bytes)):
        raise InvalidArgumentError(
            f"{what} is {value!r} ({_type_name(value)}); expected an int or a non-empty "
            "bytes digest",
            clause="EVT-005",
        )
    if isinstance(value, bytes) and not value:
        raise InvalidArgumentError(
            f"{what} is empty bytes; expected a non-empty bytes digest", clause="EVT-005"
        )
    return value


_PLAIN_CONTAINERS = frozenset({set, frozenset, list, tuple})


def _iterate(value: object, what: str, clause: str) -> list[object]:
    if type(value) in _PLAIN_CONTAINERS:  # the common case, without the ABC checks below
        return list(cast("Iterable[object]", value))
    if isinstance(value, (str, bytes, bytearray)):
        raise InvalidArgumentError(
            f"{what} is a bare {_type_name(value)} {value!r}; expected an iterable of items",
            clause=clause,
        )
    if isinstance(value, Mapping):
        raise InvalidArgumentError(
            f"{what} is a mapping; expected an iterable of items (a set, list or tuple)",
            clause=clause,
        )
    if not isinstance(value, Iterable):
        raise InvalidArgumentError(
            f"{what} is {value!r} ({_type_name(value)}); expected an iterable",
            clause=clause,
        )
    return list(value)


def _check_optional_medium(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(
            f"medium is {value!r}; expected None or a non-empty string naming the storage "
            "medium (for example 'GPU' or 'CPU')",
            clause="EVT-005",
        )
    return value


def _block_hashes(value: Iterable[BlockHash]) -> tuple[BlockHash, ...]:
    items = _iterate(value, "block_hashes", "EVT-005")
    if not items:
        raise InvalidArgumentError(
            "block_hashes is empty; expected at least one block hash", clause="EVT-005"
        )
    if set(map(type, items)) <= _BYTES and all(items):  # the common case, at C speed
        return tuple(items)  # type: ignore[arg-type]
    return tuple(_check_hash(h, f"block_hashes[{i}]") for i, h in enumerate(items))


def _parent_block_hash(value: BlockHash | None) -> BlockHash | None:
    if value is None:
        return None
    return _check_hash(value, "parent_block_hash")


def _token_ids(value: Iterable[int]) -> tuple[int, ...]:
    items = _iterate(value, "token_ids", "EVT-005")
    if not items or (set(map(type, items)) <= _INT and min(items) >= 0):  # type: ignore[type-var,operator]
        return tuple(items)  # type: ignore[arg-type]
    for i, t in enumerate(items):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise InvalidArgumentError(
                f"token_ids[{i}] is {t!r}; expected a non-negative int token id",
                clause="EVT-005",
            )
    return tuple(items)  # type: ignore[arg-type]


def _block_size(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(
            f"block_size is {value!r}; expected an int >= 1 (tokens per block)",
            clause="EVT-005",
        )
    return value


def _lora_id(value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(
            f"lora_id is {value!r}; expected None or a non-negative int", clause="EVT-005"
        )
    return value


def _medium(value: str | None) -> str | None:
    return _check_optional_medium(value)


# ---------------------------------------------------------------------- cache events


@attrs.frozen
class BlockStored:
    """The connector or engine stored full blocks in a KV cache (EVT-005).

    Produced once per storing action and delivered exactly once (EVT-004): a connector
    returns it from ``take_events`` (which drains its queue) or in one step's
    ``KVConnectorOutput``, never both and never twice.

    Attributes:
        block_hashes: The hashes of the stored blocks, in token order; at least one.
        parent_block_hash: The hash of the block preceding the first stored block, or
            None when the first stored block starts the sequence.
        token_ids: The tokens the stored blocks hold; exactly
            ``len(block_hashes) * block_size`` of them.
        block_size: Tokens per block, at least 1.
        lora_id: The LoRA adapter the blocks were computed with, or None.
        medium: Where the blocks live (``"GPU"``, ``"CPU"``, a connector-defined name),
            or None when unspecified.

    Raises:
        InvalidArgumentError: A field is malformed (EVT-005); the message names it.
    """

    block_hashes: tuple[BlockHash, ...] = attrs.field(converter=_block_hashes)
    parent_block_hash: BlockHash | None = attrs.field(converter=_parent_block_hash)
    token_ids: tuple[int, ...] = attrs.field(converter=_token_ids)
    block_size: int = attrs.field(converter=_block_size)
    lora_id: int | None = attrs.field(default=None, converter=_lora_id)
    medium: str | None = attrs.field(default=None, converter=_medium)

    def __attrs_post_init__(self) -> None:
        expected = len(self.block_hashes) * self.block_size
        if len(self.token_ids) != expected:
            raise InvalidArgumentError(
                f"token_ids has {len(self.token_ids)} tokens; expected "
                f"len(block_hashes) * block_size = {len(self.block_hashes)} * "
                f"{self.block_size} = {expected}",
                clause="EVT-005",
            )

    @classmethod
    def from_request(
        cls, request: RequestView, first: int, last: int, block_size: int, *,
        medium: str | None = None,
    ) -> BlockStored:
        """The event for the request's full blocks at positions ``[first, last)``: their
        hashes from ``request.block_hashes``, the parent the hash before ``first``, their
        tokens from the request's tokens, the request's ``lora_id``.

        Checks the arguments, not the hashes, tokens and ``lora_id`` again: a
        ``RequestView`` checked them when it was built (non-empty bytes, ints >= 0), so
        the event costs two slices, not a pass over every token id. A connector that
        stores blocks every step (vLLM calls ``take_events`` every step) should build its
        events so.

        Raises:
            InvalidArgumentError: ``request`` is not a ``RequestView``, ``[first, last)``
                is not a non-empty range of its full blocks (``last * block_size`` tokens
                at most, ``last`` hashes at most), ``block_size`` is not an int >= 1, or
                ``medium`` is malformed (EVT-005).
        """
        if not isinstance(request, RequestView):
            raise InvalidArgumentError(
                f"request is {_type_name(request)}; expected a RequestView", clause="EVT-005"
            )
        size = _block_size(block_size)
        hashes = request.block_hashes
        if (isinstance(first, bool) or isinstance(last, bool) or not isinstance(first, int)
                or not isinstance(last, int) or not 0 <= first < last <= len(hashes)
                or last * size > request.num_tokens):
            raise InvalidArgumentError(
                f"blocks [{first!r}, {last!r}) of request {request.request_id!r}; expected "
                f"0 <= first < last <= {len(hashes)} (its block hashes) and last * "
                f"{size} <= {request.num_tokens} (its tokens)", clause="EVT-005",
            )
        prompt = request.prompt_token_ids
        tokens = (prompt if last * size <= len(prompt) else request.all_token_ids)
        event = _NEW(cls)
        for setter, value in zip(_BLOCK_STORED_SETTERS, (
                hashes[first:last], hashes[first - 1] if first else None,
                tokens[first * size:last * size], size, request.lora_id, _medium(medium))):
            setter(event, value)
        return event


@attrs.frozen
class BlockRemoved:
    """Blocks were evicted or freed from a KV cache (EVT-005).

    Delivered exactly once, like every KV-cache event (EVT-004).

    Attributes:
        block_hashes: The hashes of the removed blocks; at least one.
        medium: Where the blocks lived, or None when unspecified.

    Raises:
        InvalidArgumentError: A field is malformed (EVT-005); the message names it.
    """

    block_hashes: tuple[BlockHash, ...] = attrs.field(converter=_block_hashes)
    medium: str | None = attrs.field(default=None, converter=_medium)


@attrs.frozen
class AllBlocksCleared:
    """Every block of a KV cache was dropped at once (a reset) (EVT-005).

    Consumers MUST forget every block hash they learned from earlier events of the
    same source. Delivered exactly once, like every KV-cache event (EVT-004).
    """


KVCacheEvent: TypeAlias = Union[BlockStored, BlockRemoved, AllBlocksCleared]
"""Any KV-cache event a connector reports (EVT-004, EVT-005)."""

_EVENT_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)


# ---------------------------------------------------------------------------- stats


def _freeze_counters(value: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    if (type(value) is dict and set(map(type, value)) <= _STR and "" not in value
            and set(map(type, value.values())) <= _INT):  # the usual case: at C speed
        return tuple(sorted(value.items()))
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(
            f"counters is {value!r} ({_type_name(value)}); expected a mapping of counter "
            "name to number",
            clause="EVT-006",
        )
    items: list[tuple[str, float]] = []
    for name, number in value.items():
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(
                f"counter name {name!r} is not a non-empty string; expected counter names "
                "to be non-empty strings",
                clause="EVT-006",
            )
        if (
            isinstance(number, bool)
            or not isinstance(number, (int, float))
            or not math.isfinite(number)
        ):
            raise InvalidArgumentError(
                f"counter {name!r} is {number!r}; expected a finite int or float",
                clause="EVT-006",
            )
        items.append((name, number))
    items.sort(key=lambda item: item[0])
    return tuple(items)


@attrs.frozen(repr=False)
class ConnectorStats:
    """Named numeric counters a worker rank reports for one step (EVT-006).

    The executor reduces the stats of all ranks with ``aggregate`` (summing each
    counter) and the engine's logger reads the result. Connectors with richer
    statistics subclass this class (overriding ``aggregate``, which MUST stay
    associative) or provide any ``SupportsAggregate`` value instead.

    Construct it as ``ConnectorStats(counters={name: value, ...})``: names are non-empty
    strings; values are finite ints or floats (never ``bool``). The mapping is copied;
    later changes to the argument do not affect the stats.

    Raises:
        InvalidArgumentError: A name or value is malformed (EVT-006).
    """

    _items: tuple[tuple[str, float], ...] = attrs.field(
        alias="counters", factory=dict, converter=_freeze_counters
    )

    @classmethod
    def _of_ints(cls, counters: dict[str, int]) -> Self:
        """Stats of int counters a backend keeps under names it wrote itself, without
        checking them again: for a worker's per-step stats. Not for anything that comes
        from a connector or a peer."""
        stats = object.__new__(cls)
        object.__setattr__(stats, "_items", tuple(sorted(counters.items())))
        return stats

    @property
    def counters(self) -> Mapping[str, float]:
        """A read-only view of the counters, keyed by name (sorted)."""
        return MappingProxyType(dict(self._items))

    def aggregate(self, other: Self) -> Self:
        """Return stats whose counters are the per-name sums of ``self`` and ``other``.

        A counter missing on one side counts as zero. The reduction is associative and
        commutative (EVT-006); exactly so for int counters, up to float rounding for
        float counters. Neither operand is mutated.

        Raises:
            InvalidArgumentError: ``other`` is not a ``ConnectorStats``.
        """
        if not isinstance(other, ConnectorStats):
            raise InvalidArgumentError(
                f"cannot aggregate {type(self).__name__} with {_type_name(other)}; expected "
                "stats of the same connector (a ConnectorStats)",
                clause="EVT-006",
            )
        merged: dict[str, float] = dict(self._items)
        for name, number in other._items:
            merged[name] = merged.get(name, 0) + number
        return attrs.evolve(self, counters=merged)

    def is_empty(self) -> bool:
        """True when there is nothing to log: no counters, or every counter is zero."""
        return all(number == 0 for _, number in self._items)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(counters={dict(self._items)!r})"


# --------------------------------------------------------------------------- output


def _request_ids(value: object, what: str) -> frozenset[str]:
    items = _iterate(value, what, "EVT-001")
    for rid in items:
        if not isinstance(rid, str) or not rid:
            raise InvalidArgumentError(
                f"{what} contains {rid!r} ({_type_name(rid)}); expected non-empty string "
                "request ids",
                clause="EVT-001",
            )
    return frozenset(items)  # type: ignore[arg-type]


def _finished_sending(value: Iterable[str]) -> frozenset[str]:
    return _request_ids(value, "finished_sending")


def _finished_recving(value: Iterable[str]) -> frozenset[str]:
    return _request_ids(value, "finished_recving")


def _failed_recving(value: Iterable[str]) -> frozenset[str]:
    return _request_ids(value, "failed_recving")


def _invalid_block_ids(value: Iterable[int]) -> frozenset[int]:
    items = _iterate(value, "invalid_block_ids", "EVT-003")
    for block_id in items:
        if isinstance(block_id, bool) or not isinstance(block_id, int) or block_id < 0:
            raise InvalidBlockIdError(
                f"invalid_block_ids contains {block_id!r} ({_type_name(block_id)}); "
                "expected non-negative int block ids",
                clause="EVT-003",
            )
    return frozenset(items)  # type: ignore[arg-type]


def _aggregatable(value: object, what: str, clause: str) -> SupportsAggregate | None:
    if value is None:
        return None
    # What isinstance(value, SupportsAggregate) checks, without the Protocol's slow path.
    if isinstance(value, type) or not callable(getattr(value, "aggregate", None)):
        raise InvalidArgumentError(
            f"{what} is {_type_name(value)}, which has no aggregate() method; expected "
            "None or a value satisfying SupportsAggregate",
            clause=clause,
        )
    return cast(SupportsAggregate, value)


def _stats(value: SupportsAggregate | None) -> SupportsAggregate | None:
    return _aggregatable(value, "stats", "EVT-006")


def _worker_metadata(value: SupportsAggregate | None) -> SupportsAggregate | None:
    return _aggregatable(value, "worker_metadata", "EVT-007")


def _events(value: Iterable[KVCacheEvent]) -> tuple[KVCacheEvent, ...]:
    items = _iterate(value, "events", "EVT-005")
    for i, event in enumerate(items):
        if not isinstance(event, _EVENT_TYPES):
            raise InvalidArgumentError(
                f"events[{i}] is {_type_name(event)}; expected a BlockStored, BlockRemoved "
                "or AllBlocksCleared",
                clause="EVT-005",
            )
    return tuple(items)  # type: ignore[arg-type]


def _expected_finished_count(value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(
            f"expected_finished_count is {value!r}; expected None or an int >= 1",
            clause="EVT-008",
        )
    return value


WIRE_VERSION = 1
"""The version tag ``KVConnectorOutput.to_wire`` writes and ``from_wire`` requires."""

_WIRE_KIND = "kvspec.KVConnectorOutput"
_WIRE_KEYS = frozenset(
    {
        "kind",
        "version",
        "finished_sending",
        "finished_recving",
        "failed_recving",
        "invalid_block_ids",
        "stats",
        "events",
        "worker_metadata",
        "expected_finished_count",
    }
)


@attrs.frozen
class KVConnectorOutput:
    """What one worker rank reports to the engine after a model step (EVT-001).

    A connector's worker side builds one per step (the engine calls its
    ``get_finished`` / stats / event hooks and packs the answers); the executor
    combines the outputs of all ranks (see
    ``StandardAggregator``). Every argument may be
    any iterable of the right items; it is converted to the immutable type below and
    validated on construction (EVT-001). It never changes afterwards, so the executor,
    the scheduler and the connector may share it.

    Attributes:
        finished_sending: Requests whose asynchronous send finished on this rank in
            this step; each rank MUST report each awaited send exactly once.
        finished_recving: Requests whose asynchronous receive finished on this rank in
            this step, including receives that failed (EVT-002); each rank MUST report
            each awaited receive exactly once, or the request waits forever.
        failed_recving: The subset of ``finished_recving`` whose load failed on this
            rank (EVT-002).
        invalid_block_ids: Blocks whose load failed and that the engine MUST recompute;
            non-negative ints, reported no later than the step that reports the owning
            request's finished receive (EVT-003).
        stats: This rank's connector statistics, or None (EVT-006).
        events: KV-cache events produced on this rank since the last output, in order;
            each delivered exactly once (EVT-004).
        worker_metadata: Connector-specific metadata for the scheduler side, or None
            (EVT-007).
        expected_finished_count: How many rank reports complete a request this output
            reports that has not started counting yet, overriding the executor's
            default; None keeps the default (EVT-008, EXE-008).

    Raises:
        InvalidArgumentError: A field is malformed; the message names the field.
        InvalidBlockIdError: ``invalid_block_ids`` holds a negative or non-int id.
    """

    finished_sending: frozenset[str] = attrs.field(
        factory=frozenset, converter=_finished_sending
    )
    finished_recving: frozenset[str] = attrs.field(
        factory=frozenset, converter=_finished_recving
    )
    failed_recving: frozenset[str] = attrs.field(factory=frozenset, converter=_failed_recving)
    invalid_block_ids: frozenset[int] = attrs.field(
        factory=frozenset, converter=_invalid_block_ids
    )
    stats: SupportsAggregate | None = attrs.field(default=None, converter=_stats)
    events: tuple[KVCacheEvent, ...] = attrs.field(factory=tuple, converter=_events)
    worker_metadata: SupportsAggregate | None = attrs.field(
        default=None, converter=_worker_metadata
    )
    expected_finished_count: int | None = attrs.field(
        default=None, converter=_expected_finished_count
    )
    # Whether anything besides the finished sets is set: the aggregator's fast path
    # reads one flag per rank instead of six fields. Derived, never passed.
    _rare: bool = attrs.field(init=False, default=False, repr=False, eq=False)

    @classmethod
    def _trusted(
        cls, finished_sending: frozenset[str], finished_recving: frozenset[str],
        failed_recving: frozenset[str], invalid_block_ids: frozenset[int],
        stats: SupportsAggregate | None, events: tuple[KVCacheEvent, ...],
        worker_metadata: SupportsAggregate | None,
    ) -> KVConnectorOutput:
        """Build an output from fields already in their checked form, without checking
        them again: for ``StandardAggregator``, whose result is made of the fields of
        outputs that were checked when they were constructed (EVT-001), on the
        executor's critical path. Not for anything that comes from a connector."""
        out = _NEW(cls)
        _SET_SENDING(out, finished_sending)
        _SET_RECVING(out, finished_recving)
        _SET_FAILED(out, failed_recving)
        _SET_INVALID(out, invalid_block_ids)
        _SET_STATS(out, stats)
        _SET_EVENTS(out, events)
        _SET_META(out, worker_metadata)
        _SET_COUNT(out, None)
        _SET_RARE(out, bool(failed_recving or invalid_block_ids or events or stats is not None
                            or worker_metadata is not None))
        return out

    @classmethod
    def _trusted_ids(cls, finished_sending: frozenset[str], finished_recving: frozenset[str],
                     failed_recving: frozenset[str]) -> KVConnectorOutput:
        """``_trusted`` for an output of finished ids only (and the failed receives among
        them): the aggregator's common step, with the other fields at their defaults."""
        out = _NEW(cls)
        _SET_SENDING(out, finished_sending)
        _SET_RECVING(out, finished_recving)
        _SET_FAILED(out, failed_recving)
        _SET_INVALID(out, _NO_BLOCKS)
        _SET_STATS(out, None)
        _SET_EVENTS(out, ())
        _SET_META(out, None)
        _SET_COUNT(out, None)
        _SET_RARE(out, bool(failed_recving))
        return out

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_rare", bool(
            self.failed_recving or self.invalid_block_ids or self.events
            or self.stats is not None or self.worker_metadata is not None
            or self.expected_finished_count is not None))
        stray = self.failed_recving - self.finished_recving
        if stray:
            raise InvalidArgumentError(
                f"failed_recving names {sorted(stray)!r}, which are not in "
                "finished_recving; a failed receive is a finished receive and MUST also "
                "be reported in finished_recving",
                clause="EVT-002",
            )

    def is_empty(self) -> bool:
        """True when the output carries nothing the engine must act on.

        That is: no finished or failed request ids, no invalid block ids, no events,
        no worker metadata, and stats that are None or report ``is_empty()``.
        ``expected_finished_count`` is ignored: it only qualifies reports.
        """
        if (
            self.finished_sending
            or self.finished_recving
            or self.invalid_block_ids
            or self.events
            or self.worker_metadata is not None
        ):
            return False
        if self.stats is None:
            return True
        is_empty = getattr(self.stats, "is_empty", None)
        return bool(is_empty()) if callable(is_empty) else False

    # ------------------------------------------------------------------ wire codec

    def to_wire(self, *, omit_custom: bool = False) -> dict[str, object]:
        """Encode the output as JSON-compatible data for another process (EVT-009).

        The result holds only dicts with str keys, lists, str, int, float and None;
        ``json.dumps`` accepts it and ``from_wire`` restores an equal output. Sets
        become sorted lists; a ``bytes`` block hash becomes ``{"bytes": "<hex>"}``.

        ``stats`` and ``worker_metadata`` are carried only when they are exactly
        ``ConnectorStats`` (as their counters). Any other value is the connector's
        business: it MUST encode it with its own safe codec and carry it separately.
        By default such a value is an error, so it is never dropped silently; pass
        ``omit_custom=True`` to encode it as None instead.

        Raises:
            InvalidArgumentError: ``stats`` or ``worker_metadata`` is a custom value and
                ``omit_custom`` is False (EVT-009).
        """
        return {
            "kind": _WIRE_KIND,
            "version": WIRE_VERSION,
            "finished_sending": sorted(self.finished_sending),
            "finished_recving": sorted(self.finished_recving),
            "failed_recving": sorted(self.failed_recving),
            "invalid_block_ids": sorted(self.invalid_block_ids),
            "stats": _encode_aggregatable(self.stats, "stats", omit_custom),
            "events": [_encode_event(e) for e in self.events],
            "worker_metadata": _encode_aggregatable(
                self.worker_metadata, "worker_metadata", omit_custom
            ),
            "expected_finished_count": self.expected_finished_count,
        }

    @classmethod
    def from_wire(cls, data: object) -> KVConnectorOutput:
        """Decode and validate what ``to_wire`` produced, from an untrusted peer.

        Only plain data is accepted; nothing is unpickled or imported (ERR-006). Every
        key must be present and no other key may be; every value is type-checked and
        the decoded output is validated like a constructed one.

        Raises:
            MalformedMetadataError: ``data`` is not a well-formed encoding of a valid
                output; the message names the offending key (ERR-005, EVT-009).
        """
        if not isinstance(data, dict):
            _malformed(f"expected a dict, got {_type_name(data)}")
        keys = set(data)
        missing = _WIRE_KEYS - keys
        extra = keys - _WIRE_KEYS
        if missing:
            _malformed(f"missing keys {sorted(missing)!r}")
        if extra:
            _malformed(f"unknown keys {sorted(map(repr, extra))}")
        if data["kind"] != _WIRE_KIND:
            _malformed(f"kind is {data['kind']!r}; expected {_WIRE_KIND!r}")
        version = data["version"]
        if isinstance(version, bool) or version != WIRE_VERSION:
            _malformed(f"version is {version!r}; expected {WIRE_VERSION}")
        finished_sending = _wire_str_list(data["finished_sending"], "finished_sending")
        finished_recving = _wire_str_list(data["finished_recving"], "finished_recving")
        failed_recving = _wire_str_list(data["failed_recving"], "failed_recving")
        invalid_block_ids = _wire_list(data["invalid_block_ids"], "invalid_block_ids")
        for item in invalid_block_ids:
            if isinstance(item, bool) or not isinstance(item, int):
                _malformed(f"invalid_block_ids contains {item!r}; expected ints")
        events_data = _wire_list(data["events"], "events")
        count = data["expected_finished_count"]
        if count is not None and (isinstance(count, bool) or not isinstance(count, int)):
            _malformed(f"expected_finished_count is {count!r}; expected an int or null")
        try:
            return cls(
                finished_sending=finished_sending,
                finished_recving=finished_recving,
                failed_recving=failed_recving,
                invalid_block_ids=invalid_block_ids,  # type: ignore[arg-type]
                stats=_decode_stats(data["stats"], "stats"),
                events=[_decode_event(e, i) for i, e in enumerate(events_data)],
                worker_metadata=_decode_stats(data["worker_metadata"], "worker_metadata"),
                expected_finished_count=count,
            )
        except MalformedMetadataError:
            raise
        except InvalidArgumentError as exc:
            raise MalformedMetadataError(
                f"wire output is malformed: {exc.message}", clause="ERR-005"
            ) from exc


EMPTY_OUTPUT = KVConnectorOutput()
"""The output of a rank with nothing to report this step (EVT-001)."""

# The slots' own setters, in field order: the trusted constructors fill a frozen instance
# with them (what attrs' generated ``__init__`` does, without the converters).
(_SET_SENDING, _SET_RECVING, _SET_FAILED, _SET_INVALID, _SET_STATS, _SET_EVENTS, _SET_META,
 _SET_COUNT, _SET_RARE) = (getattr(KVConnectorOutput, name).__set__ for name in (
    "finished_sending", "finished_recving", "failed_recving", "invalid_block_ids", "stats",
    "events", "worker_metadata", "expected_finished_count", "_rare"))
_BLOCK_STORED_SETTERS = tuple(getattr(BlockStored, name).__set__ for name in (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"))
_NEW = object.__new__
_NO_BLOCKS: frozenset[int] = frozenset()


# ----------------------------------------------------------------- wire helpers


def _malformed(detail: str) -> NoReturn:
    raise MalformedMetadataError(f"wire output is malformed: {detail}", clause="ERR-005")


def _encode_hash(value: BlockHash) -> object:
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    return value


def _decode_hash(value: object, what: str) -> BlockHash:
    if isinstance(value, dict):
        if set(value) != {"bytes"} or not isinstance(value["bytes"], str):
            _malformed(f"{what} is {value!r}; expected an int or {{'bytes': '<hex>'}}")
        try:
            return bytes.fromhex(value["bytes"])
        except ValueError:
            _malformed(f"{what} holds {value['bytes']!r}, which is not a hex string")
    if isinstance(value, bool) or not isinstance(value, int):
        _malformed(f"{what} is {value!r}; expected an int or {{'bytes': '<hex>'}}")
    return value


def _encode_event(event: KVCacheEvent) -> dict[str, object]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": [_encode_hash(h) for h in event.block_hashes],
            "parent_block_hash": (
                None if event.parent_block_hash is None else _encode_hash(event.parent_block_hash)
            ),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [_encode_hash(h) for h in event.block_hashes],
            "medium": event.medium,
        }
    return {"type": "AllBlocksCleared"}


_EVENT_KEYS: dict[str, frozenset[str]] = {
    "BlockStored": frozenset(
        {
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
        }
    ),
    "BlockRemoved": frozenset({"type", "block_hashes", "medium"}),
    "AllBlocksCleared": frozenset({"type"}),
}


def _decode_event(value: object, index: int) -> KVCacheEvent:
    what = f"events[{index}]"
    if not isinstance(value, dict):
        _malformed(f"{what} is {_type_name(value)}; expected a dict")
    kind = value.get("type")
    if not isinstance(kind, str) or kind not in _EVENT_KEYS:
        _malformed(f"{what} has type {kind!r}; expected one of {sorted(_EVENT_KEYS)}")
    if set(value) != _EVENT_KEYS[kind]:
        _malformed(
            f"{what} has keys {sorted(map(str, value))}; expected {sorted(_EVENT_KEYS[kind])}"
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    hashes = [
        _decode_hash(h, f"{what}.block_hashes[{i}]")
        for i, h in enumerate(_wire_list(value["block_hashes"], f"{what}.block_hashes"))
    ]
    if kind == "BlockRemoved":
        return BlockRemoved(block_hashes=hashes, medium=value["medium"])
    parent = value["parent_block_hash"]
    token_ids = _wire_list(value["token_ids"], f"{what}.token_ids")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else _decode_hash(parent, f"{what}.parent"),
        token_ids=token_ids,  # type: ignore[arg-type]
        block_size=value["block_size"],
        lora_id=value["lora_id"],
        medium=value["medium"],
    )


def _encode_aggregatable(
    value: SupportsAggregate | None, what: str, omit_custom: bool
) -> dict[str, object] | None:
    if value is None:
        return None
    if type(value) is ConnectorStats:
        return {"counters": dict(value.counters)}
    if omit_custom:
        return None
    raise InvalidArgumentError(
        f"{what} is a {_type_name(value)}, which the kvspec wire codec does not carry; "
        "expected None or a plain ConnectorStats. Encode custom values with the "
        "connector's own safe codec, or pass omit_custom=True",
        clause="EVT-009",
    )


def _decode_stats(value: object, what: str) -> ConnectorStats | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"counters"}:
        _malformed(f"{what} is {value!r}; expected null or {{'counters': {{name: number}}}}")
    counters = value["counters"]
    if not isinstance(counters, dict):
        _malformed(f"{what}.counters is {_type_name(counters)}; expected a dict")
    return ConnectorStats(counters=counters)


def _wire_list(value: object, what: str) -> list[object]:
    if not isinstance(value, list):
        _malformed(f"{what} is {_type_name(value)}; expected a list")
    return value


def _wire_str_list(value: object, what: str) -> list[str]:
    items = _wire_list(value, what)
    for item in items:
        if not isinstance(item, str):
            _malformed(f"{what} contains {item!r}; expected strings")
    return items  # type: ignore[return-value]
