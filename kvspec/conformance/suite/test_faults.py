"""Conformance: failed and slow transfers, through the fault seam.

For connectors that declare ``fault_injection``, the harness passes a
``FaultPlan`` in ``extra["kvspec.faults"]``: every load fails, every
store fails, or every transfer stays in flight for a while. One engine serves a pass that
stores and a pass that would hit; the engine checks, as always, every KV byte the model
reads, every report and every release. These tests add what only a failure shows: a load
that was made to fail is never counted as loaded, and every request still finishes with
correct KV, recomputed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import attrs
import pytest

from ...protocols import FAULTS_KEY, FaultPlan
from ..harness import Engine, RequestSpec, RunResult, Workload, run_disaggregated
from ..harness.scenarios import SCENARIOS
from ._base import ConformanceSuite
from ._harness_runs import config_for
from .._attribution import hide_unless_harness_bug

__all__ = ["TestFaults"]
__tracebackhide__ = hide_unless_harness_bug  # authors see their frames, not these

_PROMPTS = tuple(tuple(range(100 * i, 100 * i + 13 + 4 * i)) for i in range(4))

_GROWING = tuple(tuple(range(50 * i, 50 * i + 10)) for i in range(2))
"""Two prompts of 10 tokens that decode 14 more: 6 blocks of 4 each, in an engine of 11."""


def _passes(factory: Any, tmp: Path, plan: FaultPlan, **overrides: Any
            ) -> tuple[RunResult, RunResult]:
    """Serve a storing pass, then the same prompts again, on one engine with ``plan``."""
    cfg = config_for(factory.capabilities, prefix_caching=False,
                     extra={FAULTS_KEY: plan.to_plain()}, **overrides)
    with Engine(factory, cfg, tmpdir=str(tmp)) as engine:
        first = engine.run(Workload([RequestSpec(f"store-{i}", p, max_new_tokens=2)
                                     for i, p in enumerate(_PROMPTS)], name="store pass"))
        second = engine.run(Workload([RequestSpec(f"hit-{i}", p, max_new_tokens=2)
                                      for i, p in enumerate(_PROMPTS)], name="hit pass"))
    return first, second


def _all_finished(result: RunResult, prefix: str) -> bool:
    return {f"{prefix}-{i}" for i in range(len(_PROMPTS))} <= set(result.finished)


class TestFaults(ConformanceSuite):
    """Failed and slow transfers end as failed receives the engine recomputes."""

    def _check_nothing_loaded(self, hit: RunResult, when: str, expected: str) -> None:
        loaded = {r: n for r, n in hit.external_tokens.items() if n}
        self.check(not loaded, "WRK-011",
                   observed=f"{when}, tokens counted as loaded: {loaded}", expected=expected)

    @pytest.mark.kvspec_clause("WRK-011", "ERR-008")
    @pytest.mark.kvspec_requires("fault_injection")
    def test_failed_loads_are_reported_and_recomputed(self, tmp_path: Path) -> None:
        """With every load failing, the hit pass loads nothing: each load the connector
        started is reported failed with its blocks invalid, and the engine recomputes."""
        _, hit = _passes(self.factory, tmp_path, FaultPlan(fail_loads=True))
        assert _all_finished(hit, "hit")
        if not any(hit.matched_tokens.values()):
            pytest.skip("the connector offered no tokens on the hit pass: nothing could fail")
        self._check_nothing_loaded(
            hit, "with every load made to fail", "each failed load's blocks in "
            "invalid_block_ids (an asynchronous one also reported in finished_recving and "
            "failed_recving), so the engine recomputes them")

    @pytest.mark.kvspec_clause("WRK-014", "WRK-011")
    @pytest.mark.kvspec_requires("fault_injection")
    def test_output_hooks_never_wait_for_a_slow_transfer(self, tmp_path: Path) -> None:
        """Every transfer takes 0.6 s, longer than the 0.3 s this engine allows a worker's
        output hooks: ``get_finished`` must report each transfer in a step after it ended
        (or failed), never wait for it on the engine's thread (WRK-014, issue 34). Two
        prompts are stored, then served again; both passes finish, every byte checked."""
        cfg = config_for(self.capabilities, prefix_caching=False, hook_budget_s=0.3,
                         extra={FAULTS_KEY: FaultPlan(delay_s=0.6).to_plain()})
        with Engine(self.factory, cfg, tmpdir=str(tmp_path)) as engine:
            for name in ("store", "hit"):
                result = engine.run(Workload([RequestSpec(f"{name}-{i}", p, max_new_tokens=2)
                                              for i, p in enumerate(_PROMPTS[:2])],
                                             name=f"{name} pass, slow transfers"),
                                    max_steps=50_000)
                assert {f"{name}-0", f"{name}-1"} <= set(result.finished)

    @pytest.mark.kvspec_clause("WRK-017", "WRK-014", "SCH-016")
    @pytest.mark.kvspec_requires("fault_injection")
    def test_a_late_copy_never_writes_freed_blocks(self, tmp_path: Path) -> None:
        """Every load's copy hangs 0.5 s inside the copy, past its 0.1 s deadline, then
        writes anyway (``FaultPlan.stall_s``, ``deadline_s``): each load is reported failed
        at its deadline and recomputed, the requests finish, and the late writes must not
        reach blocks the engine freed (WRK-017): the connector keeps them held until its
        copies have ended. A third pass then reuses the blocks; the engine checks that no
        freed block was written since it was freed."""
        plan = FaultPlan(stall_s=0.5, deadline_s=0.1)
        cfg = config_for(self.capabilities, prefix_caching=False,
                         extra={FAULTS_KEY: plan.to_plain()})
        with Engine(self.factory, cfg, tmpdir=str(tmp_path)) as engine:
            runs = {}
            for name, prompts in (("store", _PROMPTS[:2]), ("hit", _PROMPTS[:2]),
                                  ("after", _PROMPTS[2:])):
                if name == "after":
                    time.sleep(plan.stall_s + 0.2)  # every stalled copy has written by now
                runs[name] = engine.run(Workload(
                    [RequestSpec(f"{name}-{i}", p, max_new_tokens=2)
                     for i, p in enumerate(prompts)], name=f"{name} pass, stalled loads"),
                    max_steps=50_000)
        hit = runs["hit"]
        if not any(hit.matched_tokens.values()):
            pytest.skip("the connector offered no tokens on the hit pass: nothing was loaded")
        if any(hit.external_tokens.values()):
            pytest.skip("a load succeeded: the connector does not apply FaultPlan.stall_s "
                        "and deadline_s, so no copy outlived its deadline")
        assert {"hit-0", "hit-1", "after-0", "after-1"} <= {*hit.finished,
                                                             *runs["after"].finished}

    @pytest.mark.kvspec_clause("WRK-011", "ERR-008", "SCH-016")
    @pytest.mark.kvspec_requires("fault_injection")
    def test_failed_loads_in_a_hand_off_are_recomputed(self, tmp_path: Path) -> None:
        """Two engines: the decode engine's every load fails. Each hand-off the connector
        offered is reported failed and recomputed, and the prefill engine still frees its
        blocks (its delayed frees end, SCH-016)."""
        wl = Workload([RequestSpec(f"pd-{i}", p, max_new_tokens=2, arrival_step=i)
                       for i, p in enumerate(_PROMPTS)], name="hand-off, loads failing")
        prefill = config_for(self.capabilities, prefix_caching=False)
        decode = attrs.evolve(prefill, extra={**prefill.extra,
                                              FAULTS_KEY: FaultPlan(fail_loads=True).to_plain()})
        _, hit = run_disaggregated(self.factory, wl, prefill=prefill, decode=decode,
                                   tmpdir=str(tmp_path))
        assert set(hit.finished) == {r.request_id for r in wl.requests}
        if not any(hit.matched_tokens.values()):
            pytest.skip("the decode engine was offered no tokens: nothing could fail")
        self._check_nothing_loaded(
            hit, "with every load of the decode engine made to fail", "each failed load "
            "reported in finished_recving and failed_recving, its blocks invalid")

    @pytest.mark.kvspec_clause("WRK-011", "WRK-013", "ERR-008")
    @pytest.mark.kvspec_requires("fault_injection")
    def test_failed_stores_leave_every_request_correct(self, tmp_path: Path) -> None:
        """With every store failing, nothing stored can be loaded: whatever the connector
        offers on the hit pass fails or is never offered, and every request finishes with
        correct KV."""
        store, hit = _passes(self.factory, tmp_path, FaultPlan(fail_stores=True))
        assert _all_finished(store, "store") and _all_finished(hit, "hit")
        self._check_nothing_loaded(
            hit, "with every store made to fail", "a load of data that was never stored "
            "fails, reported with its blocks invalid (or is never offered)")

    @pytest.mark.kvspec_clause("WRK-012", "WRK-014", "SCH-016", "SCH-021", "SCH-023",
                               "ERR-008")
    @pytest.mark.kvspec_requires("fault_injection")
    @pytest.mark.parametrize("scenario", ["aborts", "preemption", "full-prompt-hit"],
                             ids=["slow-aborts", "slow-preemption", "slow-full-hit"])
    def test_slow_transfers_through_aborts_and_preemption(
        self, scenario: str, tmp_path: Path
    ) -> None:
        """Every transfer stays in flight for 0.15 s, across steps: aborts while loading,
        preemptions and full hits still end with every request reported, released and
        byte-exact."""
        overrides: dict[str, Any] = {"num_blocks": 12} if scenario == "preemption" else {}
        cfg = config_for(self.capabilities, prefix_caching=False,
                         extra={FAULTS_KEY: FaultPlan(delay_s=0.15).to_plain()}, **overrides)
        wl = SCENARIOS[scenario]
        with Engine(self.factory, cfg, tmpdir=str(tmp_path)) as engine:
            # the engine steps while transfers wait in wall-clock time: allow many steps
            result = engine.run(attrs.evolve(wl, name=f"{wl.name} (slow transfers)"),
                                max_steps=50_000)
        assert set(result.finished) | set(result.aborted) == {r.request_id for r in wl.requests}

    @pytest.mark.kvspec_clause("WRK-012", "SCH-022", "WRK-013")
    @pytest.mark.kvspec_requires("fault_injection")
    def test_preempted_requests_transfers_are_fenced(self, tmp_path: Path) -> None:
        """Two requests decode into more blocks than the engine has, so one is preempted
        while running, and every transfer stays in flight for 0.15 s: a connector that
        stores a running request's blocks (as vLLM's offloading connector does) still has
        that store in flight. The engine keeps the preempted blocks poisoned for 0.2 s
        after ``handle_preemptions`` returned (then reuses them), so a store that still
        read them stores the poison (or another request's KV), which the same prompts,
        served again, load: the byte checks name WRK-012."""
        cfg = config_for(self.capabilities, prefix_caching=False, num_blocks=13,
                         preempted_hold_s=0.2,
                         extra={FAULTS_KEY: FaultPlan(delay_s=0.15).to_plain()})
        with Engine(self.factory, cfg, tmpdir=str(tmp_path)) as engine:
            first = engine.run(Workload(
                [RequestSpec(f"grow{i}", p, max_new_tokens=14) for i, p in enumerate(_GROWING)],
                name="running requests preempted with transfers in flight"), max_steps=50_000)
            engine.run(Workload(
                [RequestSpec(f"again{i}", p, max_new_tokens=2) for i, p in enumerate(_GROWING)],
                name="the same prompts again"), max_steps=50_000)
        assert first.preemptions, "harness: the workload preempted no request"
