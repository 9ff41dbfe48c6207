"""vLLM's arm of ``kvspec bench aggregate`` runs vLLM's KVOutputAggregator on the trace and
completes exactly what kvspec's StandardAggregator completes (the bench checks it)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


def test_vllm_arm_agrees_with_kvspec_on_every_completion() -> None:
    from kvspec.bench.aggregate import AggregatePoint, run_aggregate_bench, vllm_arm_factory

    assert vllm_arm_factory() is not None
    (result,) = run_aggregate_bench([AggregatePoint(4, 300)], repeats=1)
    assert result.vllm_us is not None and result.vllm_us > 0
