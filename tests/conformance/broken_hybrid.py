"""Deliberately broken variants of the offload backend on hybrid models, one KVG clause
each (issue 33): what connectors get wrong when an engine runs several KV-cache groups.
``test_broken.py`` runs each through the real plugin in a subprocess and expects its
clause, and no other, to fail. They live with the tests: the conformance package does not
depend on the reference backends."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import msgspec
import torch

from kvspec.backends.offload import OffloadConnector, OffloadScheduler
from kvspec.backends.offload._pool import CopyPlan, HostPool
from kvspec.backends.offload._scheduler import TransferJob
from kvspec.backends.offload._worker import OffloadWorker
from kvspec.protocols import NULL_BLOCK_ID, EngineConfigView, KVCacheLayout

__all__ = ["BROKEN_HYBRID", "BlockFailuresConnector", "NullBlockConnector",
           "OneGroupConnector", "StaleWindowConnector"]


class _Broken(OffloadConnector):
    violates: ClassVar[str] = ""
    selection: ClassVar[str] = "test_hybrid_model"
    label: ClassVar[str] = ""

    @property
    def name(self) -> str:
        return f"broken-{self.label}"


# ---------------------------------------------------------------- loads one group only


class _OneGroupWorker(OffloadWorker):
    @staticmethod
    def _plan(pool: HostPool, job: TransferJob) -> CopyPlan | None:
        if job.is_load and job.groups:  # every group but the first left out of the load
            first, *rest = job.groups
            job = attrs.evolve(job, groups=(first, *((NULL_BLOCK_ID,) * len(c) for c in rest)))
        return OffloadWorker._plan(pool, job)


class OneGroupConnector(_Broken):
    """Breaks KVG-003: loads only the first KV-cache group's blocks of a hit, as a
    connector written for one group does; the window layers read stale KV."""

    violates = "KVG-003"
    label = "one-group"
    worker_class = _OneGroupWorker


# --------------------------------------------------------- the null block not skipped


class _UnmaskedPool(HostPool):
    def _grouped(self, plan: CopyPlan, store: bool) -> None:
        e = self.entries_per_block
        ids = torch.tensor(plan.columns, dtype=torch.int64).index_select(0, self._entry_col)
        kv = torch.add(self._entry_base, ids, alpha=self._entry_stride).flatten()
        host = (torch.tensor(plan.slots).unsqueeze(0) * e
                + torch.arange(e).unsqueeze(1)).flatten()  # the null positions included
        if store:
            self._host.index_put_((host,), self._view.index_select(0, kv))
        else:
            self._view.index_put_((kv,), self._host.index_select(0, host))


class _NullBlockWorker(OffloadWorker):
    def register_kv_caches(self, kv_caches: Any, layout: KVCacheLayout) -> None:
        super().register_kv_caches(kv_caches, layout)
        assert self.pool is not None
        self.pool.__class__ = _UnmaskedPool


class NullBlockConnector(_Broken):
    """Breaks KVG-004: moves the positions a group skipped too, reading and writing the
    shared null block."""

    violates = "KVG-004"
    label = "null-block"
    worker_class = _NullBlockWorker


# ------------------------------------------------- window blocks it never stored


class _StaleWindowScheduler(OffloadScheduler):
    def __init__(self, config: EngineConfigView, **kwargs: Any) -> None:
        extra = {**config.extra, "offload_store": "finished"}
        super().__init__(attrs.evolve(config, extra=extra), **kwargs)

    def _plan_store(self, *args: Any, **kwargs: Any) -> bool:
        planned = super()._plan_store(*args, **kwargs)
        self._partial.clear()  # forgets which keys were stored without their window
        return planned


class StaleWindowConnector(_Broken):
    """Breaks KVG-003: stores at the finish, when the window's early blocks are already
    freed, and then offers matches as if every group's blocks were stored: a hit loads
    window blocks it never stored."""

    violates = "KVG-003"
    label = "stale-window"
    scheduler_class = _StaleWindowScheduler


# -------------------------------------------------- failures named by block id


class _BlockFailuresWorker(OffloadWorker):
    def __init__(self, config: EngineConfigView, rank: int, **kwargs: Any) -> None:
        super().__init__(config, rank, **kwargs)
        self._settings = msgspec.structs.replace(self._settings, load_fault_rate=1.0)  # every load fails

    def get_finished(self, finished_req_ids: frozenset[str]
                     ) -> tuple[frozenset[str], frozenset[str]]:
        groups, self._groups = self._groups, ()  # reports failed blocks as with one group
        try:
            return super().get_finished(finished_req_ids)
        finally:
            self._groups = groups


class BlockFailuresConnector(_Broken):
    """Breaks KVG-005: with several groups, names a failed load's blocks in
    ``invalid_block_ids`` (ids another group may hold too) instead of failing the request
    alone."""

    violates = "KVG-005"
    label = "block-failures"
    worker_class = _BlockFailuresWorker


BROKEN_HYBRID: tuple[tuple[type[_Broken], str], ...] = tuple(
    (cls, cls.violates) for cls in (OneGroupConnector, NullBlockConnector,
                                    StaleWindowConnector, BlockFailuresConnector))
"""Every broken hybrid variant with the clause it breaks."""
