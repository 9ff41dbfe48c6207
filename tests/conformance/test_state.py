"""The harness's state group (issue 50): a RUNNING state group beside the attention layers,
its toy recurrent state read and checked before every step and written after (STG-002,
STG-003), new attention blocks zeroed; StateCache moves attention and state; planted
bugs are named by their clause."""

from __future__ import annotations

import os

import pytest

from kvspec.conformance.connectors.null import NullConnector
from kvspec.conformance.connectors.broken import (
    FullPromptStateConnector,
    LateStateReadConnector,
    LayerHookStateConnector,
    LowerBoundaryStateConnector,
)
from kvspec.conformance.connectors.state import StateCache
from kvspec.conformance.harness import Engine, HarnessConfig, RequestSpec, Workload
from kvspec.conformance.harness.scenarios import SCENARIOS
from kvspec.protocols import ContractViolation, GroupKind, InvalidArgumentError, StateCaching

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


@pytest.mark.kvspec_clause("STG-003")
def test_a_state_from_a_lower_boundary_is_stg003(tmp_path: os.PathLike[str]) -> None:
    prompt = tuple(range(300, 330))  # boundaries at 8, 16, 24 stored
    with pytest.raises(ContractViolation) as info:
        with Engine(LowerBoundaryStateConnector(), _cfg(), tmpdir=str(tmp_path)) as e:
            e.run(Workload([RequestSpec("a", prompt, max_new_tokens=2)]))
            e.run(Workload([RequestSpec("b", prompt, max_new_tokens=2)]))
    assert info.value.clause == "STG-003" and "state after 16 tokens" in info.value.observed


@pytest.mark.kvspec_clause("STG-005")
def test_a_state_saved_only_from_layer_hooks_is_stg005(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(ContractViolation) as info:
        with Engine(LayerHookStateConnector(), _cfg(), tmpdir=str(tmp_path)) as e:
            e.run(Workload([RequestSpec("a", PROMPT, max_new_tokens=2)]))
            e.run(Workload([RequestSpec("b", PROMPT, max_new_tokens=2)]))
    assert info.value.clause == "STG-005"


@pytest.mark.kvspec_clause("STG-006")
def test_a_state_read_one_step_late_is_stg006(tmp_path: os.PathLike[str]) -> None:
    """Stored after the next forward updated the block in place: the state after 30
    tokens under the key of 24."""
    prompt = tuple(range(300, 330))
    with pytest.raises(ContractViolation) as info:
        with Engine(LateStateReadConnector(), _cfg(), tmpdir=str(tmp_path)) as e:
            e.run(Workload([RequestSpec("a", prompt, max_new_tokens=2)]))
            e.run(Workload([RequestSpec("b", prompt, max_new_tokens=2)]))
    assert info.value.clause == "STG-006" and "state after 30 tokens" in info.value.observed


@pytest.mark.kvspec_clause("STG-004")
def test_an_async_full_prompt_match_with_a_state_group_is_stg004(
        tmp_path: os.PathLike[str]) -> None:
    """vLLM 0.32 rewinds an asynchronous match of all 24 prompt tokens to 23: the last
    token is applied to the loaded state (after 24) a second time."""
    prompt = tuple(range(300, 330))
    with Engine(FullPromptStateConnector(), _cfg(), tmpdir=str(tmp_path)) as e:
        e.run(Workload([RequestSpec("a", prompt, max_new_tokens=2)]))
        again = e.run(Workload([RequestSpec("b", prompt, max_new_tokens=2)]))
        assert again.external_tokens == {"b": 24}  # not a full prompt: right
        with pytest.raises(ContractViolation) as info:
            e.run(Workload([RequestSpec("c", prompt[:24], max_new_tokens=2)]))
    assert info.value.clause == "STG-004" and "after all 24 tokens" in info.value.observed


def test_statecache_never_matches_a_whole_prompt(tmp_path: os.PathLike[str]) -> None:
    """The control: StateCache leaves a prompt of whole blocks a token to compute, at the
    boundary below whose state it holds."""
    prompt = tuple(range(300, 330))
    with Engine(StateCache(), _cfg(), tmpdir=str(tmp_path)) as e:
        e.run(Workload([RequestSpec("a", prompt, max_new_tokens=2)]))
        result = e.run(Workload([RequestSpec("c", prompt[:24], max_new_tokens=2)]))
    assert result.external_tokens == {"c": 16}
