"""Read your own writes (issue 32, SCH-031): a request that comes right after a finished
request with the same prompt, with no engine step in between (vLLM's in-process ``LLM``),
is served from the host pool; a store in flight is loaded only after it completed, and a
store that fails turns the pending hit into a failed load that is recomputed."""

from __future__ import annotations

from typing import Any

import pytest

from kvspec.backends.offload import (
    LayerwiseOffloadConnector,
    OffloadConnector,
    OffloadScheduler,
    SyncLoadOffloadConnector,
)
from kvspec.conformance.harness import Engine, HarnessConfig, RequestSpec, Workload
from kvspec.protocols import FAULTS_KEY, ConnectorFactory, FaultPlan

PROMPT = tuple(range(100, 117))  # four full blocks of 4 tokens and one token


def _twice(factory: ConnectorFactory, tmp: str, *, gap: bool = True,
           **extra: Any) -> tuple[int, dict[str, int]]:
    """Serve PROMPT, stop stepping (``gap``) or step until every transfer is reported,
    then serve it again: the tokens the second request loaded, and the scheduler's stats."""
    cfg = HarnessConfig(prefix_caching=False, extra=extra)
    with Engine(factory, cfg, tmpdir=tmp) as engine:
        engine.run(Workload([RequestSpec("first", PROMPT, max_new_tokens=2)], name="first"),
                   leave_pending=gap)
        result = engine.run(Workload([RequestSpec("again", PROMPT, max_new_tokens=2)],
                                     name="again"))
        scheduler = engine.scheduler
        assert isinstance(scheduler, OffloadScheduler)
        return result.external_tokens.get("again", 0), scheduler.stats()


@pytest.mark.parametrize("offload_store", ["computed", "finished"])
def test_a_request_after_an_idle_gap_loads_the_stores_still_in_flight(
        tmp_path: Any, offload_store: str) -> None:
    """Every full block but the last token's, loaded (and byte-checked by the harness)
    although no step reported the first request's stores before the second was matched."""
    loaded, stats = _twice(OffloadConnector(), str(tmp_path), offload_store=offload_store,
                           load_delay_s=0.0)
    assert loaded == 16
    assert stats["pending_hit_blocks"] > 0  # matched while the stores were unreported
    assert stats["load_failures"] == 0


def test_the_load_of_a_store_in_flight_waits_for_it(tmp_path: Any) -> None:
    """Every copy waits 0.1 s first: the second request's load is queued behind the first
    request's store and reads what it wrote (the harness checks every loaded byte)."""
    loaded, stats = _twice(OffloadConnector(), str(tmp_path), offload_store="finished",
                           **{FAULTS_KEY: FaultPlan(delay_s=0.1).to_plain()})
    assert loaded == 16 and stats["pending_hit_blocks"] == 4 and stats["load_failures"] == 0


def test_a_failed_store_makes_its_pending_hit_a_failed_load_that_is_recomputed(
        tmp_path: Any) -> None:
    """Stores fail: the second request was matched on the stores in flight, its load
    fails on every block (never loading bytes that were not stored), the engine recomputes
    them, and nothing stays pinned or held."""
    loaded, stats = _twice(OffloadConnector(), str(tmp_path), offload_store="finished",
                           **{FAULTS_KEY: FaultPlan(fail_stores=True).to_plain()})
    assert loaded == 0
    assert stats["pending_hit_blocks"] == 4 and stats["load_failures"] == 4
    assert stats["store_failures"] >= 4 and stats["pinned_slots"] == 0
    assert stats["resident_blocks"] == 0


@pytest.mark.parametrize("factory", [LayerwiseOffloadConnector(), SyncLoadOffloadConnector()],
                         ids=["layerwise", "sync-loads"])
def test_without_loads_of_stores_in_flight_the_match_waits_for_their_report(
        tmp_path: Any, factory: ConnectorFactory) -> None:
    """The layerwise store path and synchronous loads cannot order a load after a store
    in flight: the match is deferred until the store is reported (SCH-002), and then hits."""
    loaded, stats = _twice(factory, str(tmp_path), offload_store="finished")
    assert loaded == 16 and stats["pending_hit_blocks"] == 0


def test_the_same_reuse_with_steps_in_between(tmp_path: Any) -> None:
    loaded, stats = _twice(OffloadConnector(), str(tmp_path), gap=False)
    assert loaded == 16 and stats["pending_hit_blocks"] == 0
