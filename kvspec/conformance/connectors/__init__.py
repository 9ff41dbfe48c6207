"""Example connectors to read and copy, and broken variants that test the suite.

* ``TinyCache`` (``kvspec.conformance.connectors.tiny:TinyCache``), read it first: the
  tutorial's tinycache (docs/tutorial.md shows this file), a prefix cache on disk with
  synchronous loads, about 250 lines.
* ``NullConnector`` (``kvspec.conformance.connectors:NullConnector``) moves nothing
  and conforms: the baseline.
* ``SharedStorageConnector`` (``kvspec.conformance.connectors:SharedStorageConnector``)
  saves finished requests' blocks to files in a shared directory and loads them
  asynchronously: async loads, delayed free, failed loads as invalid blocks.
* ``LayerwiseStorageConnector`` stores the same files with capturable per-layer hooks:
  pure device work on persistent buffers, safe to capture in FULL graphs. Both keep their
  blocks in ``storage`` (keys, atomic writes, block files, markers, settings).
* ``BROKEN_GRAPH_CONNECTORS`` lists three graph-unsafe variants of it.
* ``BROKEN_CONNECTORS`` lists variants of the shared-storage connector that each break
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
from .broken_graphs import (
    BROKEN_GRAPH_CONNECTORS,
    AssertsRealMetadataConnector,
    BrokenGraphConnector,
    ItemInHookConnector,
    PythonDecidesConnector,
)
from .layerwise import (
    DEFAULT_MAX_BLOCKS_PER_STEP,
    LayerwiseMetadata,
    LayerwiseStorageConnector,
    LayerwiseStorageScheduler,
    LayerwiseStorageWorker,
)
from .null import NullConnector, NullMetadata, NullScheduler, NullWorker
from .layerwise import LayerwiseSettings
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
from .tiny import TinyCache, TinyCacheMetadata, TinyCacheScheduler, TinyCacheWorker

__all__ = [
    "TinyCache",
    "TinyCacheMetadata",
    "TinyCacheScheduler",
    "TinyCacheWorker",
    "BROKEN_CONNECTORS",
    "BROKEN_GRAPH_CONNECTORS",
    "DEFAULT_MAX_BLOCKS_PER_STEP",
    "HANDOFF_PARAM",
    "AssertsRealMetadataConnector",
    "AsyncZeroConnector",
    "BrokenConnector",
    "BrokenGraphConnector",
    "CorruptLoadConnector",
    "DoubleReportConnector",
    "DropsAbortedRecvConnector",
    "FullPromptHitConnector",
    "ImpureMatchConnector",
    "ItemInHookConnector",
    "LayerwiseMetadata",
    "LayerwiseSettings",
    "LayerwiseStorageConnector",
    "LayerwiseStorageScheduler",
    "LayerwiseStorageWorker",
    "LoadJob",
    "NoSaltConnector",
    "NoSendReportConnector",
    "NullConnector",
    "NullMetadata",
    "NullScheduler",
    "NullWorker",
    "PythonDecidesConnector",
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
