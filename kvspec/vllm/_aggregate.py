"""vLLM's arm of ``kvspec bench aggregate``: vLLM's own executor aggregator on a trace."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

__all__ = ["vllm_arm"]


def vllm_arm(trace: Any) -> Callable[[], tuple[float, list[set[str]]]]:
    """A run of ``KVOutputAggregator`` over ``trace`` (``kvspec.bench.aggregate.Trace``):
    returns (seconds, completions per step). vLLM's aggregate rewrites the output of rank 0,
    so each run gets outputs of its own, built before the clock starts."""

    def outputs() -> list[list[Any]]:
        steps = []
        for step in trace.reports:
            outs = []
            for sending, recving in step:
                out = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
                out.kv_connector_output = KVConnectorOutput(
                    finished_sending=set(sending) or None, finished_recving=set(recving) or None)
                outs.append(out)
            steps.append(outs)
        return steps

    def run() -> tuple[float, list[set[str]]]:
        steps = outputs()
        agg = KVOutputAggregator(trace.ranks)
        aggregate = agg.aggregate
        done = []
        t0 = time.perf_counter()
        for outs in steps:
            done.append(aggregate(outs))
        seconds = time.perf_counter() - t0
        completed = []
        for out in done:
            kv = out.kv_connector_output
            completed.append(set(kv.finished_sending or ()) | set(kv.finished_recving or ()))
        return seconds, completed

    return run
