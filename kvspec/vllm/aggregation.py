"""vLLM's own executor aggregation, driven with kvspec's per-rank completion reports.

``vllm_outputs`` turns each step's per-rank ``(finished_sending, finished_recving)`` into the
``ModelRunnerOutput`` list vLLM's executor hands its ``KVOutputAggregator``;
``vllm_aggregator(ranks)`` is that aggregator's ``aggregate``; ``completions`` reads the
request ids one aggregated output completes. ``kvspec bench aggregate`` times vLLM's arm
with them, and checks that it completes what kvspec's aggregator completes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

__all__ = ["completions", "vllm_aggregator", "vllm_outputs"]

RankReport = tuple[Iterable[str], Iterable[str]]
"""One rank's ``(finished_sending, finished_recving)`` in one step."""


def vllm_outputs(steps: Iterable[Sequence[RankReport]]) -> list[list[Any]]:
    """Fresh ``ModelRunnerOutput`` lists, one per step and one output per rank; vLLM's
    aggregate rewrites rank 0's output, so each run needs outputs of its own."""
    out_steps = []
    for step in steps:
        outs = []
        for sending, recving in step:
            out = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
            out.kv_connector_output = KVConnectorOutput(
                finished_sending=set(sending) or None, finished_recving=set(recving) or None)
            outs.append(out)
        out_steps.append(outs)
    return out_steps


def vllm_aggregator(ranks: int) -> Callable[[list[Any]], Any]:
    """The ``aggregate`` of a fresh ``KVOutputAggregator`` for ``ranks`` workers."""
    aggregate: Callable[[list[Any]], Any] = KVOutputAggregator(ranks).aggregate
    return aggregate


def completions(output: Any) -> set[str]:
    """The request ids an aggregated output reports finished, sending or receiving."""
    kv = output.kv_connector_output
    return set(kv.finished_sending or ()) | set(kv.finished_recving or ())
