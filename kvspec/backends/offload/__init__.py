"""Host-memory offloading backend: KV blocks kept in a per-rank host buffer pool.

The reference offloading connector (``kvspec.backends.offload:OffloadConnector``, name
``"offload"``), in the spirit of LMCache's CPU backend and vLLM's OffloadingConnector:

* the scheduler role (``OffloadScheduler``) looks up the longest stored prefix by the
  engine's chained, salted block hashes (SCH-020) with the matching rules of SCH-001 and
  SCH-004..007, places each stored block in a slot of the host pools, evicts with LRU or
  ARC (``LRUPolicy``, ``ARCPolicy``) under the slot budget, pins the slots of
  in-flight loads, stores a running request's prompt blocks while it runs (fenced on
  preemption, WRK-012) and the rest in ``request_finished``, with a delayed free until
  all of the request's stores are reported (SCH-016), and emits ``BlockStored`` / ``BlockRemoved`` events (EVT-004, EVT-005);
* each rank's worker role (``OffloadWorker``) allocates its ``HostPool`` once in
  ``register_kv_caches`` and moves blocks with vectorised gathers/scatters on a background
  thread, reporting failed loads as invalid blocks (WRK-011) and stats (EVT-006).

Configuration: ``OffloadSettings`` (``config.extra``: ``offload_bytes``,
``offload_slots``, ``eviction``, ``io_timeout_s``, ``load_delay_s``, ``load_fault_rate``,
``fault_seed``, ``offload_stage_blocks``, ``offload_store``, ``sync_loads``).
``SyncLoadOffloadConnector`` (name ``"offload-sync"``) is the backend with ``sync_loads``:
each load is done in the step's ``start_load_kv``, before the forward (WRK-004), and never
reported in ``finished_recving``.
"""

from __future__ import annotations

from ._eviction import ARCPolicy, EvictionPolicy, LRUPolicy, make_policy
from ._pool import HostPool, OffloadCapacityError
from ._scheduler import (
    MEDIUM,
    FailedStores,
    OffloadMetadata,
    OffloadScheduler,
    OffloadSettings,
    TransferJob,
)
from ._worker import OffloadWorker
from .connector import LayerwiseOffloadConnector, OffloadConnector, SyncLoadOffloadConnector

__all__ = [
    "ARCPolicy",
    "EvictionPolicy",
    "FailedStores",
    "HostPool",
    "LayerwiseOffloadConnector",
    "LRUPolicy",
    "MEDIUM",
    "OffloadCapacityError",
    "OffloadConnector",
    "OffloadMetadata",
    "OffloadScheduler",
    "OffloadSettings",
    "OffloadWorker",
    "SyncLoadOffloadConnector",
    "TransferJob",
    "make_policy",
]
