"""The harness's state group (issue 50): a RUNNING state group beside the attention layers,
its toy recurrent state read and checked before every step and written after (STG-002,
STG-003), new attention blocks zeroed; StateCache moves attention and state; planted
bugs are named by their clause."""

from __future__ import annotations

import os

import pytest

from kvspec.conformance.connectors.null import NullConnector
from kvspec.conformance.connectors.state import (
    StateCache,
    StateCacheScheduler,
    StateCacheWorker,
    state_key,
)
from kvspec.conformance.harness import Engine, HarnessConfig, RequestSpec, Workload
from kvspec.conformance.harness.scenarios import SCENARIOS
from kvspec.protocols import (
    ContractViolation,
    EngineConfigView,
    GroupKind,
    InvalidArgumentError,
    SchedulerConnector,
    StateCaching,
    WorkerConnector,
)

PROMPT = tuple(range(300, 322))


def _cfg(**kw: object) -> HarnessConfig:
    return HarnessConfig(**{"state_layers": 2, "prefix_caching": False,
                            "max_tokens_per_step": 8, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_scenario_runs_with_a_state_group(name: str) -> None:
    cfg = _cfg(max_tokens_per_step=32, num_blocks=12 if name == "preemption" else 48)
    with Engine(NullConnector(), cfg) as e:
        result = e.run(SCENARIOS[name])
    assert set(result.finished) | set(result.aborted) == {
        r.request_id for r in SCENARIOS[name].requests}


def test_the_state_group_is_described() -> None:
    cfg = _cfg()
    groups = cfg.engine_view("/tmp").kv_cache_groups
    assert [g.kind for g in groups] == [GroupKind.FULL, GroupKind.STATE]
    assert groups[1].state_caching is StateCaching.RUNNING
    assert groups[1].block_size == cfg.max_model_len
    lay = cfg.state_layout()
    assert lay.page_pitch_bytes == cfg.block_size * cfg.num_heads * 2 * cfg.head_size * 2
    with pytest.raises(InvalidArgumentError):
        HarnessConfig(state_layers=1)  # prefix caching on: ALIGNED is not modelled


@pytest.mark.kvspec_clause("STG-002")
def test_statecache_loads_attention_and_the_state_after_exactly_n(
        tmp_path: os.PathLike[str]) -> None:
    """A repeated prompt matches 16 tokens (the state read at the end of the step that
    computed token 16) and every later step reads the state after exactly its tokens."""
    with Engine(StateCache(), _cfg(), tmpdir=str(tmp_path)) as e:
        e.run(Workload([RequestSpec("a", PROMPT, max_new_tokens=3)]))
        e.run(Workload([RequestSpec("b", PROMPT, max_new_tokens=3)]))
        assert e._matched == {"b": 16}


class _LowerBoundaryScheduler(StateCacheScheduler):
    """Loads the state of the boundary one block below the match (STG-003)."""

    def update_state_after_alloc(self, request, blocks, num_external_tokens):  # type: ignore[no-untyped-def]
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if self.state_loads:
            block, key = self.state_loads[-1]
            keys = [h.hex() for h in request.block_hashes]
            below = [j for j in range(keys.index(key[:-1])) if self.on_disk(state_key(keys[j]))]
            if below:  # the highest stored boundary below the match
                self.state_loads[-1] = (block, state_key(keys[below[-1]]))


class LowerBoundaryState(StateCache):
    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        return _LowerBoundaryScheduler(config)


class _LayerHookWorker(StateCacheWorker):
    """Saves state only from save_kv_layer, which state layers never get (STG-005), and
    loads whatever it has, silently."""

    def wait_for_save(self) -> None:
        super(StateCacheWorker, self).wait_for_save()  # attention only

    def start_load_kv(self, forward_context):  # type: ignore[no-untyped-def]
        super(StateCacheWorker, self).start_load_kv(forward_context)  # attention only


class _NoStateCheckScheduler(StateCacheScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):  # type: ignore[no-untyped-def]
        return StateCacheScheduler.__mro__[1].get_num_new_matched_tokens(  # TinyCache's
            self, request, num_computed_tokens)


class LayerHookState(StateCache):
    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        return _NoStateCheckScheduler(config)

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        return _LayerHookWorker(config, rank)


@pytest.mark.kvspec_clause("STG-003")
def test_a_state_from_a_lower_boundary_is_stg003(tmp_path: os.PathLike[str]) -> None:
    prompt = tuple(range(300, 330))  # boundaries at 8, 16, 24 stored
    with pytest.raises(ContractViolation) as info:
        with Engine(LowerBoundaryState(), _cfg(), tmpdir=str(tmp_path)) as e:
            e.run(Workload([RequestSpec("a", prompt, max_new_tokens=2)]))
            e.run(Workload([RequestSpec("b", prompt, max_new_tokens=2)]))
    assert info.value.clause == "STG-003" and "state after 16 tokens" in info.value.observed


@pytest.mark.kvspec_clause("STG-005")
def test_a_state_saved_only_from_layer_hooks_is_stg005(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(ContractViolation) as info:
        with Engine(LayerHookState(), _cfg(), tmpdir=str(tmp_path)) as e:
            e.run(Workload([RequestSpec("a", PROMPT, max_new_tokens=2)]))
            e.run(Workload([RequestSpec("b", PROMPT, max_new_tokens=2)]))
    assert info.value.clause == "STG-005"
