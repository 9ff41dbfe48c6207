"""kvspec's StandardAggregator with salvaged outputs (``defer``, EXE-013) completes exactly
what vLLM 0.33's KVOutputAggregator completes with ``ft_defer_kv_connector_outputs``, step by
step, on random traces of reports and failed steps. Skipped where the installed vLLM has no
fault-tolerant aggregation (before 0.33)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from kvspec.protocols import Direction, KVConnectorOutput, StandardAggregator  # noqa: E402
from kvspec.vllm.aggregation import vllm_outputs  # noqa: E402

_utils = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.utils")
if not hasattr(_utils.KVOutputAggregator, "ft_defer_kv_connector_outputs"):
    pytest.skip("this vLLM's KVOutputAggregator has no ft_defer_kv_connector_outputs "
                "(fault-tolerant aggregation is new in vLLM 0.33)", allow_module_level=True)

Trace = tuple[int, list[list[tuple[set[str], set[str]]]], frozenset[int]]


@st.composite
def traces(draw: st.DrawFn) -> Trace:
    """Ranks, per step and rank the (sending, recving) ids reported, and the failed steps:
    every request/direction reported once by every rank, in random steps."""
    world = draw(st.integers(1, 4))
    steps = draw(st.integers(2, 6))
    reports = [[(set[str](), set[str]()) for _ in range(world)] for _ in range(steps)]
    for name in draw(st.lists(st.sampled_from("abcdefgh"), unique=True, max_size=6)):
        for d in draw(st.sampled_from([(0,), (1,), (0, 1)])):
            for rank in range(world):
                reports[draw(st.integers(0, steps - 1))][rank][d].add(name)
    failed = draw(st.frozensets(st.integers(0, steps - 2)))
    return world, reports, failed


@settings(max_examples=200, deadline=None)
@given(traces())
def test_defer_completes_what_vllm_ft_defer_completes(trace: Trace) -> None:
    world, reports, failed = trace
    ours = StandardAggregator(world)
    names = {n for step in reports for rank in step for ids in rank for n in ids}
    for n in names:
        for d, direction in enumerate((Direction.SEND, Direction.RECV)):
            if any(n in rank[d] for step in reports for rank in step):
                ours.expect(n, direction)
    theirs_obj = _utils.KVOutputAggregator(world)
    vsteps = vllm_outputs(reports)
    for i, step in enumerate(reports):
        mine = [KVConnectorOutput(finished_sending=s, finished_recving=r) for s, r in step]
        if i in failed:
            ours.defer(dict(enumerate(mine)))
            theirs_obj.ft_defer_kv_connector_outputs(
                [o.kv_connector_output for o in vsteps[i]])
            continue
        got = ours.aggregate(mine)
        kv = theirs_obj.aggregate(vsteps[i]).kv_connector_output
        assert set(got.finished_sending) == set(kv.finished_sending or ())
        assert set(got.finished_recving) == set(kv.finished_recving or ())
    assert ours.pending() == {}
