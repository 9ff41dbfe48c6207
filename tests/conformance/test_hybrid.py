"""The harness's hybrid model (issue 33): a full-attention group on the even layers and a
sliding-window group on the odd ones, whose out-of-window blocks the engine frees and
points at the null block, as vLLM's hybrid allocator does (KVG-001..KVG-006)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from kvspec.conformance.connectors.null import (
    NullConnector,
    NullScheduler,
    NullWorker,
)
from kvspec.conformance.connectors.shared_storage import SharedStorageConnector
from kvspec.conformance.harness import Engine, HarnessConfig, RequestSpec, Workload
from kvspec.conformance.harness.scenarios import SCENARIOS
from kvspec.protocols import (
    NULL_BLOCK_ID,
    AllocatedBlocks,
    CapabilityError,
    ContractViolation,
    EngineConfigView,
    ForwardContextView,
    GroupKind,
    InvalidArgumentError,
    KVCacheGroup,
    KVConnectorOutput,
    RequestView,
    SchedulerConnector,
    SchedulerOutputView,
    TransferRole,
    WorkerConnector,
)

WINDOW = 8


def _hybrid(**overrides: Any) -> HarnessConfig:
    return HarnessConfig(**{"sliding_window": WINDOW, "prefix_caching": False, **overrides})


class _Spy(NullScheduler):
    """Records every group list the engine hands out."""

    seen: list[tuple[str, AllocatedBlocks]]
    finished: list[tuple[str, AllocatedBlocks]]

    def update_state_after_alloc(self, request: RequestView, blocks: AllocatedBlocks,
                                 num_external_tokens: int) -> None:
        self.seen.append(("alloc", blocks))
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> Any:
        for new in scheduler_output.scheduled_new_reqs:
            self.seen.append((new.request_id, new.blocks))
        return super().build_connector_meta(scheduler_output)

    def request_finished_all_groups(self, request: RequestView, blocks: AllocatedBlocks
                                    ) -> tuple[bool, Mapping[str, Any] | None]:
        self.finished.append((request.request_id, blocks))
        return super().request_finished_all_groups(request, blocks)


class _SpyConnector(NullConnector):
    def __init__(self) -> None:
        self.scheduler: _Spy | None = None

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        self.scheduler = _Spy(config)
        self.scheduler.seen, self.scheduler.finished = [], []
        return self.scheduler


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_scenario_runs_on_the_hybrid_model(name: str) -> None:
    """Allocation with skipped positions, freeing as the window moves, preemption and
    aborts keep every in-window byte the forward reads exact, and the null block untouched
    (its poison is checked after every step)."""
    cfg = _hybrid(num_blocks=12 if name == "preemption" else 48)
    with Engine(NullConnector(), cfg) as e:
        result = e.run(SCENARIOS[name])
    assert set(result.finished) | set(result.aborted) == {
        r.request_id for r in SCENARIOS[name].requests}


def test_the_window_group_skips_what_the_window_left() -> None:
    """A 62-token prompt in chunks of 8, window 8, blocks of 4: the window group's list
    points the positions before the window at the null block; the full group never
    does; request_finished_all_groups gets both groups (KVG-006)."""
    spy = _SpyConnector()
    with Engine(spy, _hybrid(max_tokens_per_step=8)) as e:
        e.run(Workload([RequestSpec("long", tuple(range(200, 262)), max_new_tokens=3)]))
        assert e.config.engine_view(e.tmpdir).kv_cache_groups[1].window == WINDOW
    assert spy.scheduler is not None
    (rid, blocks), = spy.scheduler.finished
    full, window = blocks.groups
    assert rid == "long" and NULL_BLOCK_ID not in full and len(full) == len(window) == 16
    # after 64 computed tokens, the next token's window starts at token 57: block 14
    assert window[:14] == (NULL_BLOCK_ID,) * 14 and NULL_BLOCK_ID not in window[14:]
    assert not set(full) & set(window[14:])


def test_a_single_group_connector_is_refused_by_name(tmp_path: os.PathLike[str]) -> None:
    """KVG-002: the shared-storage connector declares one full-attention group."""
    with pytest.raises(CapabilityError, match=r"KV-cache group 1 \(sliding_window of 8 tokens"):
        Engine(SharedStorageConnector(), _hybrid(), tmpdir=str(tmp_path))


class _NullWriterWorker(NullWorker):
    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        super().start_load_kv(forward_context)
        if forward_context.step_id == 3:
            assert self._layout is not None
            self._tensors[1][NULL_BLOCK_ID].fill_(1.0)  # the window layer's null block

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor], layout: Any) -> None:
        super().register_kv_caches(kv_caches, layout)
        self._tensors = list(kv_caches.values())


class _NullWriter(NullConnector):
    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        return _NullWriterWorker(config, rank)


def test_a_write_to_the_null_block_is_kvg004() -> None:
    with pytest.raises(ContractViolation) as info:
        with Engine(_NullWriter(), _hybrid()) as e:
            e.run(SCENARIOS["chunked"])
    assert info.value.clause == "KVG-004" and "step 3" in info.value.observed


class _InvalidIdsWorker(NullWorker):
    def build_connector_output(self, finished_req_ids: frozenset[str]) -> KVConnectorOutput:
        return KVConnectorOutput(invalid_block_ids=frozenset({5}))


class _InvalidIds(NullConnector):
    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        return _InvalidIdsWorker(config, rank)


def test_invalid_block_ids_with_several_groups_are_kvg005() -> None:
    with pytest.raises(ContractViolation) as info:
        with Engine(_InvalidIds(), _hybrid()) as e:
            e.run(SCENARIOS["single"])
    assert info.value.clause == "KVG-005"


def test_engine_config_view_carries_the_groups() -> None:
    groups = _hybrid().kv_cache_groups()
    assert [(g.kind, g.layer_names) for g in groups] == [
        (GroupKind.FULL, ("model.layers.0.attn",)),
        (GroupKind.SLIDING_WINDOW, ("model.layers.1.attn",))]
    view = EngineConfigView(engine_id="e", role=TransferRole.BOTH, num_layers=2, block_size=4,
                            num_blocks=8, kv_cache_groups=list(groups))
    assert view.num_groups == 2 and view.kv_cache_groups == groups
    with pytest.raises(InvalidArgumentError, match="KVG-001"):
        EngineConfigView(engine_id="e", role=TransferRole.BOTH, num_layers=2, block_size=4,
                         num_blocks=8, kv_cache_groups=(groups[0], groups[0]))
    with pytest.raises(InvalidArgumentError, match="KVG-001"):
        EngineConfigView(engine_id="e", role=TransferRole.BOTH, num_layers=2, block_size=4,
                         num_blocks=8, kv_cache_groups=("full",))
    assert KVCacheGroup(GroupKind.FULL, 4, ("a",)) != groups[0]


@pytest.mark.parametrize("bad", [
    {"sliding_window": 0}, {"sliding_window": True}, {"sliding_window": 8, "num_layers": 1},
    {"sliding_window": 8, "prefix_caching": True},
])
def test_hybrid_config_is_checked(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError, match="sliding_window"):
        HarnessConfig(**{"prefix_caching": False, **bad})


@pytest.mark.parametrize("overrides", [{"tp_size": 2}, {"async_scheduling": True}],
                         ids=["tp2", "async"])
def test_the_hybrid_model_runs_with_worker_processes_and_async_scheduling(
        overrides: dict[str, Any]) -> None:
    """The window group's tables reach worker processes (plain data) and survive metadata
    built a step ahead."""
    with Engine(NullConnector(), _hybrid(max_tokens_per_step=8, **overrides)) as e:
        for name in ("chunked", "preemption"):
            e.run(SCENARIOS[name])


def test_two_hybrid_engines_hand_requests_over() -> None:
    """A prefill and a decode engine on the hybrid model: the hand-off's params and every
    group's block lists cross the two engines' scheduler views."""
    from kvspec.conformance.harness import run_disaggregated

    prefill, decode = run_disaggregated(NullConnector(), SCENARIOS["chunked"],
                                        prefill=_hybrid(), decode=_hybrid())
    assert set(decode.finished) == {r.request_id for r in SCENARIOS["chunked"].requests}
