"""Typed Protocols and value types of the KV-connector contract.

This package is the spec in code: the role Protocols (``SchedulerConnector``,
``WorkerConnector``, ``ExecutorConnector``, ``ConnectorFactory``), the
read-only engine views connectors receive, the connector output and events, the KV-cache
layout descriptor and its negotiation, capabilities, dummy-run and graph semantics, the
request state machine, the standard aggregator, and the error hierarchy. Docstrings cite
the clause IDs of docs/spec/. It imports nothing else of kvspec.
"""

from __future__ import annotations

from ._version import SPEC_VERSION
from .errors import (
    CapabilityError,
    CompatibilityError,
    ContractViolation,
    DoubleReportError,
    HarnessError,
    InvalidArgumentError,
    InvalidBlockIdError,
    KVSpecError,
    LayoutError,
    LayoutMismatchError,
    LayoutNegotiationError,
    MalformedMetadataError,
    MetadataNotBoundError,
    ReportError,
    TransferTimeoutError,
    UnknownRequestError,
    UnsupportedOperationError,
)
from .views import (
    AllocatedBlocks,
    CachedRequestView,
    EngineConfigView,
    ForwardContextView,
    ForwardKind,
    NewRequestView,
    RequestStatus,
    RequestView,
    SchedulerOutputView,
    TransferRole,
    freeze_params,
    thaw_params,
)
from .capabilities import (
    Capabilities,
    FailureReporting,
    HookGraphMode,
)
from .faults import FAULTS_KEY, FaultPlan
from .groups import NULL_BLOCK_ID, GroupKind, KVCacheGroup, StateCaching, check_groups
from .layout import (
    ConvLayout,
    KVCacheLayout,
    KVPacking,
    StateComponent,
    StateLayout,
    StrideOrder,
)
from .negotiation import (
    LayoutOffer,
    ResolvedLayout,
    negotiate_layout,
)
from .blockrefs import BlockReferences
from .events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    ConnectorStats,
    Direction,
    EMPTY_OUTPUT,
    KVCacheEvent,
    KVConnectorOutput,
    SupportsAggregate,
    WIRE_VERSION,
    WorkerMetadata,
)
from .metadata import (
    ConnectorMetadata,
    decode_json_envelope,
    HandshakeMetadata,
    MetadataSlot,
)
from .forward import (
    ForwardPlan,
    GraphMode,
    GraphModeDecision,
    HookPlacement,
    MetadataBinding,
    plan_forward,
    resolve_graph_mode,
)
from .lifecycle import (
    REQUEST_TRANSITIONS,
    TERMINAL_STATES,
    check_transition,
)
from .aggregation import (
    StandardAggregator,
)
from .scheduler import (
    SchedulerConnector,
)
from .worker import (
    WorkerConnector,
)
from .executor import (
    ExecutorConnector,
)
from .connector import (
    ConnectorFactory,
)
from .wire import (
    Envelope,
    parse_decimal,
    resolve_type_path,
    type_path,
)
from ._loading import (
    factory_spec,
    load_factory,
)

__all__ = [
    "SPEC_VERSION",
    "AllBlocksCleared",
    "AllocatedBlocks",
    "BlockHash",
    "BlockReferences",
    "BlockRemoved",
    "BlockStored",
    "CachedRequestView",
    "Capabilities",
    "CapabilityError",
    "CompatibilityError",
    "ConnectorFactory",
    "ConnectorMetadata",
    "ConnectorStats",
    "ContractViolation",
    "ConvLayout",
    "Direction",
    "DoubleReportError",
    "HarnessError",
    "EMPTY_OUTPUT",
    "EngineConfigView",
    "Envelope",
    "ExecutorConnector",
    "FAULTS_KEY",
    "FailureReporting",
    "FaultPlan",
    "ForwardContextView",
    "ForwardKind",
    "ForwardPlan",
    "GraphMode",
    "GraphModeDecision",
    "GroupKind",
    "HandshakeMetadata",
    "HookGraphMode",
    "HookPlacement",
    "InvalidArgumentError",
    "InvalidBlockIdError",
    "KVCacheEvent",
    "KVCacheGroup",
    "KVCacheLayout",
    "KVConnectorOutput",
    "KVPacking",
    "KVSpecError",
    "LayoutError",
    "LayoutMismatchError",
    "LayoutNegotiationError",
    "LayoutOffer",
    "MalformedMetadataError",
    "MetadataBinding",
    "MetadataNotBoundError",
    "NULL_BLOCK_ID",
    "MetadataSlot",
    "NewRequestView",
    "REQUEST_TRANSITIONS",
    "ReportError",
    "RequestStatus",
    "RequestView",
    "ResolvedLayout",
    "SchedulerConnector",
    "SchedulerOutputView",
    "StandardAggregator",
    "StateCaching",
    "StateComponent",
    "StateLayout",
    "StrideOrder",
    "SupportsAggregate",
    "TERMINAL_STATES",
    "TransferRole",
    "TransferTimeoutError",
    "UnknownRequestError",
    "UnsupportedOperationError",
    "WIRE_VERSION",
    "WorkerConnector",
    "WorkerMetadata",
    "check_groups",
    "check_transition",
    "decode_json_envelope",
    "factory_spec",
    "freeze_params",
    "thaw_params",
    "load_factory",
    "negotiate_layout",
    "parse_decimal",
    "plan_forward",
    "resolve_graph_mode",
    "resolve_type_path",
    "type_path",
]
