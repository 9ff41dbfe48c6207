"""The NIXL transport of the reference NIXL backend: one agent, one registration, prepared
descriptor lists, READs of remote blocks with a notification, deadlines and clean release.

Call order (checked against nixl 1.5.1 over UCX, host memory):

1. ``nixl_agent(name, nixl_agent_config(backends=["UCX"]))``; the target of a READ needs
   NIXL's progress thread (the default): without it a READ it serves stays ``"PROC"``.
2. ``register_memory(Nx3 array, mem_type)`` of the one KV region; keep the returned
   ``nixlRegDList`` for ``deregister_memory``.
3. ``prep_xfer_dlist("NIXL_INIT_AGENT", rows, mem_type)`` once for the local blocks,
   run-major (``BlockGeometry.descriptor_rows``): NIXL merges descriptors of a
   transfer only when their indices are consecutive and their memory contiguous.
4. Handshake: the peer's ``get_agent_metadata()`` bytes (NIXL's own serializer, never
   pickle) travel inside ``PeerInfo`` (JSON); ``add_remote_agent(bytes)`` returns the
   peer's name (as ``bytes``); ``prep_xfer_dlist(name, remote rows, mem_type)`` once per peer.
5. Per read: ``make_prepped_xfer("READ", local, idx, remote, idx, notif)`` then
   ``transfer(handle)``; ``check_xfer_state`` until ``"DONE"``/``"ERR"``;
   ``release_xfer_handle``. The notification reaches the *target* (producer) agent once
   the READ completed (``get_new_notifs`` there, keyed by the reader's agent name).
6. Close: release transfers (a release of an in-flight transfer cancels it), remote lists,
   ``remove_remote_agent``, local list, ``deregister_memory``.

Faults: a dead peer makes ``transfer``/``check_xfer_state`` *raise*
(``nixlRemoteDisconnectError``) rather than return ``"ERR"``; a removed peer makes them raise
``nixlNotFoundError``; a stalled peer keeps the transfer in ``"PROC"`` forever. All three end
here as a ``TransferState.FAILED`` transfer, the last one at its deadline (ERR-007),
and the local blocks of a failed transfer hold partial bytes: report them invalid.
"""

from __future__ import annotations

import enum
import importlib
import logging
import itertools
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from kvspec.protocols.errors import (
    CompatibilityError,
    InvalidArgumentError,
    InvalidBlockIdError,
    KVSpecError,
    LayoutMismatchError,
    MalformedMetadataError,
)
from kvspec.protocols.layout import KVCacheLayout
from kvspec.protocols.metadata import spec_major

from ._descriptors import (
    BlockGeometry,
    LayoutSummary,
    MemKind,
    BlockRuns,
    PeerInfo,
    check_compatible,
    descriptor_indices,
)

__all__ = [
    "EndpointClosedError",
    "NixlEndpoint",
    "NixlError",
    "NixlResources",
    "NixlTransfer",
    "NixlUnavailableError",
    "TransferState",
    "load_nixl",
]

_LOCAL: Final = "NIXL_INIT_AGENT"
_MAX_REMOTE_FACTOR: Final = 8
"""A peer's descriptor list may be at most this many times this endpoint's own."""
_MIN_REMOTE_LIMIT: Final = 1 << 16
"""...and is always allowed this many descriptors (small endpoints, large peers)."""
_log = logging.getLogger(__name__)


class NixlError(KVSpecError):
    """NIXL refused a set-up operation (creating the agent, registering memory, preparing
    descriptor lists, loading a peer's metadata). Transfer faults are not raised: they end
    as a ``TransferState.FAILED`` transfer."""


class NixlUnavailableError(NixlError, ImportError):
    """The ``nixl`` package cannot be imported (install ``kvspec[nixl]``)."""


class EndpointClosedError(NixlError):
    """The endpoint was used after ``NixlEndpoint.close``."""


def load_nixl() -> Any:
    """The ``nixl._api`` module (``nixl_agent``, ``nixl_agent_config``).

    Raises:
        NixlUnavailableError: ``nixl`` cannot be imported.
    """
    try:
        importlib.import_module("nixl")
        return importlib.import_module("nixl._api")
    except ImportError as e:
        raise NixlUnavailableError(
            f"the NIXL backend needs the nixl package (pip install 'kvspec[nixl]'): {e}"
        ) from None


class TransferState(enum.Enum):
    """Where a ``NixlTransfer`` is."""

    IN_PROGRESS = "in_progress"
    DONE = "done"
    FAILED = "failed"


@attrs.define(eq=False)
class NixlTransfer:
    """One READ of remote blocks into local blocks. Read-only to callers.

    Attributes:
        transfer_id: Unique within the endpoint.
        peer: The agent name read from.
        local_blocks: Local block ids written, in pair order.
        remote_blocks: Remote block ids read, in pair order.
        notification: The message the peer receives when the READ completed.
        deadline: ``clock()`` value after which the transfer is cancelled and failed.
        nbytes: Bytes the transfer moves.
        num_descriptors: Descriptors per side (before NIXL merges adjacent ones).
        state: Where it is; set by ``NixlEndpoint.poll``.
        reason: Why it failed, when it did.
        timed_out: True when it failed at its deadline.
        posted_descriptors: With ``capture_telemetry``, the descriptors NIXL actually
            posted once DONE (after merging runs of adjacent ones); None otherwise.
    """

    transfer_id: int
    peer: str
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    notification: bytes
    deadline: float
    nbytes: int
    num_descriptors: int
    state: TransferState = TransferState.IN_PROGRESS
    reason: str | None = None
    timed_out: bool = False
    posted_descriptors: int | None = None

    @property
    def finished(self) -> bool:
        """True once DONE or FAILED."""
        return self.state is not TransferState.IN_PROGRESS


@attrs.frozen
class NixlResources:
    """What an endpoint holds, for leak checks: all zero after ``NixlEndpoint.close``.

    Attributes:
        registrations: Registered memory regions.
        local_dlists: Prepared local descriptor lists.
        remote_dlists: Prepared remote descriptor lists.
        peers: Remote agents loaded.
        transfers: Transfer handles not yet released (in flight).
        unreleased: Transfer handles whose release NIXL refused (could not cancel); retried
            by every poll and by close.
    """

    registrations: int
    local_dlists: int
    remote_dlists: int
    peers: int
    transfers: int
    unreleased: int

    @property
    def total(self) -> int:
        """The sum of all counts."""
        return (self.registrations + self.local_dlists + self.remote_dlists + self.peers
                + self.transfers + self.unreleased)


@attrs.define(eq=False)
class _Peer:
    info: PeerInfo
    remote_handle: Any
    local_key: BlockRuns
    per_block: int
    lengths: tuple[int, ...]


def _nixl_message(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _mem_of(buffer: torch.Tensor) -> tuple[MemKind, int]:
    if buffer.device.type == "cpu":
        return "DRAM", 0
    if buffer.device.type == "cuda":
        return "VRAM", int(buffer.device.index or 0)
    raise InvalidArgumentError(
        f"the NIXL backend registers host (cpu) or CUDA memory, got a tensor on "
        f"{buffer.device}", clause="LAY-007"
    )


class NixlEndpoint:
    """One NIXL agent with one registered KV region, its prepared descriptor lists and the
    transfers it started. Thread-safe (one lock around every NIXL call).

    Args:
        name: The agent name, unique among the peers (e.g. ``f"{engine_id}-rank{rank}"``).
        buffer: A tensor whose first byte is byte offset 0 of ``layout`` and whose storage
            holds at least ``layout.span_bytes`` from there (host or CUDA memory). Any view
            works, e.g. ``KVCacheLayout.view`` of a flat buffer; it is never
            re-strided (LAY-009).
        layout: The layout of the KV cache in ``buffer``.
        spec_version: The kvspec spec version the connector implements
            (``kvspec.spec.SPEC_VERSION``), announced in ``info`` and compared at
            handshake (HSK-003). A parameter because backends import only
            ``kvspec.protocols``.
        runs: The byte runs of a block to build the default local descriptor list from
            (None: whole regions). See ``BlockRuns``.
        backends: NIXL backends to create.
        clock: The clock of transfer deadlines (seconds, monotonic).
        progress_thread: Run NIXL's progress thread (the default). A rank whose blocks
            are read (a producer) needs it: without it the READs it serves stay in
            progress until it calls into NIXL. A rank that only reads may turn it off
            (polling progresses its transfers); the thread busy-polls a core.
        capture_telemetry: Ask NIXL for per-transfer telemetry and record the posted
            descriptor count in ``NixlTransfer.posted_descriptors`` (benchmarks).

    Raises:
        NixlUnavailableError: nixl is not installed.
        InvalidArgumentError: a bad argument.
        LayoutMismatchError: ``buffer`` is smaller than ``layout.span_bytes`` (LAY-008).
        NixlError: NIXL refused to create the agent, register or prepare.
    """

    def __init__(
        self,
        name: str,
        buffer: torch.Tensor,
        layout: KVCacheLayout,
        *,
        spec_version: str,
        runs: BlockRuns | None = None,
        backends: Sequence[str] = ("UCX",),
        clock: Callable[[], float] = time.monotonic,
        progress_thread: bool = True,
        capture_telemetry: bool = False,
    ) -> None:
        if not isinstance(name, str) or not name or "\x00" in name:
            raise InvalidArgumentError(f"agent name must be a non-empty str, got {name!r}")
        if not isinstance(buffer, torch.Tensor):
            raise InvalidArgumentError(
                f"buffer must be a torch.Tensor, got {type(buffer).__name__}", clause="LAY-007"
            )
        if not isinstance(layout, KVCacheLayout):
            raise InvalidArgumentError(
                f"layout must be a KVCacheLayout, got {type(layout).__name__}", clause="LAY-007"
            )
        if isinstance(backends, str) or not backends or not all(
            isinstance(b, str) for b in backends
        ):
            raise InvalidArgumentError(f"backends must be a list of names, got {backends!r}")
        spec_major(spec_version, clause="HSK-003")
        if not callable(clock):
            raise InvalidArgumentError("clock must be a callable returning seconds")
        mem_type, device_id = _mem_of(buffer)
        base = buffer.data_ptr()
        storage = buffer.untyped_storage()
        available = storage.data_ptr() + storage.nbytes() - base
        if available < layout.span_bytes:
            raise LayoutMismatchError(
                f"buffer holds {available} bytes from its first element; the layout spans "
                f"{layout.span_bytes} bytes", clause="LAY-008"
            )
        self._geometry = BlockGeometry.from_layout(layout)
        default = self._geometry.check_runs(runs)
        api = load_nixl()

        self.name = name
        self._lock = threading.RLock()
        self._clock = clock
        self._buffer = buffer  # keeps the registered memory alive
        self._layout = layout
        self._mem_type: MemKind = mem_type
        self._device_id = device_id
        self._base = base
        self._nbytes = layout.span_bytes
        self._backends = list(backends)
        self._telemetry = bool(capture_telemetry)
        self._closed = False
        self._ids = itertools.count()
        self._local: dict[BlockRuns, Any] = {}
        self._peers: dict[str, _Peer] = {}
        self._handles: dict[int, tuple[NixlTransfer, Any]] = {}
        self._unreleased: list[Any] = []
        self._reg: Any = None
        try:
            self._agent: Any = api.nixl_agent(
                name, api.nixl_agent_config(enable_prog_thread=bool(progress_thread),
                                            backends=list(backends),
                                            capture_telemetry=bool(capture_telemetry))
            )
        except Exception as e:
            raise NixlError(f"NIXL could not create agent {name!r}: {_nixl_message(e)}") from e
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise NixlError(
                f"NIXL backend(s) {missing} are not available; plugins found: "
                f"{self._agent.get_plugin_list()}"
            )
        try:
            rows = np.array([[base, self._nbytes, device_id]], dtype=np.uint64)
            self._reg = self._agent.register_memory(rows, mem_type, backends=self._backends)
            self._local_handle(default)
        except Exception as e:
            self.close()
            if isinstance(e, KVSpecError):
                raise
            raise NixlError(
                f"NIXL could not register {self._nbytes} bytes of {mem_type}: "
                f"{_nixl_message(e)}"
            ) from e
        self._default = default
        self._info = PeerInfo(
            spec_version=spec_version,
            agent_name=name,
            agent_metadata=self._agent.get_agent_metadata(),
            mem_type=mem_type,
            device_id=device_id,
            base_address=base,
            nbytes=self._nbytes,
            layout=LayoutSummary.from_layout(layout),
            geometry=self._geometry,
        )

    # ------------------------------------------------------------------ description

    @property
    def info(self) -> PeerInfo:
        """This endpoint's handshake description (plain data, HSK-001)."""
        return self._info

    @property
    def geometry(self) -> BlockGeometry:
        """Where the local blocks lie in the registered region."""
        return self._geometry

    @property
    def layout(self) -> KVCacheLayout:
        """The layout of the registered KV cache."""
        return self._layout

    @property
    def closed(self) -> bool:
        """True after ``close``."""
        return self._closed

    @property
    def peers(self) -> tuple[str, ...]:
        """Names of the peers added and not removed."""
        with self._lock:
            return tuple(self._peers)

    def descriptors_per_block(self, peer: str | None = None) -> int:
        """Descriptors one block takes in the local list (with ``peer``: the one used
        for reads from that peer)."""
        with self._lock:
            if peer is None:
                return len(self._default)
            return self._peer(peer).per_block

    def resources(self) -> NixlResources:
        """What the endpoint holds now (for leak checks)."""
        with self._lock:
            return NixlResources(
                registrations=int(self._reg is not None),
                local_dlists=len(self._local),
                remote_dlists=len(self._peers),
                peers=len(self._peers),
                transfers=len(self._handles),
                unreleased=len(self._unreleased),
            )

    # ------------------------------------------------------------------ peers

    def add_peer(
        self,
        info: PeerInfo,
        *,
        local_runs: BlockRuns | None = None,
        remote_runs: BlockRuns | None = None,
    ) -> str:
        """Load a peer's NIXL metadata and prepare its block descriptors once (HSK-003).

        ``local_runs``/``remote_runs`` say which bytes of a block move, pairwise (default:
        the endpoint's runs locally, whole regions remotely); the two sides must then give
        the same number of descriptors per block with the same lengths. With runs given
        the head counts may differ (heterogeneous TP, see
        ``head_runs``).

        Returns:
            The peer's agent name, to pass to ``start_read``.

        Raises:
            InvalidArgumentError: ``info`` is not a PeerInfo, names this agent or a peer
                already added.
            CompatibilityError: spec major version, layout order, packing, dtype, block
                size, layer count, head sizes or head count differ, or the descriptors of
                one block differ in number or length (HSK-003).
            MalformedMetadataError: NIXL rejected the agent metadata (HSK-005).
            NixlError: NIXL refused to prepare the peer's descriptors.
        """
        if not isinstance(info, PeerInfo):
            raise InvalidArgumentError(f"info must be a PeerInfo, got {type(info).__name__}")
        with self._lock:
            self._check_open()
            if info.agent_name == self.name:
                raise InvalidArgumentError(
                    f"peer info names this agent {self.name!r}; agent names must be unique"
                )
            if info.agent_name in self._peers:
                raise InvalidArgumentError(
                    f"peer {info.agent_name!r} is already added; remove_peer it first"
                )
            sliced = local_runs is not None or remote_runs is not None
            check_compatible(self._info, info, heterogeneous_heads=sliced)
            local_key = (self._default if local_runs is None
                         else self._geometry.check_runs(local_runs))
            remote_key = info.geometry.check_runs(remote_runs)
            lengths = tuple(n for _, n in local_key)
            remote_lengths = tuple(n for _, n in remote_key)
            self._check_claims(info, len(remote_key))  # before anything is allocated
            if lengths != remote_lengths:
                raise CompatibilityError(
                    f"block descriptors differ: agent {self.name!r} moves "
                    f"{len(lengths)} descriptor(s) of {sorted(set(lengths))[:4]} bytes per block, "
                    f"peer {info.agent_name!r} {len(remote_lengths)} of "
                    f"{sorted(set(remote_lengths))[:4]} bytes; pass runs that match",
                    clause="HSK-003",
                )
            self._local_handle(local_key)
            try:
                loaded = self._agent.add_remote_agent(info.agent_metadata)
            except Exception as e:
                self._drop_unused_local(local_key)
                raise MalformedMetadataError(
                    f"NIXL rejected the agent metadata of peer {info.agent_name!r}: "
                    f"{_nixl_message(e)}", clause="HSK-005"
                ) from e
            loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded_name != info.agent_name:
                # Never unload an agent this endpoint uses: a PeerInfo carrying an existing
                # peer's metadata under another name must not cut that peer off.
                if loaded_name not in self._peers and loaded_name != self.name:
                    self._remove_agent(loaded_name)
                self._drop_unused_local(local_key)
                raise MalformedMetadataError(
                    f"peer info names agent {info.agent_name!r} but its NIXL metadata is "
                    f"agent {loaded_name!r}", clause="HSK-005"
                )
            try:
                rows = info.geometry.descriptor_rows(
                    info.base_address, info.device_id, remote_key
                )
                remote = self._agent.prep_xfer_dlist(
                    info.agent_name, rows, info.mem_type, backends=self._backends
                )
            except Exception as e:
                self._remove_agent(info.agent_name)
                self._drop_unused_local(local_key)
                raise NixlError(
                    f"NIXL could not prepare the {info.geometry.num_blocks} blocks of peer "
                    f"{info.agent_name!r} (its metadata may not cover the described "
                    f"region): {_nixl_message(e)}"
                ) from e
            self._peers[info.agent_name] = _Peer(
                info=info, remote_handle=remote, local_key=local_key,
                per_block=len(lengths), lengths=lengths,
            )
            return info.agent_name

    def _check_claims(self, info: PeerInfo, per_block: int) -> None:
        """Bound what a peer claims before allocating for it (ERR-002, HSK-005): its blocks
        must lie inside the region it says it registered, and its descriptor list may be at
        most ``_MAX_REMOTE_FACTOR`` times this endpoint's (at least ``_MIN_REMOTE_LIMIT``
        descriptors): a 1.5 KB PeerInfo must not make this side allocate gigabytes.

        Raises:
            MalformedMetadataError: a claim is out of bounds.
        """
        g = info.geometry
        span = (g.num_blocks - 1) * g.block_stride + g.region_offsets[-1] + g.region_nbytes
        if span > info.nbytes:
            raise MalformedMetadataError(
                f"peer {info.agent_name!r} claims {g.num_blocks} blocks spanning {span} bytes "
                f"but registered {info.nbytes}; expected its blocks inside its region",
                clause="HSK-005",
            )
        limit = max(_MAX_REMOTE_FACTOR * self._geometry.num_blocks * len(self._default),
                    _MIN_REMOTE_LIMIT)
        if g.num_blocks * per_block > limit:
            raise MalformedMetadataError(
                f"peer {info.agent_name!r} claims {g.num_blocks} blocks of {per_block} "
                f"descriptors; this endpoint accepts at most {limit} descriptors per peer "
                f"({_MAX_REMOTE_FACTOR}x its own)", clause="HSK-005",
            )

    def remove_peer(self, peer: str) -> None:
        """Forget a peer: its in-flight transfers are cancelled and FAILED, its prepared
        list released, its NIXL metadata invalidated (which disconnects). Unknown names are
        ignored, so this is idempotent."""
        with self._lock:
            entry = self._peers.pop(peer, None)
            if entry is None:
                return
            for transfer, handle in list(self._handles.values()):
                if transfer.peer == peer:
                    self._fail(transfer, handle, f"peer {peer!r} was removed")
            self._release_quietly(entry.remote_handle)
            self._remove_agent(peer)
            self._drop_unused_local(entry.local_key)

    # ------------------------------------------------------------------ transfers

    def start_read(
        self,
        peer: str,
        local_blocks: Sequence[int] | Sequence[Sequence[int]] | npt.NDArray[np.integer[Any]],
        remote_blocks: Sequence[int] | Sequence[Sequence[int]] | npt.NDArray[np.integer[Any]],
        *,
        timeout: float,
        notification: bytes = b"",
        runs: Sequence[Sequence[int]] | None = None,
    ) -> NixlTransfer:
        """Start one prepared READ of ``remote_blocks`` of ``peer`` into ``local_blocks``
        (pairwise) as one NIXL transfer; the peer receives ``notification`` once it
        completed. Never blocks beyond NIXL's post (which may copy synchronously).

        ``runs`` (several KV-cache groups, KVG-008): one tuple of run indices into
        ``pair_runs(peer)`` per part; ``local_blocks`` and ``remote_blocks`` are then one
        sequence of block ids per part, and each part moves only its runs of its blocks.

        An empty read completes at once and sends ``notification`` as a standalone
        notification, so the peer can still free its blocks. NIXL faults do not raise: the
        transfer comes back FAILED.

        Raises:
            InvalidArgumentError: unknown peer, lengths differ, bad timeout or notification.
            InvalidBlockIdError: a block id outside ``[0, num_blocks)`` of its side, or a
                local block id twice (LAY-012).
            EndpointClosedError: after close.
        """
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
            0 <= timeout < float("inf")
        ):
            raise InvalidArgumentError(
                f"timeout must be a finite number of seconds >= 0, got {timeout!r}",
                clause="ERR-007",
            )
        if not isinstance(notification, (bytes, bytearray)):
            raise InvalidArgumentError(
                f"notification must be bytes, got {type(notification).__name__}"
            )
        notification = bytes(notification)
        with self._lock:
            self._check_open()
            entry = self._peer(peer)
            parts = self._parts(entry, local_blocks, remote_blocks, runs)
            local = np.concatenate([p[0] for p in parts])
            remote = np.concatenate([p[1] for p in parts])
            if np.unique(local).size != local.size:
                raise InvalidBlockIdError(
                    "a local block id appears twice in one read; each local block is "
                    "written once", clause="LAY-012"
                )
            transfer = NixlTransfer(
                transfer_id=next(self._ids),
                peer=peer,
                local_blocks=tuple(local.tolist()),
                remote_blocks=tuple(remote.tolist()),
                notification=notification,
                deadline=self._clock() + float(timeout),
                nbytes=sum(int(lo.size) * int(sum(entry.lengths[int(r)] for r in rs))
                           for lo, _, rs in parts),
                num_descriptors=sum(int(lo.size) * rs.size for lo, _, rs in parts),
            )
            if local.size == 0:
                if notification and not self._notify(peer, notification):
                    transfer.state, transfer.reason = (
                        TransferState.FAILED, "the standalone notification could not be sent"
                    )
                else:
                    transfer.state = TransferState.DONE
                return transfer
            try:
                handle = self._agent.make_prepped_xfer(
                    "READ",
                    self._local[entry.local_key],
                    np.concatenate([descriptor_indices(lo, entry.per_block,
                                                       self._geometry.num_blocks, rs)
                                    for lo, _, rs in parts]),
                    entry.remote_handle,
                    np.concatenate([descriptor_indices(re, entry.per_block,
                                                       entry.info.geometry.num_blocks, rs)
                                    for _, re, rs in parts]),
                    notification,
                    backends=self._backends,
                )
            except Exception as e:
                transfer.state = TransferState.FAILED
                transfer.reason = f"NIXL could not create the transfer: {_nixl_message(e)}"
                return transfer
            self._handles[transfer.transfer_id] = (transfer, handle)
            try:
                status = self._agent.transfer(handle)
            except Exception as e:
                self._fail(transfer, handle, f"NIXL could not post: {_nixl_message(e)}")
                return transfer
            self._settle(transfer, handle, status)
            return transfer

    def _parts(self, entry: _Peer, local_blocks: Any, remote_blocks: Any,
               runs: Sequence[Sequence[int]] | None
               ) -> list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64],
                               npt.NDArray[np.int64]]]:
        """``(local ids, remote ids, run indices)`` of each part of a read, checked."""
        if runs is None:
            pairs = [(local_blocks, remote_blocks, np.arange(entry.per_block, dtype=np.int64))]
        else:
            if not isinstance(runs, (list, tuple)) or not runs or not all(
                    isinstance(r, (list, tuple)) and r and set(map(type, r)) <= {int}
                    and min(r) >= 0 and max(r) < entry.per_block and len(set(r)) == len(r)
                    for r in runs):
                raise InvalidArgumentError(
                    f"runs must be non-empty tuples of distinct run indices in "
                    f"[0, {entry.per_block}), got {runs!r:.120}")
            if not isinstance(local_blocks, (list, tuple)) or not isinstance(
                    remote_blocks, (list, tuple)) or not len(local_blocks) == len(
                    remote_blocks) == len(runs) or not all(
                    isinstance(b, (list, tuple, np.ndarray)) for b in (*local_blocks,
                                                                        *remote_blocks)):
                raise InvalidArgumentError(
                    f"with {len(runs)} run sets, local and remote blocks must be "
                    f"{len(runs)} sequences each")
            pairs = [(lo, re, np.asarray(r, dtype=np.int64))
                     for lo, re, r in zip(local_blocks, remote_blocks, runs)]
        out = []
        for lo, re, rs in pairs:
            local = self._geometry.block_ids(lo, "local")
            remote = entry.info.geometry.block_ids(re, f"peer {entry.info.agent_name!r}")
            if local.size != remote.size:
                raise InvalidArgumentError(
                    f"got {local.size} local and {remote.size} remote block ids; a read "
                    f"pairs them one to one"
                )
            out.append((local, remote, rs))
        return out

    def pair_runs(self, peer: str) -> BlockRuns:
        """The local byte runs of block 0 that a read from ``peer`` moves, in descriptor
        pair order (``runs`` of ``start_read`` index them).

        Raises:
            InvalidArgumentError: unknown peer.
        """
        with self._lock:
            return self._peer(peer).local_key

    def poll(self, transfer: NixlTransfer) -> TransferState:
        """Update and return ``transfer``'s state without blocking. A transfer still in
        progress at its deadline is cancelled and FAILED with ``timed_out`` (ERR-007). A
        finished transfer's handle is released at once.

        Raises:
            InvalidArgumentError: ``transfer`` was not started by this endpoint.
        """
        if not isinstance(transfer, NixlTransfer):
            raise InvalidArgumentError(
                f"poll needs a NixlTransfer, got {type(transfer).__name__}"
            )
        with self._lock:
            self._retry_unreleased()
            if transfer.finished:
                return transfer.state
            entry = self._handles.get(transfer.transfer_id)
            if entry is None or entry[0] is not transfer:
                raise InvalidArgumentError(
                    f"transfer {transfer.transfer_id} was not started by endpoint {self.name!r}"
                )
            handle = entry[1]
            try:
                status = self._agent.check_xfer_state(handle)
            except Exception as e:
                self._fail(transfer, handle, f"NIXL reported: {_nixl_message(e)}")
                return transfer.state
            self._settle(transfer, handle, status)
            return transfer.state

    def poll_all(self) -> list[NixlTransfer]:
        """Poll every transfer in flight; return those that finished by this call."""
        with self._lock:
            in_flight = [t for t, _ in self._handles.values()]
            return [t for t in in_flight if self.poll(t) is not TransferState.IN_PROGRESS]

    def wait(self, transfer: NixlTransfer, *, interval: float = 0.0005) -> TransferState:
        """Poll ``transfer`` until it finishes; it always does, at the latest at its
        deadline (as long as the endpoint's clock advances)."""
        while self.poll(transfer) is TransferState.IN_PROGRESS:
            time.sleep(interval)
        return transfer.state

    def in_flight(self) -> tuple[NixlTransfer, ...]:
        """The transfers started and not yet finished."""
        with self._lock:
            return tuple(t for t, _ in self._handles.values())

    # ------------------------------------------------------------------ notifications

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sender agent name."""
        return self.take_notifications()[0]

    def take_notifications(
        self, ignore: Collection[str] = ()
    ) -> tuple[dict[str, list[bytes]], dict[str, int]]:
        """Notifications received since the last call, by sender agent name, and how many
        each agent in ``ignore`` sent (not copied out: a flooding peer costs a count)."""
        with self._lock:
            self._check_open()
            got = self._agent.get_new_notifs()
            stash = getattr(self._agent, "notifs", None)  # what ``progress`` took in
            if stash:
                self._agent.notifs = {}
                got = {k: [*stash.get(k, ()), *got.get(k, ())] for k in {*stash, *got}}
        out: dict[str, list[bytes]] = {}
        ignored: dict[str, int] = {}
        for k, v in got.items():
            name = k.decode() if isinstance(k, bytes) else str(k)
            if name in ignore:
                ignored[name] = ignored.get(name, 0) + len(v)
            elif isinstance(v, list) and (not v or type(v[0]) is bytes):
                out[name] = v  # NIXL's own list of bytes: no per-message copy
            else:
                out[name] = [bytes(m) for m in v]
        return out, ignored

    def progress(self) -> None:
        """Let NIXL make progress on this agent's pending sends and receives (connection
        set-up, a notification still queued). Notifications it receives meanwhile wait in
        the agent for the next ``take_notifications``. Nothing once closed."""
        with self._lock:
            if not self._closed:
                self._agent.update_notifs()

    def send_notification(self, peer: str, message: bytes) -> bool:
        """Send a standalone notification to ``peer`` (for example "free these blocks,
        the read failed"). Returns False when NIXL could not send it (peer gone).

        Raises:
            InvalidArgumentError: unknown peer or a message that is not non-empty bytes.
        """
        if not isinstance(message, (bytes, bytearray)) or not message:
            raise InvalidArgumentError("a notification must be non-empty bytes")
        with self._lock:
            self._check_open()
            self._peer(peer)
            return self._notify(peer, bytes(message))

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Cancel every transfer in flight (FAILED), release every prepared list, forget
        every peer and deregister the memory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for transfer, handle in list(self._handles.values()):
                self._fail(transfer, handle, "the endpoint was closed")
            for peer in list(self._peers):
                entry = self._peers.pop(peer)
                self._release_quietly(entry.remote_handle)
                self._remove_agent(peer)
            for key in list(self._local):
                self._release_quietly(self._local.pop(key))
            self._retry_unreleased()
            if self._reg is not None:
                try:
                    self._agent.deregister_memory(self._reg, backends=self._backends)
                except Exception as e:  # nothing left to retry with: say so
                    _log.warning("NIXL could not deregister the memory of agent %r: %s",
                                 self.name, _nixl_message(e))
                self._reg = None
            self._agent = None  # destroys the agent (and its connections) once unreferenced

    def __enter__(self) -> NixlEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"NixlEndpoint({self.name!r}, {self._mem_type}, {self._nbytes} bytes, "
                f"peers={list(self._peers)}, closed={self._closed})")

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise EndpointClosedError(f"NIXL endpoint {self.name!r} is closed")

    def _peer(self, peer: str) -> _Peer:
        entry = self._peers.get(peer) if isinstance(peer, str) else None
        if entry is None:
            raise InvalidArgumentError(
                f"unknown peer {peer!r}; peers added: {sorted(self._peers)}"
            )
        return entry

    def _local_handle(self, key: BlockRuns) -> Any:
        handle = self._local.get(key)
        if handle is None:
            rows = self._geometry.descriptor_rows(self._base, self._device_id, key)
            try:
                handle = self._agent.prep_xfer_dlist(
                    _LOCAL, rows, self._mem_type, backends=self._backends
                )
            except Exception as e:
                raise NixlError(
                    f"NIXL could not prepare {rows.shape[0]} local descriptors: "
                    f"{_nixl_message(e)}"
                ) from e
            self._local[key] = handle
        return handle

    def _drop_unused_local(self, key: BlockRuns) -> None:
        if key == getattr(self, "_default", key) or any(
            p.local_key == key for p in self._peers.values()
        ):
            return
        handle = self._local.pop(key, None)
        if handle is not None:
            self._release_quietly(handle)

    def _settle(self, transfer: NixlTransfer, handle: Any, status: str) -> None:
        if status == "DONE":
            transfer.state = TransferState.DONE
            if self._telemetry:
                try:
                    transfer.posted_descriptors = int(
                        self._agent.get_xfer_telemetry(handle).descCount
                    )
                except Exception:
                    pass
            self._handles.pop(transfer.transfer_id, None)
            self._release_xfer(handle)
        elif status == "PROC":
            if self._clock() >= transfer.deadline:
                transfer.timed_out = True
                self._fail(transfer, handle, "the transfer did not finish before its deadline")
        else:
            self._fail(transfer, handle, f"NIXL reported the transfer as {status!r}")

    def _fail(self, transfer: NixlTransfer, handle: Any, reason: str) -> None:
        transfer.state = TransferState.FAILED
        transfer.reason = reason
        self._handles.pop(transfer.transfer_id, None)
        self._release_xfer(handle)

    def _release_xfer(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            # NIXL could not cancel it yet; the handle stays alive and is retried.
            self._unreleased.append(handle)

    def _retry_unreleased(self) -> None:
        pending, self._unreleased = self._unreleased, []
        for handle in pending:
            self._release_xfer(handle)

    def _release_quietly(self, handle: Any) -> None:
        try:
            self._agent.release_dlist_handle(handle)
        except Exception:
            pass

    def _remove_agent(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception:
            pass

    def _notify(self, peer: str, message: bytes) -> bool:
        try:
            self._agent.send_notif(peer, message)
        except Exception:
            return False
        return True
