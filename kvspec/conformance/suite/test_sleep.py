"""Conformance: an engine sleeps and wakes mid-serving (vLLM 0.33 sleep mode).

For connectors that declare ``sleep_mode``. The harness drains the engine the way vLLM 0.33
does before a sleep (requests served or aborted, every delayed free and store in flight
reported), calls ``unregister_kv_caches`` on every rank, retires the KV tensors (poisoned,
never used again) and, at wake, re-allocates them at new addresses and calls
``restore_kv_caches``; then it collects the handshake metadata again. (A vLLM connector is
woken in place instead, as vLLM's cumem allocator does: the same addresses, contents lost.)
Every KV byte the model reads after the wake is checked, as always; a write into the
tensors while the engine sleeps is WRK-018, a later write into the retired tensors or a
load of their poison WRK-019.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from ...protocols import ContractViolation, TransferRole
from ..harness import Engine, RequestSpec, Workload, serve_pair
from ._base import ConformanceSuite
from ._harness_runs import config_for
from .._attribution import hide_unless_harness_bug

__all__ = ["TestSleep"]
__tracebackhide__ = hide_unless_harness_bug  # authors see their frames, not these

_PROMPTS = tuple(tuple(range(100 * i, 100 * i + 13 + 4 * i)) for i in range(4))


def _specs(prefix: str, prompts: tuple[tuple[int, ...], ...] = _PROMPTS,
           stagger: bool = False) -> list[RequestSpec]:
    return [RequestSpec(f"{prefix}-{i}", p, max_new_tokens=3, arrival_step=i if stagger else 0)
            for i, p in enumerate(prompts)]


class TestSleep(ConformanceSuite):
    """Sleep and wake with transfers in flight; every byte checked after the wake."""

    @pytest.mark.kvspec_clause("WRK-018", "WRK-019", "HSK-002", "WRK-013")
    @pytest.mark.kvspec_requires("sleep_mode")
    @pytest.mark.parametrize("tp_size", [1, 2])
    def test_sleep_and_wake_mid_serving(self, tp_size: int, tmp_path: Path) -> None:
        """A store pass is put to sleep after 3 steps (transfers in flight, requests still
        running): the engine drains, unregisters, retires the KV tensors and wakes with new
        ones. The same prompts are then served again (hits on whatever the connector kept)
        and new ones stored and hit; a second sleep aborts what runs (vLLM's
        ``mode="abort"``)."""
        cfg = config_for(self.capabilities, tp_size=tp_size, prefix_caching=False)
        with Engine(self.factory, cfg, tmpdir=str(tmp_path)) as engine:
            store = _specs("store")
            engine.workload = Workload(store, name="store pass, put to sleep mid-serving")
            for spec in store:
                engine.add_request(spec)
            for _ in range(3):
                engine.step()
            engine.sleep()
            assert {s.request_id for s in store} <= set(engine.result().finished)
            engine.wake()
            engine.run(Workload(_specs("hit"), name="after wake: the same prompts"))
            fresh = tuple(tuple(range(1000 + 50 * i, 1000 + 50 * i + 17)) for i in range(2))
            engine.run(Workload(_specs("fresh", fresh), name="after wake: new prompts"))
            more = _specs("again", fresh, stagger=True)
            engine.workload = Workload(more, name="second sleep, requests aborted")
            for spec in more:
                engine.add_request(spec)
            engine.step()
            engine.sleep(abort=True)
            engine.wake()
            engine.run(Workload(_specs("last", fresh), name="after the second wake"))
            assert engine.sleeps == 2

    @pytest.mark.kvspec_clause("HSK-006", "HSK-002", "WRK-019", "SCH-018")
    @pytest.mark.kvspec_requires("sleep_mode")
    def test_two_engines_producer_sleeps(self, tmp_path: Path) -> None:
        """A prefill engine hands requests to a decode engine, sleeps (the decode engine
        keeps stepping while it drains) and wakes with new KV tensors and new handshake
        metadata; the next hand-offs must reach the decode engine as before: a connector
        whose peers kept the old handshake loads nothing (or fails every load) after the
        wake (HSK-006)."""
        cfg = config_for(self.capabilities, prefix_caching=False)
        p_cfg = attrs.evolve(cfg, role=TransferRole.PRODUCER, engine_id="prefill")
        d_cfg = attrs.evolve(cfg, role=TransferRole.CONSUMER, engine_id="decode")
        with Engine(self.factory, p_cfg, tmpdir=str(tmp_path)) as p, \
                Engine(self.factory, d_cfg, tmpdir=str(tmp_path)) as d:
            before = _specs("before", stagger=True)
            _, first = serve_pair(p, d, Workload(before, name="hand-offs before the sleep"))
            p.sleep(peers=[d])
            p.wake()
            after = _specs("after", tuple(tuple(t + 7 for t in q) for q in _PROMPTS), True)
            loaded_before = sum(first.external_tokens.get(s.request_id, 0) for s in before)
            try:
                _, second = serve_pair(p, d, Workload(after, name="hand-offs after the wake"))
            except ContractViolation as e:
                # A consumer that reads the producer's old agent fails every READ, so the
                # producer's delayed frees are never released: SCH-016 is what the harness
                # sees, HSK-006 why, when nothing after the wake was loaded.
                got = d.result().external_tokens
                if e.clause != "SCH-016" or not loaded_before or any(
                        got.get(s.request_id, 0) for s in after):
                    raise
                raise self.violation(
                    "HSK-006", observed=f"the decode engine loaded {loaded_before} tokens of "
                    "the hand-offs before the producer slept and none after it woke, and the "
                    f"producer's blocks stayed held: {e.observed}",
                    expected="after the wake, the producer publishes its new handshake "
                    "metadata and its peers handshake again, so hand-offs keep loading",
                    reproduce=e.reproduce) from e
            assert {s.request_id for s in after} <= set(second.finished)
            loaded_after = sum(second.external_tokens.get(s.request_id, 0) for s in after)
            if loaded_before and not loaded_after:
                raise self.violation(
                    "HSK-006", observed=f"the decode engine loaded {loaded_before} tokens of "
                    f"the hand-offs before the producer slept and none after it woke",
                    expected="after the wake, the producer publishes its new handshake "
                    "metadata and its peers handshake again, so hand-offs keep loading")
