"""The harness configuration the suite gives a connector follows its declaration."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvspec.conformance.harness import RequestSpec
from kvspec.conformance.harness.workload import scale_request
from kvspec.conformance.suite._harness_runs import config_for, layout_cases
from kvspec.protocols import Capabilities, KVPacking, StrideOrder


def test_first_declared_layout_and_block_size_are_used() -> None:
    caps = Capabilities(accepted_layouts=("HND", "NHD"), block_sizes=(32, 64))
    cfg = config_for(caps)
    assert cfg.order is StrideOrder.LBHNC and cfg.block_size == 32
    assert config_for(caps, block_size=64, order="NHD").block_size == 64  # tests override


def test_undeclared_block_size_keeps_the_harness_default() -> None:
    assert config_for(Capabilities()).block_size == config_for(Capabilities(), order="NHD").block_size


def test_layout_cases_follow_split_kv() -> None:
    assert layout_cases(Capabilities(accepted_layouts=("HND",), accepts_split_kv=False)) == [
        (StrideOrder.LBHNC, KVPacking.CONCAT)]
    assert len(layout_cases(Capabilities())) == 12


def test_a_larger_declared_block_scales_the_workloads_and_budgets() -> None:
    """vLLM-CPU connectors take blocks of 32: at the harness's 4-token prompts they saw no
    full block, so most of the suite loaded nothing and passed vacuously. The workloads'
    tokens, the step budget and the capture sizes now scale with the declared block."""
    cfg = config_for(Capabilities(block_sizes=(32,)), max_tokens_per_step=8)
    assert (cfg.block_size, cfg.token_scale, cfg.max_tokens_per_step) == (32, 8, 64)
    assert cfg.capture_sizes == (64, 256)
    assert config_for(Capabilities()).token_scale == 1
    assert config_for(Capabilities(block_sizes=(32,)), block_size=32).token_scale == 1


@given(prompts=st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=30), min_size=2,
                        max_size=4), scale=st.sampled_from([2, 8]))
def test_scaled_prompts_keep_blocks_shared_prefixes_and_remainders(
        prompts: list[list[int]], scale: int) -> None:
    design, block = 4, 4 * scale
    for p in prompts:
        s = scale_request(RequestSpec("r", tuple(p)), block, scale).prompt
        assert len(s) // block == len(p) // design and len(s) % block == len(p) % design
    a, b = prompts[0], prompts[1]
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    sa = scale_request(RequestSpec("a", tuple(a)), block, scale).prompt
    sb = scale_request(RequestSpec("b", tuple(b)), block, scale).prompt
    shared = next((i for i, (x, y) in enumerate(zip(sa, sb)) if x != y), min(len(sa), len(sb)))
    assert shared // block == common // design  # the same full blocks are shared
