"""Deliberately broken variants of the shared-storage connector, one clause each.

The conformance suite runs them to prove that it catches each violation: every factory here
is the ``SharedStorageConnector`` with one
behaviour changed, names the clause it breaks in its docstring and in its ``violates`` class
attribute, and is listed with that clause in ``BROKEN_CONNECTORS``. Capabilities are the
base connector's: each variant claims to conform and does not. Each subclasses or wraps the
connector's roles; the connector itself has no hooks for them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import pickle
import queue
import struct
import threading
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import msgspec
import torch
from typing_extensions import Self

from kvspec.protocols import (
    AllocatedBlocks,
    Capabilities,
    ConnectorMetadata,
    ConnectorStats,
    EngineConfigView,
    ForwardContextView,
    KVCacheLayout,
    KVConnectorOutput,
    MalformedMetadataError,
    MetadataSlot,
    RequestView,
    SchedulerConnector,
    SchedulerOutputView,
    SupportsAggregate,
    WorkerConnector,
)

from ._transfers import Transfer
from .layerwise import LayerwiseStorageConnector, LayerwiseStorageScheduler, LayerwiseStorageWorker
from .shared_storage import (
    HANDOFF_PARAM,
    LoadJob,
    SaveJob,
    SharedStorageConnector,
    SharedStorageMetadata,
    SharedStorageScheduler,
    SharedStorageWorker,
    _SaveRecord,  # the save records of the scheduler these variants subclass
)
from .state import StateCache, StateCacheMetadata, StateCacheScheduler, StateCacheWorker, state_key
from .tiny import BlockId, Key, TinyCache, TinyCacheMetadata, TinyCacheScheduler, TinyCacheWorker
from .tiny import block_file as tiny_block_file
from .storage import KVBlocks, block_path, stored_events, write_block_file, write_marker

__all__ = [
    "FullPromptStateConnector",
    "LateScrubConnector",
    "LateStateReadConnector",
    "LayerHookStateConnector",
    "LowerBoundaryStateConnector",
    "DraftNeverSavedConnector",
    "OncePerStepSavesConnector",
    "StaleOutputConnector",
    "EarlyReportConnector",
    "RejectedKVStoredConnector",
    "IgnoresResetConnector",
    "AssumesNhdConnector",
    "AssertsCapacityConnector",
    "AsyncZeroConnector",
    "AveragingStatsConnector",
    "BROKEN_CONNECTORS",
    "BrokenConnector",
    "ChunkedAdvertConnector",
    "StaleTensorsConnector",
    "CorruptLoadConnector",
    "CrashingConnector",
    "DoubleReportConnector",
    "DropsAbortedRecvConnector",
    "EagerSavesConnector",
    "ForwardOnlySavesConnector",
    "FullPromptHitConnector",
    "HidesFailedLoadsConnector",
    "ImpureMatchConnector",
    "LeakyDecoderConnector",
    "LateWriterConnector",
    "LeakyJournalConnector",
    "LoadsCutMatchConnector",
    "LoadsOverLocalHitConnector",
    "MutatesParamsConnector",
    "NoSaltConnector",
    "NoSendReportConnector",
    "PickledMetadataConnector",
    "PipelinedLookupConnector",
    "ReadAfterFreeConnector",
    "ReloadsConnector",
    "UncheckedParamsConnector",
    "UnfencedSavesConnector",
    "UnknownReportConnector",
    "UnsyncedWriterConnector",
    "WaitingOutputConnector",
]

GHOST_REQUEST_ID = "ghost-request"
"""The request id ``UnknownReportConnector`` reports without being asked."""

SLOW_LOAD_S = 0.05
"""The least time a ``DropsAbortedRecvConnector`` load takes, in seconds."""


class BrokenConnector(SharedStorageConnector):
    """Base of the broken variants: a shared-storage connector that breaks ``violates``."""

    violates: ClassVar[str] = ""
    """The ID of the one clause the variant breaks."""
    selection: ClassVar[str] = "test_scenario and no-local-cache"
    """The ``-k`` expression of the suite tests that catch it (tests/conformance)."""

    @property
    def name(self) -> str:
        """``"broken-<clause>"``, e.g. ``"broken-sch-005"``."""
        return f"broken-{self.violates.lower()}"


# ------------------------------------------------------------------------------ scheduler


class _FullPromptHitScheduler(LayerwiseStorageScheduler):
    """Matches up to the whole prompt, for a synchronous load (SCH-005)."""

    def _match_limit(self, request: RequestView) -> int:
        # Every prompt block may be matched, leaving nothing to compute when the prompt is a
        # whole number of blocks.
        return request.num_prompt_tokens // self._block_size


class FullPromptHitConnector(LayerwiseStorageConnector):
    """Breaks SCH-005: when every prompt block is stored and the prompt is a whole number of
    blocks, it matches the whole prompt for a synchronous load, leaving no token to compute.
    (An asynchronous load may cover the whole prompt; the engine then computes the last
    token again. The variant is therefore built on the synchronous layerwise connector.)"""

    violates: ClassVar[str] = "SCH-005"
    selection: ClassVar[str] = BrokenConnector.selection
    scheduler_class = _FullPromptHitScheduler

    @property
    def name(self) -> str:
        """``"broken-sch-005"``."""
        return "broken-sch-005"


class _AsyncZeroScheduler(SharedStorageScheduler):
    """Answers every match, misses included, as async (SCH-004)."""

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        count, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return (None, False) if count is None else (count, True)


class AsyncZeroConnector(BrokenConnector):
    """Breaks SCH-004: on a miss it answers ``(0, True)``, an async load of zero tokens."""

    violates = "SCH-004"
    scheduler_class = _AsyncZeroScheduler


class _ImpureMatchScheduler(SharedStorageScheduler):
    """Answers one block fewer when asked again about a request (SCH-001)."""

    def __init__(self, config: EngineConfigView) -> None:
        super().__init__(config)
        self._asked_before: set[str] = set()

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        count, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if count is None:  # deferred (a save in flight): nothing to make impure yet
            return None, False
        if request.request_id in self._asked_before:
            count = max(0, count - self._block_size)
        self._asked_before.add(request.request_id)
        return count, count > 0


class ImpureMatchConnector(BrokenConnector):
    """Breaks SCH-001: asked again about the same request, it answers one block fewer (the
    first answer changes state that later answers observe)."""

    violates = "SCH-001"
    scheduler_class = _ImpureMatchScheduler


class _NoSaltScheduler(SharedStorageScheduler):
    """Keys blocks by their token ids alone (SCH-020)."""

    def _block_keys(self, request: RequestView) -> tuple[str, ...]:
        # A chained sha256 over the token ids alone: salt and LoRA are ignored.
        bs = self._block_size
        tokens = request.all_token_ids
        keys: list[str] = []
        parent = b""
        for i in range(len(tokens) // bs):
            chunk = tokens[i * bs:(i + 1) * bs]
            parent = hashlib.sha256(parent + struct.pack(f"<{bs}q", *chunk)).digest()
            keys.append(parent.hex())
        return tuple(keys)


class NoSaltConnector(BrokenConnector):
    """Breaks SCH-020: keys stored blocks by a chained sha256 of the token ids only, so
    requests that differ in cache salt or LoRA share each other's KV."""

    violates = "SCH-020"
    scheduler_class = _NoSaltScheduler


class _ReadAfterFreeScheduler(SharedStorageScheduler):
    """Frees at once but still saves the blocks (SCH-017)."""

    def __init__(self, config: EngineConfigView) -> None:
        super().__init__(config)
        self._unreported: dict[str, _SaveRecord] = {}  # saves whose free was not delayed

    def request_finished(
        self, request: RequestView, block_ids: tuple[int, ...]
    ) -> tuple[bool, Mapping[str, object] | None]:
        delay, params = super().request_finished(request, block_ids)
        if delay:  # the slip: the save stays planned, the free is not delayed
            rid = request.request_id
            self._pending_saves[-1] = msgspec.structs.replace(self._pending_saves[-1],
                                                              report=False)
            self._unreported[rid] = self._saving.pop(rid)
        return False, params

    def _mark_written(self) -> None:
        # The workers do not report these saves; mark a block stored once every rank's file
        # exists.
        ranks = range(self._config.world_size)
        for rid, record in list(self._unreported.items()):
            if all(
                os.path.exists(block_path(self._dir, key, r)) for key in record.keys for r in ranks
            ):
                del self._unreported[rid]
                self._mark_done(record.keys, record.events)

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        self._mark_written()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        super().update_connector_output(output)
        self._mark_written()


class _ReadAfterFreeWorker(SharedStorageWorker):
    """Writes saves at once, so that the scheduler marks them stored a step later."""

    def _start(self, meta: SharedStorageMetadata) -> None:
        super()._start(meta)
        for save in meta.saves:  # waits for the background thread to write them
            future = self._saves[save.request_id].future
            if future is not None:
                concurrent.futures.wait((future,), timeout=self._settings.io_timeout_s)


class ReadAfterFreeConnector(BrokenConnector):
    """Breaks SCH-017: ``request_finished`` returns False (the engine frees and poisons the
    blocks at once) yet the blocks are still saved, snapshotted in the next step's
    ``start_load_kv``, and marked stored once every rank's file exists.

    To make the violation observable at a fixed step, the files are written on the calling
    thread (not a violation in itself): the blocks count as stored from the step after.
    """

    violates = "SCH-017"
    scheduler_class = _ReadAfterFreeScheduler
    worker_class = _ReadAfterFreeWorker


# --------------------------------------------------------------------------------- worker


class _DoubleReportWorker(SharedStorageWorker):
    """Reports each finished receive twice (WRK-009)."""

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        super().__init__(config, rank)
        self._report_again: set[str] = set()

    def get_finished(
        self, finished_req_ids: frozenset[str]
    ) -> tuple[frozenset[str], frozenset[str]]:
        sending, recving = super().get_finished(finished_req_ids)
        again, self._report_again = self._report_again, set(recving)
        return sending, recving | again


class DoubleReportConnector(BrokenConnector):
    """Breaks WRK-009: reports every finished receive again in the following step."""

    violates = "WRK-009"
    worker_class = _DoubleReportWorker


class _UnknownReportWorker(SharedStorageWorker):
    """Reports a send it never started (WRK-010)."""

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        super().__init__(config, rank)
        self._ghost_reported = False

    def get_finished(
        self, finished_req_ids: frozenset[str]
    ) -> tuple[frozenset[str], frozenset[str]]:
        sending, recving = super().get_finished(finished_req_ids)
        if not self._ghost_reported:
            self._ghost_reported = True
            sending = sending | {GHOST_REQUEST_ID}
        return sending, recving


class UnknownReportConnector(BrokenConnector):
    """Breaks WRK-010: in its first ``get_finished`` it reports ``"ghost-request"`` in
    ``finished_sending``, a request it was never asked to send."""

    violates = "WRK-010"
    worker_class = _UnknownReportWorker


class _CorruptBlocks(KVBlocks):
    """Flips the low bit of the first byte of every block read from storage."""

    def read(self, directory: str, key: str, rank: int) -> torch.Tensor:
        block = super().read(directory, key, rank)
        block.reshape(-1).view(torch.uint8)[0] ^= 1
        return block


class _CorruptLoadWorker(SharedStorageWorker):
    """Corrupts every loaded block (WRK-013)."""

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout
    ) -> None:
        super().register_kv_caches(kv_caches, layout)
        self._kv = _CorruptBlocks(kv_caches, layout)


class CorruptLoadConnector(BrokenConnector):
    """Breaks WRK-013: flips the low bit of the first byte of every block it loads, and
    reports the load as successful."""

    violates = "WRK-013"
    worker_class = _CorruptLoadWorker


class _NoSendReportWorker(SharedStorageWorker):
    """Never reports a finished send (SCH-016)."""

    def get_finished(
        self, finished_req_ids: frozenset[str]
    ) -> tuple[frozenset[str], frozenset[str]]:
        _, recving = super().get_finished(finished_req_ids)
        return frozenset(), recving


class NoSendReportConnector(BrokenConnector):
    """Breaks SCH-016: ``request_finished`` returns True but no rank ever reports the
    request in ``finished_sending``, so its blocks are never freed."""

    violates = "SCH-016"
    worker_class = _NoSendReportWorker


class _DropsAbortedRecvWorker(SharedStorageWorker):
    """Drops the receive reports of aborted loads (SCH-021)."""

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        super().__init__(config, rank)
        self._settings = msgspec.structs.replace(
            self._settings, load_delay_s=max(self._settings.load_delay_s, SLOW_LOAD_S))
        self._aborted: set[str] = set()  # aborted loads still in flight

    def _start(self, meta: SharedStorageMetadata) -> None:
        super()._start(meta)
        self._aborted.update(r for r in meta.aborted_loads if r in self._loads)

    def get_finished(
        self, finished_req_ids: frozenset[str]
    ) -> tuple[frozenset[str], frozenset[str]]:
        aborted = set(self._aborted)
        sending, recving = super().get_finished(finished_req_ids)
        self._aborted &= set(self._loads)
        recving -= aborted  # the slip
        self._failed &= recving
        return sending, recving


class DropsAbortedRecvConnector(BrokenConnector):
    """Breaks SCH-021: never reports ``finished_recving`` for a request aborted while its
    load was in flight, once the abort reached the worker (the metadata's
    ``aborted_loads``) before the load completed.

    To make the violation observable, every load takes at least ``SLOW_LOAD_S``
    seconds (not a violation in itself), so an abort in the next step finds it in flight.
    """

    violates = "SCH-021"
    worker_class = _DropsAbortedRecvWorker


class _LoadsOverLocalHitScheduler(SharedStorageScheduler):
    """Places a load's blocks from the request's first allocated block (SCH-010)."""

    def update_state_after_alloc(
        self, request: RequestView, blocks: AllocatedBlocks, num_external_tokens: int
    ) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        rid = request.request_id
        if self._pending_loads and self._pending_loads[-1].request_id == rid:
            job = self._pending_loads[-1]
            ids = blocks.block_ids(0)  # the slip: forgets that the local hit comes first
            moved = LoadJob(rid, tuple((ids[i], key) for i, (_, key) in enumerate(job.blocks)))
            self._pending_loads[-1] = self._loading[rid] = moved


class LoadsOverLocalHitConnector(BrokenConnector):
    """Breaks SCH-010: it writes a load into the request's blocks from the first one on,
    forgetting the engine's own prefix hit, so the loaded KV lands on the blocks the engine
    already holds and the blocks after them are never written. Only a partial local hit
    followed by an external hit shows it."""

    violates = "SCH-010"
    selection = "test_scenario and partial-local-hit"
    scheduler_class = _LoadsOverLocalHitScheduler


# ------------------------------------------------------------------------ hostile input


class _PickledMetadata(SharedStorageMetadata, frozen=True):
    """Shared-storage metadata that crosses processes as a pickle (ERR-006)."""

    def encode(self) -> bytes:
        return pickle.dumps(self)

    @classmethod
    def decode(cls, data: bytes) -> Self:
        value = pickle.loads(data)  # the slip: a peer's bytes can run any code here
        if not isinstance(value, cls):
            raise MalformedMetadataError(f"not {cls.__name__}: {type(value).__name__}")
        return value


class _LeakyMetadata(SharedStorageMetadata, frozen=True):
    """Checks the envelope with a bare ``json.loads`` before the strict decoder (ERR-005)."""

    @classmethod
    def decode(cls, data: bytes) -> Self:
        if json.loads(data)["version"] != 1:  # the slip: ValueError, KeyError, TypeError
            raise MalformedMetadataError("unknown version")
        base = SharedStorageMetadata.decode(data)
        return cls(loads=base.loads, saves=base.saves, aborted_loads=base.aborted_loads)


def _as(meta_type: type[SharedStorageMetadata], meta: ConnectorMetadata) -> ConnectorMetadata:
    assert isinstance(meta, SharedStorageMetadata)
    return meta_type(loads=meta.loads, saves=meta.saves, aborted_loads=meta.aborted_loads)


class _PickledMetadataScheduler(SharedStorageScheduler):
    """Builds ``_PickledMetadata`` (ERR-006)."""

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ConnectorMetadata:
        return _as(_PickledMetadata, super().build_connector_meta(scheduler_output))


class PickledMetadataConnector(BrokenConnector):
    """Breaks ERR-006: its metadata encodes with ``pickle.dumps`` and decodes with
    ``pickle.loads``, so whoever can hand a worker bytes can run code in it."""

    violates = "ERR-006"
    selection = "TestHostileInput"
    scheduler_class = _PickledMetadataScheduler


class _LeakyDecoderScheduler(SharedStorageScheduler):
    """Builds ``_LeakyMetadata`` (ERR-005)."""

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ConnectorMetadata:
        return _as(_LeakyMetadata, super().build_connector_meta(scheduler_output))


class LeakyDecoderConnector(BrokenConnector):
    """Breaks ERR-005: its metadata decoder peeks at the version with a bare
    ``json.loads(data)["version"]``, so truncated or garbage bytes raise ValueError,
    KeyError or TypeError instead of MalformedMetadataError."""

    violates = "ERR-005"
    selection = "TestHostileInput"
    scheduler_class = _LeakyDecoderScheduler


class _UncheckedParamsScheduler(SharedStorageScheduler):
    """Trusts the client's ``kv_transfer_params`` (ERR-002)."""

    @staticmethod
    def _announced_blocks(request: RequestView) -> int | None:
        params = request.kv_transfer_params
        if not params or HANDOFF_PARAM not in params:
            return None
        entry = params[HANDOFF_PARAM]
        assert isinstance(entry, Mapping)  # the slip: trusts the client's params
        return int(entry["blocks"])


class UncheckedParamsConnector(BrokenConnector):
    """Breaks ERR-002: it reads a hand-off's block count from the client's
    ``kv_transfer_params`` without checking it, so ``{"kvspec.shared_storage": None}`` or a
    missing ``"blocks"`` raise AssertionError, KeyError or TypeError out of the scheduler."""

    violates = "ERR-002"
    selection = "TestHostileInput"
    scheduler_class = _UncheckedParamsScheduler


# ------------------------------------------------------------------------------- leaks


class _LeakyJournalWorker(SharedStorageWorker):
    """Opens an append-only journal of its saves and never closes it (ERR-009)."""

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor],
                           layout: KVCacheLayout) -> None:
        super().register_kv_caches(kv_caches, layout)
        path = os.path.join(self._dir, f"journal-rank{self._rank}.log")
        self._journal = open(path, "a")  # noqa: SIM115  (the slip: shutdown never closes it)

    def wait_for_save(self) -> None:
        super().wait_for_save()
        self._journal.write("saved\n")


class LeakyJournalConnector(BrokenConnector):
    """Breaks ERR-009: each worker opens a journal file when it registers its KV caches and
    ``shutdown`` never closes it, so every engine restart leaks a file descriptor."""

    violates = "ERR-009"
    worker_class = _LeakyJournalWorker


# ------------------------------------------------------------------------------- stats


@attrs.frozen
class _MeanStats:
    """Blocks moved per step, reduced by averaging two ranks' values (EVT-006)."""

    blocks_per_step: float

    def aggregate(self, other: _MeanStats) -> _MeanStats:
        return _MeanStats((self.blocks_per_step + other.blocks_per_step) / 2)  # the slip


class _AveragingStatsWorker(SharedStorageWorker):
    """Reports its stats as ``_MeanStats`` (EVT-006)."""

    def get_kv_connector_stats(self) -> SupportsAggregate | None:
        stats = super().get_kv_connector_stats()
        if not isinstance(stats, ConnectorStats):
            return stats
        return _MeanStats(float(sum(stats.counters.values())))


class AveragingStatsConnector(BrokenConnector):
    """Breaks EVT-006: its stats report blocks moved per step and combine two ranks' values
    by their mean, which depends on how the executor groups the ranks:
    ``mean(mean(a, b), c) != mean(a, mean(b, c))``."""

    violates = "EVT-006"
    selection = "TestStats"
    worker_class = _AveragingStatsWorker


# ------------------------------------------------------------------------------ faults


class _HidesFailedLoadsWorker(SharedStorageWorker):
    """Reports every finished load as a success (WRK-011)."""

    def get_failed_recving(self) -> frozenset[str]:
        super().get_failed_recving()
        return frozenset()  # the slip: the failure is logged, not reported

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        super().get_block_ids_with_load_errors()
        return frozenset()


class HidesFailedLoadsConnector(BrokenConnector):
    """Breaks WRK-011: a load that failed is reported in ``finished_recving`` only, never in
    ``failed_recving`` or with invalid blocks, so the engine computes on blocks that were
    never written. Only a failed load shows it: the fault seam makes every load fail."""

    violates = "WRK-011"
    selection = "TestFaults"
    worker_class = _HidesFailedLoadsWorker


# ------------------------------------------------------------------------------ crashes


class _CrashingScheduler(SharedStorageScheduler):
    """Counts the external tokens of each request, and reads them back at the finish."""

    def __init__(self, config: EngineConfigView) -> None:
        super().__init__(config)
        self._hits: dict[str, int] = {}

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        count, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if count:
            self._hits[request.request_id] = count
        return count, is_async

    def request_finished(
        self, request: RequestView, block_ids: tuple[int, ...]
    ) -> tuple[bool, Mapping[str, object] | None]:
        self._hits.pop(request.request_id)  # the slip: KeyError for requests without a hit
        return super().request_finished(request, block_ids)


class CrashingConnector(BrokenConnector):
    """Breaks ERR-010: ``request_finished`` pops the request's hit count with
    ``dict.pop(key)``, which raises KeyError for every request that had no hit."""

    violates = "ERR-010"
    scheduler_class = _CrashingScheduler


class _PipelinedLookupScheduler(SharedStorageScheduler):
    """Under async scheduling, matches through a "conservative" path that keeps the last
    stored block back (SCH-014)."""

    def _match(self, request: RequestView, num_computed_tokens: int) -> int:
        count = super()._match(request, num_computed_tokens)
        if self._config.async_scheduling:  # the slip: "its save may not have landed yet"
            count = max(0, count - self._block_size)
        return count


class PipelinedLookupConnector(BrokenConnector):
    """Breaks SCH-014: under asynchronous scheduling (``EngineConfigView.async_scheduling``)
    it offers one block less of the same stored data than under synchronous scheduling,
    guarding against saves that are in fact complete."""

    violates = "SCH-014"
    selection = "test_async_scheduling_matches_like_sync"
    scheduler_class = _PipelinedLookupScheduler


class _ReloadsScheduler(SharedStorageScheduler):
    """Starts the request's load again on the follow-up ``update_state_after_alloc`` with
    ``num_external_tokens=0`` (SCH-009)."""

    def __init__(self, config: EngineConfigView) -> None:
        super().__init__(config)
        self._loaded: dict[str, LoadJob] = {}

    def update_state_after_alloc(
        self, request: RequestView, blocks: AllocatedBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        job = self._loaded.pop(rid, None)
        if num_external_tokens == 0 and job is not None and rid not in self._loading:
            self._pending_loads.append(job)  # the slip: "make sure the blocks are there"
            self._loading[rid] = job
            return
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if rid in self._loading:
            self._loaded[rid] = self._loading[rid]

    def request_finished(
        self, request: RequestView, block_ids: tuple[int, ...]
    ) -> tuple[bool, Mapping[str, object] | None]:
        self._loaded.pop(request.request_id, None)
        return super().request_finished(request, block_ids)


class ReloadsConnector(BrokenConnector):
    """Breaks SCH-009: treats the second ``update_state_after_alloc`` of an async load
    (``num_external_tokens=0``, after the load finished) as a request to load again, so the
    blocks are loaded twice and the request's receive is reported twice."""

    violates = "SCH-009"
    selection = "test_second_allocation_starts_no_load"
    scheduler_class = _ReloadsScheduler


class _NhdBlocks(KVBlocks):
    """Copies loaded blocks in by address, as if every page were tokens x heads x channels
    (vLLM's NHD), whatever the registered stride order (LAY-007)."""

    def copy_in(self, block: int, src: torch.Tensor) -> None:
        for tensor, part in zip(self.tensors, src):
            dst = self.block(tensor, block)
            pages = [dst[i] for i in range(dst.shape[0])] if self.split else [dst]
            parts = [part[i] for i in range(part.shape[0])] if self.split else [part]
            for page, data in zip(pages, parts):
                dense = torch.empty(page.shape, dtype=page.dtype).stride()
                torch.as_strided(page, page.shape, dense, page.storage_offset()).copy_(data)


class _AssumesNhdWorker(SharedStorageWorker):
    """Loads through ``_NhdBlocks`` (LAY-007)."""

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout
    ) -> None:
        super().register_kv_caches(kv_caches, layout)
        self._kv = _NhdBlocks(kv_caches, layout)


class AssumesNhdConnector(BrokenConnector):
    """Breaks LAY-007: loads write each page at the offsets of a dense tokens x heads x
    channels page, ignoring the descriptor's stride order. Right under the NHD orders,
    wrong (the right bytes, rearranged) under HND and the others."""

    violates = "LAY-007"
    selection = "test_every_accepted_layout"
    worker_class = _AssumesNhdWorker


# ------------------------------------------------------------- saves while running


class _EagerSavesScheduler(SharedStorageScheduler):
    """Also saves each running request's prompt blocks in the step after the one that
    computed them (``SaveJob.report`` False: never reported; marked stored once every
    rank's file exists), one such save in flight per request."""

    def __init__(self, config: EngineConfigView) -> None:
        super().__init__(config)
        self._running: dict[str, tuple[RequestView, list[int]]] = {}
        self._eager: dict[str, tuple[str, ...]] = {}  # request -> keys being saved
        self._unreported: dict[str, _SaveRecord] = {}  # eager saves, never reported

    def _mark_eager_written(self) -> None:
        ranks = range(self._config.world_size)
        for rid, keys in list(self._eager.items()):
            if all(os.path.exists(block_path(self._dir, k, r)) for k in keys for r in ranks):
                del self._eager[rid]
                record = self._unreported.pop(rid)
                self._mark_done(record.keys, record.events)

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ConnectorMetadata:
        self._mark_eager_written()
        for rid in scheduler_output.preempted_req_ids:
            self._running.pop(rid, None)
        todo: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            if new.request_id in self._known:
                self._running[new.request_id] = (new.request, list(new.blocks.block_ids(0)))
                todo.append((new.request_id, new.num_computed_tokens))
        for cached in scheduler_output.scheduled_cached_reqs:
            if cached.request_id in self._running:
                self._running[cached.request_id][1].extend(cached.new_blocks.block_ids(0))
                todo.append((cached.request_id, cached.num_computed_tokens))
        for rid, computed in todo:
            if rid in self._eager or rid in self._unreported:
                continue
            request, ids = self._running[rid]
            keys = self._block_keys(request)
            full = min(len(keys), computed // self._block_size, len(ids))
            positions = [i for i in range(full)
                         if keys[i] not in self._saving_keys and not self._is_stored(keys[i])]
            if positions:
                saved = tuple(keys[i] for i in positions)
                self._pending_saves.append(SaveJob(
                    rid, tuple((ids[i], keys[i]) for i in positions), report=False))
                self._saving_keys.update(saved)
                self._eager[rid] = saved
                self._unreported[rid] = _SaveRecord(
                    saved, stored_events(request, keys, positions, self._block_size))
        return super().build_connector_meta(scheduler_output)

    def request_finished(
        self, request: RequestView, block_ids: tuple[int, ...]
    ) -> tuple[bool, Mapping[str, object] | None]:
        rid = request.request_id
        self._running.pop(rid, None)
        delay, params = super().request_finished(request, block_ids)
        if rid in self._eager and not delay and rid not in self._loading:
            # Hold the blocks until a reported save queued behind the running one ends.
            keys = self._block_keys(request)
            pairs = tuple((block_ids[i], keys[i]) for i in range(len(block_ids))
                          if i < len(keys) and keys[i] in self._eager[rid])
            if pairs:
                self._pending_saves.append(SaveJob(rid, pairs, report=True))
                self._saving[rid] = _SaveRecord((), ())
                return True, params
        return delay, params


class _EagerSavesWorker(SharedStorageWorker):
    """Runs the unreported saves on the background thread and reads their blocks there,
    when it writes them (no snapshot), and fences them in ``handle_preemptions``."""

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        super().__init__(config, rank)
        self._eager: dict[str, list[Transfer]] = {}

    def _start(self, meta: SharedStorageMetadata) -> None:
        eager = [s for s in meta.saves if not s.report]
        super()._start(msgspec.structs.replace(
            meta, saves=tuple(s for s in meta.saves if s.report)))
        pool = self._pool
        if not eager or pool is None:
            return
        for save in eager:
            j = Transfer(save.request_id, tuple(b for b, _ in save.blocks),
                         self._settings.io_timeout_s, False)
            j.future = pool.submit(self._write_lazily, j, tuple(k for _, k in save.blocks))
            self._eager.setdefault(save.request_id, []).append(j)

    def _write_lazily(self, job: Transfer, keys: tuple[str, ...]) -> tuple[int, ...]:
        if self._faults.delay_s:
            self._closing.wait(self._faults.delay_s)  # the transfer is slow to start
        with job.lock:
            if self._closing.is_set() or job.cancelled.is_set() or self._kv is None:
                return job.block_ids
            snapshot = self._kv.snapshot(job.block_ids)  # the blocks are read only now
        return self._write_blocks(job, keys, snapshot)

    def _fence(self, rid: str) -> None:
        for job in self._eager.pop(rid, ()):
            job.cancelled.set()  # not started: never reads; reading: waited for
            if job.lock.acquire(timeout=max(0.0, job.deadline - time.monotonic())):
                job.lock.release()

    def handle_preemptions(self, preempted_req_ids: frozenset[str]) -> None:
        super().handle_preemptions(preempted_req_ids)
        for rid in preempted_req_ids:
            self._fence(rid)

    def get_finished(
        self, finished_req_ids: frozenset[str]
    ) -> tuple[frozenset[str], frozenset[str]]:
        for rid, jobs in list(self._eager.items()):
            jobs[:] = [j for j in jobs if j.future is not None and not j.future.done()]
            if not jobs:
                del self._eager[rid]
        return super().get_finished(finished_req_ids)

    def shutdown(self) -> None:
        for jobs in self._eager.values():
            for j in jobs:
                j.cancelled.set()
        self._eager.clear()
        super().shutdown()


class EagerSavesConnector(SharedStorageConnector):
    """Not broken: the shared-storage connector that also saves running requests' blocks,
    reading them on its background thread while the request runs, and fences those reads
    when the request is preempted (WRK-012). The control of
    ``UnfencedSavesConnector``."""

    scheduler_class = _EagerSavesScheduler
    worker_class = _EagerSavesWorker

    @property
    def name(self) -> str:
        """``"eager-saves"``."""
        return "eager-saves"


class _UnfencedSavesWorker(_EagerSavesWorker):
    """Leaves the running saves of preempted requests running (WRK-012)."""

    def _fence(self, rid: str) -> None:
        return None  # the slip: the saves of a preempted request go on reading


class UnfencedSavesConnector(BrokenConnector):
    """Breaks WRK-012: as ``EagerSavesConnector``, but ``handle_preemptions`` does
    not wait for the running requests' saves, which read the preempted blocks after the
    engine reused them. Caught when a save is in flight at a preemption: the engine test
    of a request preempted soon after its prompt was computed holds the connector's
    threads while the engine works (``hold_threads``), so it is, without the fault seam
    (whose slow transfers catch it too)."""

    violates = "WRK-012"
    selection = "test_preempted_while_storing"
    scheduler_class = _EagerSavesScheduler
    worker_class = _UnfencedSavesWorker


# ------------------------------------------------------- issue 35: slips seen from outside


class _MutatesParamsScheduler(SharedStorageScheduler):
    """Marks a hand-off consumed in the request's own ``kv_transfer_params`` once its load
    is planned, the way vLLM's NIXL connector clears ``do_remote_prefill`` (SCH-012)."""

    def update_state_after_alloc(
        self, request: RequestView, blocks: AllocatedBlocks, num_external_tokens: int
    ) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        params = request.kv_transfer_params
        if num_external_tokens and params is not None and HANDOFF_PARAM in params:
            params[HANDOFF_PARAM] = {"blocks": 0}  # type: ignore[index]  # the slip


class MutatesParamsConnector(BrokenConnector):
    """Breaks SCH-012: once a handed-off request's load is planned, writes into the
    request's ``kv_transfer_params`` (an idiom of vLLM's own NIXL connector). In vLLM the
    write silently changes the engine's request; the suite's read-only view refuses it,
    and the verdict names the contract, not the ``TypeError``."""

    violates = "SCH-012"
    selection = "test_two_engines and not layout"
    scheduler_class = _MutatesParamsScheduler


class _AssertsCapacityWorker(SharedStorageWorker):
    """Asserts that the KV tensors hold exactly the engine's block budget."""

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        super().__init__(config, rank)
        self._budget = config.num_blocks

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout
    ) -> None:
        assert layout.block_capacity == self._budget, "KV tensors != num_blocks"  # the slip
        super().register_kv_caches(kv_caches, layout)


class AssertsCapacityConnector(BrokenConnector):
    """Breaks LAY-003: ``register_kv_caches`` asserts that the tensors hold exactly
    ``num_blocks`` blocks, which fails on over-allocated (kvcached-style) tensors, where
    capacity and budget are distinct. A bare ``AssertionError`` from connector code is
    still a crash the suite attributes."""

    violates = "LAY-003"
    selection = "test_over_allocated_non_restridable_tensors"
    worker_class = _AssertsCapacityWorker


class _WaitingWorker(SharedStorageWorker):
    """``get_finished`` waits for every transfer in flight to end before it reports."""

    def get_finished(
        self, finished_req_ids: frozenset[str]
    ) -> tuple[frozenset[str], frozenset[str]]:
        for job in (*self._loads.values(), *self._saves.values()):
            if job.future is not None:
                concurrent.futures.wait((job.future,))  # the slip: no timeout, engine thread
        return super().get_finished(finished_req_ids)


class WaitingOutputConnector(BrokenConnector):
    """Breaks WRK-014: ``get_finished`` waits, with no timeout, for every transfer in
    flight, on the engine's thread: a slow or hung copy stalls every step (and a copy
    that never returns, the engine)."""

    violates = "WRK-014"
    selection = "test_output_hooks_never_wait_for_a_slow_transfer"
    worker_class = _WaitingWorker


class _LateWriterWorker(SharedStorageWorker):
    """Copies in each block it read without asking whether the load was cancelled."""

    def _load_blocks(self, job: Transfer, blocks: tuple[tuple[int, str], ...]) -> tuple[int, ...]:
        kv = self._kv
        assert kv is not None
        failed: list[int] = []
        for block, key in blocks:
            try:
                src = kv.read(self._dir, key, self._rank)
                if self._faults.stall_s and block == blocks[0][0]:  # the read hangs
                    self._closing.wait(self._faults.stall_s)
                kv.copy_in(block, src)  # the slip: written even after the load was failed
            except (OSError, ValueError, RuntimeError):
                failed.append(block)
        return tuple(failed)


class LateWriterConnector(BrokenConnector):
    """Breaks WRK-017: a load whose read hangs past its deadline is reported failed (the
    engine recomputes the request, which finishes and frees its blocks), and then its
    thread still copies what it read into those blocks, by then another request's."""

    violates = "WRK-017"
    selection = "test_a_late_copy_never_writes_freed_blocks"
    worker_class = _LateWriterWorker


class _UnsyncedWriterWorker(LayerwiseStorageWorker):
    """``wait_for_save`` hands the persistent save staging itself to a writer thread and
    returns at once: the CPU form of an asynchronous device-to-host copy with no sync. The
    writer marks each block stored once its file is written."""

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        super().__init__(config, rank)
        self._jobs: queue.SimpleQueue[tuple[tuple[str, ...], torch.Tensor] | None] = (
            queue.SimpleQueue())
        self._writer = threading.Thread(target=self._write, name="unsynced-writer",
                                        daemon=True)
        self._writer.start()

    def wait_for_save(self) -> None:
        self._slot.get("wait_for_save")
        keys, self._save_keys = self._save_keys, ()
        if keys:  # the slip: the staging the next forward's save_kv_layer overwrites
            self._jobs.put((keys, self._buf["save_staging"][: len(keys)]))

    def _write(self) -> None:
        while (job := self._jobs.get()) is not None:
            keys, staging = job
            for i, key in enumerate(keys):
                with contextlib.suppress(OSError, ValueError, RuntimeError):
                    write_block_file(block_path(self._dir, key, self._rank), key,
                                     self._rank, staging[i].to("cpu"))
                    # stored once written, as file-per-block stores often decide it
                    write_marker(self._dir, key)

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._writer.join(timeout=5)
        super().shutdown()


class UnsyncedWriterConnector(LayerwiseStorageConnector):
    """Breaks WRK-013 (through WRK-007): ``wait_for_save`` hands its persistent save
    staging to a writer thread and returns at once, so the next step's ``save_kv_layer``
    overwrites the staging before the writer read it, and files hold the next step's bytes
    under this step's keys; their later loads deliver wrong KV. Caught in every run because
    the suite holds the connector's threads until the next forward ran
    (``HarnessConfig.hold_threads``), as a busy machine would."""

    violates: ClassVar[str] = "WRK-013"
    selection: ClassVar[str] = "test_connector_threads_run_late"
    worker_class = _UnsyncedWriterWorker

    @property
    def name(self) -> str:
        """``"broken-unsynced-writer"``."""
        return "broken-unsynced-writer"


class _IgnoresResetScheduler(SharedStorageScheduler):
    """Answers True to a cache reset and keeps every stored file (SCH-032)."""

    def reset_cache(self) -> bool:
        return True


class IgnoresResetConnector(BrokenConnector):
    """Breaks SCH-032: answers True to ``reset_cache`` but keeps serving its stored files, as
    a connector that ignores the reset does (vLLM reads a connector that does not implement
    the hook as reset): after a weight update it serves KV computed with the old weights."""

    violates = "SCH-032"
    selection = "test_cache_reset"
    scheduler_class = _IgnoresResetScheduler


class _LoadsCutMatchScheduler(SharedStorageScheduler):
    """Plans the load of its last asynchronous answer even when the allocation carries
    0 external tokens (SCH-034)."""

    def __init__(self, config: EngineConfigView) -> None:
        super().__init__(config)
        self._answered: dict[str, int] = {}

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        count, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if count and is_async:
            self._answered[request.request_id] = count
        return count, is_async

    def update_state_after_alloc(
        self, request: RequestView, blocks: AllocatedBlocks, num_external_tokens: int
    ) -> None:
        answered = self._answered.pop(request.request_id, 0)
        if num_external_tokens == 0 and answered:  # the slip: "the match said so"
            start = self._asked.get(request.request_id, request.num_computed_tokens)
            room = len(blocks.block_ids(0)) * self._block_size - start
            num_external_tokens = max(0, min(answered, room - room % self._block_size))
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(
        self, request: RequestView, block_ids: tuple[int, ...]
    ) -> tuple[bool, Mapping[str, object] | None]:
        self._answered.pop(request.request_id, None)
        return super().request_finished(request, block_ids)


class LoadsCutMatchConnector(BrokenConnector):
    """Breaks SCH-034: when the engine cuts its asynchronous match to 0 tokens (vLLM's
    auxiliary-output cap) and calls ``update_state_after_alloc`` with 0, it loads the
    tokens it had matched anyway, and reports a receive nobody awaits."""

    violates = "SCH-034"
    selection = "test_an_async_match_cut_to_zero_loads_nothing"
    scheduler_class = _LoadsCutMatchScheduler


class _ChunkedMatchScheduler(SharedStorageScheduler):
    """Matches whole chunks of two blocks only, but advertises every stored block
    (EVT-010)."""

    def _match(self, request: RequestView, num_computed_tokens: int) -> int:
        count = super()._match(request, num_computed_tokens)
        return count - count % (2 * self._block_size)


class ChunkedAdvertConnector(BrokenConnector):
    """Breaks EVT-010, as vLLM issue 57159 reports of chunked offloading: its KV events
    advertise every block's hash, but it finds blocks only in whole chunks of two, so a
    prefix that ends with an odd block is not loadable on its own."""

    violates = "EVT-010"
    selection = "test_every_advertised_block_loads_on_its_own"
    scheduler_class = _ChunkedMatchScheduler


class _ForwardOnlySavesWorker(SharedStorageWorker):
    """Reports the saves that completed only in steps that run a forward (WRK-021)."""

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        super().__init__(config, rank)
        self._forward = False
        self._done_saves: frozenset[str] = frozenset()

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        self._forward = False
        super().bind_connector_metadata(metadata)

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        self._forward = forward_context.num_tokens > 0
        super().start_load_kv(forward_context)

    def get_finished(
        self, finished_req_ids: frozenset[str]
    ) -> tuple[frozenset[str], frozenset[str]]:
        sending, recving = super().get_finished(finished_req_ids)
        self._done_saves |= sending
        if not self._forward:  # the slip: saves are finalized with the forward's layers
            return frozenset(), recving
        sending, self._done_saves = self._done_saves, frozenset()
        return sending, recving


class ForwardOnlySavesConnector(BrokenConnector):
    """Breaks WRK-021, as vLLM PR 57775 fixed for vLLM's own connectors: it finalizes its
    saves only in steps with a forward, so the last requests' stores stay unreported while
    the engine runs steps without one."""

    violates = "WRK-021"
    selection = "test_saves_finish_in_steps_without_a_forward"
    worker_class = _ForwardOnlySavesWorker


# ------------------------------------------------------------------------------ sleep


class _StaleTensorsWorker(SharedStorageWorker):
    """Declares sleep mode but never lets go of the tensors registered first: after the
    wake it still reads and writes them (WRK-019)."""

    def unregister_kv_caches(self) -> None:
        return None

    def restore_kv_caches(self, kv_caches: Mapping[str, torch.Tensor],
                          layout: KVCacheLayout) -> None:
        return None


class _LateScrubWorker(SharedStorageWorker):
    """Scrubs (zeroes) its registered KV tensors at ``unregister_kv_caches`` on a thread of
    its own, and returns without waiting for it (WRK-018)."""

    def unregister_kv_caches(self) -> None:
        kv = self._kv
        super().unregister_kv_caches()
        if kv is None:
            return

        def scrub() -> None:
            time.sleep(0.01)  # the slip: the engine frees the memory meanwhile
            for tensor in kv.tensors:
                tensor.zero_()

        threading.Thread(target=scrub, name="broken-late-scrub", daemon=True).start()


class LateScrubConnector(BrokenConnector):
    """Breaks WRK-018: ``unregister_kv_caches`` hands the scrubbing of the KV tensors (so
    that the next tenant finds no KV of this one) to a thread and returns at once; the
    thread writes memory the engine has freed (on a GPU: memory cumem unmapped, or handed
    to the weights)."""

    violates: ClassVar[str] = "WRK-018"
    selection: ClassVar[str] = "TestSleep and mid_serving and 1"
    worker_class = _LateScrubWorker


class StaleTensorsConnector(BrokenConnector):
    """Breaks WRK-019: restore_kv_caches ignores the tensors it is given, so a hit after
    the wake is copied into the KV tensors the sleep retired (on a GPU: freed memory) and
    the model reads never-written blocks."""

    violates: ClassVar[str] = "WRK-019"
    selection: ClassVar[str] = "TestSleep and mid_serving and 1"
    worker_class = _StaleTensorsWorker


# ---------------------------------------------------------------------- speculative decoding

_SPECULATIVE = "TestSpeculative and test_speculative_workload"
"""The suite tests that catch the speculative variants (eagle: two draft passes a step)."""


class _LayerwiseBroken(LayerwiseStorageConnector):
    """Base of the speculative variants built on the layerwise connector (per-layer hooks)."""

    violates: ClassVar[str] = ""
    selection: ClassVar[str] = _SPECULATIVE

    @property
    def name(self) -> str:
        """``"broken-<clause>"``."""
        return f"broken-{self.violates.lower()}"


class _SkipsDraftWorker(LayerwiseStorageWorker):
    """Skips the draft layers' save_kv_layer (SPD-003)."""

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        super().__init__(config, rank)
        self._draft = frozenset(config.draft_layer_names)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      forward_context: ForwardContextView) -> None:
        if layer_name in self._draft:  # "the drafter's KV is recomputed anyway"
            return
        super().save_kv_layer(layer_name, kv_layer, forward_context)


class DraftNeverSavedConnector(_LayerwiseBroken):
    """Breaks SPD-003: never saves the draft layers' KV (vLLM PR 34529 / PR 35158, issue
    43719): a request whose prefix it loads drafts from whatever its staging held."""

    violates: ClassVar[str] = "SPD-003"
    worker_class = _SkipsDraftWorker


class _OncePerStepWorker(LayerwiseStorageWorker):
    """Saves each layer on its first save_kv_layer of a step only (SPD-002)."""

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        super().__init__(config, rank)
        self._saved: set[str] = set()

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        self._saved = set()
        super().bind_connector_metadata(metadata)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      forward_context: ForwardContextView) -> None:
        if layer_name in self._saved:  # "each layer is saved once a step"
            return
        self._saved.add(layer_name)
        super().save_kv_layer(layer_name, kv_layer, forward_context)


class OncePerStepSavesConnector(_LayerwiseBroken):
    """Breaks SPD-002: saves each layer on its first ``save_kv_layer`` of the step and
    ignores the later calls, so a draft layer's KV is stored as the first draft pass left
    it, not as the last pass did."""

    violates: ClassVar[str] = "SPD-002"
    worker_class = _OncePerStepWorker


class _StaleOutputWorker(SharedStorageWorker):
    """Returns its last non-empty output again when the new one is empty (SPD-004)."""

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        super().__init__(config, rank)
        self._kept: KVConnectorOutput | None = None

    def build_connector_output(self, finished_req_ids: frozenset[str]) -> KVConnectorOutput:
        out = super().build_connector_output(finished_req_ids)
        if out.is_empty() and self._kept is not None:
            out = self._kept  # "nothing new: the output built before drafting still holds"
        self._kept = None if out is self._kept or out.is_empty() else out
        return out


class StaleOutputConnector(BrokenConnector):
    """Breaks SPD-004: returns the output object it built before drafting again in the next
    step when nothing new finished (vllm-ascend issue 8064), which repeats its reports and
    hides what completed after it."""

    violates = "SPD-004"
    selection = _SPECULATIVE
    worker_class = _StaleOutputWorker


class _EarlyReportWorker(SharedStorageWorker):
    """Saves in ``wait_for_save`` and reports the bound step's saves in its output, built
    before wait_for_save ran under a drafter (SPD-004)."""

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        super().__init__(config, rank)
        self._deferred: tuple[SaveJob, ...] = ()  # the bound step's saves, run in wait_for_save
        self._early: set[str] = set()  # of those, the ones already reported

    def _start(self, meta: SharedStorageMetadata) -> None:
        self._deferred = meta.saves
        super()._start(msgspec.structs.replace(meta, saves=()))

    def get_finished(
        self, finished_req_ids: frozenset[str]
    ) -> tuple[frozenset[str], frozenset[str]]:
        sending, recving = super().get_finished(finished_req_ids)
        # "this step's saves complete in wait_for_save, which always runs before the
        # engine reads the output": true of the plain step only
        early = {j.request_id for j in self._deferred if j.report}
        self._early |= early
        return sending | early, recving

    def _run_deferred(self) -> None:
        deferred, self._deferred = self._deferred, ()
        if not deferred:
            return
        saves = tuple(msgspec.structs.replace(j, report=j.request_id not in self._early)
                      for j in deferred)
        self._early -= {j.request_id for j in deferred}
        super()._start(SharedStorageMetadata(saves=saves))
        for j in saves:
            job = self._saves.get(j.request_id)
            if job is not None:
                job.wait()  # bounded by the transfer's deadline

    def wait_for_save(self) -> None:
        self._run_deferred()

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._run_deferred()  # a step with no forward started its saves in the clear


class EarlyReportConnector(BrokenConnector):
    """Breaks SPD-004: writes a finished request's blocks in ``wait_for_save`` and reports
    them in ``finished_sending`` in the same step's output, which under a drafter is built
    before ``wait_for_save`` runs: the engine frees and reuses the blocks while the save
    still reads them (the MTP hand-off of vLLM issue 55053 that sent an incomplete prompt).
    Right in a plain step, where wait_for_save comes first."""

    violates = "SPD-004"
    selection = _SPECULATIVE
    worker_class = _EarlyReportWorker

    @property
    def name(self) -> str:
        """``"broken-spd-004-early-report"`` (StaleOutputConnector breaks SPD-004 too)."""
        return "broken-spd-004-early-report"


class _EagerBlocksMetadata(TinyCacheMetadata, frozen=True, forbid_unknown_fields=True,
                           tag="tinycache-eager"):
    """Tiny's metadata, plus blocks to copy aside now and stashed blocks to store."""

    stash: tuple[tuple[str, int, BlockId], ...] = ()  # (request, block index, block id)
    commit: tuple[tuple[str, int, Key], ...] = ()  # (request, block index, key)

    @classmethod
    def decode(cls, data: bytes) -> _EagerBlocksMetadata:
        """Rebuild what ``encode`` wrote; MalformedMetadataError for anything else."""
        try:
            return msgspec.json.decode(data, type=cls)
        except (msgspec.MsgspecError, ValueError) as e:
            raise MalformedMetadataError(f"tinycache-eager metadata: {e}",
                                         clause="ERR-005") from None


class _EagerBlocksScheduler(TinyCacheScheduler):
    """Copies a decode block aside in the step whose scheduled tokens fill it, and stores
    the copy under the request's block hash once it finishes (SPD-005)."""

    def __init__(self, config: EngineConfigView) -> None:
        super().__init__(config)
        self._filled: dict[str, int] = {}  # request -> blocks its scheduled tokens filled
        self._stashed: dict[str, list[int]] = {}  # request -> stashed block indexes
        self._commit: list[tuple[str, int, str]] = []

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ConnectorMetadata:
        for rid in scheduler_output.preempted_req_ids:
            self._filled.pop(rid, None)
            self._stashed.pop(rid, None)
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, TinyCacheMetadata)
        stash = []
        for rid in scheduler_output.num_scheduled_tokens:
            req = self.running[rid]
            # "the scheduled tokens are computed once this step ran": drafts included
            full = min(req.computed // self.block_size, len(req.block_ids))
            first = max(self._filled.get(rid, len(req.keys)), len(req.keys))
            for i in range(first, full):
                stash.append((rid, i, req.block_ids[i]))
                self._stashed.setdefault(rid, []).append(i)
            self._filled[rid] = max(full, first)
        commit, self._commit = tuple(self._commit), []
        return _EagerBlocksMetadata(loads=meta.loads, saves=meta.saves, stash=tuple(stash),
                                    commit=commit)

    def request_finished(
        self, request: RequestView, block_ids: tuple[int, ...]
    ) -> tuple[bool, Mapping[str, Any] | None]:
        rid = request.request_id
        keys = [h.hex() for h in request.block_hashes]
        for i in self._stashed.pop(rid, []):
            if i < len(keys) and keys[i] not in self.stored and keys[i] not in self.saving:
                self._commit.append((rid, i, keys[i]))
                self.saving.add(keys[i])
        self._filled.pop(rid, None)
        return super().request_finished(request, block_ids)


class _EagerBlocksWorker(TinyCacheWorker):
    """Copies the step's filled blocks aside after the forward; writes them when told."""

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        super().__init__(config, rank)
        self.slot = MetadataSlot(_EagerBlocksMetadata)
        self._stash: dict[tuple[str, int], bytes] = {}

    def wait_for_save(self) -> None:
        super().wait_for_save()
        meta = self.slot.get("wait_for_save")
        assert isinstance(meta, _EagerBlocksMetadata)
        for rid, i, block_id in meta.stash:
            self._stash[(rid, i)] = bytes(
                torch.stack(self.block(block_id)).view(torch.uint8).untyped_storage())
        for rid, i, key in meta.commit:
            data = self._stash.pop((rid, i), None)
            if data is not None:
                path = tiny_block_file(self.dir, key, self.rank)
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                tmp.write_bytes(data)
                os.replace(tmp, path)


class RejectedKVStoredConnector(TinyCache):
    """Breaks SPD-005: copies a decode block aside in the step whose scheduled tokens fill
    it, counting a speculative step's draft tokens computed, and stores the copy under the
    request's block hash once the request finishes: where the target rejected the block's
    last drafts, the stored block holds the rejected tokens' KV under the accepted
    tokens' hash."""

    violates: ClassVar[str] = "SPD-005"
    selection: ClassVar[str] = _SPECULATIVE

    @property
    def name(self) -> str:
        """``"broken-spd-005"``."""
        return f"broken-{self.violates.lower()}"

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        """The scheduler that stashes blocks filled by scheduled tokens."""
        return _EagerBlocksScheduler(config)

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        """The worker that copies them aside and stores them when told."""
        return _EagerBlocksWorker(config, rank)



# ------------------------------------------------------------------- state-space hybrids

_STATE = "TestStateGroups and repeated_prompt"
"""The suite test that catches the state variants: a prompt computed in chunks ending on
block boundaries, then again, then its first whole blocks alone (a full-prompt match)."""


class _StateBroken(StateCache):
    """Base of the state variants, built on StateCache (attention and a state group)."""

    violates: ClassVar[str] = ""
    selection: ClassVar[str] = _STATE

    @property
    def name(self) -> str:
        """``"broken-<clause>"``."""
        return f"broken-{self.violates.lower()}"


class _LowerBoundaryScheduler(StateCacheScheduler):
    """Loads the state of the highest stored boundary below the match (STG-003)."""

    def update_state_after_alloc(self, request: RequestView, blocks: AllocatedBlocks,
                                 num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if self.state_loads:
            block, key = self.state_loads[-1]
            keys = [h.hex() for h in request.block_hashes]
            below = [j for j in range(keys.index(key[:-1]))
                     if self.on_disk(state_key(keys[j]))]
            if below:  # "a stored state close to the match is good enough"
                self.state_loads[-1] = (block, state_key(keys[below[-1]]))


class LowerBoundaryStateConnector(_StateBroken):
    """Breaks STG-003: loads, with the attention blocks of a match of N tokens, the state
    of the highest boundary below N it stored (the issue's "state at an aligned boundary at
    or below N"): the tokens between that boundary and N never reach the state."""

    violates: ClassVar[str] = "STG-003"

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        """The scheduler that swaps in a lower boundary's state."""
        return _LowerBoundaryScheduler(config)


class _AttentionOnlyWorker(StateCacheWorker):
    """Moves the state only from per-layer hooks, which state layers never get, so it never
    moves it: attention only, in the step-level hooks (STG-005)."""

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        TinyCacheWorker.start_load_kv(self, forward_context)

    def wait_for_save(self) -> None:
        TinyCacheWorker.wait_for_save(self)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      forward_context: ForwardContextView) -> None:
        return None  # "the state is saved per layer, as attention is": never called for it


class _AttentionMatchScheduler(StateCacheScheduler):
    """Matches attention blocks without asking whether the state was stored (STG-005)."""

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return TinyCacheScheduler.get_num_new_matched_tokens(self, request, num_computed_tokens)


class LayerHookStateConnector(_StateBroken):
    """Breaks STG-005: saves and loads state from ``save_kv_layer`` and
    ``wait_for_layer_load``, which the engine never calls for state layers (vllm-ascend
    issue 10246: Mamba state never saved under graph capture), and matches on the
    attention blocks alone: a hit loads attention and leaves the state block as allocated."""

    violates: ClassVar[str] = "STG-005"

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        """The scheduler that matches on attention blocks alone."""
        return _AttentionMatchScheduler(config)

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        """The worker that moves the state from per-layer hooks only."""
        return _AttentionOnlyWorker(config, rank)


class _LateStateReadWorker(StateCacheWorker):
    """Reads the states a step ended on one step late, in the next ``wait_for_save``
    (STG-006)."""

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        super().__init__(config, rank)
        self._late: tuple[tuple[int, str], ...] = ()

    def wait_for_save(self) -> None:
        meta = self.slot.get("wait_for_save")
        TinyCacheWorker.wait_for_save(self)
        late, self._late = self._late, tuple(meta.state_saves)  # type: ignore[attr-defined]
        for block_id, key in late:  # "the state stays in its block": it was updated since
            path = tiny_block_file(self.dir, key, self.rank)
            data = b"".join(bytes(layout.block_bytes(t, block_id).cpu().numpy().tobytes())
                            for t, layout in self.state)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)


class LateStateReadConnector(_StateBroken):
    """Breaks STG-006: copies the state a step ended on in the next step's
    ``wait_for_save`` (a copy queued behind the next forward). Under RUNNING caching the
    engine updates the state block in place, so the copy stored under the boundary's key
    is the state after more tokens than the key says."""

    violates: ClassVar[str] = "STG-006"

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        """The worker that reads states one step late."""
        return _LateStateReadWorker(config, rank)


class _FullPromptStateMetadata(StateCacheMetadata, frozen=True, forbid_unknown_fields=True,
                               tag="statecache-async"):
    """StateCache's metadata, plus the requests whose asynchronous load it carries."""

    recv: tuple[str, ...] = ()

    @classmethod
    def decode(cls, data: bytes) -> _FullPromptStateMetadata:
        """Rebuild what ``encode`` wrote; MalformedMetadataError for anything else."""
        try:
            return msgspec.json.decode(data, type=cls)
        except (msgspec.MsgspecError, ValueError) as e:
            raise MalformedMetadataError(f"statecache-async metadata: {e}",
                                         clause="ERR-005") from None


class _FullPromptStateScheduler(StateCacheScheduler):
    """Matches every stored block whose state it holds, the whole prompt included, for an
    asynchronous load (STG-004)."""

    def __init__(self, config: EngineConfigView) -> None:
        super().__init__(config)
        self._recv: list[str] = []

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        bs = self.block_size
        if num_computed_tokens % bs:
            return 0, False
        keys = [h.hex() for h in request.block_hashes]
        end = num_computed_tokens // bs
        while end < len(keys) and end < request.num_prompt_tokens // bs and keys[end] in \
                self.stored:  # "an asynchronous load may cover the whole prompt"
            end += 1
        while end > num_computed_tokens // bs and not self.on_disk(state_key(keys[end - 1])):
            end -= 1
        self.asked[request.request_id] = num_computed_tokens
        n = end * bs - num_computed_tokens
        return n, n > 0

    def update_state_after_alloc(self, request: RequestView, blocks: AllocatedBlocks,
                                 num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens:
            self._recv.append(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, StateCacheMetadata)
        recv, self._recv = tuple(self._recv), []
        return _FullPromptStateMetadata(loads=meta.loads, saves=meta.saves,
                                        state_loads=meta.state_loads,
                                        state_saves=meta.state_saves, recv=recv)


class _FullPromptStateWorker(StateCacheWorker):
    """Loads in ``start_load_kv`` and reports the loads' requests finished receiving."""

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        super().__init__(config, rank)
        self.slot = MetadataSlot(_FullPromptStateMetadata)  # type: ignore[arg-type]
        self._done: set[str] = set()

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        super().start_load_kv(forward_context)
        self._done |= set(self.slot.get("start_load_kv").recv)  # type: ignore[attr-defined]

    def get_finished(self, finished_req_ids: frozenset[str]
                     ) -> tuple[frozenset[str], frozenset[str]]:
        done, self._done = frozenset(self._done), set()
        return frozenset(), done


class FullPromptStateConnector(_StateBroken):
    """Breaks STG-004: with a state group, makes an asynchronous match that covers the whole
    prompt when every prompt block and the state after it are stored. vLLM 0.32 rewinds such
    a match by one token so that the request can sample (scheduler.py:3170-3172): the
    forward applies the last prompt token to the loaded state, which already holds it."""

    violates: ClassVar[str] = "STG-004"

    @property
    def capabilities(self) -> Capabilities:
        """StateCache's, with asynchronous loads."""
        return attrs.evolve(super().capabilities, async_loads=True)

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        """The scheduler that matches whole prompts for asynchronous loads."""
        return _FullPromptStateScheduler(config)

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        """The worker that reports its loads finished receiving."""
        return _FullPromptStateWorker(config, rank)

BROKEN_CONNECTORS: tuple[tuple[type[BrokenConnector] | type[FullPromptHitConnector]
                               | type[_LayerwiseBroken] | type[RejectedKVStoredConnector]
                               | type[UnsyncedWriterConnector] | type[StaleTensorsConnector]
                               | type[_StateBroken],
                               str], ...] = tuple(
    (cls, cls.violates)
    for cls in (
        FullPromptHitConnector,
        AsyncZeroConnector,
        ImpureMatchConnector,
        DoubleReportConnector,
        UnknownReportConnector,
        NoSaltConnector,
        CorruptLoadConnector,
        NoSendReportConnector,
        ReadAfterFreeConnector,
        DropsAbortedRecvConnector,
        PickledMetadataConnector,
        LeakyDecoderConnector,
        UncheckedParamsConnector,
        LeakyJournalConnector,
        AveragingStatsConnector,
        CrashingConnector,
        HidesFailedLoadsConnector,
        LoadsOverLocalHitConnector,
        UnfencedSavesConnector,
        PipelinedLookupConnector,
        AssumesNhdConnector,
        ReloadsConnector,
        MutatesParamsConnector,
        AssertsCapacityConnector,
        UnsyncedWriterConnector,
        WaitingOutputConnector,
        LateWriterConnector,
        IgnoresResetConnector,
        LoadsCutMatchConnector,
        ChunkedAdvertConnector,
        ForwardOnlySavesConnector,
        StaleTensorsConnector,
        LateScrubConnector,
        DraftNeverSavedConnector,
        OncePerStepSavesConnector,
        StaleOutputConnector,
        EarlyReportConnector,
        RejectedKVStoredConnector,
        LowerBoundaryStateConnector,
        LayerHookStateConnector,
        LateStateReadConnector,
        FullPromptStateConnector,
    )
)
"""Every broken variant with the clause it breaks."""
