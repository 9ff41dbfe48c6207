"""Read-only views of the engine objects a connector sees.

Engines adapt their own request, scheduler-output, block and forward-context objects into
these small immutable types, so one connector runs on any engine. Every view validates its
fields on construction (ERR-002) and never exposes a mutable engine object (SCH-012).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Mapping
from operator import attrgetter
from types import MappingProxyType
from typing import Annotated, Any, cast

import attrs
import msgspec

from .errors import InvalidArgumentError, InvalidBlockIdError
from .groups import NULL_BLOCK_ID, GroupKind, KVCacheGroup, check_groups

__all__ = [
    "AllocatedBlocks",
    "CachedRequestView",
    "EngineConfigView",
    "ForwardContextView",
    "ForwardKind",
    "NewRequestView",
    "RequestStatus",
    "RequestView",
    "SchedulerOutputView",
    "TransferRole",
    "freeze_params",
    "thaw_params",
]


_INT = frozenset({int})
_STR = frozenset({str})
_BYTES = frozenset({bytes})
_CONTAINERS = frozenset({list, tuple, set, frozenset})


# From this many values on, msgspec's one C pass (type and range of every value, bools and
# floats refused) is faster than the passes below; below it, msgspec's call costs more.
_BULK = 16
_NONNEG_INTS = tuple[Annotated[int, msgspec.Meta(ge=0)], ...]


def _as_ints(values: object, schema: Any, *, at_least: int = 0) -> tuple[int, ...] | None:
    """``values`` as a tuple when it is a list or tuple of at least ``at_least`` values that
    ``schema`` (a msgspec tuple-of-ints type, with its bounds) accepts, checked in one pass
    at C speed; else None: the callers' own checks then decide, and say what is wrong."""
    if (type(values) is not tuple and type(values) is not list) or len(values) < at_least:
        return None
    try:
        out: tuple[int, ...] = msgspec.convert(values, schema)
    except msgspec.ValidationError:
        return None
    return out


def _nonneg_bulk(values: object) -> tuple[int, ...] | None:
    """``values`` as a tuple when it is a list or tuple of at least ``_BULK`` ints >= 0."""
    return _as_ints(values, _NONNEG_INTS, at_least=_BULK)


def _ints(name: str, values: Iterable[int]) -> tuple[int, ...]:
    try:
        out = tuple(values)
    except TypeError:
        raise InvalidArgumentError(
            f"{name} must be an iterable of ints, got {type(values).__name__}", clause="ERR-002"
        ) from None
    if set(map(type, out)) <= _INT:  # the common case, at C speed
        return out
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidArgumentError(
                f"{name} must hold ints, got {v!r} ({type(v).__name__})", clause="ERR-002"
            )
    return out


def _block_ids(name: str, values: Iterable[int]) -> tuple[int, ...]:
    bulk = _nonneg_bulk(values)
    if bulk is not None:
        return bulk
    if isinstance(values, (set, frozenset)):
        raise InvalidBlockIdError(
            f"{name} must be ordered (token order), got a {type(values).__name__}",
            clause="ERR-003",
        )
    try:
        out = _ints(name, values)
    except InvalidArgumentError as e:
        raise InvalidBlockIdError(e.message, clause="ERR-003") from None
    if not out or min(out) >= 0:
        return out
    for b in out:
        if b < 0:
            raise InvalidBlockIdError(
                f"{name} holds a negative block id {b}; block ids are >= 0", clause="ERR-003"
            )
    return out


def _req_id(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(
            f"{name} must be a non-empty str, got {value!r}", clause="ERR-002"
        )
    return value


def _nonneg(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"{name} must be an int >= 0, got {value!r}", clause="ERR-002")
    return value


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}", clause="ERR-002")
    return value


_JSON_SCALARS = (str, int, float, bool, type(None))


_MAX_DEPTH = 64
"""Deepest nesting accepted in plain-data parameters (a client's kv_transfer_params)."""
_MAX_INT_BITS = 1024
"""Largest int accepted there: far below the 4300-digit limit of Python's int-to-str, so the
parameters always serialise; no real parameter needs more."""


def _check_plain(path: str, value: object, depth: int = 0) -> object:
    """Return a deep, immutable copy of JSON-representable data (SCH-018); every failure is
    an InvalidArgumentError naming the path, never a RecursionError or ValueError."""
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgumentError(
            f"{path} is {value}; JSON has no NaN or infinity", clause="SCH-018"
        )
    if isinstance(value, int) and not isinstance(value, bool) and (
            value.bit_length() > _MAX_INT_BITS):
        raise InvalidArgumentError(
            f"{path} is an int of {value.bit_length()} bits; expected at most "
            f"{_MAX_INT_BITS}", clause="SCH-018",
        )
    if isinstance(value, _JSON_SCALARS):
        return value
    if depth >= _MAX_DEPTH:
        raise InvalidArgumentError(
            f"{path} is nested more than {_MAX_DEPTH} levels deep; plain-data parameters "
            "are shallow", clause="SCH-018",
        )
    if isinstance(value, Mapping):
        out: dict[str, object] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidArgumentError(
                    f"{path} has a non-str key {k!r}; plain-data parameters are JSON objects",
                    clause="SCH-018",
                )
            out[k] = _check_plain(f"{path}.{k}", v, depth + 1)
        return MappingProxyType(out)
    if isinstance(value, (list, tuple)):
        return tuple(_check_plain(f"{path}[{i}]", v, depth + 1) for i, v in enumerate(value))
    raise InvalidArgumentError(
        f"{path} is a {type(value).__name__}; transfer params hold only JSON-representable "
        "values (str, int, float, bool, None, lists and str-keyed mappings)",
        clause="SCH-018",
    )


def freeze_params(
    params: Mapping[str, Any] | None, name: str = "kv_transfer_params"
) -> Mapping[str, Any] | None:
    """Validate plain-data parameters and return an immutable deep copy (SCH-018).

    ``name`` is the field the parameters belong to, used in error messages.

    Raises:
        InvalidArgumentError: ``params`` is not a str-keyed mapping of JSON-representable values.
    """
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise InvalidArgumentError(
            f"{name} must be a mapping or None, got {type(params).__name__}",
            clause="SCH-018",
        )
    frozen = _check_plain(name, params)
    assert isinstance(frozen, Mapping)
    return frozen


def thaw_params(value: Any) -> Any:
    """The inverse of ``freeze_params``: a plain, mutable, JSON-ready copy of frozen
    parameters (mappings become ``dict`` with ``str`` keys, sequences become ``list``), for
    ``json.dumps`` or for handing to another process (SCH-018)."""
    if isinstance(value, Mapping):
        return {str(k): thaw_params(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw_params(v) for v in value]
    return value


class RequestStatus(enum.Enum):
    """Where a request is in its life (see docs/spec/state-machines.md)."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


class TransferRole(enum.Enum):
    """What an engine does with KV across engines."""

    PRODUCER = "producer"
    """Computes prompts and hands KV off (a prefill engine)."""
    CONSUMER = "consumer"
    """Receives KV computed elsewhere (a decode engine)."""
    BOTH = "both"
    """Stores and loads its own KV (offloading, shared storage)."""


class ForwardKind(enum.Enum):
    """Why a forward pass runs; decides what the engine binds and calls (DRY, GRA clauses)."""

    REAL = "real"
    """A scheduled step serving real requests, run eagerly or piecewise."""
    PROFILE = "profile"
    """Memory profiling before the KV caches exist: no connector hook runs (DRY-002)."""
    WARMUP = "warmup"
    """A dummy run that warms kernels up after the KV caches are registered."""
    CAPTURE = "capture"
    """A dummy run recorded into a graph (at start-up, or lazily mid-serving)."""
    REPLAY = "replay"
    """A real step executed by replaying a captured graph."""

    @property
    def is_dummy(self) -> bool:
        """True for forwards that serve no request (profile, warm-up, capture)."""
        return self in (ForwardKind.PROFILE, ForwardKind.WARMUP, ForwardKind.CAPTURE)


def _ids_tuple(value: Iterable[str]) -> tuple[str, ...]:
    if type(value) in _CONTAINERS and set(map(type, value)) <= _STR and "" not in value:
        return tuple(value)  # the common case, checked at C speed
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        got = "one str" if isinstance(value, str) else type(value).__name__
        if isinstance(value, Mapping):
            got += " (a mapping's keys are not taken for ids: pass a set or frozenset of str)"
        raise InvalidArgumentError(
            f"expected an iterable of request ids, got {got}", clause="ERR-002"
        )
    return tuple(_req_id("request id", v) for v in value)


def _v_req_id(_inst: object, attr: attrs.Attribute[str], value: str) -> None:
    _req_id(attr.name, value)


def _v_nonneg(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    _nonneg(attr.name, value)


def _v_positive(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    _positive(attr.name, value)


def _token_ids(values: Iterable[int]) -> tuple[int, ...]:
    bulk = _nonneg_bulk(values)
    if bulk is not None:
        return bulk
    out = _ints("token ids", values)
    if out and min(out) < 0:
        raise InvalidArgumentError(
            f"token ids must be >= 0, got {min(out)}", clause="ERR-002"
        )
    return out


def _groups(groups: object) -> tuple[tuple[int, ...], ...]:
    if type(groups) is not tuple and type(groups) is not list and (
            isinstance(groups, (str, bytes)) or not isinstance(groups, Iterable)):
        raise InvalidBlockIdError(
            f"blocks must be an iterable of block-id iterables (one per KV-cache group), "
            f"got {groups!r}",
            clause="ERR-003",
        )
    out = tuple(_block_ids("block ids", g) for g in groups)
    for g, ids in enumerate(out):
        if len(set(ids)) != len(ids):  # only the null block may repeat (KVG-004)
            seen: set[int] = set()
            for b in ids:
                if b in seen and b != NULL_BLOCK_ID:
                    raise InvalidBlockIdError(
                        f"group {g} holds block id {b} twice; a request's blocks in one group "
                        f"are distinct (only the null block {NULL_BLOCK_ID} may repeat)",
                        clause="ERR-003",
                    )
                seen.add(b)
    return out


def _token_counts(m: object) -> Mapping[str, int]:
    if type(m) is not dict and not isinstance(m, Mapping):
        raise InvalidArgumentError(
            f"num_scheduled_tokens must be a mapping of request id to token count, got {m!r}",
            clause="ERR-002",
        )
    return MappingProxyType(dict(m))


def _hashes(values: object) -> tuple[bytes, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidArgumentError(
            f"block_hashes must be an iterable of bytes, got {values!r}", clause="ERR-002"
        )
    return tuple(values)


_checked_layer_names: tuple[str, ...] | None = None
"""The last tuple of layer names found valid (non-empty, unique): an engine passes the same
tuple every step, and a tuple of str cannot change, so it is not checked again. Only a valid
tuple is kept, so what is accepted never depends on what was checked before."""


def _layer_names(values: object) -> tuple[str, ...]:
    global _checked_layer_names
    cached = _checked_layer_names
    if values is cached and cached is not None:
        return cached
    if type(values) is tuple and set(map(type, values)) <= _STR and "" not in values:
        names = cast("tuple[str, ...]", values)
    elif isinstance(values, str) or not isinstance(values, Iterable):
        raise InvalidArgumentError(
            f"layer_names must be an iterable of str, got {values!r}", clause="ERR-002"
        )
    else:
        names = tuple(values)
        for v in names:
            if not isinstance(v, str) or not v:
                raise InvalidArgumentError(
                    f"layer_names must hold non-empty str, got {v!r}", clause="ERR-002"
                )
    if not names or len(set(names)) != len(names):
        raise InvalidArgumentError(
            f"layer_names must be unique and non-empty, got {names!r}", clause="ERR-002"
        )
    _checked_layer_names = names
    return names


def _is(cls: type) -> Callable[[object, attrs.Attribute[Any], object], None]:
    """An attrs validator raising InvalidArgumentError when the value is not a ``cls``."""

    def check(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, cls):
            raise InvalidArgumentError(
                f"{attr.name} must be a {cls.__name__}, got {value!r}", clause="ERR-002"
            )

    return check


def _id_set(values: Iterable[str]) -> frozenset[str]:
    return frozenset(_ids_tuple(values))


def _extra(m: Mapping[str, Any]) -> Mapping[str, Any]:
    frozen = freeze_params(m, "extra")
    if frozen is None:
        raise InvalidArgumentError("extra must be a mapping, got None", clause="ERR-002")
    return frozen


@attrs.frozen
class AllocatedBlocks:
    """The blocks the engine allocated to a request, one tuple of ids per KV-cache group.

    Block ids index the block dimension of the registered KV tensors and are always within the
    engine's physical block budget (LAY-012).
    """

    groups: tuple[tuple[int, ...], ...] = attrs.field(converter=_groups)

    @classmethod
    def single(cls, block_ids: Iterable[int]) -> AllocatedBlocks:
        """Blocks of an engine with a single KV-cache group.

        Raises:
            InvalidBlockIdError: ``block_ids`` is not an ordered iterable of ids >= 0.
        """
        return cls((block_ids,))  # the converter checks them

    @property
    def num_groups(self) -> int:
        """Number of KV-cache groups."""
        return len(self.groups)

    def block_ids(self, group: int = 0) -> tuple[int, ...]:
        """The block ids of one KV-cache group.

        Raises:
            InvalidArgumentError: ``group`` is out of range.
        """
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < len(self.groups):
            raise InvalidArgumentError(
                f"group must be in [0, {len(self.groups)}), got {group!r}", clause="ERR-002"
            )
        return self.groups[group]

    def check_budget(self, num_blocks: int) -> None:
        """Raise InvalidBlockIdError if any id is outside ``[0, num_blocks)`` (LAY-012).

        Raises:
            InvalidArgumentError: ``num_blocks`` is not an int >= 1.
        """
        _positive("num_blocks", num_blocks)
        for g, ids in enumerate(self.groups):
            if ids and max(ids) >= num_blocks:
                b = next(b for b in ids if b >= num_blocks)
                raise InvalidBlockIdError(
                    f"group {g} holds block id {b}, outside the physical block budget "
                    f"[0, {num_blocks})",
                    clause="LAY-012",
                )


@attrs.frozen
class RequestView:
    """What a scheduler hook sees of one request.

    Attributes:
        request_id: The engine's id for the request, unique while the request lives.
        prompt_token_ids: The prompt, token by token.
        output_token_ids: Tokens sampled so far.
        block_hashes: The chained prefix-block hashes of the full blocks of the request's
            tokens, salted by ``cache_salt`` and ``lora_id`` (SCH-020).
        cache_salt: Tenant isolation salt, or None.
        lora_id: Identity of the LoRA adapter, or None for the base model.
        kv_transfer_params: Plain-data parameters handed over from another engine (SCH-018).
        status: Where the request is in its life.
        num_computed_tokens: Tokens whose KV is in the engine's cache.
    """

    request_id: str = attrs.field(validator=_v_req_id)
    prompt_token_ids: tuple[int, ...] = attrs.field(converter=_token_ids)
    output_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_token_ids)
    block_hashes: tuple[bytes, ...] = attrs.field(default=(), converter=_hashes)
    cache_salt: str | None = None
    lora_id: int | None = None
    kv_transfer_params: Mapping[str, Any] | None = attrs.field(
        default=None, converter=freeze_params
    )
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0

    def __attrs_post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidArgumentError(
                f"request {self.request_id!r} has an empty prompt; a request has >= 1 prompt token",
                clause="ERR-002",
            )
        hashes = self.block_hashes
        if not (set(map(type, hashes)) <= _BYTES and all(hashes)):  # else: say which
            for h in hashes:
                if not isinstance(h, bytes) or not h:
                    raise InvalidArgumentError(
                        f"block_hashes must hold non-empty bytes, got {h!r}", clause="ERR-002"
                    )
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InvalidArgumentError(
                f"cache_salt must be a str or None, got {self.cache_salt!r}", clause="ERR-002"
            )
        if self.lora_id is not None:
            _nonneg("lora_id", self.lora_id)
        if not isinstance(self.status, RequestStatus):
            raise InvalidArgumentError(
                f"status must be a RequestStatus, got {self.status!r}", clause="ERR-002"
            )
        _nonneg("num_computed_tokens", self.num_computed_tokens)
        if self.num_computed_tokens > self.num_tokens:
            raise InvalidArgumentError(
                f"request {self.request_id!r}: num_computed_tokens {self.num_computed_tokens} "
                f"exceeds its {self.num_tokens} tokens",
                clause="ERR-002",
            )

    @property
    def num_prompt_tokens(self) -> int:
        """Number of prompt tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        """Prompt tokens followed by output tokens."""
        return self.prompt_token_ids + self.output_token_ids


@attrs.frozen
class NewRequestView:
    """A request scheduled for the first time (or resumed after preemption) in this step."""

    request: RequestView = attrs.field(validator=_is(RequestView))
    blocks: AllocatedBlocks = attrs.field(validator=_is(AllocatedBlocks))
    num_computed_tokens: int = attrs.field(validator=_v_nonneg)

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request.request_id


@attrs.frozen
class CachedRequestView:
    """A request that was already running and is scheduled again in this step."""

    request_id: str = attrs.field(validator=_v_req_id)
    new_blocks: AllocatedBlocks = attrs.field(
        factory=lambda: AllocatedBlocks(((),)), validator=_is(AllocatedBlocks)
    )
    num_computed_tokens: int = attrs.field(default=0, validator=_v_nonneg)
    new_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_token_ids)
    resumed_from_preemption: bool = attrs.field(default=False, validator=_is(bool))

    @classmethod
    def _trusted_many(
        cls, request_ids: Iterable[str], new_blocks: Iterable[AllocatedBlocks],
        num_computed_tokens: Iterable[int], new_token_ids: Iterable[tuple[int, ...]],
        resumed: frozenset[str] | set[str],
    ) -> list[CachedRequestView]:
        """One view per running request, from columns already in their checked form,
        without checking them again: for an engine adapter that checked a whole step's
        columns at once (``kvspec.vllm``), on the scheduler's per-step path. Not for
        anything that comes from a connector."""
        out: list[CachedRequestView] = []
        append = out.append
        for rid, blocks, count, tokens in zip(request_ids, new_blocks, num_computed_tokens,
                                              new_token_ids):
            view = _NEW(cls)
            _SET_CACHED_ID(view, rid)
            _SET_CACHED_BLOCKS(view, blocks)
            _SET_CACHED_COMPUTED(view, count)
            _SET_CACHED_TOKENS(view, tokens)
            _SET_CACHED_RESUMED(view, rid in resumed)
            append(view)
        return out


_NEW = object.__new__
(_SET_CACHED_ID, _SET_CACHED_BLOCKS, _SET_CACHED_COMPUTED, _SET_CACHED_TOKENS,
 _SET_CACHED_RESUMED) = (getattr(CachedRequestView, name).__set__ for name in (
    "request_id", "new_blocks", "num_computed_tokens", "new_token_ids",
    "resumed_from_preemption"))


def _new_reqs(value: Iterable[NewRequestView]) -> tuple[NewRequestView, ...]:
    _check_seq("scheduled_new_reqs", value)
    return tuple(value)


def _cached_reqs(value: Iterable[CachedRequestView]) -> tuple[CachedRequestView, ...]:
    _check_seq("scheduled_cached_reqs", value)
    return tuple(value)


def _check_seq(name: str, value: object) -> None:
    if type(value) in _CONTAINERS:
        return
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidArgumentError(f"{name} must be an iterable of views, got {value!r}")


_NEW_VIEW = frozenset({NewRequestView})
_CACHED_VIEW = frozenset({CachedRequestView})
_REQUEST_ID = attrgetter("request_id")


@attrs.frozen
class SchedulerOutputView:
    """What one scheduler step decided, as the connector's scheduler and worker roles see it.

    ``build_connector_meta`` receives it and must not mutate anything in it (SCH-012); a step
    may schedule zero tokens and is still built and delivered (SCH-011).

    Attributes:
        step_id: Monotonic step counter of the engine, from 0.
        scheduled_new_reqs: Requests scheduled for the first time, or resumed.
        scheduled_cached_reqs: Requests continuing from an earlier step.
        num_scheduled_tokens: Tokens scheduled per request id in this step.
        finished_req_ids: Requests that finished or were aborted since the previous step.
        preempted_req_ids: Requests preempted in this step; their blocks will be reused
            (SCH-022, WRK-012).
        spec_decode_tokens: Per request id, how many of its scheduled tokens are draft
            tokens (proposals of a drafter, vLLM's ``scheduled_spec_decode_tokens``): the
            last ones of ``num_scheduled_tokens``. The engine counts them computed now and
            subtracts the rejected ones when the step's output arrives, so a block is full
            of accepted tokens only once a later step's ``num_computed_tokens`` covers it
            (SPD-005). Empty without speculative decoding.
    """

    step_id: int = attrs.field(validator=_v_nonneg)
    scheduled_new_reqs: tuple[NewRequestView, ...] = attrs.field(default=(), converter=_new_reqs)
    scheduled_cached_reqs: tuple[CachedRequestView, ...] = attrs.field(
        default=(), converter=_cached_reqs
    )
    num_scheduled_tokens: Mapping[str, int] = attrs.field(factory=dict, converter=_token_counts)
    finished_req_ids: frozenset[str] = attrs.field(factory=frozenset, converter=_id_set)
    preempted_req_ids: frozenset[str] = attrs.field(factory=frozenset, converter=_id_set)
    spec_decode_tokens: Mapping[str, int] = attrs.field(factory=dict, converter=_token_counts)

    def __attrs_post_init__(self) -> None:
        # Each check runs at C speed over the whole step; the loops only find the culprit.
        if not set(map(type, self.scheduled_new_reqs)) <= _NEW_VIEW:
            for r in self.scheduled_new_reqs:
                if not isinstance(r, NewRequestView):
                    raise InvalidArgumentError(
                        f"scheduled_new_reqs must hold NewRequestView, got {type(r).__name__}"
                    )
        if not set(map(type, self.scheduled_cached_reqs)) <= _CACHED_VIEW:
            for c in self.scheduled_cached_reqs:
                if not isinstance(c, CachedRequestView):
                    raise InvalidArgumentError(
                        f"scheduled_cached_reqs must hold CachedRequestView, got "
                        f"{type(c).__name__}"
                    )
        scheduled = [r.request_id for r in self.scheduled_new_reqs]
        scheduled += map(_REQUEST_ID, self.scheduled_cached_reqs)
        counts = self.num_scheduled_tokens
        if len(counts) != len(scheduled) or counts.keys() != set(scheduled):
            if len(set(scheduled)) != len(scheduled):
                raise InvalidArgumentError(
                    f"step {self.step_id} schedules a request twice: {sorted(scheduled)}",
                    clause="ERR-002",
                )
            raise InvalidArgumentError(
                f"step {self.step_id}: num_scheduled_tokens names {sorted(counts)}"
                f" but the step schedules {sorted(scheduled)}",
                clause="ERR-002",
            )
        if counts and not (set(map(type, counts.values())) <= _INT and min(counts.values()) >= 1):
            for rid, n in counts.items():
                _positive(f"num_scheduled_tokens[{rid!r}]", n)
        for rid, k in self.spec_decode_tokens.items():
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < counts.get(rid, 0):
                raise InvalidArgumentError(
                    f"step {self.step_id}: spec_decode_tokens[{rid!r}] is {k!r}; expected an int "
                    f"in [1, {counts.get(rid, 0)}) for a request scheduled "
                    f"{counts.get(rid, 0)} tokens (one token, then its draft tokens)",
                    clause="ERR-002")

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens scheduled in this step over all requests."""
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        """True when the step schedules no token (SCH-011: it is still built and delivered)."""
        return not self.num_scheduled_tokens


@attrs.frozen
class ForwardContextView:
    """What a worker hook sees of the forward pass it runs in.

    Attributes:
        kind: Why this forward runs; dummy kinds carry no real request (DRY clauses).
        step_id: The scheduler step this forward executes, or None for dummy forwards.
        num_tokens: Tokens in the forward, after padding to a captured size (GRA-009).
        layer_names: The attention layers of this worker, in execution order (never a
            state layer: those get no per-layer hook, STG-005).
    """

    kind: ForwardKind
    step_id: int | None
    num_tokens: int = attrs.field(validator=_v_nonneg)
    layer_names: tuple[str, ...] = attrs.field(converter=_layer_names)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.kind, ForwardKind):
            raise InvalidArgumentError(f"kind must be a ForwardKind, got {self.kind!r}")
        if self.kind.is_dummy != (self.step_id is None):
            raise InvalidArgumentError(
                f"a {self.kind.value} forward "
                + ("has no step id" if self.kind.is_dummy else "needs the step id it executes")
                + f", got step_id={self.step_id!r}"
            )
        if self.step_id is not None:
            _nonneg("step_id", self.step_id)


def _draft_names(values: object) -> tuple[str, ...]:
    return () if values == () else _layer_names(values)


def _groups_tuple(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


def _v_groups(_: object, attr: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, tuple) or not all(isinstance(g, KVCacheGroup) for g in value):
        raise InvalidArgumentError(
            f"kv_cache_groups must be a tuple of KVCacheGroup, got {value!r}", clause="KVG-001")
    if value:
        check_groups(value, frozenset(GroupKind), len(value))  # each layer in one group


@attrs.frozen
class EngineConfigView:
    """The engine configuration a connector factory receives.

    Attributes:
        engine_id: Unique id of this engine instance (peers address it by this id).
        role: What the engine does with KV across engines.
        num_layers: Attention layers of the model (all ranks); a state group's layers
            (``GroupKind.STATE``) are not counted: they are registered apart
            (``register_state_caches``, STG-001) and named by ``state_layer_names``.
        block_size: Tokens per KV block.
        num_blocks: The physical block budget per rank (LAY-003).
        tp_size: Tensor-parallel ranks.
        pp_size: Pipeline-parallel ranks.
        extra: The connector's own configuration (vLLM's kv_connector_extra_config), plain data.
        async_scheduling: The engine builds step N+1's metadata before step N's output
            arrives (vLLM's ``scheduler_config.async_scheduling``, SCH-014). A connector
            may adapt to it; its matches for the same stored data must not change (SCH-014).
        kv_cache_groups: The model's KV-cache groups, in the order of the block-id lists
            every ``AllocatedBlocks`` carries (KVG-001); empty (the default) for one
            full-attention group of every layer. A connector reads a group's kind, window
            and layers here, skips its null positions (KVG-004) and moves, per group, the
            blocks ``KVCacheGroup.needed_blocks`` names (KVG-003). A ``STATE`` group also
            says how its states are kept (``state_caching``, STG-001) and has no per-layer
            hook (STG-005).
        draft_layer_names: The registered layers that belong to a drafter (speculative
            decoding: an EAGLE head, an MTP module, a draft model), empty without one. They
            are KV layers of the group they are registered in, the target's full-attention
            group in vLLM (SPD-003), and their per-layer hooks run once per draft pass
            (SPD-002); ``num_layers`` counts them.
        num_speculative_tokens: Draft tokens proposed per decoding request and step (0:
            no speculative decoding). Above 0 the engine runs the speculative step
            (SPD-001): the output hooks before the draft passes and ``wait_for_save``.
    """

    engine_id: str = attrs.field(validator=_v_req_id)
    role: TransferRole = attrs.field(validator=_is(TransferRole))
    num_layers: int = attrs.field(validator=_v_positive)
    block_size: int = attrs.field(validator=_v_positive)
    num_blocks: int = attrs.field(validator=_v_positive)
    tp_size: int = attrs.field(default=1, validator=_v_positive)
    pp_size: int = attrs.field(default=1, validator=_v_positive)
    extra: Mapping[str, Any] = attrs.field(factory=dict, converter=_extra)
    async_scheduling: bool = attrs.field(default=False, validator=_is(bool))
    kv_cache_groups: tuple[KVCacheGroup, ...] = attrs.field(
        default=(), converter=_groups_tuple, validator=_v_groups)
    draft_layer_names: tuple[str, ...] = attrs.field(default=(), converter=_draft_names)
    num_speculative_tokens: int = attrs.field(default=0, validator=_v_nonneg)

    @property
    def num_groups(self) -> int:
        """How many KV-cache groups the engine gives each request's blocks in (1 without
        ``kv_cache_groups``)."""
        return len(self.kv_cache_groups) or 1

    @property
    def state_group_ids(self) -> tuple[int, ...]:
        """Indices of the ``GroupKind.STATE`` groups in ``kv_cache_groups`` (STG-001)."""
        return tuple(i for i, g in enumerate(self.kv_cache_groups)
                     if g.kind is GroupKind.STATE)

    @property
    def state_layer_names(self) -> tuple[str, ...]:
        """The layers of every ``STATE`` group, in group order: registered with
        ``register_state_caches``, never with ``register_kv_caches``, and given no per-layer
        hook (STG-001, STG-005)."""
        return tuple(n for g in self.kv_cache_groups if g.kind is GroupKind.STATE
                     for n in g.layer_names)

    @property
    def world_size(self) -> int:
        """Number of worker ranks, TP times PP: the default expected report count (EXE-008)."""
        return self.tp_size * self.pp_size
