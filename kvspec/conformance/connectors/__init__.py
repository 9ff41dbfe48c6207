"""Example connectors: a null connector, a shared-storage connector and broken variants.

* :class:`NullConnector` (``kvspec.conformance.connectors:NullConnector``) moves nothing
  and conforms: the baseline.
* :class:`SharedStorageConnector` (``kvspec.conformance.connectors:SharedStorageConnector``)
  saves finished requests' blocks to files in a shared directory and loads them
  asynchronously: async loads, delayed free, failed loads as invalid blocks.
* :data:`BROKEN_CONNECTORS` lists variants of the shared-storage connector that each break
  exactly one clause, with that clause, so the conformance suite can prove it catches them.
"""

from __future__ import annotations

from .broken import (
    BROKEN_CONNECTORS,
    AsyncZeroConnector,
    BrokenConnector,
    CorruptLoadConnector,
    DoubleReportConnector,
    DropsAbortedRecvConnector,
    FullPromptHitConnector,
    ImpureMatchConnector,
    NoSaltConnector,
    NoSendReportConnector,
    ReadAfterFreeConnector,
    UnknownReportConnector,
)
from .null import NullConnector, NullMetadata, NullScheduler, NullWorker
from .shared_storage import (
    HANDOFF_PARAM,
    LoadJob,
    SaveJob,
    SharedStorageConnector,
    SharedStorageMetadata,
    SharedStorageScheduler,
    SharedStorageWorker,
    StorageSettings,
    block_path,
    marker_path,
)

__all__ = [
    "AsyncZeroConnector",
    "BROKEN_CONNECTORS",
    "BrokenConnector",
    "CorruptLoadConnector",
    "DoubleReportConnector",
    "DropsAbortedRecvConnector",
    "FullPromptHitConnector",
    "HANDOFF_PARAM",
    "ImpureMatchConnector",
    "LoadJob",
    "NoSaltConnector",
    "NoSendReportConnector",
    "NullConnector",
    "NullMetadata",
    "NullScheduler",
    "NullWorker",
    "ReadAfterFreeConnector",
    "SaveJob",
    "SharedStorageConnector",
    "SharedStorageMetadata",
    "SharedStorageScheduler",
    "SharedStorageWorker",
    "StorageSettings",
    "UnknownReportConnector",
    "block_path",
    "marker_path",
]
