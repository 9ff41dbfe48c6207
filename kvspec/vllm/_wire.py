"""The objects the adapter hands vLLM, which vLLM moves between its processes.

vLLM ships connector metadata, handshake metadata, stats and worker metadata from one
process to another as Python objects (pickled by vLLM when its engine runs in several
processes). So that nothing of the connector's own crosses that way, each wrapper here holds
only plain data: the kvspec metadata's own encoding (ERR-006), the handshake's JSON, the
stats' counters. The kvspec objects are rebuilt on the other side with the connector's own
decoders, which validate what they read (ERR-005).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared as VllmAllBlocksCleared
from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.distributed.kv_events import KVCacheEvent as VllmKVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvspec.protocols import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ConnectorMetadata,
    ConnectorStats,
    Envelope,
    KVCacheEvent,
    MalformedMetadataError,
    SupportsAggregate,
    resolve_type_path,
)

__all__ = [
    "HandshakeWire",
    "StatsWire",
    "StepWire",
    "WorkerMetaWire",
    "metadata_type",
    "to_vllm_events",
]


class StepWire(KVConnectorMetadata):  # type: ignore[misc]
    """One step's metadata as vLLM carries it to the workers.

    Attributes:
        envelope: The kvspec connector's metadata as an ``Envelope``: its class's
            ``"module:QualName"`` (whose ``decode`` rebuilds it) and
            ``ConnectorMetadata.encode()``.
        step_id: The adapter's step counter (the ``ForwardContextView.step_id``).
        num_tokens: Tokens scheduled in the step.
        preempted: Requests preempted in the step (``handle_preemptions``, WRK-012).
    """

    __slots__ = ("envelope", "num_tokens", "preempted", "step_id")

    def __init__(self, payload: bytes, meta_type: str, step_id: int, num_tokens: int,
                 preempted: frozenset[str]) -> None:
        self.envelope = Envelope(meta_type, payload)
        self.step_id = step_id
        self.num_tokens = num_tokens
        self.preempted = preempted

    @property
    def payload(self) -> bytes:
        """``ConnectorMetadata.encode()`` of the kvspec connector's metadata."""
        return self.envelope.data

    @property
    def meta_type(self) -> str:
        """``"module:QualName"`` of the metadata's class."""
        return self.envelope.type_path

    def __reduce__(self) -> tuple[Any, ...]:
        return (StepWire, (self.payload, self.meta_type, self.step_id, self.num_tokens,
                           self.preempted))


_TYPES: dict[str, type[ConnectorMetadata]] = {}


def metadata_type(path: str) -> type[ConnectorMetadata]:
    """The metadata class ``path`` (``"module:QualName"``) names, imported once.

    Raises:
        MalformedMetadataError: the path does not name a class with ``encode``/``decode``.
    """
    cls = _TYPES.get(path)
    if cls is not None:
        return cls
    obj = resolve_type_path(path, what="step metadata type", clause="ERR-005")
    if not isinstance(obj, type) or not callable(getattr(obj, "decode", None)):
        raise MalformedMetadataError(
            f"step metadata names {path!r}, which is not a ConnectorMetadata class",
            clause="ERR-005",
        )
    _TYPES[path] = obj
    return obj


class HandshakeWire(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """A worker's kvspec ``HandshakeMetadata``, as its JSON encoding (HSK-001)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, ...]:
        return (HandshakeWire, (self.data,))


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else 0.0


class StatsWire(KVConnectorStats):  # type: ignore[misc]
    """A worker's stats as vLLM's ``KVConnectorStats``.

    ``data`` holds the counters (plain numbers, what vLLM logs and ships); ``kvspec`` holds
    the connector's own stats object in the process that made it, so the scheduler role
    receives exactly what the workers reported, reduced with the connector's ``aggregate``
    (EVT-006). Rebuilt from ``data`` alone (vLLM's logger process), aggregation sums.
    """

    def __init__(self, data: Mapping[str, Any] | None = None,
                 kvspec: SupportsAggregate | None = None) -> None:
        super().__init__(data=dict(data or {}))
        self.kvspec = kvspec

    @classmethod
    def of(cls, stats: SupportsAggregate | None) -> StatsWire | None:
        """Wrap a worker's stats; None stays None."""
        if stats is None:
            return None
        wire = cls.__new__(cls)  # what __init__ sets, without the dataclass machinery
        wire.data = dict(stats.counters) if isinstance(stats, ConnectorStats) else {}
        wire.kvspec = stats
        return wire

    def reset(self) -> None:
        """Forget every counter."""
        self.data: dict[str, Any] = {}
        self.kvspec = None

    def aggregate(self, other: KVConnectorStats) -> StatsWire:
        """Reduce with another rank's stats: the connector's own ``aggregate`` when both
        carry it, else counters summed."""
        theirs = other.kvspec if isinstance(other, StatsWire) else None
        if self.kvspec is not None and theirs is not None:
            return StatsWire.of(self.kvspec.aggregate(theirs)) or StatsWire()
        data: dict[str, Any] = dict(self.data)
        for key, value in (other.data or {}).items():
            data[key] = _number(data.get(key, 0)) + _number(value)
        return StatsWire(data)

    def reduce(self) -> dict[str, int | float]:
        """The counters, for vLLM's log line."""
        return {k: _number(v) for k, v in self.data.items() if math.isfinite(_number(v))}

    def is_empty(self) -> bool:
        """True when no counter is set."""
        return not self.data and (self.kvspec is None or (
            isinstance(self.kvspec, ConnectorStats) and self.kvspec.is_empty()))


class WorkerMetaWire(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """What the workers tell the scheduler role beyond vLLM's fields: the connector's worker
    metadata (WRK-016), its KV-cache events (EVT-004) and, on vLLM releases whose output
    has no ``failed_recving``, the requests whose load failed (WRK-010), reduced across
    ranks."""

    __slots__ = ("events", "failed_recving", "metadata")

    def __init__(self, metadata: SupportsAggregate | None,
                 events: tuple[KVCacheEvent, ...],
                 failed_recving: frozenset[str] = frozenset()) -> None:
        self.metadata = metadata
        self.events = events
        self.failed_recving = failed_recving

    def aggregate(self, other: KVConnectorWorkerMetadata) -> WorkerMetaWire:
        """Reduce with another rank's: metadata by the connector's ``aggregate``, events
        concatenated in rank order, failed loads united."""
        if not isinstance(other, WorkerMetaWire):
            return self
        if self.metadata is None or other.metadata is None:
            meta = self.metadata if other.metadata is None else other.metadata
        else:
            meta = self.metadata.aggregate(other.metadata)
        return WorkerMetaWire(meta, self.events + other.events,
                              self.failed_recving | other.failed_recving)


def to_vllm_events(events: Iterable[KVCacheEvent]) -> list[VllmKVCacheEvent]:
    """kvspec's KV-cache events as vLLM's, for vLLM's event publisher."""
    out: list[VllmKVCacheEvent] = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(VllmBlockStored(
                block_hashes=list(e.block_hashes), parent_block_hash=e.parent_block_hash,
                token_ids=list(e.token_ids), block_size=e.block_size, lora_id=e.lora_id,
                medium=e.medium, lora_name=None,
            ))
        elif isinstance(e, BlockRemoved):
            out.append(VllmBlockRemoved(block_hashes=list(e.block_hashes), medium=e.medium))
        elif isinstance(e, AllBlocksCleared):
            out.append(VllmAllBlocksCleared())
    return out
