"""The worker role of the NIXL backend: one NIXL agent per rank, READs and notifications.

``register_kv_caches`` registers the rank's KV buffer once with a ``NixlEndpoint``
(descriptors prepared once, one per block for block-outermost layouts, LAY-013); its
``PeerInfo`` travels as the rank's handshake metadata (HSK-001, HSK-002).

* Consumer: the first load from a producer engine adds, as peers, the producer ranks
  whose KV heads overlap this rank's (their NIXL agent metadata, compatibility checked,
  HSK-003): the rank of the same index when both engines run the same TP size; with
  heterogeneous TP (``._heads``) several producer ranks, each for its share of the
  heads (2 -> 1), or one producer rank of which this rank reads its share (1 -> 2). A load
  is one prepared READ per such producer rank, started in ``start_load_kv`` (WRK-004) and
  polled by ``get_finished``; the request is reported once all of them finished. When one
  fails or passes ``transfer_timeout_s``, the request is reported in ``finished_recving``
  and ``failed_recving`` with all of its blocks invalid (WRK-011, ERR-007).
* Producer: each handed-off request is reported in ``finished_sending`` once this rank got
  a notification from every consumer rank that reads it (NIXL delivers one when a READ
  completed; each says how many to expect), or at ``free_timeout_s``. A notification
  counts only if it carries the hand-off's secret, which only the engine the request was
  handed to learned (from ``kv_transfer_params``): any other agent's is dropped and
  counted, so it cannot free blocks before their read.

State groups (STG): ``register_state_caches`` registers a second NIXL agent per rank over a
staging buffer, one row per block id holding every state layer's content bytes (padding
never moves, LAY-004). A producer rank copies a request's state into the row of its state
block at the end of each step the scheduler names (``snaps``, ``wait_for_save``); its
handshake metadata carries that agent and each state group's layout (components, dtypes,
offsets, content bytes, conv layout, TP size and sharding). A consumer rank compares them
with its own before its first READ from a producer and refuses any difference with
``CompatibilityError`` (STG-010), and any other TP size (no component split is known, so
it never copies whole pages between different shards: STG-011). It READs the producer rank
of its own index's state rows into its own staging rows beside the attention blocks; the
request is one load: reported once every READ of it finished (STG-013), its state copied
into the state blocks first, and reported failed (never finished) when any READ failed
(STG-014). It then notifies every producer rank it read attention from itself, once all of
them finished, so a producer frees the state block (and its row) only after the read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

import attrs
import torch

from kvspec.protocols import (
    NULL_BLOCK_ID,
    SPEC_VERSION,
    CompatibilityError,
    ConnectorMetadata,
    ConnectorStats,
    EngineConfigView,
    FaultPlan,
    ForwardContextView,
    HandshakeMetadata,
    InvalidArgumentError,
    KVCacheLayout,
    KVPacking,
    KVSpecError,
    LayoutMismatchError,
    MalformedMetadataError,
    MetadataSlot,
    StateLayout,
    SupportsAggregate,
    TransferRole,
    WorkerConnector,
    parse_decimal,
)

from .._groups import storage_of
from ._descriptors import PeerInfo
from ._heads import head_runs, overlap
from ._scheduler import NixlLoad, NixlMetadata, NixlSettings, _SECRET, state_groups
from ._transport import NixlEndpoint, NixlTransfer, TransferState

__all__ = ["NixlWorker"]

_log = logging.getLogger(__name__)


@attrs.frozen
class _Source:
    """A producer rank this rank reads from."""

    agent: str
    readers: int  # consumer ranks that read it: the notifications it waits for


@attrs.define(eq=False)
class _Load:
    """One request's READs on this rank, reported once all of them finished."""

    local_blocks: tuple[int, ...]
    transfers: list[NixlTransfer]
    failed: bool = False
    engine_id: str = ""
    not_before: float = 0.0  # the fault plan's delay: reported no sooner than this
    state: list[NixlTransfer] = attrs.field(factory=list)  # the state rows' READ
    state_blocks: tuple[int, ...] = ()  # each state group's local block (= staging row)
    notify: list[tuple[str, bytes]] = attrs.field(factory=list)  # sent once all finished


@attrs.define
class _Notes:
    """Notifications a producer rank got for one request."""

    got: int
    expected: int
    first_seen: float
    peer: str = ""  # the agent whose early notification created the entry, if early


def _notification(load: NixlLoad, readers: int) -> bytes:
    return f"{load.secret}|{readers}|{load.notification}".encode()


_MAX_READERS = 1 << 16
_MAX_EARLY_NOTES = 1 << 16
"""Notifications kept for requests this rank has not handed off (yet), over all peers:
beyond this many, further ones are dropped."""
_PEER_BUDGET = 256
"""Per peer: the most notifications kept for requests this rank has not handed off, and
the most malformed, spoofed or unknown ones in one ``get_finished``. A genuine consumer
sends one per hand-off it read; a peer past either is flooding and is cut off: everything
it sends afterwards is counted, never parsed or kept (issue 34)."""


def _parse_notification(message: bytes) -> tuple[str, str, int] | None:
    """``(request id, secret, notifications expected)`` from ``_notification``'s bytes
    (``secret|count|request id``), or None for anything else: not UTF-8, a secret that is
    not 32 lowercase hex digits, a count that is not 1 to 5 ASCII digits (``'²'`` is a digit
    to ``str.isdigit`` but not to ``int``) or outside ``[1, 65536]``, no request id."""
    try:
        text = message.decode("utf-8")
    except UnicodeDecodeError:
        return None
    parts = text.split("|", 2)
    if len(parts) != 3:
        return None
    secret, count, rid = parts
    if not (rid and _SECRET.fullmatch(secret)):
        return None
    try:
        n = parse_decimal(count, what="a notification's count", minimum=1,
                          maximum=_MAX_READERS)
    except MalformedMetadataError:
        return None
    return rid, secret, n


def _state_summary(layout: StateLayout) -> dict[str, object]:
    """What peers compare of a state group's layout (STG-010, STG-011): components (name,
    shape, dtype, byte offset), content bytes, conv layout, TP size and sharding; plain
    JSON data."""
    return {"components": [[c.name, list(c.shape), str(c.dtype), c.byte_offset]
                           for c in layout.components],
            "content_bytes": layout.content_bytes,
            "conv_layout": None if layout.conv_layout is None else layout.conv_layout.value,
            "tp_size": layout.tp_size, "tp_replicated": layout.tp_replicated}


class _Poller:
    """Progresses a consumer rank's NIXL agent for ``window_s`` after it last sent
    something (a notification, a READ that ends with one), every ``period_s``, then sleeps
    until the next send. A consumer runs no NIXL progress thread (it busy-polls a core),
    so its sends move only while it polls: an engine that goes idle after its last
    hand-off would leave the producer holding the blocks until ``free_timeout_s``
    (issue 34). Its thread starts at the first send and ends at ``close``."""

    def __init__(self, endpoint: NixlEndpoint, name: str, window_s: float = 2.0,
                 period_s: float = 0.002) -> None:
        self._endpoint = endpoint
        self._name = name
        self._window_s = window_s
        self._period_s = period_s
        self._until = 0.0
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None

    def kick(self) -> None:
        """Progress the agent for the next ``window_s``."""
        self._until = time.monotonic() + self._window_s
        if self._thread is None and not self._closing:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while not self._closing:
            if time.monotonic() < self._until:
                try:
                    self._endpoint.progress()
                except Exception:  # noqa: BLE001 (the endpoint closed under it: stop)
                    return
                self._wake.wait(self._period_s)
            else:
                self._wake.wait(self._window_s)
            self._wake.clear()

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the thread (bounded: it is never inside a long call)."""
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)


class NixlWorker(WorkerConnector):
    """Worker role of the NIXL backend (one per rank). See the module docstring.

    Raises:
        InvalidArgumentError: a bad rank or configuration (ERR-002).
    """

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        self._settings = NixlSettings.from_config(config)
        self._faults = FaultPlan.from_config(config)  # the conformance suite's fault seam
        if isinstance(rank, bool) or not isinstance(rank, int) or not (
            0 <= rank < config.world_size
        ):
            raise InvalidArgumentError(
                f"rank must be an int in [0, {config.world_size}), got {rank!r}",
                clause="ERR-002",
            )
        self._config = config
        self._rank = rank
        self._slot: MetadataSlot[NixlMetadata] = MetadataSlot(NixlMetadata)
        self._started = False
        self.endpoint: NixlEndpoint | None = None
        """The rank's NIXL endpoint, once ``register_kv_caches`` ran."""
        self._peer_infos: dict[str, Mapping[int, Mapping[str, object]]] = {}
        self._sources: dict[str, tuple[_Source, ...]] = {}  # producer engine -> its ranks read
        self._reads: dict[str, _Load] = {}
        self._failed_early: dict[str, tuple[int, ...]] = {}  # loads that never started
        self._sends: dict[str, tuple[float, str]] = {}  # producer: request -> (free
        # deadline, secret)
        # producer: (request, secret) -> notifications got, expected, first seen; a
        # notification may arrive before the step that names the request in ``sends``.
        self._notes: dict[tuple[str, str], _Notes] = {}
        self._early: dict[str, int] = {}  # peer -> entries of ``_notes`` it created early
        self._cut_off: set[str] = set()  # flooding peers, ignored from then on
        self._failed: frozenset[str] = frozenset()
        self._invalid: frozenset[int] = frozenset()
        self._counters: dict[str, int] = {}
        self._poller: _Poller | None = None  # consumers: sends move while the engine idles
        self._closed = False
        self._groups = config.kv_cache_groups if config.num_groups > 1 else ()
        self._storages: tuple[frozenset[int], ...] = ()  # layer storages of each group
        self._group_runs: dict[str, tuple[tuple[int, ...], ...]] = {}  # peer -> runs of each
        self._layout: KVCacheLayout | None = None
        self._asleep = False  # between unregister_kv_caches and restore_kv_caches
        self._wakes = 0
        self._state_ids = state_groups(config)
        if self._state_ids:
            self._groups = ()  # one attention group beside the state groups
        self.state_endpoint: NixlEndpoint | None = None
        """The rank's NIXL endpoint of its state staging rows (state groups only)."""
        self._staging: torch.Tensor | None = None
        self._state_layouts: dict[int, StateLayout] = {}
        self._state_parts: dict[int, list[tuple[torch.Tensor, int]]] = {}  # (tensor, offset)
        self._state_agents: dict[str, str] = {}  # producer engine -> its state agent read
        self._snaps: dict[str, tuple[int, ...]] = {}  # producer: copied at wait_for_save

    # -- registration -------------------------------------------------------------------

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout
    ) -> None:
        """Register the rank's KV buffer with NIXL once and prepare its block descriptors
        (WRK-001). Tensors are never re-strided (LAY-009); a capacity above the block
        budget is registered as is (LAY-003, kvcached).

        Raises:
            InvalidArgumentError: called twice or after shutdown (WRK-001).
            LayoutMismatchError: the tensors do not match ``layout`` (LAY-008).
            NixlError: NIXL refused the agent or the registration.
        """
        if self.endpoint is not None or self._asleep or self._closed:
            raise InvalidArgumentError(
                "register_kv_caches called twice (or after shutdown)", clause="WRK-001"
            )
        if not isinstance(layout, KVCacheLayout) or not isinstance(kv_caches, Mapping):
            raise InvalidArgumentError(
                "register_kv_caches needs a mapping of layer tensors and a KVCacheLayout",
                clause="WRK-001",
            )
        tensors = list(kv_caches.values())
        layout.check_layer_tensors(tensors)
        if self._groups:
            if layout.order.block_outermost:
                raise LayoutMismatchError(
                    "the NIXL backend moves several KV-cache groups only with a "
                    f"layer-outermost order, got {layout.order.dims}", clause="LAY-010")
            slot_of = dict(zip(kv_caches, layout.layer_slots))
            missing = [n for g in self._groups for n in g.layer_names if n not in slot_of]
            if missing:
                raise InvalidArgumentError(
                    f"KV-cache groups name layers {missing[:3]} that were not registered",
                    clause="KVG-001")
            self._storages = tuple(frozenset(slot_of[n] for n in g.layer_names)
                                   for g in self._groups)
        self._layout = layout
        self._open(tensors[0], layout)

    def _open(self, buffer: torch.Tensor, layout: KVCacheLayout) -> None:
        """The rank's NIXL agent over ``buffer``, registered; a new agent name after each
        wake (``-wN``), so no peer can take it for the agent it knew (HSK-006)."""
        # A consumer only reads: polling drives its transfers, and NIXL's progress thread,
        # which busy-polls a core, is needed only by ranks whose memory others read.
        suffix = f"-w{self._wakes}" if self._wakes else ""
        self.endpoint = NixlEndpoint(
            f"{self._config.engine_id}-rank{self._rank}{suffix}", buffer, layout,
            spec_version=SPEC_VERSION,
            progress_thread=self._config.role is not TransferRole.CONSUMER,
        )
        if self._config.role is TransferRole.CONSUMER:
            self._poller = _Poller(self.endpoint, f"kvspec-nixl-progress-rank{self._rank}")

    def register_state_caches(
        self, state_caches: Mapping[str, torch.Tensor], layouts: Mapping[int, StateLayout]
    ) -> None:
        """Register a staging buffer of one row per block id (every state layer's content
        bytes) with a second NIXL agent of this rank (STG-001); its layouts travel in the
        handshake metadata (STG-010).

        Raises:
            InvalidArgumentError: called before ``register_kv_caches`` or twice, a state
                group without a layout or a layer without a tensor (STG-001).
            LayoutMismatchError: a tensor does not match its layout (LAY-008).
            NixlError: NIXL refused the agent or the registration.
        """
        if self.endpoint is None or self.state_endpoint is not None or self._closed:
            raise InvalidArgumentError(
                "register_state_caches before register_kv_caches, twice, or after shutdown",
                clause="STG-001")
        if not isinstance(layouts, Mapping) or set(layouts) != set(self._state_ids) or not all(
                isinstance(v, StateLayout) for v in layouts.values()):
            raise InvalidArgumentError(
                f"register_state_caches needs a StateLayout for each state group "
                f"{list(self._state_ids)}, got {sorted(layouts) if isinstance(layouts, Mapping) else layouts!r}",
                clause="STG-001")
        parts: dict[int, list[tuple[torch.Tensor, int]]] = {}
        offset = 0
        capacity = 1
        for g in self._state_ids:
            layout = layouts[g]
            capacity = max(capacity, layout.block_capacity)
            parts[g] = []
            for name in self._config.kv_cache_groups[g].layer_names:
                tensor = state_caches.get(name)
                if tensor is None:
                    raise InvalidArgumentError(
                        f"state group {g}: no tensor registered for layer {name!r}",
                        clause="STG-001")
                layout.check_tensor(tensor)
                parts[g].append((tensor, offset))
                offset += layout.content_bytes
        row = offset + offset % 2  # K and V halves of one uint8 "head" per row
        device = next(iter(state_caches.values())).device
        self._staging = torch.zeros(capacity, row, dtype=torch.uint8, device=device)
        self._state_layouts = dict(layouts)
        self._state_parts = parts
        self._open_state()

    def _open_state(self) -> None:
        assert self._staging is not None
        capacity, row = self._staging.shape
        layout = KVCacheLayout.contiguous("LBHNC", KVPacking.CONCAT, torch.uint8, 1, capacity,
                                          1, 1, row // 2)
        suffix = f"-w{self._wakes}" if self._wakes else ""
        self.state_endpoint = NixlEndpoint(
            f"{self._config.engine_id}-rank{self._rank}{suffix}-state", self._staging, layout,
            spec_version=SPEC_VERSION,
            progress_thread=self._config.role is not TransferRole.CONSUMER)

    def _move_state(self, group: int, block: int, *, to_staging: bool) -> None:
        """Copy every layer's content bytes of state ``block`` to its staging row or back."""
        assert self._staging is not None
        layout = self._state_layouts[group]
        n = layout.content_bytes
        for tensor, offset in self._state_parts[group]:
            page = layout.block_bytes(tensor, block)
            row = self._staging[block, offset:offset + n]
            if to_staging:
                row.copy_(page.view(torch.uint8))
            else:
                page.view(torch.uint8).copy_(row)

    # -- sleep and wake (WRK-018, WRK-019, HSK-006) ----------------------------------------

    def unregister_kv_caches(self) -> None:
        """Before the engine sleeps: stop the poller, cancel any READ still in flight
        (a drained engine leaves none), release every prepared list and remote agent, and
        deregister the KV memory from NIXL (WRK-018). The peers' information is kept; their
        agents are loaded again at their next load. Idempotent.
        """
        if self._closed or self.endpoint is None:
            return
        if self._poller is not None:
            self._poller.close()
            self._poller = None
        self.endpoint.close()
        self.endpoint = None
        if self.state_endpoint is not None:
            self.state_endpoint.close()
            self.state_endpoint = None
        self._state_agents.clear()
        self._sources.clear()
        self._group_runs.clear()
        self._asleep = True

    def restore_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout
    ) -> None:
        """At wake: a new NIXL agent registers the tensors given (new addresses, new
        registration keys); ``get_handshake_metadata`` then describes it, and consumers
        that see the producer's new metadata in a hand-off handshake again (HSK-006).
        Idempotent.

        Raises:
            InvalidArgumentError: arguments of the wrong type, or another layout than the
                one registered (WRK-019).
            LayoutMismatchError: the tensors do not match ``layout`` (LAY-008).
            NixlError: NIXL refused the agent or the registration.
        """
        if self._closed or not self._asleep:
            return
        if not isinstance(layout, KVCacheLayout) or not isinstance(kv_caches, Mapping):
            raise InvalidArgumentError(
                "restore_kv_caches needs a mapping of layer tensors and a KVCacheLayout",
                clause="WRK-019")
        if layout != self._layout:
            raise InvalidArgumentError(
                "restore_kv_caches got another layout than register_kv_caches",
                clause="WRK-019")
        tensors = list(kv_caches.values())
        layout.check_layer_tensors(tensors)
        self._wakes += 1
        self._open(tensors[0], layout)
        self._asleep = False

    def get_handshake_metadata(self) -> HandshakeMetadata | None:
        """The rank's ``PeerInfo`` (NIXL agent metadata, region, block geometry) as
        plain data (HSK-001, HSK-002); None before registration."""
        endpoint = self.endpoint
        if endpoint is None:
            return None
        info = endpoint.info
        payload: dict[str, object] = {"peer": info.to_json()}
        if self.state_endpoint is not None:  # the state groups' layouts (STG-010)
            payload["state"] = {"peer": self.state_endpoint.info.to_json(), "layouts": {
                str(g): _state_summary(lay) for g, lay in self._state_layouts.items()}}
        return HandshakeMetadata(
            engine_id=self._config.engine_id, rank=self._rank, spec_version=SPEC_VERSION,
            layout={"order": info.layout.order, "packing": info.layout.packing,
                    "dtype": info.layout.dtype, "block_size": info.layout.block_size},
            payload=payload,
        )

    # -- metadata -----------------------------------------------------------------------

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        """Bind the step's metadata (WRK-003).

        Raises:
            InvalidArgumentError: ``metadata`` is not ``NixlMetadata``.
        """
        self._slot.bind(metadata)  # type: ignore[arg-type]  # the slot checks the type
        self._started = False
        self._snaps = dict(metadata.snaps) if isinstance(metadata, NixlMetadata) else {}

    def clear_connector_metadata(self) -> None:
        """Start the bound metadata's work if ``start_load_kv`` did not (a step without a
        forward), then forget it (WRK-003)."""
        if self._slot.is_bound and not self._started:
            self._start(self._slot.get("clear_connector_metadata"))
        self._slot.clear()

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        """Start the step's READs and track its hand-offs (WRK-004). Dummy forwards move
        nothing (DRY-006).

        Raises:
            MetadataNotBoundError: no metadata is bound (DRY-001).
            CompatibilityError: a producer's layout, dtype, block size or spec version
                differs from this rank's (HSK-003).
        """
        meta = self._slot.get("start_load_kv")
        if isinstance(forward_context, ForwardContextView) and forward_context.kind.is_dummy:
            return
        self._start(meta)

    def _peer_sources(self, engine_id: str) -> tuple[_Source, ...]:
        """The ranks of ``engine_id`` this rank reads, added as peers once: those whose
        model heads overlap this rank's, each with the byte runs of the shared heads."""
        sources = self._sources.get(engine_id)
        if sources is not None:
            return sources
        endpoint = self.endpoint
        ranks = self._peer_infos.get(engine_id)
        if endpoint is None or ranks is None:
            raise InvalidArgumentError(
                f"a load from engine {engine_id!r} before its peer information or before "
                "register_kv_caches", clause="HSK-002",
            )
        producers = len(ranks)
        if set(ranks) != set(range(producers)):
            raise CompatibilityError(
                f"producer engine {engine_id!r} describes ranks {sorted(ranks)}; expected "
                f"0 .. {producers - 1}", clause="HSK-003",
            )
        mine = endpoint.info.layout
        consumers = self._config.world_size
        heads = consumers * mine.num_heads
        my_heads = range(self._rank * mine.num_heads, (self._rank + 1) * mine.num_heads)
        chosen: list[tuple[int, PeerInfo, range]] = []
        for p in range(producers):
            info = PeerInfo.from_json({k: v for k, v in ranks[p].items() if k != "state"})
            theirs = info.layout.num_heads
            if theirs * producers != heads:
                raise CompatibilityError(
                    f"producer engine {engine_id!r} holds {theirs} KV head(s) on each of "
                    f"{producers} rank(s), this engine {mine.num_heads} on each of "
                    f"{consumers}: the models' {theirs * producers} and {heads} heads differ",
                    clause="HSK-003",
                )
            their_heads = range(p * theirs, (p + 1) * theirs)
            if overlap(my_heads, their_heads):
                chosen.append((p, info, their_heads))
        found: list[_Source] = []
        try:
            for p, info, their_heads in chosen:
                local_runs, remote_runs = head_runs(
                    mine, my_heads, info.layout, their_heads, endpoint.layout.element_size
                )
                name = endpoint.add_peer(info, local_runs=local_runs, remote_runs=remote_runs)
                readers = sum(
                    1 for c in range(consumers)
                    if overlap(range(c * mine.num_heads, (c + 1) * mine.num_heads),
                               their_heads)
                )
                found.append(_Source(name, readers))
        except BaseException:
            for source in found:  # all or nothing: a later load tries every rank again
                endpoint.remove_peer(source.agent)
            raise
        sources = tuple(found)
        self._sources[engine_id] = sources
        return sources

    def _state_source(self, engine_id: str) -> str:
        """The state agent of ``engine_id``'s rank of this rank's index, added as a peer
        once its state layouts were found equal to this rank's.

        Raises:
            CompatibilityError: another TP size (STG-011), or a state group whose layout
                differs: components, dtypes, offsets, conv layout or sharding (STG-010).
        """
        agent = self._state_agents.get(engine_id)
        if agent is not None:
            return agent
        ranks = self._peer_infos.get(engine_id)
        endpoint = self.state_endpoint
        if endpoint is None or ranks is None:
            raise InvalidArgumentError(
                f"a load with state from engine {engine_id!r} before its peer information or "
                "before register_state_caches", clause="STG-001")
        if len(ranks) != self._config.world_size:
            raise CompatibilityError(
                f"producer engine {engine_id!r} runs {len(ranks)} TP rank(s), this engine "
                f"{self._config.world_size}: state groups are sharded by TP rank and this "
                "backend knows no component split to move them by, so it refuses (it never "
                "copies whole state pages between different shards)", clause="STG-011")
        theirs = ranks.get(self._rank, {}).get("state")
        if not isinstance(theirs, Mapping) or not isinstance(theirs.get("layouts"), Mapping):
            raise CompatibilityError(
                f"producer engine {engine_id!r} describes no state layout in its handshake; "
                "this engine runs state groups", clause="STG-010")
        for g, mine in self._state_layouts.items():
            got = theirs["layouts"].get(str(g))
            want = _state_summary(mine)
            if got != want:
                clause = "STG-011" if isinstance(got, Mapping) and got.get(
                    "tp_size") != want["tp_size"] else "STG-010"
                diff = sorted(k for k in want if not isinstance(got, Mapping)
                              or got.get(k) != want[k])
                raise CompatibilityError(
                    f"producer engine {engine_id!r} describes state group {g} as {got!r:.300}; "
                    f"this rank as {want!r:.300} (differ: {diff}): peers must run the same "
                    "state layout (vLLM: the same VLLM_SSM_CONV_STATE_LAYOUT); refused, "
                    "never copied", clause=clause)
        info = PeerInfo.from_json(theirs.get("peer"))
        agent = endpoint.add_peer(info)
        self._state_agents[engine_id] = agent
        return agent

    def _forget_engine(self, engine_id: str) -> None:
        """Drop the peers of ``engine_id``: its next load handshakes again (a producer
        that restarted, or whose READs failed)."""
        state_agent = self._state_agents.pop(engine_id, None)
        if state_agent is not None and self.state_endpoint is not None \
                and state_agent in self.state_endpoint.peers:
            self.state_endpoint.remove_peer(state_agent)
        sources = self._sources.pop(engine_id, ())
        endpoint = self.endpoint
        for source in sources:
            self._group_runs.pop(source.agent, None)
            if endpoint is not None and source.agent in endpoint.peers:
                endpoint.remove_peer(source.agent)

    def _start(self, meta: NixlMetadata) -> None:
        self._started = True
        for engine_id, ranks in meta.peers.items():
            if self._peer_infos.get(engine_id) != ranks:  # new, or the producer restarted
                self._forget_engine(engine_id)
            self._peer_infos[engine_id] = ranks
        now = time.monotonic()
        for rid, secret in meta.sends.items():
            self._sends[rid] = (now + self._settings.free_timeout_s, secret)
        if not meta.loads:
            return
        endpoint = self.endpoint
        if endpoint is None or self._closed:
            raise InvalidArgumentError(
                "the metadata names loads but no KV caches are registered (or the worker "
                "is shut down)", clause="WRK-001",
            )
        for load in meta.loads:
            self._read(endpoint, load)
        if self._poller is not None:
            self._poller.kick()

    def _read(self, endpoint: NixlEndpoint, load: NixlLoad) -> None:
        state_agent = ""
        try:
            if load.local_state:
                state_agent = self._state_source(load.engine_id)  # STG-010/011 first
            sources = self._peer_sources(load.engine_id)
        except CompatibilityError:
            raise  # a misconfigured pair: fail loudly (HSK-003)
        except KVSpecError as e:  # the producer is unreachable (dead, or its agent gone)
            _log.warning("rank %d: cannot reach engine %s for %s: %s", self._rank,
                         load.engine_id, load.request_id, str(e))
            if load.local_blocks:
                self._failed_early[load.request_id] = load.local_blocks
            return
        parts = self._parts(load) if load.local_groups else None
        if parts is None and load.local_groups:  # a block this engine needs was not handed off
            _log.warning("rank %d: the hand-off of %s lacks a block of a KV-cache group this "
                         "engine needs (KVG-003)", self._rank, load.request_id)
            for source in sources:
                endpoint.send_notification(source.agent, _notification(load, source.readers))
            self._failed_early[load.request_id] = load.local_blocks
            return
        if not load.local_blocks or self._faults.fail_loads:
            # nothing to read (or the fault plan fails the read): free the producer's blocks
            for source in sources:
                endpoint.send_notification(source.agent, _notification(load, source.readers))
            if load.local_blocks:
                self._failed_early[load.request_id] = load.local_blocks
            return
        if load.request_id in self._reads:
            raise InvalidArgumentError(
                f"request {load.request_id!r} already has a READ in flight", clause="SCH-013"
            )
        entry = _Load(load.local_blocks, [], engine_id=load.engine_id,
                      not_before=time.monotonic() + self._faults.delay_s,
                      state_blocks=load.local_state)
        if load.local_state:  # the producer is told once every READ finished
            entry.notify = [(s.agent, _notification(load, s.readers)) for s in sources]
            self._read_state(load, state_agent, entry)
        for source in sources:
            note = b"" if load.local_state else _notification(load, source.readers)
            try:
                if parts is None:
                    entry.transfers.append(endpoint.start_read(
                        source.agent, load.local_blocks, load.remote_blocks,
                        timeout=self._settings.transfer_timeout_s, notification=note,
                    ))
                    continue
                runs = self._runs_of(endpoint, source.agent)
                used = [i for i, (lo, _) in enumerate(parts) if lo]
                entry.transfers.append(endpoint.start_read(
                    source.agent, [parts[i][0] for i in used], [parts[i][1] for i in used],
                    timeout=self._settings.transfer_timeout_s, notification=note,
                    runs=[runs[i] for i in used],
                ))
            except CompatibilityError:
                raise
            except KVSpecError as e:  # e.g. a block id outside the producer's budget
                _log.warning("rank %d: READ of %s from %s not started: %s", self._rank,
                             load.request_id, source.agent, str(e))
                entry.failed = True
        if entry.transfers:  # reported once every READ that started has finished
            self._reads[load.request_id] = entry
        else:
            self._notify(entry)
            self._failed_early[load.request_id] = load.local_blocks

    def _read_state(self, load: NixlLoad, agent: str, entry: _Load) -> None:
        """Start the READ of the producer's staging rows of ``load`` into this rank's rows
        of its state blocks (one row per state group's block)."""
        endpoint = self.state_endpoint
        assert endpoint is not None
        try:
            entry.state.append(endpoint.start_read(
                agent, list(load.local_state), list(load.remote_state),
                timeout=self._settings.transfer_timeout_s))
        except CompatibilityError:
            raise
        except KVSpecError as e:
            _log.warning("rank %d: state READ of %s not started: %s", self._rank,
                         load.request_id, str(e))
            entry.failed = True

    def _notify(self, entry: _Load) -> None:
        """Tell every producer rank ``entry`` read attention from that it may free."""
        endpoint = self.endpoint
        for agent, message in entry.notify:
            if endpoint is not None and not endpoint.closed:
                endpoint.send_notification(agent, message)
        entry.notify = []
        if self._poller is not None:
            self._poller.kick()

    @staticmethod
    def _parts(load: NixlLoad) -> list[tuple[list[int], list[int]]] | None:
        """Each group's ``(local, remote)`` ids to read, the null block left out on both
        sides (KVG-004); None when a block this engine allocated was not handed off."""
        parts = []
        for local, remote in zip(load.local_groups, load.remote_groups):
            pairs = [(lo, re) for lo, re in zip(local, remote) if lo != NULL_BLOCK_ID]
            if any(re == NULL_BLOCK_ID for _, re in pairs):
                return None
            parts.append(([lo for lo, _ in pairs], [re for _, re in pairs]))
        return parts

    def _runs_of(self, endpoint: NixlEndpoint, agent: str) -> tuple[tuple[int, ...], ...]:
        """For each group, the indices of the pair runs of ``agent`` that lie in the layer
        storages its layers use (a storage two groups share counts for both, KVG-008)."""
        runs = self._group_runs.get(agent)
        if runs is None:
            layout = endpoint.layout
            offsets = [o for o, _ in endpoint.pair_runs(agent)]
            storage = storage_of(layout, offsets)
            runs = self._group_runs[agent] = tuple(
                tuple(i for i, s in enumerate(storage) if s in used) for used in self._storages)
        return runs

    def wait_for_save(self) -> None:
        """The producer's blocks are read by the consumer, held by a delayed free until
        then (SCH-016, WRK-007). With state groups, first copy the state of each request the
        step's metadata names (``snaps``) into its staging rows: the step's forward is done,
        so the running state is the state after exactly the step's tokens."""
        self._slot.get("wait_for_save")
        snaps, self._snaps = self._snaps, {}
        for rows in snaps.values():
            for g, block in zip(self._state_ids, rows):
                self._move_state(g, block, to_staging=True)

    # -- completion ---------------------------------------------------------------------

    def get_finished(
        self, finished_req_ids: frozenset[str]
    ) -> tuple[frozenset[str], frozenset[str]]:
        """Producer: hand-offs of which this rank got a notification from every consumer
        rank that reads it, or whose ``free_timeout_s`` passed (sending). Consumer: loads
        whose READs all finished, failed or timed out (recving; failures also in
        ``failed_recving``). Each once (WRK-009, WRK-010)."""
        endpoint = self.endpoint
        sending: set[str] = set()
        recving: set[str] = set(self._failed_early)
        failed: set[str] = set(self._failed_early)
        invalid: set[int] = {b for blocks in self._failed_early.values() for b in blocks}
        self._failed_early.clear()
        now = time.monotonic()
        if endpoint is not None and not endpoint.closed:
            dropped = self._take_notifications(endpoint, now)
            if dropped:  # one line per call, however many: a flood must not flood the log
                self._count(bad_notifications=sum(n for _, n, _ in dropped))
                peer, n, first = dropped[0]
                _log.warning("rank %d: dropped %d malformed, spoofed or excess notifications, the "
                             "first from %s: %r", self._rank, sum(n for _, n, _ in dropped),
                             peer, first)
            state_ep = self.state_endpoint
            for rid, entry in list(self._reads.items()):
                states = [endpoint.poll(t) for t in entry.transfers]
                if entry.state:
                    states += [state_ep.poll(t) if state_ep is not None and not state_ep.closed
                               else TransferState.FAILED for t in entry.state]
                if TransferState.IN_PROGRESS in states or now < entry.not_before:
                    continue  # its blocks are still being written: report all at once
                del self._reads[rid]
                recving.add(rid)
                bad = [t for t in [*entry.transfers, *entry.state]
                       if t.state is TransferState.FAILED]
                if not (bad or entry.failed):  # the state into its blocks, then the report
                    for g, block in zip(self._state_ids, entry.state_blocks):
                        self._move_state(g, block, to_staging=False)
                self._notify(entry)
                for transfer in bad:
                    _log.warning("rank %d: READ of %s from %s failed: %s", self._rank, rid,
                                 transfer.peer, transfer.reason)
                if bad or entry.failed:
                    if bad and not any(e.engine_id == entry.engine_id
                                       for e in self._reads.values()):
                        # handshake again before the next READ from that engine (once no
                        # other READ from it is in flight: removing a peer fails those)
                        self._forget_engine(entry.engine_id)
                    failed.add(rid)
                    invalid.update(entry.local_blocks)
                    self._count(load_failures=len(entry.local_blocks))
                else:
                    self._count(blocks_loaded=len(entry.local_blocks),
                                bytes_loaded=sum(t.nbytes for t in entry.transfers),
                                **({"states_loaded": len(entry.state_blocks)}
                                   if entry.state_blocks else {}))
        for rid, (deadline, secret) in list(self._sends.items()):
            notes = self._notes.get((rid, secret))
            if notes is not None and notes.got >= notes.expected:
                del self._sends[rid]
                self._drop_note((rid, secret))
                sending.add(rid)
            elif now >= deadline:
                _log.warning("rank %d: not every consumer rank read request %s within "
                             "%.0f s; freeing", self._rank, rid, self._settings.free_timeout_s)
                del self._sends[rid]
                self._drop_note((rid, secret))
                sending.add(rid)
        for key, notes in list(self._notes.items()):  # early ones nobody claimed (or spoofed)
            if (self._sends.get(key[0], (0.0, ""))[1] != key[1]
                    and now - notes.first_seen > self._settings.free_timeout_s):
                self._drop_note(key)
        self._failed = frozenset(failed)
        # Several groups: a failed READ is its request's, never block ids (KVG-005).
        self._invalid = frozenset(invalid) if not self._groups else frozenset()
        return frozenset(sending), frozenset(recving)

    def _take_notifications(self, endpoint: NixlEndpoint, now: float
                            ) -> list[tuple[str, int, bytes]]:
        """Count this call's notifications towards their hand-offs, per peer within
        ``_PEER_BUDGET``; return what was dropped, ``(peer, count, first message)``. A peer
        that exceeds its budget is cut off (counted, logged once by name); the others'
        notifications count as without it."""
        batches, ignored = endpoint.take_notifications(self._cut_off)
        dropped = [(peer, n, b"(a peer cut off before)") for peer, n in ignored.items()]
        for peer, messages in batches.items():
            bad = 0
            first = b""
            for i, message in enumerate(messages):
                parsed = _parse_notification(message)
                sent = None if parsed is None else self._sends.get(parsed[0])
                early = parsed is not None and sent is None and parsed[:2] not in self._notes
                if parsed is None or (sent is not None and sent[1] != parsed[1]) or (
                        early and len(self._notes) >= _MAX_EARLY_NOTES):
                    bad += 1  # garbage, a wrong secret, or no room: dropped and counted
                    first = first or message[:80]
                elif early and self._early.get(peer, 0) >= _PEER_BUDGET:
                    bad += 1
                    first = first or message[:80]
                else:
                    assert parsed is not None
                    rid, secret, expected = parsed
                    note = self._notes.get((rid, secret))
                    if note is None:
                        note = self._notes[rid, secret] = _Notes(
                            0, expected, now, peer if early else "")
                        if early:
                            self._early[peer] = self._early.get(peer, 0) + 1
                    note.got += 1
                    note.expected = max(note.expected, expected)
                full = self._early.get(peer, 0) >= _PEER_BUDGET
                if bad >= _PEER_BUDGET or (full and bad):  # past a budget: flooding
                    rest = len(messages) - i - 1
                    self._cut(peer, bad + rest)
                    bad += rest
                    break
            if bad:
                dropped.append((peer, bad, first))
        return dropped

    def _cut(self, peer: str, count: int) -> None:
        """Cut a flooding peer off: its early entries go, its later notifications are
        counted and never parsed."""
        self._cut_off.add(peer)
        for key, note in list(self._notes.items()):
            if note.peer == peer and self._sends.get(key[0], (0.0, ""))[1] != key[1]:
                self._drop_note(key)
        self._count(peers_cut_off=1)
        _log.warning("rank %d: cut off peer %s: %d notifications for hand-offs this rank did "
                     "not make, malformed or spoofed, past its budget of %d; everything it "
                     "sends from now on is dropped", self._rank, peer, count, _PEER_BUDGET)

    def _drop_note(self, key: tuple[str, str]) -> None:
        note = self._notes.pop(key, None)
        if note is not None and note.peer and note.peer in self._early:
            self._early[note.peer] -= 1
            if not self._early[note.peer]:
                del self._early[note.peer]

    def get_failed_recving(self) -> frozenset[str]:
        """The READs of the last ``get_finished`` that failed (WRK-011)."""
        failed, self._failed = self._failed, frozenset()
        return failed

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        """Every block of the last ``get_finished``'s failed READs (WRK-011, EVT-003)."""
        invalid, self._invalid = self._invalid, frozenset()
        return invalid

    def _count(self, **counts: int) -> None:
        for name, n in counts.items():
            self._counters[name] = self._counters.get(name, 0) + n

    def get_kv_connector_stats(self) -> SupportsAggregate | None:
        """``blocks_loaded``, ``bytes_loaded``, ``load_failures``, ``bad_notifications``
        (dropped malformed, spoofed or excess notifications) and ``peers_cut_off``
        (flooding peers, issue 34) since the last call, or None (EVT-006)."""
        counters, self._counters = self._counters, {}
        return ConnectorStats(counters) if any(counters.values()) else None

    def handle_preemptions(self, preempted_req_ids: frozenset[str]) -> None:
        """Nothing to fence: a consumer never preempts a request whose READ is in flight
        (it is waiting for remote KV), and the producer only reads finished requests."""
        return None

    def shutdown(self) -> None:
        """Cancel READs in flight, release every NIXL handle, peer and registration;
        idempotent (WRK-015)."""
        if self._closed:
            return
        self._closed = True
        if self._poller is not None:
            self._poller.close()
        if self.endpoint is not None:
            self.endpoint.close()
        if self.state_endpoint is not None:
            self.state_endpoint.close()
        self._reads.clear()
        self._sends.clear()
        self._notes.clear()
        self._early.clear()
        self._cut_off.clear()
        self._sources.clear()
        self._slot.clear()
