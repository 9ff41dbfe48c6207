"""Settings, hand-off parameters, metadata and the scheduler role of the NIXL backend.

Prefill/decode disaggregation, as vLLM's NIXL connector does it:

* the **producer** (prefill) engine's ``request_finished`` returns ``kv_transfer_params``
  naming its engine, the request's full prompt blocks, every rank's ``PeerInfo``
  (from the workers' handshake metadata, HSK-002) and a fresh random secret, and holds the blocks (delayed free,
  SCH-016) until its workers report the request in ``finished_sending``: each rank does
  once every consumer rank reading it sent its NIXL notification carrying that secret
  (a notification without it is dropped and counted), or at ``free_timeout_s``;
* the **consumer** (decode) engine's scheduler matches the handed-off blocks
  (``get_num_new_matched_tokens``, async), plans one READ per request in
  ``update_state_after_alloc`` and tells its workers; a worker loads the producer's agent
  metadata once per peer, then READs and polls. A failed or timed-out READ ends as a failed
  receive with every block of it invalid, and the engine recomputes them (WRK-011, ERR-007).

With several KV-cache groups (KVG-001) the hand-off carries every group's block ids
(``groups``, the null block where the producer's window had let a position go), a match
reaches only as far as every group's needed blocks were handed off (KVG-003), and each
load names both engines' ids per group; the workers read each group's layers at its ids
and never the null block (KVG-004), and a failed READ fails its request (KVG-005).

The engines may run different TP sizes: the hand-off carries every producer rank's
``PeerInfo``, and each consumer rank reads the producer ranks whose KV heads overlap its
own (see ``kvspec.backends.nixl._worker``); the model's head counts must agree (HSK-003).

State-space hybrids (STG): beside one full-attention group, state groups under ``RUNNING``
caching (one state block per request, updated in place). The running state moves on with
every step, so the producer keeps a copy of it: at the end of each step whose computed
tokens reach a block boundary below the prompt's last token, its workers copy the request's
state (every state layer's content bytes) into a registered staging row (``snaps``). It
hands a request off with the state after exactly ``T`` tokens, the last such boundary, and
the attention blocks of those ``T`` tokens (``"state"`` in the hand-off); the consumer matches
exactly ``T`` tokens (STG-003) and computes the rest, the prompt's last token included
(STG-016's backoff, at block granularity). A request whose prefill never ended a step on
such a boundary is not handed off (its state after a whole-block prefix does not exist).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Final, Literal, NoReturn

import attrs
import msgspec
from typing_extensions import Self

from kvspec.protocols import (
    NULL_BLOCK_ID,
    AllocatedBlocks,
    CapabilityError,
    ConnectorMetadata,
    EngineConfigView,
    GroupKind,
    HandshakeMetadata,
    InvalidArgumentError,
    KVCacheEvent,
    KVConnectorOutput,
    MalformedMetadataError,
    RequestStatus,
    RequestView,
    SchedulerConnector,
    SchedulerOutputView,
    StateCaching,
    TransferRole,
    UnknownRequestError,
    parse_decimal,
    thaw_params,
)

from .._checks import (
    check_blocks,
    check_count,
    check_output,
    check_request,
    check_scheduler_output,
)
from .._groups import spine_of, whole_prefix
from .._settings import PositiveSeconds, read_settings

__all__ = ["NixlLoad", "NixlMetadata", "NixlScheduler", "NixlSettings", "PARAMS_KIND"]


def state_groups(config: EngineConfigView) -> tuple[int, ...]:
    """The state groups the NIXL backend moves: ``RUNNING`` state groups beside exactly one
    full-attention group (STG-001); () without state groups.

    Raises:
        CapabilityError: a state group under ``ALIGNED`` caching, or state groups beside
            other attention groups than one full-attention group (KVG-002).
    """
    ids = tuple(config.state_group_ids)
    if not ids:
        return ()
    groups = config.kv_cache_groups
    attention = [g for j, g in enumerate(groups) if j not in ids]
    if len(attention) != 1 or attention[0].kind is not GroupKind.FULL:
        raise CapabilityError(
            "the NIXL backend moves state groups beside exactly one full-attention group, "
            f"got {[g.kind.value for g in groups]}", clause="KVG-002")
    for j in ids:
        if groups[j].state_caching is not StateCaching.RUNNING:
            raise CapabilityError(
                f"KV-cache group {j}: the NIXL backend moves state groups under RUNNING "
                f"caching (vLLM's mamba_cache_mode 'none'), got {groups[j].state_caching}",
                clause="KVG-002")
    return ids

PARAMS_KIND = "kvspec.nixl.handoff"
"""The ``"kind"`` of the backend's ``kv_transfer_params``."""

_META_KIND: Final = "kvspec.nixl"
_META_VERSION: Final = 4

_SECRET = re.compile(r"[0-9a-f]{32}")


def _check_secret(value: object, what: str) -> str:
    if not isinstance(value, str) or not _SECRET.fullmatch(value):
        raise InvalidArgumentError(f"{what} must be 32 lowercase hex digits, got {value!r}")
    return value


def new_handoff_secret() -> str:
    """A fresh hand-off secret: 128 random bits as 32 lowercase hex digits."""
    return secrets.token_hex(16)


def _malformed(detail: str) -> NoReturn:
    raise MalformedMetadataError(f"NIXL metadata is malformed: {detail}", clause="ERR-005")


class _EngineTimeout(msgspec.Struct, frozen=True):
    """The engine's own transfer timeout, the NIXL one's default."""

    seconds: PositiveSeconds = msgspec.field(default=30.0, name="kvspec.transfer_timeout_s")


class NixlSettings(msgspec.Struct, frozen=True):
    """The NIXL backend's configuration, read from ``EngineConfigView.extra``.

    Attributes:
        transfer_timeout_s: A READ not finished this long after it started is cancelled
            and fails (ERR-007); ``extra["nixl_transfer_timeout_s"]``, else the engine's
            ``extra["kvspec.transfer_timeout_s"]``, default 30.
        free_timeout_s: A producer frees a handed-off request's blocks after this long even
            if no consumer read them (a consumer that died or aborted);
            ``extra["nixl_free_timeout_s"]``, default 120.
    """

    transfer_timeout_s: PositiveSeconds = msgspec.field(default=30.0,
                                                        name="nixl_transfer_timeout_s")
    free_timeout_s: PositiveSeconds = msgspec.field(default=120.0, name="nixl_free_timeout_s")

    @classmethod
    def from_config(cls, config: EngineConfigView) -> NixlSettings:
        """Read the settings from ``config.extra``.

        Raises:
            InvalidArgumentError: a value is malformed (ERR-002).
        """
        engine = read_settings(config, _EngineTimeout)
        settings = read_settings(config, cls)
        if "nixl_transfer_timeout_s" not in config.extra:
            settings = msgspec.structs.replace(settings, transfer_timeout_s=engine.seconds)
        return settings


def _block_list(value: object, what: str, *, nulls: bool = False) -> tuple[int, ...]:
    """Distinct block ids >= 0 (``nulls``: the null block may repeat, KVG-004)."""
    if not isinstance(value, (list, tuple)) or not set(map(type, value)) <= {int} or (
        value and min(value) < 0
    ) or len(set(value)) != len(value) and not (
        nulls and len(set(value) - {NULL_BLOCK_ID}) == len(value) - value.count(NULL_BLOCK_ID)
    ):
        raise InvalidArgumentError(f"{what} must be distinct block ids >= 0, got {value!r:.200}")
    return tuple(value)


def _columns(value: object, n: int, what: str) -> tuple[tuple[int, ...], ...]:
    """Several groups' block-id columns of ``n`` positions each (nulls allowed), or ()."""
    if not isinstance(value, (list, tuple)) or len(value) == 1 or len(value) > 64:
        raise InvalidArgumentError(f"{what} must be two or more block-id columns or none, "
                                   f"got {value!r:.200}")
    cols = tuple(_block_list(c, what, nulls=True) for c in value)
    if any(len(c) != n for c in cols):
        raise InvalidArgumentError(f"{what} columns must have {n} block ids each")
    return cols


@attrs.frozen
class NixlLoad:
    """One request's READ on every consumer rank.

    Attributes:
        request_id: The consumer's request.
        engine_id: The producer engine read from.
        local_blocks: Consumer block ids written, in token order.
        remote_blocks: Producer block ids read, pairwise with ``local_blocks``. Empty: no
            block to read (the consumer had them all), only the producer's notification.
        notification: What each rank sends the producer rank it read once the READ is done
            (the producer's request id).
        secret: The hand-off's secret from the producer's ``kv_transfer_params``, sent
            with the notification: the producer counts only notifications that carry it.
        local_groups, remote_groups: With several KV-cache groups, each group's consumer
            and producer block ids at the load's positions (``NULL_BLOCK_ID`` where a
            side skipped one); empty with one group. ``local_blocks`` and
            ``remote_blocks`` are then the full-attention group's columns.
        local_state, remote_state: With state groups, each state group's consumer block
            and the producer's staging row holding the state after exactly the load's last
            token (pairwise, in group order); empty without (STG-014).

    Raises:
        InvalidArgumentError: a field is malformed.
    """

    request_id: str
    engine_id: str
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    notification: str
    secret: str
    local_groups: tuple[tuple[int, ...], ...] = ()
    remote_groups: tuple[tuple[int, ...], ...] = ()
    local_state: tuple[int, ...] = ()
    remote_state: tuple[int, ...] = ()

    def __attrs_post_init__(self) -> None:
        for name in ("request_id", "engine_id", "notification"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise InvalidArgumentError(f"{name} must be a non-empty str, got {value!r}")
        _check_secret(self.secret, "secret")
        _block_list(self.local_blocks, "local_blocks")
        _block_list(self.remote_blocks, "remote_blocks")
        if len(self.local_blocks) != len(self.remote_blocks):
            raise InvalidArgumentError(
                f"load of {self.request_id!r} pairs {len(self.local_blocks)} local with "
                f"{len(self.remote_blocks)} remote blocks"
            )
        n = len(self.local_blocks)
        if self.local_groups or self.remote_groups:
            local = _columns(self.local_groups, n, "local_groups")
            remote = _columns(self.remote_groups, n, "remote_groups")
            if len(local) != len(remote) or self.local_blocks not in local:
                raise InvalidArgumentError(
                    f"load of {self.request_id!r}: {len(local)} local and {len(remote)} "
                    "remote group columns, local_blocks among them; expected as many")
        _block_list(self.local_state, "local_state")
        _block_list(self.remote_state, "remote_state")
        if len(self.local_state) != len(self.remote_state) or (self.local_state and not n) \
                or NULL_BLOCK_ID in self.local_state:
            raise InvalidArgumentError(
                f"load of {self.request_id!r}: {len(self.local_state)} local and "
                f"{len(self.remote_state)} remote state blocks (none without attention "
                "blocks, never the null block); expected one of each per state group")

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields (block ids as lists)."""
        return {"request_id": self.request_id, "engine_id": self.engine_id,
                "local_blocks": list(self.local_blocks),
                "remote_blocks": list(self.remote_blocks), "notification": self.notification,
                "secret": self.secret, "local_groups": [list(c) for c in self.local_groups],
                "remote_groups": [list(c) for c in self.remote_groups],
                "local_state": list(self.local_state), "remote_state": list(self.remote_state)}


_MAX_RANK = 1 << 20
"""The largest rank a peer may name (a decimal key of at most 7 ASCII digits)."""
_Rank = Annotated[int, msgspec.Meta(ge=0, le=_MAX_RANK)]


class _LoadWire(msgspec.Struct, forbid_unknown_fields=True):
    """A ``NixlLoad`` as ``NixlMetadata.encode`` writes it."""

    request_id: str
    engine_id: str
    local_blocks: list[int]
    remote_blocks: list[int]
    notification: str
    secret: str
    local_groups: list[list[int]]
    remote_groups: list[list[int]]
    local_state: list[int]
    remote_state: list[int]


class _MetaWire(msgspec.Struct, forbid_unknown_fields=True):
    """``NixlMetadata`` as it crosses: kind and version first, peers' ranks as keys."""

    kind: Literal["kvspec.nixl"]
    version: Literal[4]
    loads: list[_LoadWire]
    sends: dict[str, str]
    peers: dict[str, dict[_Rank, dict[str, Any]]]  # ranks written as decimal keys
    snaps: dict[str, list[int]]


_META_DECODER = msgspec.json.Decoder(_MetaWire)
_META_ENCODER = msgspec.json.Encoder()


@attrs.frozen
class NixlMetadata:
    """One step's work for every worker (SCH-011).

    Attributes:
        loads: READs to start (consumer), each request at most once.
        sends: Requests handed off this step (producer), each with its hand-off secret:
            each rank frees their blocks once read (notifications that carry the secret),
            or at ``free_timeout_s``.
        peers: Producer engines the workers have not been told about yet: engine id to
            ``{rank: PeerInfo JSON}``.
        snaps: Producer with state groups: requests whose state each rank copies into its
            staging rows at the end of this step (``wait_for_save``), with each state
            group's block (the staging row is the block's id).

    Encodes to UTF-8 JSON; ``decode`` validates every field (ERR-005, ERR-006).
    """

    loads: tuple[NixlLoad, ...] = ()
    sends: Mapping[str, str] = attrs.field(factory=dict)
    peers: Mapping[str, Mapping[int, Mapping[str, Any]]] = attrs.field(factory=dict)
    snaps: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.loads, tuple) or not all(isinstance(j, NixlLoad)
                                                        for j in self.loads):
            raise InvalidArgumentError(f"loads must be a tuple of NixlLoad, got {self.loads!r}")
        ids = [j.request_id for j in self.loads]
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError("loads name a request twice", clause="SCH-013")
        if not isinstance(self.sends, Mapping) or not all(
            isinstance(r, str) and r for r in self.sends
        ):
            raise InvalidArgumentError(
                f"sends must map request ids to hand-off secrets, got {self.sends!r}"
            )
        for secret in self.sends.values():
            _check_secret(secret, "a hand-off secret")
        if not isinstance(self.peers, Mapping) or not all(
            isinstance(e, str) and isinstance(m, Mapping) and all(
                type(r) is int and r >= 0 and isinstance(p, Mapping) for r, p in m.items()
            ) for e, m in self.peers.items()
        ):
            raise InvalidArgumentError("peers must map engine ids to {rank: peer info}")
        if not isinstance(self.snaps, Mapping) or not all(
            isinstance(r, str) and r and isinstance(b, tuple) and b
            and NULL_BLOCK_ID not in _block_list(b, "snaps") for r, b in self.snaps.items()
        ):
            raise InvalidArgumentError(
                f"snaps must map request ids to state block ids, got {self.snaps!r:.200}")

    @property
    def is_empty(self) -> bool:
        """True when the metadata describes nothing."""
        return not (self.loads or self.sends or self.peers or self.snaps)

    def encode(self) -> bytes:
        """UTF-8 JSON, no pickle (ERR-006): ``{kind, version, loads, sends, peers, snaps}``,
        ranks as decimal object keys."""
        return _META_ENCODER.encode(_MetaWire(
            _META_KIND, _META_VERSION, [_LoadWire(**j.to_json()) for j in self.loads],
            dict(self.sends), {e: {r: thaw_params(p) for r, p in m.items()}
                               for e, m in self.peers.items()},
            {r: list(b) for r, b in self.snaps.items()}))

    @classmethod
    def decode(cls, data: bytes) -> Self:
        """Decode and validate ``encode`` output: msgspec's typed decoder checks the layout
        and every value's type (ranks as decimal keys in ``[0, 2**20]``), then the fields
        are checked as the constructor checks them.

        Raises:
            MalformedMetadataError: anything else (ERR-005).
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            _malformed(f"expected bytes, got {type(data).__name__}")
        try:
            wire = _META_DECODER.decode(data)
        except (msgspec.MsgspecError, ValueError, RecursionError) as e:  # ValueError: UTF-8
            _malformed(f"{e}; expected the JSON object encode() writes")
        try:
            loads = tuple(NixlLoad(
                j.request_id, j.engine_id, _block_list(j.local_blocks, "local_blocks"),
                _block_list(j.remote_blocks, "remote_blocks"), j.notification, j.secret,
                tuple(map(tuple, j.local_groups)), tuple(map(tuple, j.remote_groups)),
                tuple(j.local_state), tuple(j.remote_state),
            ) for j in wire.loads)
            return cls(loads=loads, sends=wire.sends, peers=wire.peers,
                       snaps={r: tuple(b) for r, b in wire.snaps.items()})
        except InvalidArgumentError as e:
            _malformed(e.message)


@attrs.frozen
class _Handoff:
    """Validated ``kv_transfer_params`` of a consumer request."""

    engine_id: str
    request_id: str
    blocks: tuple[int, ...]
    peers: Mapping[int, Mapping[str, Any]]
    secret: str
    groups: tuple[tuple[int, ...], ...] = ()
    state: tuple[int, tuple[int, ...]] | None = None  # (tokens, each state group's row)


def _state_of(value: object) -> tuple[int, tuple[int, ...]]:
    """A hand-off's ``"state"``: ``{"tokens": T, "blocks": [row, ...]}``."""
    if not isinstance(value, Mapping) or set(value) != {"tokens", "blocks"}:
        raise InvalidArgumentError(f"state must be {{tokens, blocks}}, got {value!r:.200}")
    tokens = value["tokens"]
    if type(tokens) is not int or tokens < 1:
        raise InvalidArgumentError(f"state tokens must be an int >= 1, got {tokens!r}")
    rows = _block_list(value["blocks"], "state blocks")
    if not rows or NULL_BLOCK_ID in rows or len(rows) > 64:
        raise InvalidArgumentError(f"state blocks must name 1 to 64 blocks, got {rows!r}")
    return tokens, rows


def _handoff(params: Mapping[str, Any] | None) -> _Handoff | None:
    """The hand-off in ``params``, None if there is none.

    Raises:
        MalformedMetadataError: ``params`` claim to be a hand-off but are malformed.
    """
    if not params or params.get("kind") != PARAMS_KIND:
        return None
    try:
        peers = params["peers"]
        if not isinstance(peers, Mapping) or not peers or not all(
            isinstance(p, Mapping) for p in peers.values()
        ):
            raise InvalidArgumentError(f"peers is {peers!r:.200}; expected {{rank: peer info}}")
        ranks = {parse_decimal(str(r), what="a peers rank", maximum=_MAX_RANK,
                               error=InvalidArgumentError, clause="SCH-018"): p
                 for r, p in peers.items()}
        engine, rid = params["engine_id"], params["request_id"]
        if not isinstance(engine, str) or not engine or not isinstance(rid, str) or not rid:
            raise InvalidArgumentError("engine_id and request_id must be non-empty strings")
        blocks = _block_list(params["blocks"], "blocks")
        groups = _columns(params["groups"], len(blocks), "groups") if "groups" in params \
            else ()
        if groups and blocks not in groups:
            raise InvalidArgumentError("blocks must be one of the groups' columns")
        state = _state_of(params["state"]) if "state" in params else None
        return _Handoff(engine, rid, blocks, ranks,
                        _check_secret(params["secret"], "secret"), groups, state)
    except KeyError as e:
        raise MalformedMetadataError(
            f"kv_transfer_params of kind {PARAMS_KIND!r} lack the key {e}; expected "
            "engine_id, request_id, blocks, peers and secret", clause="SCH-018"
        ) from None
    except InvalidArgumentError as e:
        raise MalformedMetadataError(
            f"kv_transfer_params of kind {PARAMS_KIND!r} are malformed: {e.message}",
            clause="SCH-018",
        ) from None


class NixlScheduler(SchedulerConnector):
    """Scheduler role of the NIXL backend: hand-off on the producer, matching and READ
    planning on the consumer. See the module docstring."""

    def __init__(self, config: EngineConfigView) -> None:
        self._settings = NixlSettings.from_config(config)
        self._config = config
        self._bs = config.block_size
        self._state_ids = state_groups(config)
        self._groups = config.kv_cache_groups if config.num_groups > 1 else ()
        if self._state_ids:  # one attention group: its blocks are the spine's
            self._groups = ()
        self._spine = spine_of(config, "NIXL", states=True)
        self._state_blocks: dict[str, tuple[int, ...]] = {}  # producer: rid -> state blocks
        self._prompts: dict[str, int] = {}  # producer: rid -> prompt tokens
        self._snapped: dict[str, tuple[tuple[int, ...], int]] = {}  # rid -> (rows, tokens)
        self._pending_snaps: dict[str, tuple[int, ...]] = {}
        self._producer = config.role in (TransferRole.PRODUCER, TransferRole.BOTH)
        self._peers: dict[int, Mapping[str, Any]] = {}
        self._peers_sent: dict[str, Mapping[int, Mapping[str, Any]]] = {}
        self._known: set[str] = set()
        self._asked: dict[str, int] = {}
        self._loading: set[str] = set()
        self._consumed: set[str] = set()  # hand-offs already read (or being read): never again
        self._sending: set[str] = set()
        self._pending_loads: list[NixlLoad] = []
        self._pending_sends: dict[str, str] = {}
        self._pending_peers: dict[str, Mapping[int, Mapping[str, Any]]] = {}

    # -- handshake ----------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: Mapping[int, HandshakeMetadata]) -> None:
        """Keep every rank's ``PeerInfo`` (HSK-002), handed to consumers in the
        ``kv_transfer_params`` of each request; with state groups, under ``"state"``, the
        rank's state agent and state layouts (STG-010)."""
        self._peers = {r: thaw_params(h.payload.get("peer", {})) for r, h in metadata.items()}
        for r, h in metadata.items():  # with state groups: the rank's state agent and layouts
            if "state" in h.payload:
                self._peers[r] = {**self._peers[r], "state": thaw_params(h.payload["state"])}

    # -- consumer -----------------------------------------------------------------------

    def _external(self, request: RequestView, computed: int) -> tuple[_Handoff | None, int]:
        h = _handoff(request.kv_transfer_params)
        if h is None or computed % self._bs or request.request_id in self._consumed:
            return h, 0
        if bool(self._state_ids) != (h.state is not None) or (
                h.state is not None and len(h.state[1]) != len(self._state_ids)):
            raise MalformedMetadataError(
                f"the hand-off of request {request.request_id!r} carries "
                f"{len(h.state[1]) if h.state else 0} state group(s); this engine runs "
                f"{len(self._state_ids)}: both engines must run the same model", clause="SCH-018")
        if h.state is not None:  # exactly the tokens whose state was handed off (STG-003)
            tokens = h.state[0]
            if tokens % self._bs or tokens > len(h.blocks) * self._bs or computed >= tokens \
                    or tokens >= request.num_prompt_tokens:
                return h, 0
            return h, tokens - computed
        if len(h.groups or (h.blocks,)) != len(self._groups or (None,)):
            raise MalformedMetadataError(
                f"the hand-off of request {request.request_id!r} carries "
                f"{len(h.groups) or 1} KV-cache group(s); this engine runs "
                f"{len(self._groups) or 1}: both engines must run the model's groups alike "
                "(vLLM: the same --disable-hybrid-kv-cache-manager)", clause="SCH-018")
        usable = min(len(h.blocks), (request.num_prompt_tokens - 1) // self._bs)
        start = computed // self._bs
        if self._groups and usable > start:  # only as far as every needed block came
            cols = h.groups
            usable = start + whole_prefix(self._groups, self._spine, start, usable - start,
                                          self._bs, lambda g, i: cols[g][i] == NULL_BLOCK_ID)
        return h, max(0, usable * self._bs - computed)

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Consumer: the handed-off prompt blocks after the computed tokens, block aligned,
        leaving one prompt token (SCH-001, SCH-005, SCH-007), loaded asynchronously;
        ``(0, False)`` for requests without a hand-off. Side-effect free (SCH-004).

        Raises:
            MalformedMetadataError: malformed hand-off parameters (SCH-018).
            InvalidArgumentError: a wrong type, or a negative or too large computed-token
                count (ERR-002).
        """
        check_request(request)
        check_count("num_computed_tokens", num_computed_tokens)
        if num_computed_tokens > request.num_prompt_tokens:
            raise InvalidArgumentError(
                f"num_computed_tokens {num_computed_tokens} exceeds the {request.num_prompt_tokens}"
                f"-token prompt of {request.request_id!r}", clause="ERR-002",
            )
        _, count = self._external(request, num_computed_tokens)
        self._known.add(request.request_id)
        self._asked[request.request_id] = num_computed_tokens
        return count, count > 0

    def update_state_after_alloc(
        self, request: RequestView, blocks: AllocatedBlocks, num_external_tokens: int
    ) -> None:
        """Consumer: plan the READ of the external tokens' blocks (SCH-008..010). A
        hand-off with nothing to read still notifies the producer, so it frees its blocks.

        Raises:
            UnknownRequestError: the request was never seen (SCH-028).
            InvalidArgumentError: the external tokens are not whole handed-off blocks.
        """
        rid = check_request(request).request_id
        check_blocks(blocks)
        check_count("num_external_tokens", num_external_tokens)
        if rid not in self._known:
            raise UnknownRequestError(
                f"update_state_after_alloc for unknown request {rid!r}", request_id=rid,
                clause="SCH-028",
            )
        blocks.check_budget(self._config.num_blocks)
        start = self._asked.pop(rid, request.num_computed_tokens)
        h, _ = self._external(request, start)
        if h is None or rid in self._consumed:
            return
        if start % self._bs or num_external_tokens % self._bs:
            raise InvalidArgumentError(
                f"request {rid!r}: external tokens [{start}, {start + num_external_tokens}) "
                f"are not whole blocks of {self._bs}", clause="SCH-007",
            )
        first, last = start // self._bs, (start + num_external_tokens) // self._bs
        ids = blocks.block_ids(self._spine)
        shortest = min(len(g) for j, g in enumerate(blocks.groups) if j not in self._state_ids)
        if last > len(h.blocks) or last > shortest:
            raise InvalidArgumentError(
                f"request {rid!r}: external blocks [{first}, {last}) exceed the "
                f"{len(h.blocks)} handed-off or {shortest} allocated blocks", clause="SCH-010",
            )
        local_groups: tuple[tuple[int, ...], ...] = ()
        remote_groups: tuple[tuple[int, ...], ...] = ()
        if self._groups and last > first:
            local_groups = tuple(tuple(g[first:last]) for g in blocks.groups)
            remote_groups = tuple(c[first:last] for c in h.groups)
        local_state: tuple[int, ...] = ()
        remote_state: tuple[int, ...] = ()
        if h.state is not None and last > first:
            if last * self._bs != h.state[0]:
                raise InvalidArgumentError(
                    f"request {rid!r}: external tokens end at {last * self._bs}; the state "
                    f"handed off is the state after {h.state[0]}", clause="STG-003")
            local_state = tuple(blocks.groups[g][self._config.kv_cache_groups[g].state_index(
                h.state[0]) or 0] for g in self._state_ids)
            remote_state = h.state[1]
        self._pending_loads.append(NixlLoad(rid, h.engine_id, tuple(ids[first:last]),
                                            h.blocks[first:last], h.request_id, h.secret,
                                            local_groups, remote_groups, local_state,
                                            remote_state))
        self._consumed.add(rid)
        if num_external_tokens:
            self._loading.add(rid)
        if self._peers_sent.get(h.engine_id) != h.peers:  # new, or the producer restarted
            self._peers_sent[h.engine_id] = h.peers
            self._pending_peers[h.engine_id] = h.peers

    # -- producer -----------------------------------------------------------------------

    def request_finished(
        self, request: RequestView, block_ids: tuple[int, ...]
    ) -> tuple[bool, Mapping[str, Any] | None]:
        """Producer: hand a finished request off: ``(True, kv_transfer_params)`` holding
        its full prompt blocks until the workers report it sent (SCH-016, SCH-018).
        Aborted requests and requests without a full block are not handed off. Consumer:
        ``(False, None)``; a load in flight is still reported by the workers (SCH-021).
        """
        rid = check_request(request).request_id
        AllocatedBlocks.single(block_ids).check_budget(self._config.num_blocks)
        if self._groups:
            raise InvalidArgumentError(
                f"request_finished for request {rid!r} on an engine with {len(self._groups)} "
                "KV-cache groups; expected request_finished_all_groups (KVG-006)",
                clause="KVG-006")
        return self._finish(request, block_ids, ())

    def request_finished_all_groups(
        self, request: RequestView, blocks: AllocatedBlocks
    ) -> tuple[bool, Mapping[str, Any] | None]:
        """``request_finished`` with every group's blocks (KVG-006): the hand-off names
        each group's ids of the full prompt blocks (the null block where a group let a
        position go), and the delayed free holds every group's blocks.

        Raises:
            As ``request_finished``; InvalidArgumentError when ``blocks`` does not have
            the engine's groups (KVG-006).
        """
        if self._state_ids:
            check_request(request)
            check_blocks(blocks)
            blocks.check_budget(self._config.num_blocks)
            if blocks.num_groups != self._config.num_groups:
                raise InvalidArgumentError(
                    f"request {request.request_id!r} finished with {blocks.num_groups} groups "
                    f"of blocks; the engine has {self._config.num_groups}", clause="KVG-006")
            return self._finish(request, blocks.block_ids(self._spine), (), blocks)
        if not self._groups:
            return super().request_finished_all_groups(request, blocks)
        check_request(request)
        check_blocks(blocks)
        blocks.check_budget(self._config.num_blocks)
        if blocks.num_groups != len(self._groups):
            raise InvalidArgumentError(
                f"request {request.request_id!r} finished with {blocks.num_groups} groups of "
                f"blocks; the engine has {len(self._groups)}", clause="KVG-006")
        return self._finish(request, blocks.block_ids(self._spine), blocks.groups)

    def _finish(self, request: RequestView, block_ids: tuple[int, ...],
                groups: tuple[tuple[int, ...], ...], all_groups: AllocatedBlocks | None = None,
                ) -> tuple[bool, Mapping[str, Any] | None]:
        rid = request.request_id
        snapped = self._snapped.pop(rid, None)
        self._state_blocks.pop(rid, None)
        self._prompts.pop(rid, None)
        self._known.discard(rid)
        self._asked.pop(rid, None)
        self._consumed.discard(rid)
        if not self._producer or request.status is not RequestStatus.FINISHED or (
            self._config.role is TransferRole.BOTH
            and not (request.kv_transfer_params or {}).get("do_remote_decode")
        ):
            return False, None
        full = min(len(block_ids), request.num_prompt_tokens // self._bs,
                   request.num_computed_tokens // self._bs, *map(len, groups))
        state: dict[str, Any] | None = None
        if self._state_ids:  # the state after exactly the tokens handed off (STG-014)
            now = None if all_groups is None else tuple(
                all_groups.groups[g][0] if all_groups.groups[g] else NULL_BLOCK_ID
                for g in self._state_ids)
            if snapped is None or snapped[0] != now or snapped[1] > full * self._bs:
                return False, None  # no copy of a whole-block state: nothing to hand off
            full = snapped[1] // self._bs
            state = {"tokens": snapped[1], "blocks": list(snapped[0])}
        if full == 0 or not self._peers:
            return False, None
        self._sending.add(rid)
        secret = new_handoff_secret()
        self._pending_sends[rid] = secret
        params: dict[str, Any] = {
            "kind": PARAMS_KIND, "engine_id": self._config.engine_id, "request_id": rid,
            "blocks": list(block_ids[:full]), "secret": secret,
            "peers": {str(r): thaw_params(p) for r, p in sorted(self._peers.items())},
        }
        if groups:
            params["groups"] = [list(g[:full]) for g in groups]
        if state is not None:
            params["state"] = state
        return True, params

    # -- per step -----------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ConnectorMetadata:
        """The READs, hand-offs and new peers planned since the last call, once each
        (SCH-011, SCH-013); never waits (SCH-014)."""
        check_scheduler_output(scheduler_output)
        if self._state_ids and self._producer:
            self._plan_snaps(scheduler_output)
        meta = NixlMetadata(tuple(self._pending_loads), dict(self._pending_sends),
                            dict(self._pending_peers), dict(self._pending_snaps))
        self._pending_snaps.clear()
        self._pending_loads.clear()
        self._pending_sends.clear()
        self._pending_peers.clear()
        return meta

    def _plan_snaps(self, out: SchedulerOutputView) -> None:
        """Producer: the requests whose step ends on a block boundary below their prompt's
        last token; their workers copy the state after it at the end of the step."""
        computed: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            rid = new.request.request_id
            self._prompts[rid] = new.request.num_prompt_tokens
            self._state_blocks[rid] = tuple(
                new.blocks.groups[g][0] if new.blocks.groups[g] else NULL_BLOCK_ID
                for g in self._state_ids)
            computed[rid] = new.num_computed_tokens
        for cached in out.scheduled_cached_reqs:
            computed[cached.request_id] = cached.num_computed_tokens
        for rid, n in out.num_scheduled_tokens.items():
            start = computed.get(rid)
            rows = self._state_blocks.get(rid)
            if start is None or rows is None:
                continue
            done = self._snapped.get(rid)
            if done is not None and start < done[1]:  # recomputed (preempted): copy again
                del self._snapped[rid]
            end = start + n
            if end % self._bs == 0 and 0 < end < self._prompts[rid] \
                    and NULL_BLOCK_ID not in rows:
                self._pending_snaps[rid] = rows
                self._snapped[rid] = (rows, end)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Forget finished READs and hand-offs; a failed READ's blocks are recomputed by
        the engine (WRK-011).

        Raises:
            UnknownRequestError: a report for a transfer this role is not waiting for
                (SCH-028).
        """
        check_output(output)
        stray = sorted({*output.finished_sending - self._sending,
                        *output.finished_recving - self._loading})
        if stray:
            raise UnknownRequestError(
                f"the output reports {stray}, which this connector is not waiting for",
                request_id=stray[0], clause="SCH-028",
            )
        self._sending -= output.finished_sending
        self._loading -= output.finished_recving

    def take_events(self) -> Iterable[KVCacheEvent]:
        """No KV-cache events: the backend stores nothing."""
        return ()

    def shutdown(self) -> None:
        """Forget everything; idempotent (SCH-027)."""
        for state in (self._known, self._asked, self._loading, self._consumed, self._sending,
                      self._pending_loads, self._pending_sends, self._pending_peers,
                      self._peers_sent, self._state_blocks, self._prompts, self._snapped,
                      self._pending_snaps):
            state.clear()
