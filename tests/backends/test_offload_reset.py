"""Cache reset in the offload backend (issue 48, SCH-032): ``reset_cache`` drops the host
tier's index, stores in flight at the reset never become matchable, loads planned before
it still finish, and no slot or pin is leaked. The harness changes the model's weights at
an accepted reset, so any byte served from before it fails the run."""

from __future__ import annotations

from typing import Any

import pytest

from kvspec.backends.offload import OffloadConnector, OffloadScheduler
from kvspec.conformance.harness import Engine, HarnessConfig, RequestSpec, Workload
from kvspec.protocols import FAULTS_KEY, AllBlocksCleared, FaultPlan

A = tuple(range(100, 117))  # four full blocks of 4 tokens and one token
B = tuple(range(200, 217))


def _slots_accounted(s: OffloadScheduler) -> None:
    stats = s.stats()
    assert stats["pinned_slots"] == 0
    assert len(set(s._free)) + stats["resident_blocks"] == stats["capacity_slots"]


@pytest.mark.parametrize("offload_store", ["computed", "finished"])
def test_a_reset_drops_stored_and_in_flight_blocks(tmp_path: Any, offload_store: str) -> None:
    """A stored, B's stores in flight (every copy waits 0.1 s) at the reset: after it
    neither prompt is matched, B's stores come back as stale slots, and a third round
    loads what the second stored after the reset."""
    cfg = HarnessConfig(prefix_caching=False, extra={
        "offload_store": offload_store, FAULTS_KEY: FaultPlan(delay_s=0.1).to_plain()})
    with Engine(OffloadConnector(), cfg, tmpdir=str(tmp_path)) as engine:
        s = engine.scheduler
        assert isinstance(s, OffloadScheduler)
        engine.run(Workload([RequestSpec("a", A, max_new_tokens=2)], name="a"))
        engine.run(Workload([RequestSpec("b", B, max_new_tokens=2)], name="b"),
                   leave_pending=True)
        assert s.stats()["resident_blocks"] == 4 and s._inflight  # B still being stored
        list(s.take_events())
        assert engine.reset_cache() is True
        assert s.stats()["resident_blocks"] == 0 and not s._inflight
        assert list(s.take_events()) == [AllBlocksCleared()]
        after = engine.run(Workload([RequestSpec("a2", A, max_new_tokens=2),
                                     RequestSpec("b2", B, max_new_tokens=2)], name="after"))
        assert after.matched_tokens.get("a2", 0) == after.matched_tokens.get("b2", 0) == 0
        stats = s.stats()
        assert stats["resets"] == 1 and stats["stale_stores"] == 4
        again = engine.run(Workload([RequestSpec("a3", A, max_new_tokens=2),
                                     RequestSpec("b3", B, max_new_tokens=2)], name="again"))
        assert again.external_tokens == {**again.external_tokens, "a3": 16, "b3": 16}
        _slots_accounted(s)


def test_a_load_planned_before_a_reset_finishes_and_frees_its_slots(tmp_path: Any) -> None:
    """The reset comes while a load of A is in flight (copies wait 0.1 s): the load still
    runs (the request was matched before the reset), its pinned slots are freed when it
    ends, and the request, known at the reset, is not stored after it."""
    cfg = HarnessConfig(prefix_caching=False,
                        extra={FAULTS_KEY: FaultPlan(delay_s=0.1).to_plain()})
    with Engine(OffloadConnector(), cfg, tmpdir=str(tmp_path)) as engine:
        s = engine.scheduler
        assert isinstance(s, OffloadScheduler)
        engine.run(Workload([RequestSpec("a", A, max_new_tokens=2)], name="a"))
        engine.add_request(RequestSpec("loading", A, max_new_tokens=2))
        for _ in range(3):
            engine.step()
            if s._loading:
                break
        assert s._loading and s.stats()["pinned_slots"] == 4
        assert s.reset_cache() is True  # the scheduler role alone: the weights stay
        assert s.stats()["resident_blocks"] == 0 and s.stats()["pinned_slots"] == 4
        engine.drain()
        while not engine.idle:
            engine.step()
        assert engine.result().external_tokens["loading"] == 16
        assert s.stats()["resident_blocks"] == 0  # known at the reset: never stored
        _slots_accounted(s)
