"""``kvspec bench aggregate``: kvspec's executor aggregator against vLLM's, on one trace.

A synthetic trace: ``requests`` requests finish over ``requests // 10`` steps, half of them
sending (a delayed free) and half receiving (an async load); each of ``ranks`` ranks reports
each request once, zero to two steps after it became awaited, so completions straddle
steps. Both arms aggregate the same trace, outputs built before the clock starts:

* **kvspec**: ``StandardAggregator``, with the engine's registrations (EXE-011) inside the
  timed loop: each step's new awaited requests, per direction, with ``expect_many``;
* **vLLM**: ``KVOutputAggregator`` (vLLM's executor), on ``ModelRunnerOutput`` objects
  carrying vLLM's ``KVConnectorOutput``; it needs an environment with vLLM.

Runs alternate between the arms (which goes first alternates too); each run's time per step
is its total over the trace's steps; the medians over ``repeats`` runs are compared:
``kvspec/vLLM`` is kvspec's median over vLLM's. Both arms must report the same completions
(checked on the first run). vLLM's silently completes a request early when a rank reports it
twice; kvspec's raises ``DoubleReportError`` (EXE-002): the trace has no double report, so
the comparison is of the common path.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvspec.protocols import Direction, KVConnectorOutput, StandardAggregator

from ._table import markdown_table

__all__ = ["AggregatePoint", "AggregateResult", "Trace", "make_trace", "run_aggregate_bench"]


@attrs.frozen
class Trace:
    """What every rank reports in each step, and what the engine awaits before it.

    Attributes:
        ranks: World size.
        expects: Per step, the ``(request_id, is_send)`` the engine starts awaiting.
        reports: Per step, per rank, ``(finished_sending, finished_recving)``.
    """

    ranks: int
    expects: tuple[tuple[tuple[str, bool], ...], ...]
    reports: tuple[tuple[tuple[frozenset[str], frozenset[str]], ...], ...]

    @property
    def steps(self) -> int:
        """Steps in the trace."""
        return len(self.reports)


def make_trace(ranks: int, requests: int, *, seed: int = 0) -> Trace:
    """The synthetic trace of the module docstring (deterministic for a seed)."""
    rng = random.Random(seed)
    steps = max(1, requests // 10) + 3
    expects: list[list[tuple[str, bool]]] = [[] for _ in range(steps)]
    send: list[list[set[str]]] = [[set() for _ in range(ranks)] for _ in range(steps)]
    recv: list[list[set[str]]] = [[set() for _ in range(ranks)] for _ in range(steps)]
    for i in range(requests):
        rid = f"req-{i}"
        start = i * (steps - 3) // requests
        is_send = i % 2 == 0
        expects[start].append((rid, is_send))
        for rank in range(ranks):
            (send if is_send else recv)[start + rng.randint(0, 2)][rank].add(rid)
    return Trace(
        ranks, tuple(tuple(e) for e in expects),
        tuple(tuple((frozenset(s), frozenset(r)) for s, r in zip(send[t], recv[t]))
              for t in range(steps)),
    )


def kvspec_arm(trace: Trace) -> Callable[[], tuple[float, list[set[str]]]]:
    """A run of kvspec's aggregator over ``trace``: returns (seconds, completions). Each
    run builds its outputs before the clock starts, as vLLM's arm must (its aggregate
    rewrites rank 0's output), so both arms read inputs equally fresh in memory."""
    # What the engine registers in each step, as it has it: the ids of each direction.
    sends = [[rid for rid, is_send in step if is_send] for step in trace.expects]
    recvs = [[rid for rid, is_send in step if not is_send] for step in trace.expects]

    def run() -> tuple[float, list[set[str]]]:
        outputs = [[KVConnectorOutput(finished_sending=s, finished_recving=r)
                    for s, r in step] for step in trace.reports]
        agg = StandardAggregator(trace.ranks)
        expect_many, aggregate = agg.expect_many, agg.aggregate
        send, recv = Direction.SEND, Direction.RECV
        done: list[Any] = []
        t0 = time.perf_counter()
        for s, r, outs in zip(sends, recvs, outputs):
            if s:
                expect_many(s, send)
            if r:
                expect_many(r, recv)
            done.append(aggregate(outs))
        seconds = time.perf_counter() - t0
        return seconds, [set(o.finished_sending) | set(o.finished_recving) for o in done]

    return run


@attrs.frozen
class AggregatePoint:
    """One point of the grid: ranks and requests."""

    ranks: int
    requests: int


@attrs.frozen
class AggregateResult:
    """Medians of one point, in microseconds per step; ``vllm_us`` None without vLLM."""

    point: AggregatePoint
    steps: int
    kvspec_us: float
    vllm_us: float | None

    @property
    def ratio(self) -> float | None:
        """kvspec's time over vLLM's, or None."""
        return None if self.vllm_us is None else self.kvspec_us / self.vllm_us

    def as_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return {"ranks": self.point.ranks, "requests": self.point.requests,
                "steps": self.steps, "kvspec_us_per_step": self.kvspec_us,
                "vllm_us_per_step": self.vllm_us, "kvspec_over_vllm": self.ratio}


def vllm_arm_factory() -> Callable[[Trace], Callable[[], tuple[float, list[set[str]]]]] | None:
    """vLLM's arm (its ``KVOutputAggregator``, through ``kvspec.vllm.aggregation``), or None
    when vLLM cannot be imported here."""
    try:
        from kvspec.vllm.aggregation import completions, vllm_aggregator, vllm_outputs
    except ImportError:
        return None

    def arm(trace: Trace) -> Callable[[], tuple[float, list[set[str]]]]:
        def run() -> tuple[float, list[set[str]]]:
            steps = vllm_outputs(trace.reports)  # built before the clock starts
            aggregate = vllm_aggregator(trace.ranks)
            done = []
            t0 = time.perf_counter()
            for outs in steps:
                done.append(aggregate(outs))
            seconds = time.perf_counter() - t0
            return seconds, [completions(out) for out in done]

        return run

    return arm


def run_aggregate_bench(
    points: Sequence[AggregatePoint], *, repeats: int = 15, seed: int = 0,
    progress: Callable[[int, int, AggregatePoint], None] | None = None,
) -> list[AggregateResult]:
    """Measure every point, arms interleaved; raises AssertionError if the arms disagree
    on what completed."""
    factory = vllm_arm_factory()
    results = []
    for i, point in enumerate(points):
        if progress is not None:
            progress(i, len(points), point)
        trace = make_trace(point.ranks, point.requests, seed=seed)
        arms = {"kvspec": kvspec_arm(trace)}
        if factory is not None:
            arms["vllm"] = factory(trace)
        times: dict[str, list[float]] = {name: [] for name in arms}
        first: dict[str, list[set[str]]] = {}
        for r in range(repeats + 1):  # the first round warms up, and is checked
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            for name in order:
                gc.collect()  # each run starts from the same collector state
                seconds, completed = arms[name]()
                if r == 0:
                    first[name] = completed
                else:
                    times[name].append(seconds)
        if "vllm" in first and first["vllm"] != first["kvspec"]:
            raise AssertionError(f"{point}: the aggregators completed different requests")
        per_step = {name: statistics.median(t) / trace.steps * 1e6 for name, t in times.items()}
        results.append(AggregateResult(point, trace.steps, per_step["kvspec"],
                                       per_step.get("vllm")))
    return results


def format_results(results: Sequence[AggregateResult]) -> str:
    """The results as a Markdown table."""
    rows = [(str(r.point.ranks), str(r.point.requests), str(r.steps), f"{r.kvspec_us:.1f}",
             "n/a" if r.vllm_us is None else f"{r.vllm_us:.1f}",
             "n/a" if r.ratio is None else f"{r.ratio:.2f}") for r in results]
    return markdown_table(("ranks", "requests", "steps", "kvspec us/step", "vLLM us/step",
                           "kvspec/vLLM"), rows)
