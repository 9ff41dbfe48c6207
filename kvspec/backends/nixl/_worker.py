"""The worker role of the NIXL backend: one NIXL agent per rank, READs and notifications.

``register_kv_caches`` registers the rank's KV buffer once with a :class:`NixlEndpoint`
(descriptors prepared once, one per block for block-outermost layouts, LAY-013); its
:class:`PeerInfo` travels as the rank's handshake metadata (HSK-001, HSK-002).

* Consumer: the first load from a producer engine adds the producer rank of the same
  index as a peer (its NIXL agent metadata, compatibility checked, HSK-003); each load is
  one prepared READ started in ``start_load_kv`` (WRK-004) and polled by ``get_finished``.
  A READ that fails or passes ``transfer_timeout_s`` is reported in ``finished_recving`` and
  ``failed_recving`` with all of its blocks invalid (WRK-011, ERR-007).
* Producer: each handed-off request is reported in ``finished_sending`` once this rank got
  the consumer's notification (NIXL delivers it when the READ completed), or at
  ``free_timeout_s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch

from kvspec.protocols import (
    SPEC_VERSION,
    CompatibilityError,
    ConnectorMetadata,
    ConnectorStats,
    EngineConfigView,
    ForwardContextView,
    HandshakeMetadata,
    InvalidArgumentError,
    KVCacheLayout,
    KVSpecError,
    MetadataSlot,
    SupportsAggregate,
    TransferRole,
    WorkerConnector,
)

from ._descriptors import PeerInfo
from ._scheduler import NixlLoad, NixlMetadata, NixlSettings
from ._transport import NixlEndpoint, NixlTransfer, TransferState

__all__ = ["NixlWorker"]

_log = logging.getLogger(__name__)


class NixlWorker(WorkerConnector):
    """Worker role of the NIXL backend (one per rank). See the module docstring.

    Raises:
        InvalidArgumentError: a bad rank or configuration (ERR-002).
    """

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        self._settings = NixlSettings.from_config(config)
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
        self._peer_names: dict[str, str] = {}  # producer engine -> loaded agent name
        self._reads: dict[str, NixlTransfer] = {}
        self._failed_early: dict[str, tuple[int, ...]] = {}  # loads that never started
        self._sends: dict[str, float] = {}  # producer: request -> free deadline
        self._failed: frozenset[str] = frozenset()
        self._invalid: frozenset[int] = frozenset()
        self._counters: dict[str, int] = {}
        self._closed = False

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
        if self.endpoint is not None or self._closed:
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
        # A consumer only reads: polling drives its transfers, and NIXL's progress thread,
        # which busy-polls a core, is needed only by ranks whose memory others read.
        self.endpoint = NixlEndpoint(
            f"{self._config.engine_id}-rank{self._rank}", tensors[0], layout,
            spec_version=SPEC_VERSION,
            progress_thread=self._config.role is not TransferRole.CONSUMER,
        )

    def get_handshake_metadata(self) -> HandshakeMetadata | None:
        """The rank's :class:`PeerInfo` (NIXL agent metadata, region, block geometry) as
        plain data (HSK-001, HSK-002); None before registration."""
        endpoint = self.endpoint
        if endpoint is None:
            return None
        info = endpoint.info
        return HandshakeMetadata(
            engine_id=self._config.engine_id, rank=self._rank, spec_version=SPEC_VERSION,
            layout={"order": info.layout.order, "packing": info.layout.packing,
                    "dtype": info.layout.dtype, "block_size": info.layout.block_size},
            payload={"peer": info.to_json()},
        )

    # -- metadata -----------------------------------------------------------------------

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        """Bind the step's metadata (WRK-003).

        Raises:
            InvalidArgumentError: ``metadata`` is not :class:`NixlMetadata`.
        """
        self._slot.bind(metadata)  # type: ignore[arg-type]  # the slot checks the type
        self._started = False

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

    def _peer(self, engine_id: str) -> str:
        """The agent name of ``engine_id``'s rank paired with this one, added once."""
        name = self._peer_names.get(engine_id)
        if name is not None:
            return name
        endpoint = self.endpoint
        ranks = self._peer_infos.get(engine_id)
        if endpoint is None or ranks is None:
            raise InvalidArgumentError(
                f"a load from engine {engine_id!r} before its peer information or before "
                "register_kv_caches", clause="HSK-002",
            )
        if self._rank not in ranks or len(ranks) != self._config.world_size:
            raise CompatibilityError(
                f"producer engine {engine_id!r} runs {len(ranks)} rank(s), this engine "
                f"{self._config.world_size}: this backend pairs ranks one to one",
                clause="HSK-003",
            )
        name = endpoint.add_peer(PeerInfo.from_json(ranks[self._rank]))
        self._peer_names[engine_id] = name
        return name

    def _start(self, meta: NixlMetadata) -> None:
        self._started = True
        self._peer_infos.update(meta.peers)
        now = time.monotonic()
        for rid in meta.sends:
            self._sends[rid] = now + self._settings.free_timeout_s
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

    def _read(self, endpoint: NixlEndpoint, load: NixlLoad) -> None:
        try:
            peer = self._peer(load.engine_id)
        except CompatibilityError:
            raise  # a misconfigured pair: fail loudly (HSK-003)
        except KVSpecError as e:  # the producer is unreachable (dead, or its agent gone)
            _log.warning("rank %d: cannot reach engine %s for %s: %s", self._rank,
                         load.engine_id, load.request_id, e)
            if load.local_blocks:
                self._failed_early[load.request_id] = load.local_blocks
            return
        note = load.notification.encode()
        if not load.local_blocks:  # nothing to read: only free the producer's blocks
            endpoint.send_notification(peer, note)
            return
        if load.request_id in self._reads:
            raise InvalidArgumentError(
                f"request {load.request_id!r} already has a READ in flight", clause="SCH-013"
            )
        try:
            transfer = endpoint.start_read(
                peer, load.local_blocks, load.remote_blocks,
                timeout=self._settings.transfer_timeout_s, notification=note,
            )
        except CompatibilityError:
            raise
        except KVSpecError as e:  # e.g. a block id outside the producer's budget
            _log.warning("rank %d: READ of %s not started: %s", self._rank,
                         load.request_id, e)
            self._failed_early[load.request_id] = load.local_blocks
            return
        self._reads[load.request_id] = transfer

    def wait_for_save(self) -> None:
        """Return at once: the producer's blocks are read by the consumer, held by a
        delayed free until then (SCH-016, WRK-007)."""
        self._slot.get("wait_for_save")

    # -- completion ---------------------------------------------------------------------

    def get_finished(
        self, finished_req_ids: frozenset[str]
    ) -> tuple[frozenset[str], frozenset[str]]:
        """Producer: hand-offs whose READ this rank was notified of, or whose
        ``free_timeout_s`` passed (sending). Consumer: READs that finished, failed or timed
        out (recving; failures also in ``failed_recving``). Each once (WRK-009, WRK-010)."""
        endpoint = self.endpoint
        sending: set[str] = set()
        recving: set[str] = set(self._failed_early)
        failed: set[str] = set(self._failed_early)
        invalid: set[int] = {b for blocks in self._failed_early.values() for b in blocks}
        self._failed_early.clear()
        if endpoint is not None and not endpoint.closed:
            for messages in endpoint.notifications().values():
                for message in messages:
                    rid = message.decode(errors="replace")
                    if self._sends.pop(rid, None) is not None:
                        sending.add(rid)
            for rid, transfer in list(self._reads.items()):
                state = endpoint.poll(transfer)
                if state is TransferState.IN_PROGRESS:
                    continue
                del self._reads[rid]
                recving.add(rid)
                if state is TransferState.FAILED:
                    _log.warning("rank %d: READ of %s failed: %s", self._rank, rid,
                                 transfer.reason)
                    failed.add(rid)
                    invalid.update(transfer.local_blocks)
                    self._count(load_failures=len(transfer.local_blocks))
                else:
                    self._count(blocks_loaded=len(transfer.local_blocks),
                                bytes_loaded=transfer.nbytes)
        now = time.monotonic()
        for rid, deadline in list(self._sends.items()):
            if now >= deadline:
                _log.warning("rank %d: no consumer read request %s within %.0f s; freeing",
                             self._rank, rid, self._settings.free_timeout_s)
                del self._sends[rid]
                sending.add(rid)
        self._failed = frozenset(failed)
        self._invalid = frozenset(invalid)
        return frozenset(sending), frozenset(recving)

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
        """``blocks_loaded``, ``bytes_loaded`` and ``load_failures`` since the last call,
        or None (EVT-006)."""
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
        if self.endpoint is not None:
            self.endpoint.close()
        self._reads.clear()
        self._sends.clear()
        self._peer_names.clear()
        self._slot.clear()
