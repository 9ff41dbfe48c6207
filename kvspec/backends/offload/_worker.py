"""The worker role of the offloading backend: the host pool and its background transfers.

One background thread per worker (a daemon ``Runner``) runs the step's stores
and loads in submission order, each as one vectorised gather/scatter
(``HostPool``). Stores read the engine's blocks in the
background: a running request holds its blocks, a finished one holds them by a delayed free
until ``finished_sending`` (SCH-016), and ``handle_preemptions`` waits for (or stops) the
copies of preempted requests before their blocks are reused (WRK-012), so ``wait_for_save``
returns at once (WRK-007). A request's stores are reported together, in ``finished_sending``
once it finished and all of them ended (WRK-010). Each slot remembers the tag of its last
successful store; a load whose slot holds another tag (evicted, overwritten, a failed
store) or an injected fault fails its blocks: the request is reported in
``finished_recving`` and ``failed_recving`` with those block ids invalid (WRK-011).

With ``sync_loads`` (``OffloadSettings``), loads are complete before the forward reads
their KV and are never reported in ``finished_recving``; the blocks of a failed one are
named in the invalid block ids of the step's ``get_finished`` (WRK-011, SCH-024). Their
copies run on a second daemon thread (the loader), never on the engine's: host memory can
be a file mapping, a device or a page being swapped, and a copy that hangs must hold no
hook past the load's deadline (WRK-014, issue 34). A large load on host memory with a
layer-outermost layout is *pipelined*: the loader copies it layer by layer while the
forward runs, and ``wait_for_layer_load`` waits, up to the load's deadline, for the layer
the next attention reads (WRK-004, WRK-005): the copy of layer ``n + 1`` overlaps the
attention of layer ``n``. ``get_finished`` waits for what the forward did not (bounded the
same way). Any other sync load (a few blocks, or another layout) is copied by the loader
while ``start_load_kv`` waits for it, up to its deadline. A load past its deadline fails
with every block invalid.

With several KV-cache groups (KVG-001) each job names every group's block ids; the pool
moves each group's regions at its ids and never the null block (KVG-004). Stores run
after the forward that computed their blocks: ``wait_for_save`` submits them and waits,
up to their deadline, because the engine may free a sliding window's block at the next
schedule; one still running then is cancelled and fails. A failed load fails its request
(``failed_recving``) and names no block ids (KVG-005).

A copy still running at its deadline (``io_timeout_s``: a stuck device, a hung driver) is
never waited for: its request is reported at once, a load as failed with every block
invalid, a store as failed (its slots stay invalid, the scheduler role never advertises
it). Until that copy ends, the worker is *wedged*: new transfers fail at once instead of
queueing behind it, and ``shutdown`` returns without it, logging the thread it could not
stop (a daemon: it does not keep the process alive). A load's copy writes the engine's
blocks straight from the pool, so one that outlives its deadline may still write them
after it was reported failed: the worker names its request *late*
(``FailedStores.late_loads``), the scheduler role delays the request's free when it
finishes and names it in ``OffloadMetadata.held``, and the worker reports it in
``finished_sending`` once the copy ended; a request aborted while its late copy runs is
reported in ``finished_recving`` only then (WRK-017).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import random
import threading
import time
from collections.abc import Mapping
from operator import eq
from typing import Any

import torch

from kvspec.protocols import (
    CapabilityError,
    ConnectorMetadata,
    ConnectorStats,
    EngineConfigView,
    FaultPlan,
    ForwardContextView,
    InvalidArgumentError,
    KVCacheLayout,
    KVSpecError,
    MetadataSlot,
    StateLayout,
    SupportsAggregate,
    TransferTimeoutError,
    WorkerConnector,
)

from ._pool import CopyPlan, HostPool, OffloadCapacityError
from ._runner import Runner
from ._stage import SaveStage
from ._scheduler import FailedStores, OffloadMetadata, OffloadSettings, TransferJob
from ._state import StatePool

__all__ = ["OffloadWorker"]

_log = logging.getLogger(__name__)
_LOCK_TIMEOUT_S = 5.0
_SHUTDOWN_WAIT_S = 5.0
"""At most this long ``shutdown`` waits for a copy that is running and not yet past its
deadline; a copy past it is not waited for at all."""
_HELP_WAIT_S = 0.05
"""The longest one ``get_finished`` waits, over all loads, for host-memory copies running
on the background thread, so that small loads are reported in the step they ran in."""


class _Job:
    """One request's load or store on this rank, as the worker tracks it."""

    __slots__ = ("job", "plan", "deadline", "cancelled", "lock", "future", "remaining",
                 "layers", "submitted", "index")

    def __init__(self, job: TransferJob, plan: CopyPlan | None, timeout_s: float) -> None:
        self.job = job
        self.plan = plan
        self.remaining = len(job)  # blocks of a queued layerwise store not yet in the pool
        self.deadline = time.monotonic() + timeout_s
        # Set by the engine's thread, read by the copy's (a bool: reads and writes of an
        # attribute are atomic, and nothing waits on it).
        self.cancelled = False
        self.lock = threading.Lock()
        self.future: concurrent.futures.Future[tuple[int, ...]] | None = None
        self.layers: tuple[threading.Event, ...] = ()  # a pipelined load: set per layer copied
        self.submitted = 0.0  # a pipelined load: when it was handed to the loader
        self.index: torch.Tensor | None = None  # a pipelined load: its plan's layer index


class OffloadWorker(WorkerConnector):
    """Worker role of the offloading backend (one per rank). See the module docstring.

    Raises:
        InvalidArgumentError: a bad rank or configuration (ERR-002).
    """

    def __init__(
        self, config: EngineConfigView, rank: int, *, store_path: str = "background"
    ) -> None:
        self._settings = OffloadSettings.from_config(config)
        if store_path not in ("background", "layerwise"):
            raise InvalidArgumentError(
                f"store_path is {store_path!r}; expected 'background' or 'layerwise'",
                clause="ERR-002",
            )
        self.store_path = store_path
        """``"background"``: stores gathered by the background thread; ``"layerwise"``:
        gathered by capturable ``save_kv_layer`` hooks into a staging buffer
        (``kvspec.backends.offload._stage``)."""
        self._stage: SaveStage | None = None
        self._save_queue: collections.deque[list[Any]] = collections.deque()  # [_Job, next]
        self._staged: list[tuple[_Job, int, int]] = []  # this forward's (job, start, end)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < config.world_size:
            raise InvalidArgumentError(
                f"rank must be an int in [0, {config.world_size}), got {rank!r}",
                clause="ERR-002",
            )
        self._rank = rank
        groups = config.kv_cache_groups
        self._groups = groups if len(groups) > 1 else ()
        if self._groups and (store_path != "background" or self._settings.sync_loads):
            raise CapabilityError(
                "the offload backend moves several KV-cache groups only with background "
                "stores and asynchronous loads (failures per request, KVG-005)",
                clause="KVG-002")
        self._state_ids = frozenset(config.state_group_ids) if self._groups else frozenset()
        self._attention_ids = tuple(g for g in range(len(self._groups))
                                    if g not in self._state_ids)
        self.states: StatePool | None = None
        """Host copies of the state groups' states, once ``register_state_caches`` ran."""
        self._state_args: tuple[Mapping[str, torch.Tensor], Mapping[int, StateLayout]] | None \
            = None
        self._asleep_states: torch.Tensor | None = None
        self._after_forward: list[_Job] = []  # several groups: stores run after the forward
        self._slot: MetadataSlot[OffloadMetadata] = MetadataSlot(OffloadMetadata)
        self._started = False
        self._layout: KVCacheLayout | None = None
        self.pool: HostPool | None = None
        """The host pool, once ``register_kv_caches`` ran."""
        self._slot_tags: list[int] = []  # the tag of each slot's last completed store
        self._stream: torch.cuda.Stream | None = None
        self._executor: Runner | None = None
        self._stuck: list[_Job] = []  # timed out while their copy ran: wedged until it ends
        self._closing = threading.Event()
        self._closed = False
        self._loads: dict[str, _Job] = {}
        self._stores: dict[str, list[_Job]] = {}  # each request's unfinished store jobs
        self._finishing: set[str] = set()  # finished requests whose stores still run
        self._store_failed: set[str] = set()  # a store of the request failed on this rank
        self._failed: frozenset[str] = frozenset()
        self._failed_stores: set[str] = set()
        # WRK-017: loads reported failed whose copy still ran (late), by request; those
        # not yet told to the scheduler role; the finished ones it holds for them; and
        # every request the engine said finished while its load was tracked here.
        self._late_copies: dict[str, list[_Job]] = {}
        self._late_new: set[str] = set()
        self._held: set[str] = set()
        self._ended: set[str] = set()
        self._invalid: frozenset[int] = frozenset()
        self._sync_invalid: set[int] = set()  # failed blocks of sync loads, not yet reported
        self._loader: Runner | None = None  # the pipelined sync loads' thread
        self._layer_of: dict[str, int] = {}  # layer name -> its storage (LAY-011)
        self._asleep_host: torch.Tensor | None = None  # the host pool kept during a sleep
        self._pipelined: list[_Job] = []  # this step's pipelined sync loads
        self._stats_lock = threading.Lock()
        self._counters: dict[str, int] = {}
        self._rng = random.Random(self._settings.fault_seed * 1_000_003 + rank)
        self._faults = FaultPlan.from_config(config)  # the conformance suite's fault seam
        self._timeout_s = self._faults.deadline(self._settings.io_timeout_s)

    # -- registration -----------------------------------------------------------------------

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout
    ) -> None:
        """Check the tensors against ``layout``, allocate the host pool once and start the
        background thread (WRK-001). Tensors are only indexed, never re-strided (LAY-009).

        Raises:
            InvalidArgumentError: called twice, or arguments of the wrong type (WRK-001).
            LayoutMismatchError: a tensor does not match ``layout`` (LAY-008).
            OffloadCapacityError: the pool does not fit ``offload_bytes`` (ERR-002).
        """
        if self._layout is not None or self._closed:
            raise InvalidArgumentError(
                "register_kv_caches called twice (or after shutdown)", clause="WRK-001"
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
        storages = self._check_tensors(kv_caches, layout)
        tensors = list(kv_caches.values())
        s = self._settings
        self.pool = HostPool(tensors[0], layout, s.offload_slots, s.offload_bytes, storages)
        self._slot_tags = [-1] * s.offload_slots
        self._bind_tensors(kv_caches, layout)
        self._layout = layout
        self._executor = Runner(f"kvspec-offload-rank{self._rank}")
        if s.sync_loads:
            self._loader = Runner(f"kvspec-offload-loader-rank{self._rank}", any_cpu=True)

    def _check_tensors(self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout
                       ) -> list[frozenset[int]]:
        """Check the tensors against ``layout`` (LAY-008); each group's layer storages."""
        tensors = list(kv_caches.values())
        layout.check_layer_tensors(tensors)  # one buffer at the stated offsets (LAY-008)
        storages: list[frozenset[int]] = []
        if len(self._attention_ids) > 1:  # the pool moves several attention groups
            slot_of = dict(zip(kv_caches, layout.layer_slots))
            for g, group in ((g, self._groups[g]) for g in self._attention_ids):
                missing = [n for n in group.layer_names if n not in slot_of]
                if missing:
                    raise InvalidArgumentError(
                        f"KV-cache group {g} names layers {missing[:3]} that were not "
                        f"registered; registered: {list(slot_of)[:4]}...", clause="KVG-001")
                storages.append(frozenset(slot_of[n] for n in group.layer_names))
        return storages

    def register_state_caches(
        self, state_caches: Mapping[str, torch.Tensor], layouts: Mapping[int, StateLayout]
    ) -> None:
        """Allocate the host copies of the state groups' states, one row per pool slot
        (STG-001); again after a wake (the rows, their contents included, are kept).

        Raises:
            InvalidArgumentError: before ``register_kv_caches``, layouts of other groups
                than the engine's state groups, or a layer without a tensor (STG-001).
            LayoutMismatchError: a tensor does not match its group's layout (LAY-008).
            OffloadCapacityError: the pool and the states do not fit ``offload_bytes``.
        """
        if self.pool is None:
            raise InvalidArgumentError(
                "register_state_caches before register_kv_caches", clause="STG-001")
        if set(layouts) != self._state_ids or not all(
                isinstance(v, StateLayout) for v in layouts.values()):
            raise InvalidArgumentError(
                f"register_state_caches got layouts of groups {sorted(layouts)}; the engine's "
                f"state groups are {sorted(self._state_ids)}", clause="STG-001")
        s = self._settings
        kept = self.states.host if self.states is not None else self._asleep_states
        self._asleep_states = None
        states = StatePool(state_caches, layouts,
                           {g: self._groups[g].layer_names for g in self._state_ids},
                           s.offload_slots)
        need = s.offload_slots * (self.pool.bytes_per_block + states.bytes_per_slot)
        if need > s.offload_bytes:
            raise OffloadCapacityError(
                f"offload_slots={s.offload_slots} slots of {self.pool.bytes_per_block} KV "
                f"bytes and {states.bytes_per_slot} state bytes need {need} bytes per rank; "
                f"the budget offload_bytes is {s.offload_bytes}", clause="ERR-002")
        if kept is not None and kept.shape == states.host.shape:
            states.host = kept
        self.states = states
        self._state_args = (state_caches, layouts)

    def _move_states(self, job: TransferJob, store: bool) -> int:
        """Copy ``job``'s state blocks (its state groups' non-null ids) to or from their
        slots; the bytes moved."""
        if not self._state_ids or not job.groups:
            return 0
        if self.states is None:
            raise InvalidArgumentError(
                "a job moves state blocks but no state caches are registered", clause="STG-001")
        return self.states.move({g: job.groups[g] for g in self._state_ids}, job.slots, store)

    def _bind_tensors(self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout
                      ) -> None:
        """What refers to the KV tensors besides the pool: the staging buffers, the
        stream, the pipelined loads' layer map."""
        assert self.pool is not None
        tensors = list(kv_caches.values())
        if self.store_path == "layerwise":
            self._stage = SaveStage(kv_caches, layout, self.pool, self._settings.stage_blocks)
        if tensors[0].is_cuda and self._stream is None:
            self._stream = torch.cuda.Stream(device=tensors[0].device)  # type: ignore[no-untyped-call]
        if self._settings.sync_loads and self.pool.layer_chunks:  # pipelined loads
            slots = layout.layer_slots
            self._layer_of = {name: slots[i] for i, name in enumerate(kv_caches)}

    # -- sleep and wake (WRK-018, WRK-019) ---------------------------------------------------

    def unregister_kv_caches(self) -> None:
        """Before the engine sleeps: wait (bounded) for any copy still running, then drop
        every reference to the KV tensors; the host pool, its contents and the scheduler
        role's index are kept, so what was stored before the sleep is served after the
        wake (WRK-018). Idempotent; nothing before registration or after shutdown.

        Raises:
            TransferTimeoutError: a copy still runs after ``io_timeout_s`` (WRK-014): the
                tensors cannot be released safely.
        """
        if self._closed or self.pool is None:
            return
        jobs = (*self._loads.values(), *self._pipelined, *self._stuck,
                *(j for js in self._stores.values() for j in js),
                *(j for js in self._late_copies.values() for j in js))
        deadline = time.monotonic() + self._settings.io_timeout_s
        for j in jobs:  # a drained engine leaves none running; a late copy may still
            if not j.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TransferTimeoutError(
                    f"rank {self._rank}: the copy of request {j.job.request_id!r} still runs "
                    f"{self._settings.io_timeout_s} s into unregister_kv_caches; the KV "
                    "tensors cannot be released", clause="WRK-018")
            j.lock.release()
        if self._stage is not None:
            self._stage.release()
        self._stage = None
        self._layer_of = {}
        self._asleep_host = self.pool.detach_kv()
        self.pool = None
        if self.states is not None:  # the state rows are kept, the tensors dropped
            self._asleep_states = self.states.host
            self.states = None

    def restore_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout
    ) -> None:
        """At wake: bind the pool's kept host memory to the tensors given, wherever they
        now lie (WRK-019). Idempotent: nothing unless ``unregister_kv_caches`` ran.

        Raises:
            InvalidArgumentError: arguments of the wrong type, or another layout than the
                one registered (WRK-019).
            LayoutMismatchError: a tensor does not match ``layout`` (LAY-008).
        """
        host = self._asleep_host
        if self._closed or host is None:
            return
        if not isinstance(layout, KVCacheLayout) or not isinstance(kv_caches, Mapping):
            raise InvalidArgumentError(
                "restore_kv_caches needs a mapping of layer tensors and a KVCacheLayout",
                clause="WRK-019")
        if layout != self._layout:
            raise InvalidArgumentError(
                "restore_kv_caches got another layout than register_kv_caches: the kept "
                "host pool holds blocks of the registered one", clause="WRK-019")
        storages = self._check_tensors(kv_caches, layout)
        s = self._settings
        self.pool = HostPool(list(kv_caches.values())[0], layout, s.offload_slots,
                             s.offload_bytes, storages, host=host)
        self._asleep_host = None
        self._bind_tensors(kv_caches, layout)

    # -- metadata ---------------------------------------------------------------------------

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        """Bind the step's metadata (WRK-003).

        Raises:
            InvalidArgumentError: ``metadata`` is not ``OffloadMetadata``.
        """
        self._slot.bind(metadata)  # type: ignore[arg-type]  # the slot checks the type
        self._started = False
        self._held.update(metadata.held)  # type: ignore[attr-defined]  # checked by bind

    def clear_connector_metadata(self) -> None:
        """Start the bound metadata's transfers if ``start_load_kv`` did not (a step without
        a forward), then forget the metadata (WRK-003). With ``store_path="layerwise"``, a
        step without a forward hands the queued store blocks to the background thread."""
        if self._slot.is_bound and not self._started:
            self._start(self._slot.get("clear_connector_metadata"))
            self._flush_queue()
        self._stores_after_forward()
        if self._stage is not None and self._stage.pending:  # wait_for_save never came
            self._stage.cancel()
            staged, self._staged = self._staged, []
            self._to_background(staged)
            self._flush_queue()
        self._slot.clear()

    def _flush_queue(self) -> None:
        if self._stage is None:
            return
        parts = [(j, start, len(j.job)) for j, start in self._save_queue]
        self._save_queue.clear()
        self._to_background(parts)

    def _store_range(self, j: _Job, start: int, end: int) -> None:
        """Background: store blocks ``start:end`` of a queued layerwise store job."""
        pool, job = self.pool, j.job
        if j.future is None or j.future.done():
            return
        if not j.lock.acquire(timeout=_LOCK_TIMEOUT_S):  # a fence waits on it (WRK-012)
            self._fail_store(j)
            return
        try:
            if pool is None or self._closing.is_set() or j.cancelled:
                self._fail_store(j)
                return
            plan = pool.plan(job.block_ids[start:end], job.slots[start:end])
            self._copy(pool, plan, True, None)
        except (KVSpecError, RuntimeError, ValueError) as e:
            _log.warning("rank %d: store of request %s failed: %s", self._rank,
                         job.request_id, str(e))
            self._fail_store(j)
            return
        finally:
            j.lock.release()
        self._stored(j, start, end)

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        """Submit the bound metadata's loads, then its stores, to the background thread
        (WRK-004); with ``sync_loads``, do the loads first, complete on return. Dummy
        forwards move nothing (DRY-006).

        Raises:
            MetadataNotBoundError: no metadata is bound (DRY-001).
            InvalidBlockIdError: a block outside the budget (LAY-012).
        """
        meta = self._slot.get("start_load_kv")
        if isinstance(forward_context, ForwardContextView) and forward_context.kind.is_dummy:
            if self._stage is not None:
                self._stage.fill((), ())  # the hooks run and store nothing (DRY-006)
            return
        self._start(meta)
        if self._stage is not None:
            self._fill_stage(self._stage)

    def _fill_stage(self, stage: SaveStage) -> None:
        """Point the stage at the next queued store blocks, at most ``stage_blocks``."""
        ids: list[int] = []
        slots: list[int] = []
        self._staged = []
        while self._save_queue and len(ids) < stage.size:
            entry = self._save_queue[0]
            j, start = entry
            job: TransferJob = j.job
            if j.cancelled or (j.future is not None and j.future.done()):
                self._save_queue.popleft()
                continue
            end = min(len(job), start + stage.size - len(ids))
            ids.extend(job.block_ids[start:end])
            slots.extend(job.slots[start:end])
            self._staged.append((j, start, end))
            if end == len(job):
                self._save_queue.popleft()
            else:
                entry[1] = end
        stage.fill(tuple(ids), tuple(slots))

    def build_dummy_connector_meta(self, forward_context: ForwardContextView) -> ConnectorMetadata:
        """Empty metadata for a dummy forward, built here (DRY-005..007); bound, the hooks
        run the same device work on the same persistent buffers and store nothing.

        Raises:
            UnsupportedOperationError: ``store_path="background"`` (no hooks to capture).
        """
        if self.store_path != "layerwise":
            return super().build_dummy_connector_meta(forward_context)
        if not isinstance(forward_context, ForwardContextView):
            raise InvalidArgumentError(
                f"forward_context must be a ForwardContextView, got "
                f"{type(forward_context).__name__}", clause="ERR-002",
            )
        return OffloadMetadata()

    @property
    def persistent_buffers(self) -> Mapping[str, torch.Tensor]:
        """The buffers the captured hooks use (GRA-005): ``save_idx`` and ``staging`` with
        ``store_path="layerwise"`` once registered; else empty."""
        return {} if self._stage is None else self._stage.buffers

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait, up to each load's deadline, until the step's pipelined sync loads copied
        ``layer_name``'s storage (WRK-005, WRK-014); a load past its deadline fails
        (``get_finished`` names its blocks invalid). Otherwise nothing to wait for:
        asynchronous loads complete before their requests are scheduled, other synchronous
        ones in ``start_load_kv``. Capturable: no device work at all."""
        self._slot.get("wait_for_layer_load")
        if not self._pipelined:
            return
        layer = self._layer_of.get(layer_name)
        for j in self._pipelined:
            if j.cancelled:
                continue  # past its deadline already: failed once, not again per layer
            done = j.layers[layer] if layer is not None else None
            if done is None or done.is_set():
                continue
            start = time.perf_counter()
            if not done.wait(max(0.0, j.deadline - time.monotonic())):
                self._cancel(j)  # reported failed by get_finished
            self._count(load_wait_us=int((time.perf_counter() - start) * 1e6))

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, forward_context: ForwardContextView
    ) -> None:
        """``store_path="layerwise"``: gather the staged store blocks of ``layer_name``
        into the persistent staging, capturable (WRK-006, GRA-004, GRA-005). Otherwise
        nothing: stores are gathered by the background thread.

        Raises:
            MetadataNotBoundError: no metadata is bound (DRY-001).
            InvalidArgumentError: an unregistered layer or a mis-shaped ``kv_layer``.
        """
        self._slot.get("save_kv_layer")
        if self._stage is not None:
            self._stage.save_layer(layer_name, kv_layer)

    def _start(self, meta: OffloadMetadata) -> None:
        self._started = True
        if not meta.loads and not meta.stores:
            return
        layout, executor = self._layout, self._executor
        if layout is None or executor is None or self._closed:
            raise InvalidArgumentError(
                "the metadata names transfers but no KV caches are registered (or the worker "
                "is shut down)", clause="WRK-001",
            )
        pool = self.pool
        assert pool is not None
        jobs: tuple[TransferJob, ...] = (*meta.loads, *meta.stores)  # loads first
        after_stores: tuple[TransferJob, ...] = ()
        if meta.loads and meta.stores:  # a load of a store in this step runs after it
            written = {s for job in meta.stores for s in job.slots}
            after_stores = tuple(job for job in meta.loads if not written.isdisjoint(job.slots))
            if after_stores:
                jobs = (*(job for job in meta.loads if job not in after_stores), *meta.stores,
                        *after_stores)
        plans = []
        for job in jobs:
            if job.is_load and job.request_id in self._loads:
                raise InvalidArgumentError(
                    f"request {job.request_id!r} already has a load in flight", clause="SCH-013",
                )
            plans.append(self._plan(pool, job, self._attention_ids) if self._state_ids
                         else self._plan(pool, job))  # range checks (LAY-012) happen here
        event = None
        if self._stream is not None:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()  # the forward's KV writes so far
        timeout = self._timeout_s
        wedged = self._wedged()
        sync = self._settings.sync_loads
        for job, plan in zip(jobs, plans):
            if sync and job.is_load:  # complete before the forward reads it: never reported
                if (self._layer_of and plan is not None and not pool.few(plan)
                        and job not in after_stores):
                    self._pipeline(pool, job, plan)
                else:
                    self._sync_invalid.update(self._sync_load(job, plan, event))
                continue
            j = _Job(job, plan, timeout)
            if wedged is not None:  # queued behind a stuck copy it would only time out
                self._failed_job(job)
                j.future = concurrent.futures.Future()
                j.future.set_result(job.block_ids)
            elif self._groups and not job.is_load:  # its blocks are written by this forward
                self._after_forward.append(j)
            elif self._stage is not None and not job.is_load:  # gathered by the hooks
                for slot in job.slots:
                    self._slot_tags[slot] = -1  # invalid until stored
                j.future = concurrent.futures.Future()
                self._save_queue.append([j, 0])
            else:
                j.future = executor.submit(self._run, j, event)
            if job.is_load:
                self._loads[job.request_id] = j
            else:
                self._stores.setdefault(job.request_id, []).append(j)

    def _wedged(self) -> _Job | None:
        """A timed-out job whose copy still runs (the background thread is stuck in it),
        or None; forgets those that ended."""
        if not self._stuck:
            return None
        self._stuck = [j for j in self._stuck if j.lock.locked()]
        return self._stuck[0] if self._stuck else None

    @staticmethod
    def _plan(pool: HostPool, job: TransferJob,
              attention: tuple[int, ...] | None = None) -> CopyPlan | None:
        """Check and plan ``job``'s copy: every block of a store; a load's blocks that have
        a slot (a slot of -1 was evicted: that block fails). None when nothing moves.
        ``attention``: the attention groups' indices when the engine has state groups (their
        columns move apart, ``StatePool``); None: every group is an attention group.

        Raises:
            InvalidBlockIdError: a block id outside the budget (LAY-012).
            OffloadCapacityError: a slot outside the pool (ERR-002).
        """
        if job.groups:  # a load that lacks a block fails as a whole (KVG-005)
            # The attention groups' columns; a state group's blocks move apart (StatePool).
            columns = [c for g, c in enumerate(job.groups)
                       if attention is None or g in attention] if pool.columns else []
            if -1 in job.slots:
                pool.plan(job.block_ids, [0] * len(job), checked=True, columns=columns)
                return None
            return pool.plan(job.block_ids, job.slots, checked=True, columns=columns)
        if job.is_load and -1 in job.slots:
            pool.plan(job.block_ids, [0] * len(job), checked=True)  # range-check every id
            keep = [i for i, s in enumerate(job.slots) if s >= 0]
            if not keep:
                return None
            return pool.plan([job.block_ids[i] for i in keep], [job.slots[i] for i in keep],
                             checked=True)
        return pool.plan(job.block_ids, job.slots, checked=True)

    # -- transfers (background thread) ------------------------------------------------------

    def _count(self, **counts: int) -> None:
        """Add ``counts`` to the step's counters (zeros are not counted)."""
        with self._stats_lock:
            counters = self._counters
            for name, n in counts.items():
                if n:
                    counters[name] = counters.get(name, 0) + n

    def _run(self, j: _Job, event: torch.cuda.Event | None) -> tuple[int, ...]:
        """Run one job; return the block ids that failed."""
        pool = self.pool
        job = j.job
        if pool is None or self._closing.is_set() or j.cancelled:
            return job.block_ids
        delay = max(self._settings.load_delay_s if job.is_load else 0.0, self._faults.delay_s)
        if delay:
            self._closing.wait(delay)  # returns early at shutdown
        if not j.lock.acquire(timeout=_LOCK_TIMEOUT_S):  # every wait is bounded (WRK-014)
            return job.block_ids
        try:
            if self._closing.is_set() or j.cancelled:
                return job.block_ids
            if job.is_load:
                return self._load(pool, j, job, j.plan, event)
            assert j.plan is not None
            return self._store(pool, j, j.plan, event)
        except (KVSpecError, RuntimeError, ValueError) as e:
            _log.warning("rank %d: %s of request %s failed: %s", self._rank,
                         "load" if job.is_load else "store", job.request_id, str(e))
            self._failed_job(job)
            return job.block_ids
        finally:
            j.lock.release()

    def _sync_load(self, job: TransferJob, plan: CopyPlan | None,
                   event: torch.cuda.Event | None) -> tuple[int, ...]:
        """Run a synchronous load on the loader thread and wait for it, up to its deadline
        (WRK-004, WRK-014); return the block ids that failed (all of them past the
        deadline: the copy is cancelled and, while it runs, wedges the loader). A loader
        stuck in an earlier copy fails it at once."""
        loader = self._loader
        assert loader is not None
        if self._closing.is_set() or any(s.lock.locked() and s.job.is_load
                                         for s in self._stuck):
            self._failed_job(job)
            return job.block_ids
        j = _Job(job, plan, self._timeout_s)
        j.future = future = loader.submit(self._run, j, event)
        done, _ = concurrent.futures.wait((future,), max(0.0, j.deadline - time.monotonic()))
        if not done:
            _log.warning("rank %d: load of request %s timed out", self._rank, job.request_id)
            self._cancel(j)
            self._count(load_failures=len(job))
            return job.block_ids
        return job.block_ids if future.cancelled() else future.result()

    def _failed_job(self, job: TransferJob) -> None:
        """Count a job that failed as a whole; a store's slots stay invalid."""
        if job.is_load:
            self._count(load_failures=len(job))
            return
        for slot in job.slots:
            self._slot_tags[slot] = -1
        self._count(store_failures=len(job))

    def _on_stream(self, event: torch.cuda.Event | None) -> torch.cuda.Stream | None:
        stream = self._stream
        if stream is not None and event is not None:
            stream.wait_event(event)
        return stream

    def _copy(self, pool: HostPool, plan: CopyPlan, store: bool,
              event: torch.cuda.Event | None) -> int:
        """Run the copy, complete on return; return how long it took, in microseconds
        (at least 1), for the caller's counters."""
        start = time.perf_counter()
        if self._stream is None:
            pool.store(plan) if store else pool.load(plan)
        else:
            stream = self._on_stream(event)
            assert stream is not None
            with torch.cuda.stream(stream):
                pool.store(plan) if store else pool.load(plan)
            stream.synchronize()  # complete before reported
        return max(1, int((time.perf_counter() - start) * 1e6))

    def _late(self, j: _Job) -> bool:
        """True (and logged) when ``j`` was cancelled while its copy ran: its request was
        already reported failed."""
        if not j.cancelled:
            return False
        _log.warning("rank %d: the %s of request %s ended after its deadline; it had been "
                     "reported failed", self._rank, "load" if j.job.is_load else "store",
                     j.job.request_id)
        return True

    def _store(self, pool: HostPool, j: _Job, plan: CopyPlan,
               event: torch.cuda.Event | None) -> tuple[int, ...]:
        tags = self._slot_tags
        job = j.job
        for s in job.slots:
            tags[s] = -1  # invalid until the copy completes
        if self._faults.fail_stores:
            raise RuntimeError("store failed by the fault plan (kvspec.faults)")
        micros = self._copy(pool, plan, True, event)
        state_bytes = self._move_states(job, True)
        if self._late(j):  # reported failed: its slots stay invalid
            self._count(store_copy_us=micros, store_failures=len(job))
            return job.block_ids
        for s, t in zip(job.slots, job.tags):
            tags[s] = t
        n = len(job)
        self._count(store_copy_us=micros, blocks_stored=n, bytes_stored=n * pool.bytes_per_block,
                    state_bytes_stored=state_bytes)
        return ()

    def _load(self, pool: HostPool, j: _Job | None, job: TransferJob, plan: CopyPlan | None,
              event: torch.cuda.Event | None) -> tuple[int, ...]:
        """Load ``job`` (tracked as ``j``, or None for a synchronous load)."""
        failed, plan = self._checked(pool, job, plan)
        if plan is not None and self._faults.stall_s:  # hung inside the copy: it goes on
            self._closing.wait(self._faults.stall_s)
        micros = self._copy(pool, plan, False, event) if plan is not None else 0
        state_bytes = self._move_states(job, False) if plan is not None and not failed else 0
        if j is not None and self._late(j):
            self._count(load_copy_us=micros, load_failures=len(job))
            return job.block_ids
        good = len(job) - len(failed)
        self._count(load_copy_us=micros, blocks_loaded=good,
                    bytes_loaded=good * pool.bytes_per_block, load_failures=len(failed),
                    state_bytes_loaded=state_bytes)
        return tuple(failed)

    def _checked(self, pool: HostPool, job: TransferJob, plan: CopyPlan | None
                 ) -> tuple[list[int], CopyPlan | None]:
        """The blocks of load ``job`` that fail (a slot holding another tag, or an injected
        fault), and the plan of the others (None when none is left)."""
        tags = self._slot_tags
        rate = 1.0 if self._faults.fail_loads else self._settings.load_fault_rate
        slots = job.slots
        if not rate and min(slots) >= 0 and all(map(eq, map(tags.__getitem__, slots), job.tags)):
            failed: list[int] = []  # the common case: every slot holds what the job expects
        else:
            failed = [
                b for b, s, t in zip(job.block_ids, slots, job.tags)
                if s < 0 or tags[s] != t or (rate and self._rng.random() < rate)
            ]
            if failed and job.groups:  # the request fails as a whole (KVG-005)
                return list(job.block_ids), None
            if failed and plan is not None:
                bad = set(failed)
                keep = [(b, s) for b, s in zip(job.block_ids, slots) if b not in bad]
                plan = pool.plan([b for b, _ in keep], [s for _, s in keep]) if keep else None
        return failed, plan

    def _pipeline(self, pool: HostPool, job: TransferJob, plan: CopyPlan) -> None:
        """Hand sync load ``job`` to the loader thread, to copy layer by layer while the
        forward runs (``wait_for_layer_load``); a stuck earlier one fails it at once."""
        loader = self._loader
        assert loader is not None
        j = _Job(job, plan, self._timeout_s)
        j.layers = tuple(threading.Event() for _ in pool.layer_chunks)
        j.future = concurrent.futures.Future()
        if any(s.lock.locked() and s.layers for s in self._stuck):  # the loader is stuck
            self._failed_job(job)
            j.future.set_result(job.block_ids)
            for done in j.layers:
                done.set()
        else:
            j.index = pool.layer_index(plan)
            j.submitted = time.perf_counter()
            j.future = loader.submit(self._run_pipelined, pool, j)
            self._count(loads_pipelined=1)
        self._pipelined.append(j)

    def _run_pipelined(self, pool: HostPool, j: _Job) -> tuple[int, ...]:
        """Loader thread: copy pipelined load ``j`` layer by layer, setting each layer's
        event; every event is set on return, whatever happened. Return the failed ids."""
        job = j.job
        try:
            delay = max(self._settings.load_delay_s, self._faults.delay_s)
            if delay:
                self._closing.wait(delay)  # returns early at shutdown
            if not j.lock.acquire(timeout=_LOCK_TIMEOUT_S):
                return job.block_ids
            try:
                if self._closing.is_set() or j.cancelled:
                    return job.block_ids
                failed, plan = self._checked(pool, job, j.plan)
                stall = [self._faults.stall_s]

                def stop() -> bool:
                    if j.cancelled or self._closing.is_set():
                        return True
                    if stall[0]:  # the fault plan: the first layer's copy hangs, then lands
                        self._closing.wait(stall.pop())
                        stall.append(0.0)
                    return False

                start = time.perf_counter()
                self._count(load_start_us=int((start - j.submitted) * 1e6))
                if plan is not None and not pool.load_by_layer(
                        plan, lambda n: j.layers[n].set(), stop,
                        j.index if plan is j.plan else None):
                    self._late(j)  # stopped between two layers
                    self._count(load_failures=len(job))
                    return job.block_ids
                micros = max(1, int((time.perf_counter() - start) * 1e6)) if plan else 0
                if self._late(j):
                    self._count(load_copy_us=micros, load_failures=len(job))
                    return job.block_ids
                good = len(job) - len(failed)
                self._count(load_copy_us=micros, blocks_loaded=good,
                            bytes_loaded=good * pool.bytes_per_block,
                            load_failures=len(failed))
                return tuple(failed)
            finally:
                j.lock.release()
        except (KVSpecError, RuntimeError, ValueError) as e:
            _log.warning("rank %d: load of request %s failed: %s", self._rank,
                         job.request_id, str(e))
            self._failed_job(job)
            return job.block_ids
        finally:
            for done in j.layers:
                done.set()  # a failed load's blocks are named invalid after the forward

    def _end_pipelined(self) -> None:
        """Wait, up to each deadline, for the step's pipelined loads the forward did not
        wait for to its end; their failed blocks (all on a timeout) become invalid."""
        for j in self._pipelined:
            future = j.future
            assert future is not None
            if not j.cancelled:
                concurrent.futures.wait((future,), max(0.0, j.deadline - time.monotonic()))
            if future.done() and not j.cancelled:
                self._sync_invalid.update(j.job.block_ids if future.cancelled()
                                          else future.result())
            else:
                if not j.cancelled:
                    _log.warning("rank %d: load of request %s timed out", self._rank,
                                 j.job.request_id)
                    self._cancel(j)
                self._sync_invalid.update(j.job.block_ids)  # counted by _late if it ends
        self._pipelined = []

    def _cancel(self, j: _Job) -> None:
        """Cancel ``j`` without waiting: a copy not started never starts; one running is
        left to end on its own (its result is discarded, ``_late``) and wedges the
        worker until then."""
        j.cancelled = True
        if j.future is not None:
            j.future.cancel()
        if j.lock.acquire(blocking=False):  # not running: it never will now
            j.lock.release()
        elif j.future is None or not j.future.done():
            _log.warning("rank %d: the %s of request %s is stuck past its deadline: reported "
                         "failed; new transfers fail until it ends", self._rank,
                         "load" if j.job.is_load else "store", j.job.request_id)
            self._stuck.append(j)
            if j.job.is_load:  # it may still write the request's blocks (WRK-017)
                rid = j.job.request_id
                self._late_copies.setdefault(rid, []).append(j)
                if rid not in self._ended:  # running: held by the scheduler role at its end
                    self._late_new.add(rid)

    def _help(self, j: _Job, until: float) -> None:
        """Let a host-memory load finish in this step: wait for its copy on the background
        thread until ``until`` or the load's deadline, whichever comes first. On CPU the
        background thread waits for the GIL while the engine's thread runs Python (up to
        the 5 ms switch interval, per wait), so a load it would finish in microseconds is
        reported steps later; waiting here releases the GIL to it. The copy never runs on
        the engine's thread: host memory can be a file mapping, a device or a page being
        swapped, and a copy that hangs must hold no hook past the load's deadline
        (WRK-014, issue 34)."""
        future = j.future
        if (self._stream is not None or self._settings.load_delay_s or self._faults.delay_s
                or future is None or future.done()):
            return
        timeout = min(until, j.deadline) - time.monotonic()
        if timeout > 0:
            concurrent.futures.wait((future,), timeout=timeout)

    def _outcome(self, j: _Job, now: float) -> tuple[int, ...] | None:
        """None while ``j`` runs; else the block ids that failed (all on a timeout)."""
        future = j.future
        if future is not None and future.done():
            if future.cancelled() or future.exception() is not None:
                return j.job.block_ids
            return future.result()
        if now >= j.deadline:
            _log.warning("rank %d: transfer of request %s timed out", self._rank,
                         j.job.request_id)
            self._cancel(j)
            return j.job.block_ids
        return None

    # -- completion -------------------------------------------------------------------------

    def get_finished(
        self, finished_req_ids: frozenset[str]
    ) -> tuple[frozenset[str], frozenset[str]]:
        """Return the finished requests whose stores all completed (sending) and the loads
        (recving) completed since the last call, each once (WRK-009, WRK-010); failed or
        timed-out loads count as completed (WRK-011, WRK-014). A failed store is still
        reported sending, and named in the worker metadata (its slots stay invalid). Held
        requests (``OffloadMetadata.held``) are reported sending once no late copy of
        theirs runs on this rank (WRK-017)."""
        if self._pipelined:
            self._end_pipelined()
        now = time.monotonic()
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        invalid: set[int] = set()
        until = now + _HELP_WAIT_S
        self._ended.update(r for r in finished_req_ids if r in self._loads)
        for rid, j in list(self._loads.items()):
            if rid in self._late_copies:  # finished while loading, its copy late: held back
                if self._copying(rid):
                    continue
                del self._loads[rid], self._late_copies[rid]
                self._ended.discard(rid)
                recving.add(rid)
                failed.add(rid)
                invalid.update(j.job.block_ids)
                continue
            self._help(j, until)
            bad = self._outcome(j, time.monotonic())
            if bad is None:
                continue
            if rid in self._ended and self._copying(rid):
                # Finished while loading (SCH-021): the engine frees its blocks once this
                # is reported, so it is reported only once the copy has ended (WRK-017).
                continue
            del self._loads[rid]
            self._ended.discard(rid)
            recving.add(rid)
            if bad:
                failed.add(rid)
                invalid.update(bad)
        if self._sync_invalid:  # failed sync loads: invalid blocks only (WRK-011)
            invalid.update(self._sync_invalid)
            self._sync_invalid.clear()
        # A request's stores (those planned while it ran and the last one) are reported
        # together, once it finished (WRK-010) and all of them ended.
        self._finishing.update(r for r in finished_req_ids if r in self._stores)
        for rid, jobs in list(self._stores.items()):
            if not jobs and rid not in self._finishing:
                continue  # a running request whose stores all ended: nothing to do yet
            running = []
            for j in jobs:
                bad = self._outcome(j, now)
                if bad is None:
                    running.append(j)
                elif bad:
                    self._store_failed.add(rid)
            self._stores[rid] = running
            if running or rid not in self._finishing or self._copying(rid):
                continue
            del self._stores[rid]
            self._finishing.discard(rid)
            self._held.discard(rid)
            sending.add(rid)
            if rid in self._store_failed:  # told to the scheduler role: never advertised
                self._store_failed.discard(rid)
                self._failed_stores.add(rid)
        self._release_held(sending)
        self._failed = frozenset(failed)
        # Several groups: a failed load is its request's, never block ids (KVG-005).
        self._invalid = frozenset(invalid) if not self._groups else frozenset()
        return frozenset(sending), frozenset(recving)

    def _copying(self, rid: str) -> bool:
        """True while a late copy of ``rid``'s load still runs on this rank."""
        return any(j.lock.locked() for j in self._late_copies.get(rid, ()))

    def _release_held(self, sending: set[str]) -> None:
        """Report the held requests (``OffloadMetadata.held``) whose late copy ended on
        this rank, or never ran here, and whose stores are not pending, in ``sending``
        (WRK-017); forget the late copies that ended of requests not held."""
        for rid in list(self._held):
            if rid not in self._stores and not self._copying(rid):
                self._held.discard(rid)
                sending.add(rid)
        for rid in list(self._late_copies):
            if rid not in self._held and rid not in self._loads and not self._copying(rid):
                del self._late_copies[rid]

    def get_failed_recving(self) -> frozenset[str]:
        """The loads of the last ``get_finished`` that failed (WRK-011)."""
        failed, self._failed = self._failed, frozenset()
        return failed

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        """The blocks of the last ``get_finished``'s failed loads (WRK-011, EVT-003)."""
        invalid, self._invalid = self._invalid, frozenset()
        return invalid

    def get_kv_connector_stats(self) -> SupportsAggregate | None:
        """``blocks_stored``, ``bytes_stored``, ``blocks_loaded``, ``bytes_loaded``,
        ``load_failures``, ``store_failures``, ``loads_pipelined`` (sync loads handed to the
        loader thread), the copy times ``store_copy_us`` and ``load_copy_us`` (background
        and loader copies; the layerwise path's drain is not timed), and for pipelined
        loads ``load_wait_us`` (how long the forward waited in ``wait_for_layer_load``) and
        ``load_start_us`` (from ``start_load_kv`` handing a load to the loader thread to
        its copy starting) since the last call, or None (EVT-006)."""
        with self._stats_lock:
            counters, self._counters = self._counters, {}
        # Zeros are never counted; the names are the worker's own, the values ints.
        return ConnectorStats._of_ints(counters) if counters else None

    def build_connector_worker_meta(self) -> SupportsAggregate | None:
        """The stores that failed and the loads named late since the last call
        (``FailedStores``), or None (WRK-016): the scheduler role must not advertise or
        match the failed stores, and holds the late loads' requests when they finish
        (WRK-017)."""
        if not self._failed_stores and not self._late_new:
            return None
        meta = FailedStores(self._failed_stores, self._late_new)
        self._failed_stores, self._late_new = set(), set()
        return meta

    def wait_for_save(self) -> None:
        """``store_path="background"``: return at once; stored blocks are held by a delayed
        free until reported, so no block the next step may overwrite is read (WRK-007).
        With several KV-cache groups, run the step's stores now and wait for them, up to
        their deadlines (``_stores_after_forward``).
        ``"layerwise"``: copy the blocks the forward staged into their pool slots (complete
        on return), and complete the store jobs whose blocks are all in the pool."""
        self._stores_after_forward()
        stage = self._stage
        if stage is None or not stage.pending:
            return
        staged, self._staged = self._staged, []
        if not stage.complete:  # a step without a forward: the hooks never ran
            stage.cancel()
            self._to_background(staged)
            self._flush_queue()  # no forward may come soon: the background stores the rest
            return
        try:
            stage.drain()
        except (KVSpecError, RuntimeError, ValueError) as e:
            _log.warning("rank %d: staged store failed: %s", self._rank, str(e))
            for j, _, _ in staged:
                self._fail_store(j)
            return
        for j, start, end in staged:
            self._stored(j, start, end)

    def _stores_after_forward(self) -> None:
        """Several groups: submit the stores held back by ``_start`` (their blocks are
        written now) and wait for them, up to each deadline: the engine may free a sliding
        window's blocks at its next schedule, so a copy still running is cancelled (it
        fails, its slots stay invalid, WRK-014)."""
        jobs, self._after_forward = self._after_forward, []
        if not jobs:
            return
        executor = self._executor
        assert executor is not None
        event = None
        if self._stream is not None:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()  # the forward's KV writes
        for j in jobs:
            j.future = executor.submit(self._run, j, event)
        for j in jobs:
            assert j.future is not None
            done, _ = concurrent.futures.wait((j.future,), max(0.0, j.deadline - time.monotonic()))
            if not done:
                self._cancel(j)

    def _stored(self, j: _Job, start: int, end: int) -> None:
        """Blocks ``start:end`` of queued store ``j`` are in the pool: tag their slots, and
        complete ``j`` once all of its blocks are (main or background thread)."""
        if self._faults.fail_stores:  # the fault plan: the store fails, its slots invalid
            self._fail_store(j)
            return
        job = j.job
        tags = self._slot_tags
        for s, t in zip(job.slots[start:end], job.tags[start:end]):
            tags[s] = t
        with self._stats_lock:
            j.remaining -= end - start
            done = j.remaining == 0
        if done and j.future is not None and not j.future.done():
            n = len(job)
            self._count(blocks_stored=n, bytes_stored=n * self._stage_bytes())
            j.future.set_result(())

    def _stage_bytes(self) -> int:
        return self.pool.bytes_per_block if self.pool is not None else 0

    def _fail_store(self, j: _Job) -> None:
        for slot in j.job.slots:
            self._slot_tags[slot] = -1
        self._count(store_failures=len(j.job))
        if j.future is not None and not j.future.done():
            j.future.set_result(j.job.block_ids)  # reported failed; its slots stay invalid

    def _to_background(self, parts: list[tuple[_Job, int, int]]) -> None:
        executor = self._executor
        for j, start, end in parts:
            if executor is None or j.cancelled:
                self._fail_store(j)
            else:
                executor.submit(self._store_range, j, start, end)

    def handle_preemptions(self, preempted_req_ids: frozenset[str]) -> None:
        """Wait, bounded by each transfer's deadline, for the transfers of preempted requests;
        cancel those still running (WRK-012, WRK-014). They are reported as usual. While a
        stuck copy wedges the worker, nothing queued behind it can run: cancelled at once."""
        for rid in preempted_req_ids:
            for j in (self._loads.get(rid), *self._stores.get(rid, ())):
                if j is None or j.future is None or j.future.done():
                    continue
                if self._stage is not None and not j.job.is_load:
                    self._fence_staged(j)
                    continue
                if self._wedged() is not None:
                    self._cancel(j)
                    continue
                try:
                    j.future.result(timeout=max(0.0, j.deadline - time.monotonic()))
                except concurrent.futures.TimeoutError:
                    self._cancel(j)
                except Exception:  # reported as failed by get_finished
                    pass

    def _fence_staged(self, j: _Job) -> None:
        """Stop a store queued for the per-layer hooks (the forwards that would gather it
        come after the preempted blocks are reused): no later range starts, and a range the
        background thread copies now is waited for, up to the job's deadline."""
        j.cancelled = True
        if j.lock.acquire(timeout=max(0.0, j.deadline - time.monotonic())):
            j.lock.release()
        else:
            self._stuck.append(j)
        self._fail_store(j)

    def shutdown(self) -> None:
        """Cancel queued work, wait a bounded time for a running copy (not at all for one
        already past its deadline) and for the thread, and release the host pool and every
        reference to the KV caches; idempotent (WRK-015). A thread stuck in a copy is
        logged by name and left behind (a daemon: it does not keep the process alive)."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        runner, self._executor = self._executor, None
        loader, self._loader = self._loader, None
        for j, _ in self._save_queue:  # queued for the hooks: never started
            if j.future is not None:
                j.future.cancel()
        self._save_queue.clear()
        self._staged = []
        if runner is not None:
            now = time.monotonic()
            jobs = (*self._loads.values(), *self._pipelined,
                    *(j for js in self._stores.values() for j in js))
            for j in jobs:
                if j.future is not None:
                    j.future.cancel()  # those not started; the running one goes on
            running = [j for j in (*jobs, *self._stuck) if j.lock.locked()]
            wait = min((max(0.0, j.deadline - now) for j in running), default=0.0)
            for thread in (runner, loader):
                if thread is not None and not thread.close(
                        max(0.05, min(wait, _SHUTDOWN_WAIT_S)) if running else _SHUTDOWN_WAIT_S):
                    stuck = self._wedged() or (running[0] if running else None)
                    _log.error("rank %d: thread %s did not stop: it is stuck in the %s; left "
                               "behind as a daemon thread", self._rank, thread.thread.name,
                               "copy of request " + stuck.job.request_id if stuck
                               else "a copy")
        self._loads.clear()
        self._pipelined = []
        self._sync_invalid.clear()
        self._stores.clear()
        self._finishing.clear()
        self._store_failed.clear()
        self._stuck = []
        self._late_copies.clear()
        self._late_new.clear()
        self._held.clear()
        self._ended.clear()
        if self._stage is not None:
            self._stage.release()
        self._stage = None
        if self.pool is not None:
            self.pool.release()
        self.pool = None
        self._asleep_host = None
        self._slot_tags = []
        self._stream = None
        self._slot.clear()
