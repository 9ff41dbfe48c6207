"""The null connector: a conforming connector that moves nothing.

It is the smallest connector that satisfies every clause a connector without transfers can
satisfy: matching answers ``(0, False)`` without side effects (SCH-001, SCH-004), metadata is
built every step and crosses processes as JSON (SCH-011, ERR-005, ERR-006), request ids the
role never saw are rejected (SCH-028), the worker checks its registration against the layout
descriptor (WRK-001, LAY-008) and refuses hooks without bound metadata (DRY-001), and both
roles shut down idempotently (SCH-027, WRK-015). The conformance suite runs it as the
baseline every engine must pass with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import torch
from typing_extensions import Self

from kvspec.protocols import (
    AllocatedBlocks,
    Capabilities,
    ConnectorFactory,
    ConnectorMetadata,
    EngineConfigView,
    ForwardContextView,
    GroupKind,
    InvalidArgumentError,
    KVCacheLayout,
    StateLayout,
    KVConnectorOutput,
    MalformedMetadataError,
    MetadataSlot,
    RequestView,
    SchedulerConnector,
    SchedulerOutputView,
    UnknownRequestError,
    WorkerConnector,
)

from ._checks import check_count, check_request

__all__ = ["NullConnector", "NullMetadata", "NullScheduler", "NullWorker"]


class NullMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The null connector's step metadata: describes no transfer.

    Encodes to the JSON object ``{}``; ``decode`` accepts nothing else (ERR-005).
    """

    def encode(self) -> bytes:
        """Return ``b"{}"``: an empty JSON object (ERR-006)."""
        return msgspec.json.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> Self:
        """Rebuild the metadata from ``encode``'s bytes.

        Raises:
            MalformedMetadataError: ``data`` is not bytes holding the empty JSON object.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MalformedMetadataError(
                f"null metadata must be bytes, got {type(data).__name__}", clause="ERR-005"
            )
        try:
            return msgspec.json.decode(data, type=cls)
        except (msgspec.MsgspecError, ValueError) as e:  # ValueError: a key not UTF-8
            raise MalformedMetadataError(
                f"null metadata must be the empty JSON object {{}}: {e}", clause="ERR-005"
            ) from None


class NullScheduler(SchedulerConnector):
    """Scheduler role of the null connector: never matches, never delays a free.

    It remembers the ids of live requests (from ``on_new_request`` or the first
    ``get_num_new_matched_tokens``) only to reject ids it never saw (SCH-028); a request is
    forgotten at ``request_finished``.
    """

    def __init__(self, config: EngineConfigView) -> None:
        if not isinstance(config, EngineConfigView):
            raise InvalidArgumentError(
                f"config must be an EngineConfigView, got {type(config).__name__}",
                clause="ERR-002",
            )
        self._config = config
        self._known: set[str] = set()

    def on_new_request(self, request: RequestView) -> None:
        """Remember the request's id."""
        self._known.add(check_request(request).request_id)

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Return ``(0, False)``: nothing can be loaded (SCH-001, SCH-004)."""
        check_request(request)
        check_count("num_computed_tokens", num_computed_tokens)
        # Idempotent: the engine calls on_new_request first, so this adds nothing another
        # hook could tell apart; it only keeps engines that skip on_new_request working.
        self._known.add(request.request_id)
        return 0, False

    def update_state_after_alloc(
        self, request: RequestView, blocks: AllocatedBlocks, num_external_tokens: int
    ) -> None:
        """Check the arguments; nothing is ever loaded.

        Raises:
            UnknownRequestError: the request was never seen (SCH-028).
            InvalidArgumentError: ``num_external_tokens`` is not 0, which this connector
                never matched (SCH-004).
        """
        check_request(request)
        if request.request_id not in self._known:
            raise UnknownRequestError(
                f"update_state_after_alloc for request {request.request_id!r}, which this "
                "connector never saw; expected a request added with on_new_request or asked "
                "with get_num_new_matched_tokens",
                request_id=request.request_id,
                clause="SCH-028",
            )
        if check_count("num_external_tokens", num_external_tokens) != 0:
            raise InvalidArgumentError(
                f"num_external_tokens is {num_external_tokens} for request "
                f"{request.request_id!r}, but the null connector matched 0 tokens",
                clause="SCH-004",
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ConnectorMetadata:
        """Return empty metadata; called every step (SCH-011)."""
        if not isinstance(scheduler_output, SchedulerOutputView):
            raise InvalidArgumentError(
                f"scheduler_output must be a SchedulerOutputView, got "
                f"{type(scheduler_output).__name__}",
                clause="ERR-002",
            )
        return NullMetadata()

    def request_finished(
        self, request: RequestView, block_ids: tuple[int, ...]
    ) -> tuple[bool, Mapping[str, Any] | None]:
        """Forget the request and return ``(False, None)``: its blocks are freed at once.

        Raises:
            UnknownRequestError: the request was never seen or already finished (SCH-028).
        """
        check_request(request)
        if request.request_id not in self._known:
            raise UnknownRequestError(
                f"request_finished for request {request.request_id!r}, which this connector "
                "never saw or already finished; expected exactly one call per request "
                "(SCH-015)",
                request_id=request.request_id,
                clause="SCH-028",
            )
        self._known.discard(request.request_id)
        return False, None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Accept an output that reports no transfer.

        Raises:
            UnknownRequestError: the output reports a finished transfer; the null connector
                never starts one (SCH-028).
        """
        if not isinstance(output, KVConnectorOutput):
            raise InvalidArgumentError(
                f"output must be a KVConnectorOutput, got {type(output).__name__}",
                clause="ERR-002",
            )
        reported = sorted(output.finished_sending | output.finished_recving)
        if reported:
            raise UnknownRequestError(
                f"the output reports finished transfers for {reported}, but the null "
                "connector never starts a transfer",
                request_id=reported[0],
                clause="SCH-028",
            )

    def shutdown(self) -> None:
        """Forget every request; idempotent (SCH-027)."""
        self._known.clear()


class NullWorker(WorkerConnector):
    """Worker role of the null connector: checks what it is given and moves nothing."""

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        if not isinstance(config, EngineConfigView):
            raise InvalidArgumentError(
                f"config must be an EngineConfigView, got {type(config).__name__}",
                clause="ERR-002",
            )
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < config.world_size:
            raise InvalidArgumentError(
                f"rank must be an int in [0, {config.world_size}), got {rank!r}",
                clause="ERR-002",
            )
        self._rank = rank
        self._slot: MetadataSlot[NullMetadata] = MetadataSlot(NullMetadata)
        self._layout: KVCacheLayout | None = None

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout
    ) -> None:
        """Check the tensors against the descriptor and keep nothing else (WRK-001, LAY-008).

        Raises:
            InvalidArgumentError: called a second time (WRK-001), or arguments of the wrong type.
            LayoutMismatchError: a tensor does not match ``layout`` (LAY-008).
        """
        if self._layout is not None:
            raise InvalidArgumentError(
                "register_kv_caches called twice; expected exactly one registration per worker",
                clause="WRK-001",
            )
        if not isinstance(layout, KVCacheLayout):
            raise InvalidArgumentError(
                f"layout must be a KVCacheLayout, got {type(layout).__name__}", clause="LAY-007"
            )
        if not isinstance(kv_caches, Mapping):
            raise InvalidArgumentError(
                f"kv_caches must map layer names to tensors, got {type(kv_caches).__name__}",
                clause="WRK-001",
            )
        layout.check_layer_tensors(list(kv_caches.values()))
        self._layout = layout

    def register_state_caches(
        self, state_caches: Mapping[str, torch.Tensor], layouts: Mapping[int, StateLayout]
    ) -> None:
        """Check every state tensor against its group's layout and keep nothing (STG-001,
        LAY-008).

        Raises:
            LayoutMismatchError: a tensor does not match its layout (LAY-008).
        """
        for layout in layouts.values():
            for tensor in state_caches.values():
                layout.check_tensor(tensor)

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        """Bind the step's metadata (WRK-003).

        Raises:
            InvalidArgumentError: ``metadata`` is not ``NullMetadata``.
        """
        self._slot.bind(metadata)  # type: ignore[arg-type]  # the slot checks the type

    def clear_connector_metadata(self) -> None:
        """Forget the bound metadata (WRK-003)."""
        self._slot.clear()

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        """Load nothing.

        Raises:
            MetadataNotBoundError: no metadata is bound (DRY-001).
        """
        self._slot.get("start_load_kv")

    def wait_for_save(self) -> None:
        """Return at once: nothing is ever saved (WRK-007)."""
        return None

    def shutdown(self) -> None:
        """Release nothing but the references it holds; idempotent (WRK-015)."""
        self._slot.clear()
        self._layout = None


class NullConnector(ConnectorFactory):
    """Factory of the null connector (``kvspec.conformance.connectors:NullConnector``).

    Declares the default capabilities: no async loads, no delayed free, no per-layer hooks,
    loads that never fail. Holds no state.
    """

    @property
    def name(self) -> str:
        """``"null"``."""
        return "null"

    @property
    def capabilities(self) -> Capabilities:
        """The default ``Capabilities``, and any KV-cache groups (it moves no block of
        any, KVG-002)."""
        return Capabilities(group_kinds=frozenset(GroupKind), kv_cache_groups=4)

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        """Build a ``NullScheduler``."""
        return NullScheduler(config)

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        """Build a ``NullWorker`` for ``rank``."""
        return NullWorker(config, rank)
