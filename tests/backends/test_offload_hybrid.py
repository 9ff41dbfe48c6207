"""The offload backend on a hybrid model (issue 33, KVG-001..KVG-006): a full-attention
group beside a sliding-window group. Every group's bytes are stored and loaded (the
harness checks each group's loaded bytes and the null block's poison after every step),
a match needs only the blocks each group attends to, and a failed load fails its request."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvspec.backends.offload import (
    LayerwiseOffloadConnector,
    OffloadConnector,
    OffloadMetadata,
    OffloadScheduler,
    SyncLoadOffloadConnector,
    TransferJob,
)
from kvspec.backends.offload._pool import HostPool
from kvspec.conformance.harness import Engine, HarnessConfig, RequestSpec, Workload
from kvspec.protocols import (
    NULL_BLOCK_ID,
    CapabilityError,
    ConnectorFactory,
    InvalidArgumentError,
    InvalidBlockIdError,
    KVCacheLayout,
    KVPacking,
    MalformedMetadataError,
)

WINDOW = 8
PROMPT = tuple(range(300, 341))  # 10 full blocks of 4 tokens and one token


def _cfg(**overrides: Any) -> HarnessConfig:
    extra = overrides.pop("extra", {})
    return HarnessConfig(**{"sliding_window": WINDOW, "prefix_caching": False,
                            "extra": extra, **overrides})


def _twice(tmp: str, **overrides: Any) -> tuple[int, OffloadScheduler, list[TransferJob]]:
    """Serve PROMPT, then serve it again: the tokens loaded the second time, the scheduler
    and every load job it planned."""
    loads: list[TransferJob] = []
    with Engine(OffloadConnector(), _cfg(**overrides), tmpdir=tmp) as engine:
        scheduler = engine.scheduler
        assert isinstance(scheduler, OffloadScheduler)
        build = scheduler.build_connector_meta

        def spy(output: Any) -> Any:
            meta = build(output)
            loads.extend(meta.loads)
            return meta

        scheduler.build_connector_meta = spy  # type: ignore[method-assign]
        engine.run(Workload([RequestSpec("first", PROMPT, max_new_tokens=2)], name="first"))
        result = engine.run(Workload([RequestSpec("again", PROMPT, max_new_tokens=2)],
                                     name="again"))
        assert scheduler.stats()["pinned_slots"] == 0
        return result.external_tokens.get("again", 0), scheduler, loads


@pytest.mark.parametrize("chunk", [4, 16], ids=["chunks-below-the-window", "chunks-of-twice-it"])
def test_a_hit_loads_every_group_and_skips_the_null_positions(tmp_path: Any, chunk: int) -> None:
    """Blocks are stored in the step that computes them, so even a chunk twice the window
    stores every window block before the engine frees it; the hit loads all 40 tokens:
    the full group's 10 blocks and only the window group's last two (tokens 33..39 are
    what token 40 attends to), the other window positions left null (KVG-003, KVG-004)."""
    loaded, scheduler, loads = _twice(str(tmp_path), max_tokens_per_step=chunk)
    assert loaded == 40
    (job,) = loads
    full, window = job.groups
    assert full == job.block_ids and NULL_BLOCK_ID not in full
    assert window[:8] == (NULL_BLOCK_ID,) * 8 and NULL_BLOCK_ID not in window[8:]
    stats = scheduler.stats()
    assert stats["hit_blocks"] == 10 and stats["load_failures"] == 0
    assert not scheduler._partial


@pytest.mark.parametrize(("generated", "hit"), [(2, 40), (12, 0)])
def test_stores_at_finish_hold_only_what_the_window_still_held(
        tmp_path: Any, generated: int, hit: int) -> None:
    """``offload_store="finished"``: at the finish the window group's early positions are
    already null, so those keys are stored partial, and a match is offered only where the
    window blocks it needs are whole. Finishing 2 tokens after the prompt, blocks 8 and 9
    (what token 40 attends to) were still held: the hit is whole. After 12 they were
    freed too: nothing is offered (loading the full group alone would leave the window
    layers' KV stale), the engine recomputes."""
    with Engine(OffloadConnector(), _cfg(extra={"offload_store": "finished"}),
                tmpdir=str(tmp_path)) as engine:
        scheduler = engine.scheduler
        assert isinstance(scheduler, OffloadScheduler)
        engine.run(Workload([RequestSpec("first", PROMPT, max_new_tokens=generated)]))
        result = engine.run(Workload([RequestSpec("again", PROMPT, max_new_tokens=2)]))
        assert len(scheduler._partial) == (8 if hit else 11)  # 11: a block of generated tokens
        assert scheduler.stats()["load_failures"] == 0
    assert result.external_tokens.get("again", 0) == hit


def test_a_failed_load_fails_its_request_and_names_no_block(tmp_path: Any) -> None:
    """Every loaded block fails: with several groups the worker reports the request in
    ``failed_recving`` and no block ids (KVG-005, which the harness checks); the engine
    recomputes and the stored blocks are dropped."""
    loaded, scheduler, _ = _twice(str(tmp_path), extra={"load_fault_rate": 1.0})
    stats = scheduler.stats()
    assert loaded == 0 and stats["load_failures"] == 10 and stats["pinned_slots"] == 0


@pytest.mark.parametrize("overrides", [{"tp_size": 2}, {"async_scheduling": True}],
                         ids=["tp2-processes", "async-scheduling"])
def test_a_hit_with_worker_processes_and_async_scheduling(tmp_path: Any,
                                                          overrides: dict[str, Any]) -> None:
    loaded, _, _ = _twice(str(tmp_path), **overrides)
    assert loaded == 40


@pytest.mark.parametrize("factory", [SyncLoadOffloadConnector(), LayerwiseOffloadConnector()],
                         ids=["sync-loads", "layerwise"])
def test_the_variants_that_move_one_group_are_refused_by_name(
        tmp_path: Any, factory: ConnectorFactory) -> None:
    with pytest.raises(CapabilityError, match=r"KV-cache group 1 \(sliding_window"):
        Engine(factory, _cfg(), tmpdir=str(tmp_path))


def _shared_pool() -> tuple[torch.Tensor, HostPool, KVCacheLayout]:
    """Two layer storages, each shared by one layer of each group, as vLLM's hybrid
    allocator shares them: group 0 = layers 0 and 2, group 1 = layers 1 and 3."""
    storage = torch.randn(2, 12, 2, 4, 8)  # (L storages, B, H, N, C)
    layout = KVCacheLayout.from_tensor(storage, packing=KVPacking.CONCAT, num_blocks=12,
                                       num_heads=2, head_size_k=4, shared_layers=((0, 1), (2, 3)))
    slots = layout.layer_slots
    groups = [frozenset({slots[0], slots[2]}), frozenset({slots[1], slots[3]})]
    return storage, HostPool(storage, layout, 4, 1 << 20, groups), layout


def test_a_storage_shared_by_two_groups_is_held_once_per_group() -> None:
    """KVG-008: position 0: group 0 at block 3, group 1 at block 5; position 1: block 4 and the
    null block. A store then a load into other blocks moves exactly those blocks' bytes
    of both storages, and never reads or writes block 0."""
    storage, pool, layout = _shared_pool()
    assert pool.bytes_per_block == 2 * layout.regions_per_block * layout.region_nbytes
    before = storage.clone()
    pool.store(pool.plan((3, 4), (0, 1), columns=((3, 4), (5, NULL_BLOCK_ID))))
    assert torch.equal(storage, before)
    storage[:, NULL_BLOCK_ID] = float("nan")  # poisoned: a read would store it, a write clear it
    poisoned = storage.clone()
    pool.load(pool.plan((7, 8), (0, 1), columns=((7, 8), (9, NULL_BLOCK_ID))))
    for dst, src in ((7, 3), (8, 4), (9, 5)):
        assert torch.equal(storage[:, dst], before[:, src])
    untouched = [b for b in range(12) if b not in (7, 8, 9)]
    assert torch.equal(storage[:, untouched].nan_to_num(1.0), poisoned[:, untouched].nan_to_num(1.0))
    assert not pool.host[1].view(torch.float32).isnan().any()  # the null block was not stored


def test_a_grouped_plan_is_checked() -> None:
    _, pool, _ = _shared_pool()
    with pytest.raises(InvalidArgumentError, match="group columns"):
        pool.plan((3,), (0,))
    with pytest.raises(InvalidBlockIdError):
        pool.plan((3,), (0,), columns=((3,), (12,)))


def test_group_columns_cross_the_wire_and_are_checked() -> None:
    job = TransferJob("r", (3, 4), (0, 1), (7, 7), True, groups=((3, 4), (5, NULL_BLOCK_ID)))
    meta = OffloadMetadata(loads=(job,))
    assert OffloadMetadata.decode(meta.encode()) == meta
    for groups in (((3, 4),), ((3, 4), (5,)), ((3, 4), (5, 5)), ((1, 2), (5, 6))):
        with pytest.raises(InvalidArgumentError):
            TransferJob("r", (3, 4), (0, 1), (7, 7), True, groups=groups)
    bad = meta.encode().replace(b"\x05\x00", b"\x05\x05")  # the window column names 5 twice
    with pytest.raises(MalformedMetadataError):
        OffloadMetadata.decode(bad)


class _LateWindowStores(OffloadScheduler):
    """KVG-007's bug, planted: a running request's blocks are stored in the step after the
    one that computed them (the one-group timing) with the window ids they were allocated,
    though the engine frees a window block at that step's schedule and hands it on."""

    def _store_running(self, scheduler_output: Any) -> None:
        from kvspec.backends.offload._scheduler import _Running

        todo = []
        for new in scheduler_output.scheduled_new_reqs:
            if new.request_id in self._known:
                r = self._running[new.request_id] = _Running(new.request, new.blocks, 0)
                todo.append((r, new.num_computed_tokens))
        for cached in scheduler_output.scheduled_cached_reqs:
            if cached.request_id in self._running:
                r = self._running[cached.request_id]
                r.extend(cached.new_blocks, replace=cached.resumed_from_preemption)
                todo.append((r, cached.num_computed_tokens))
        for r, computed in todo:
            full = min(len(r.request.block_hashes), computed // 4)
            if full > r.upto:
                start, r.upto = r.upto, full
                self._plan_store(r.request, r.block_ids, start, full, r.groups, (0, 0))


class _LateWindowConnector(OffloadConnector):
    scheduler_class = _LateWindowStores


def test_a_window_store_a_step_late_is_caught(tmp_path: Any) -> None:
    """KVG-007: chunks of 16 tokens, a window of 8. Stored a step late, the window blocks
    of a chunk's first tokens were already freed when the store read them; a later prompt
    that shares 20 tokens loads them (the window blocks token 20 attends to) and gets the
    poison the harness writes into window blocks it frees: KVG-007. The reference
    scheduler stores them in the step that computes them: the same hit is exact."""
    from kvspec.protocols import ContractViolation

    other = PROMPT[:21] + tuple(range(400, 420))
    work = [Workload([RequestSpec("first", PROMPT, max_new_tokens=2)], name="first"),
            Workload([RequestSpec("prefix", other, max_new_tokens=2)], name="prefix")]
    for factory, caught in ((OffloadConnector(), False), (_LateWindowConnector(), True)):
        with Engine(factory, _cfg(max_tokens_per_step=16), tmpdir=str(tmp_path)) as engine:
            if not caught:
                engine.run(work[0])
                assert engine.run(work[1]).external_tokens["prefix"] == 20
                continue
            engine.run(work[0])
            with pytest.raises(ContractViolation) as info:
                engine.run(work[1])
            assert info.value.clause == "KVG-007", info.value
