"""Two-engine mode: a prefill engine hands requests to a decode engine (disaggregation).

The prefill (producer) engine computes each prompt and one token; when its connector's
``request_finished`` returns, the request is added to the decode (consumer) engine with the
returned ``kv_transfer_params``. Both engines step in lockstep, so a producer may still hold
blocks (delayed free, SCH-016) while the consumer loads them.
"""

from __future__ import annotations

import itertools
import tempfile

import attrs

from kvspec.protocols import ConnectorFactory, RequestStatus, TransferRole

from .config import HarnessConfig
from .engine import Engine, RunResult
from .workload import RequestSpec, Workload
from .._attribution import hide_unless_harness_bug

__all__ = ["run_disaggregated", "serve_pair"]
__tracebackhide__ = hide_unless_harness_bug  # authors see their frames, not these


def run_disaggregated(
    factory: ConnectorFactory, workload: Workload, *,
    prefill: HarnessConfig | None = None, decode: HarnessConfig | None = None,
    tmpdir: str | None = None, max_steps: int = 500,
) -> tuple[RunResult, RunResult]:
    """Serve ``workload`` through a prefill engine and a decode engine sharing ``tmpdir``.

    Returns the two engines' results (prefill, decode). Aborts in the workload apply to the
    prefill side; requests it aborts never reach the decode engine.
    """
    p_cfg = attrs.evolve(prefill or HarnessConfig(), role=TransferRole.PRODUCER, engine_id="prefill")
    d_cfg = attrs.evolve(decode or HarnessConfig(), role=TransferRole.CONSUMER, engine_id="decode")
    with tempfile.TemporaryDirectory(prefix="kvspec-pd-") as own:
        shared = tmpdir or own
        with Engine(factory, p_cfg, tmpdir=shared) as p, Engine(factory, d_cfg, tmpdir=shared) as d:
            return serve_pair(p, d, workload, max_steps=max_steps)


def serve_pair(p: Engine, d: Engine, workload: Workload, *, max_steps: int = 500,
               ) -> tuple[RunResult, RunResult]:
    """Serve ``workload`` through a prefill engine ``p`` and a decode engine ``d`` that
    already run (``run_disaggregated``'s loop; engines may serve several workloads, and
    sleep and wake between them). Returns what each engine did so far."""
    p_specs = [attrs.evolve(r, max_new_tokens=1) for r in workload.requests]
    p.workload = Workload(p_specs, name=f"{workload.name} (prefill side)")
    d.workload = Workload([], name=f"{workload.name} (decode side)")
    by_id = {r.request_id: r for r in workload.requests}
    arrivals: dict[int, list[RequestSpec]] = {}
    aborts: dict[int, list[str]] = {}
    for spec in p_specs:
        arrivals.setdefault(spec.arrival_step, []).append(spec)
        if spec.abort_at_step is not None:
            aborts.setdefault(spec.abort_at_step, []).append(spec.request_id)
    last = max([*arrivals, *aborts, 0])
    handed: set[str] = set(p.requests)  # earlier workloads' requests were handed already
    for i in itertools.count():
        for spec in arrivals.get(i, ()):
            p.add_request(spec)
        for rid in aborts.get(i, ()):
            p.abort(rid)
        for rid, r in p.requests.items():
            if rid not in handed and r.finished_called and r.status is RequestStatus.FINISHED:
                handed.add(rid)
                spec = attrs.evolve(by_id[rid], arrival_step=i, abort_at_step=None,
                                    kv_transfer_params=r.params)
                d.workload = Workload([*d.workload.requests, spec], name=d.workload.name)
                d.add_request(spec)
        if i > last and p.idle and d.idle:
            break
        # awaited transfers end by their timeout, with the clause they break
        if i >= max_steps and not p.awaited and not d.awaited:
            raise AssertionError(
                f"harness: {workload.name!r} did not finish in {max_steps} steps "
                f"(prefill: {p.stuck()}; decode: {d.stuck()})")
        p.step()
        d.step()
    p.drain()
    d.drain()
    return p.result(), d.result()
