"""The connector driven by the reference engine: fixed scenarios, layouts, parallelism,
async scheduling, two engines, random workloads and a stateful machine.

Every run checks, at every layer of every step, that the KV of every computed or loaded
token is byte-identical to what the toy model computes, and raises ContractViolation naming
the clause at the first thing the connector gets wrong.
"""

from __future__ import annotations

import time

from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from ...protocols import ContractViolation, GroupKind, RequestStatus
from ..harness import Engine, RequestSpec, Workload, run_disaggregated, workloads
from ..harness.scenarios import SCENARIOS
from ._base import ConformanceSuite
from ._harness_runs import config_for, layout_cases, serve
from .._attribution import hide_unless_harness_bug

_SCENARIO_CONFIG: dict[str, dict[str, Any]] = {
    "preemption": {"num_blocks": 12},
    "chunked": {"max_tokens_per_step": 8},
}
_HYBRID_CONFIG: dict[str, dict[str, Any]] = {
    # A hit holds a window group's blocks beside the full group's: with 12 blocks two
    # loaded "-again" requests hold 10 and wait for 2 each, which no engine preempts for
    # (vLLM does not preempt waiting requests either). 16 still preempts several times.
    "preemption": {"num_blocks": 16},
}


_LOOKUP_PROMPTS = tuple(tuple(range(40 * i, 40 * i + 9 + 5 * i)) for i in range(4))
"""Four prompts of 9 to 24 tokens: whole blocks plus a remainder, or exactly whole blocks."""


def _examples(profile: str, default: int) -> int:
    return default * 10 if profile == "full" else default


def _phases(profile: str) -> tuple[Phase, ...]:
    """Every phase in the full profile; the default one reports the first failing workload
    as found, unshrunk: shrinking an engine workload runs up to hypothesis's 300 s budget
    of engines, which is the developer's time, and checks nothing more."""
    if profile == "full":
        return tuple(Phase)
    return (Phase.explicit, Phase.reuse, Phase.generate)


class TestEngine(ConformanceSuite):
    """The connector through the reference engine."""

    @pytest.mark.kvspec_clause(
        "SCH-001", "SCH-004", "SCH-005", "SCH-008", "SCH-009", "SCH-010", "SCH-011", "SCH-012",
        "SCH-013", "SCH-015", "SCH-016", "SCH-017", "SCH-018", "SCH-019", "SCH-020", "SCH-021",
        "SCH-022", "SCH-023", "SCH-025", "WRK-003", "WRK-008", "WRK-009", "WRK-010", "WRK-011",
        "WRK-012", "WRK-013", "EXE-001",
    )
    @pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-local-cache", "local-cache"])
    @pytest.mark.parametrize("scenario", sorted(SCENARIOS))
    def test_scenario(self, scenario: str, prefix_caching: bool, tmp_path: Path) -> None:
        """Each trap scenario runs to completion with every block byte-exact."""
        result = serve(self.factory, SCENARIOS[scenario], tmp_path,
                       prefix_caching=prefix_caching, **_SCENARIO_CONFIG.get(scenario, {}))
        assert set(result.finished) | set(result.aborted) == {
            r.request_id for r in SCENARIOS[scenario].requests
        }

    @pytest.mark.kvspec_clause("KVG-001", "KVG-002", "KVG-003", "KVG-004", "KVG-005",
                               "KVG-006", "KVG-007", "WRK-011", "WRK-013")
    def test_hybrid_model(self, tmp_path: Path) -> None:
        """Every scenario, and a prefill engine handing requests to a decode engine, on a
        hybrid model: a sliding-window group of 8 tokens (the odd layers) beside the
        full-attention one, whose out-of-window positions the engine
        frees and points at the null block as vLLM's hybrid allocator does. Every group's
        loaded bytes are checked, the null block must stay unwritten (KVG-004) and a failed
        load be reported per request (KVG-005). Skipped for a connector that does not
        declare a sliding-window group beside a full one (KVG-002: an engine refuses it)."""
        caps = self.capabilities
        if caps.kv_cache_groups < 2 or not {GroupKind.FULL, GroupKind.SLIDING_WINDOW} \
                <= caps.group_kinds:
            pytest.skip("the connector declares no sliding-window group beside a full one "
                        "(Capabilities.group_kinds, kv_cache_groups): hybrid engines refuse it")
        for name in sorted(SCENARIOS):
            serve(self.factory, SCENARIOS[name], tmp_path / name, prefix_caching=False,
                  sliding_window=8, **{**_SCENARIO_CONFIG.get(name, {}),
                                       **_HYBRID_CONFIG.get(name, {})})
        # prefill to decode (a connector that hands nothing off lets decode recompute):
        # prompts past the window, so the producer's window group holds nulls
        wl = Workload([RequestSpec(f"pd-{i}", tuple(range(7 * i, 7 * i + 29 + 4 * i)),
                                   max_new_tokens=3, arrival_step=i) for i in range(3)],
                      name="disaggregated, hybrid")
        cfg = config_for(caps, prefix_caching=False, sliding_window=8, max_tokens_per_step=16)
        _, decode = run_disaggregated(self.factory, wl, prefill=cfg, decode=cfg,
                                      tmpdir=str(tmp_path / "disaggregated"))
        assert set(decode.finished) == {r.request_id for r in wl.requests}

    @pytest.mark.kvspec_clause("WRK-007", "WRK-012", "WRK-013")
    def test_connector_threads_run_late(self, tmp_path: Path) -> None:
        """The connector's own threads are held from just before each ``wait_for_save``
        until the next step's forward ran (``hold_threads``: a busy machine, every time),
        over a long prompt saved in small chunks, then, after the engine idled for half a
        second (held threads run again after 0.2 s), loaded: a save that goes on reading
        its step's KV or staging after ``wait_for_save`` returned stores a later step's
        bytes, which the load delivers (WRK-007, WRK-013)."""
        prompt = tuple(range(200, 262))
        cfg = config_for(self.capabilities, prefix_caching=False, max_tokens_per_step=8,
                         hold_threads=True)
        with Engine(self.factory, cfg, tmpdir=str(tmp_path)) as engine:
            engine.run(Workload([RequestSpec("long", prompt, max_new_tokens=2)],
                                name="a long prompt saved in chunks, threads held"))
            time.sleep(0.5)  # an idle engine: the connector's threads catch up
            engine.run(Workload([RequestSpec("again", prompt, max_new_tokens=2)],
                                name="the same prompt again"))

    @pytest.mark.kvspec_clause("WRK-012", "SCH-022", "WRK-013")
    def test_preempted_while_storing(self, tmp_path: Path) -> None:
        """A long prompt and, a step later, a short one that decodes into more blocks than
        the engine has left, so a running request is preempted soon after its prompt
        blocks were computed, with the connector's threads held (``hold_threads``): a
        store of those blocks (as vLLM's offloading connector makes while a request runs)
        is still in flight when ``handle_preemptions`` returns and the engine poisons,
        then reuses, the blocks. A connector that does not fence it stores what the
        engine wrote there since, which the same prompts, served again, load (WRK-012)."""
        prompts = [tuple(range(50 * i, 50 * i + n)) for i, n in enumerate((17, 9))]
        cfg = config_for(self.capabilities, prefix_caching=False, num_blocks=10,
                         hold_threads=True)
        with Engine(self.factory, cfg, tmpdir=str(tmp_path)) as engine:
            engine.run(Workload(
                [RequestSpec(f"grow{i}", p, max_new_tokens=n, arrival_step=i)
                 for i, (p, n) in enumerate(zip(prompts, (3, 8)))],
                name="a running request preempted, its store held"), max_steps=50_000)
            time.sleep(0.3)  # an idle engine: the connector's threads catch up
            engine.run(Workload(
                [RequestSpec(f"again{i}", p, max_new_tokens=2) for i, p in enumerate(prompts)],
                name="the same prompts again"), max_steps=50_000)

    @pytest.mark.kvspec_clause("SCH-014", "SCH-019", "SCH-013", "EXE-001")
    @pytest.mark.parametrize("scenario", ["full-prompt-hit", "aborts", "preemption", "chunked"])
    def test_async_scheduling(self, scenario: str, tmp_path: Path) -> None:
        """Step N+1's metadata is built before step N's output arrives (SCH-014)."""
        serve(self.factory, SCENARIOS[scenario], tmp_path, async_scheduling=True,
              prefix_caching=False, **_SCENARIO_CONFIG.get(scenario, {}))

    @pytest.mark.kvspec_clause("SCH-014", "SCH-001")
    def test_async_scheduling_matches_like_sync(self, tmp_path: Path) -> None:
        """The same stored data gives the same matches whether the engine schedules
        synchronously or asynchronously (SCH-014): on one engine of each kind, a pass
        stores four prompts and drains, then the same prompts come again; each request of
        the second pass must be offered the same number of tokens on both engines."""
        offered: dict[bool, dict[str, int]] = {}
        for mode in (False, True):
            cfg = config_for(self.capabilities, async_scheduling=mode, prefix_caching=False)
            with Engine(self.factory, cfg, tmpdir=str(tmp_path / ("async" if mode else "sync"))
                        ) as engine:
                engine.run(Workload([RequestSpec(f"store-{i}", p, max_new_tokens=2)
                                     for i, p in enumerate(_LOOKUP_PROMPTS)], name="store pass"))
                hit = engine.run(Workload([RequestSpec(f"ask-{i}", p, max_new_tokens=2)
                                           for i, p in enumerate(_LOOKUP_PROMPTS)],
                                          name="lookup pass"))
            offered[mode] = {r: hit.matched_tokens.get(r, 0) for r in sorted(hit.finished)
                             if r.startswith("ask-")}
        self.check(offered[False] == offered[True], "SCH-014",
                   observed=f"tokens offered per request of the second pass: {offered[False]} "
                   f"under synchronous scheduling, {offered[True]} under asynchronous "
                   "scheduling, for the same stored data",
                   expected="the same matches under both (a match must not depend on "
                   "whether the previous step's output has arrived)")
        if not any(offered[False].values()):
            pytest.skip("the connector offered no tokens in either mode: nothing to compare")

    @pytest.mark.kvspec_clause("SCH-031")
    def test_reuse_after_an_idle_gap(self, tmp_path: Path) -> None:
        """A request that comes after an idle gap, behind a finished request with the same
        prompt, loads as many tokens as it does when the engine stepped in between
        (SCH-031): an engine that steps only while it has requests (vLLM's in-process
        ``LLM``) runs no step between two calls, so stores still in flight are unreported
        when the second request is matched. Every loaded byte is checked: a load of a store
        that had not completed fails the byte checks."""
        cfg = config_for(self.capabilities, prefix_caching=False)
        prompt = tuple(range(60, 73))  # three full blocks and one token

        def second_load(gap: bool) -> int:
            with Engine(self.factory, cfg, tmpdir=str(tmp_path / ("gap" if gap else "steps"))) as e:
                e.run(Workload([RequestSpec("first", prompt, max_new_tokens=2)],
                               name="a first request"), leave_pending=gap)
                result = e.run(Workload([RequestSpec("again", prompt, max_new_tokens=2)],
                                        name="the same prompt again"))
            return result.external_tokens.get("again", 0)

        stepped = second_load(gap=False)
        if not stepped:
            pytest.skip("the connector loads nothing of a finished request's prompt even when "
                        "the engine steps in between: nothing to reuse after a gap")
        after_gap = second_load(gap=True)
        self.check(after_gap >= stepped, "SCH-031",
                   observed=f"the second request loaded {after_gap} tokens when it came right "
                   f"after the first one ended, with no step in between, and {stepped} when "
                   "the engine stepped until the first one's transfers were reported",
                   expected="the same reuse whether or not the engine stepped in between "
                   "(offer stores still in flight as loads ordered after them, or store "
                   "before reporting the request finished)")

    @pytest.mark.kvspec_clause("SCH-032", "SCH-033")
    def test_cache_reset(self, tmp_path: Path) -> None:
        """A cache reset, as before a weight update (vLLM's
        ``reset_prefix_cache(reset_connector=True)``). One prompt is served twice (the
        second time must hit, or there is nothing a reset could drop: skipped), a second
        prompt once with its stores left in flight (the engine stops stepping once the
        request ended), then ``reset_cache`` is called. A connector may refuse (False: the
        test checks it keeps serving byte-exact KV, then skips). If it accepts, the harness
        changes the model's weights, so KV from before the reset is wrong bytes under the
        right block hashes, and serves both prompts again: any token matched is KV from
        before the reset (SCH-032), and any loaded byte is checked. A last round may load
        what the one before stored after the reset."""
        cfg = config_for(self.capabilities, prefix_caching=False)
        # 3 full blocks + 2 tokens, then 4 + 1: a connector may hit only some lengths
        # (vLLM's ExampleConnector never hits a k*bs+1 prompt it stored), and the control
        # hit must come from the first.
        prompts = (tuple(range(60, 74)), tuple(range(120, 137)))

        def round_(name: str) -> Workload:
            return Workload([RequestSpec(f"{name}-{i}", p, max_new_tokens=2)
                             for i, p in enumerate(prompts)], name=f"both prompts, {name}")

        with Engine(self.factory, cfg, tmpdir=str(tmp_path)) as e:
            e.run(Workload([RequestSpec("stored", prompts[0], max_new_tokens=2)],
                           name="a prompt stored before the reset"))
            control = e.run(Workload([RequestSpec("control", prompts[0], max_new_tokens=2)],
                                     name="the same prompt, before the reset"))
            if not control.matched_tokens.get("control"):
                pytest.skip("the connector matched nothing of a prompt it had served: "
                            "nothing a cache reset could drop")
            e.run(Workload([RequestSpec("in-flight", prompts[1], max_new_tokens=2)],
                           name="a prompt whose stores are in flight at the reset"),
                  leave_pending=True)
            if not e.reset_cache():
                e.run(round_("after-a-refused-reset"))
                pytest.skip("the connector refused the cache reset (reset_cache answered "
                            "False, which SCH-032 allows; the engine then reports the reset "
                            "failed, SCH-033): nothing to check after a reset")
            after = e.run(round_("after-the-reset"))
            e.run(round_("again"))
        hits = {rid: n for rid, n in after.matched_tokens.items()
                if n and rid.startswith("after-the-reset")}
        self.check(not hits, "SCH-032",
                   observed=f"after reset_cache answered True, the connector matched {hits} "
                   "tokens of prompts it had stored (or was storing) only before the reset",
                   expected="no match of anything stored or being stored before an accepted "
                   "reset")

    @pytest.mark.kvspec_clause("SCH-009")
    @pytest.mark.kvspec_requires("async_loads")
    def test_second_allocation_starts_no_load(self, tmp_path: Path) -> None:
        """When a request whose async load finished is scheduled, the engine calls
        ``update_state_after_alloc`` again with ``num_external_tokens=0``; the connector
        must start no load on it (SCH-009). The engine sees only a second receive report,
        which is a double report (WRK-009) unless it goes away when the engine skips that
        call: the same scenario is then served again without it, to tell them apart."""
        try:
            serve(self.factory, SCENARIOS["full-prompt-hit"], tmp_path / "with-call",
                  prefix_caching=False)
        except ContractViolation as e:
            if e.clause != "WRK-009":
                raise
            try:
                serve(self.factory, SCENARIOS["full-prompt-hit"], tmp_path / "without-call",
                      prefix_caching=False, realloc_after_load=False)
            except ContractViolation:
                raise e from None
            self.check(False, "SCH-009", observed=f"{e.observed}; served again without the "
                       "update_state_after_alloc(..., num_external_tokens=0) call that follows "
                       "a finished load, no request was received twice: that call started a "
                       "second load", expected="no load started by the update_state_after_"
                       "alloc call with num_external_tokens=0 after a finished load")

    @pytest.mark.kvspec_clause("LAY-001", "LAY-002", "LAY-004", "LAY-006", "LAY-007", "WRK-013")
    def test_every_accepted_layout(self, tmp_path: Path) -> None:
        """Every stride order and K/V packing the connector accepts, with padded pages."""
        for i, (order, packing) in enumerate(layout_cases(self.capabilities)):
            serve(self.factory, SCENARIOS["full-prompt-hit"], tmp_path / str(i), order=order,
                  packing=packing, page_padding=i % 3, prefix_caching=False)

    @pytest.mark.kvspec_clause("LAY-003", "LAY-009", "LAY-012", "WRK-002")
    def test_over_allocated_non_restridable_tensors(self, tmp_path: Path) -> None:
        """kvcached-style tensors: capacity above the budget, re-striding refused (kvcached PR 313)."""
        serve(self.factory, SCENARIOS["shared-prefix"], tmp_path, extra_capacity=17,
              restridable=False, prefix_caching=False)

    @pytest.mark.kvspec_clause("WRK-009", "WRK-010", "EXE-001", "EXE-010", "SCH-023", "WRK-015")
    @pytest.mark.parametrize("tp_size", [2, 4])
    def test_tensor_parallel(self, tp_size: int, tmp_path: Path) -> None:
        """Workers as separate processes; every rank reports once (WRK-009, EXE-001)."""
        wl = Workload([*SCENARIOS["full-prompt-hit"].requests,
                       *(_later(r, 20) for r in SCENARIOS["aborts"].requests)], name="tp")
        serve(self.factory, wl, tmp_path, tp_size=tp_size, prefix_caching=False)

    @pytest.mark.kvspec_clause("SCH-018", "SCH-016", "SCH-023", "HSK-002")
    @pytest.mark.parametrize("tp_size", [1, 2])
    def test_two_engines(self, tp_size: int, tmp_path: Path) -> None:
        """A prefill engine hands requests to a decode engine via kv_transfer_params."""
        wl = Workload([RequestSpec(f"pd-{i}", tuple(range(7 * i, 7 * i + 13)), max_new_tokens=3,
                                   arrival_step=i) for i in range(3)], name="disaggregated")
        cfg = config_for(self.capabilities, tp_size=tp_size, prefix_caching=False)
        prefill, decode = run_disaggregated(self.factory, wl, prefill=cfg, decode=cfg,
                                            tmpdir=str(tmp_path))
        assert set(decode.finished) == {r.request_id for r in wl.requests}

    @pytest.mark.kvspec_clause("SCH-018", "SCH-016", "LAY-001", "LAY-002", "LAY-003", "LAY-004",
                               "LAY-009", "WRK-013")
    def test_two_engines_every_accepted_layout(self, tmp_path: Path) -> None:
        """Prefill to decode in every stride order and K/V packing the connector accepts,
        with padded pages, and every other case over-allocated and not re-stridable
        (kvcached PR 313)."""
        wl = Workload([RequestSpec("pd-layout", tuple(range(21)), max_new_tokens=2)],
                      name="disaggregated layouts")
        for i, (order, packing) in enumerate(layout_cases(self.capabilities)):
            cfg = config_for(self.capabilities, order=order, packing=packing,
                             page_padding=i % 3, extra_capacity=5 * (i % 2),
                             restridable=i % 2 == 0, prefix_caching=False)
            _, decode = run_disaggregated(self.factory, wl, prefill=cfg, decode=cfg,
                                          tmpdir=str(tmp_path / str(i)))
            assert decode.finished == ("pd-layout",)

    @pytest.mark.kvspec_requires("heterogeneous_tp")
    @pytest.mark.kvspec_clause("SCH-018", "SCH-016", "HSK-002", "HSK-003", "WRK-013", "EXE-008")
    @pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
    def test_two_engines_heterogeneous_tp(
        self, prefill_tp: int, decode_tp: int, tmp_path: Path
    ) -> None:
        """Prefill at one TP size, decode at another: every decode rank must end up with
        exactly the KV of the heads it holds (each decode layer's read is checked), and the
        prefill ranks must hold their blocks until every decode rank that needs them has read
        them (freed blocks are poisoned). The accepted layouts are shared between the two
        directions; the engines' block budgets and capacities differ."""
        wl = Workload([RequestSpec(f"hetero-{i}", tuple(range(5 * i, 5 * i + 11 + 4 * i)),
                                   max_new_tokens=2, arrival_step=i) for i in range(2)],
                      name="heterogeneous TP")
        direction = 0 if prefill_tp > decode_tp else 1
        cases = layout_cases(self.capabilities)
        for i, (order, packing) in enumerate(cases):
            if i % 2 != direction and len(cases) > 1:
                continue
            cfg = config_for(self.capabilities, order=order, packing=packing,
                             page_padding=i % 3, prefix_caching=False)
            prefill = attrs.evolve(cfg, tp_size=prefill_tp, extra_capacity=3 * (i % 2))
            decode = attrs.evolve(cfg, tp_size=decode_tp, num_blocks=cfg.num_blocks + 8,
                                  restridable=i % 2 == 0)
            _, result = run_disaggregated(self.factory, wl, prefill=prefill, decode=decode,
                                          tmpdir=str(tmp_path / str(i)))
            assert set(result.finished) == {r.request_id for r in wl.requests}

    @pytest.mark.kvspec_clause("SCH-001", "SCH-005", "SCH-015", "SCH-020", "SCH-021", "SCH-022",
                               "SCH-023", "WRK-009", "WRK-013", "EXE-001")
    def test_random_workloads(self, kvspec_profile: str, tmp_path: Path) -> None:
        """Random arrivals, lengths, shared prefixes, tenants, aborts and preemptions."""
        counter = iter(range(10**9))

        @settings(max_examples=_examples(kvspec_profile, 12), deadline=None, database=None,
                  suppress_health_check=list(HealthCheck), phases=_phases(kvspec_profile))
        @given(wl=workloads(), async_scheduling=st.booleans(), blocks=st.sampled_from([14, 48]),
               caching=st.booleans())
        def run(wl: Workload, async_scheduling: bool, blocks: int, caching: bool) -> None:
            serve(self.factory, wl, tmp_path / str(next(counter)), num_blocks=blocks,
                  async_scheduling=async_scheduling, prefix_caching=caching)

        run()

    @pytest.mark.kvspec_clause("SCH-003", "SCH-015", "SCH-021", "SCH-022", "WRK-009", "EXE-001",
                               "ERR-009")
    def test_stateful(self, kvspec_profile: str, tmp_path: Path) -> None:
        """Random interleavings of arrivals, aborts and steps, compared with a model."""
        factory, caps = self.factory, self.capabilities
        counter = iter(range(10**9))

        class Machine(RuleBasedStateMachine):
            def __init__(self) -> None:
                super().__init__()
                self.engine = Engine(factory, config_for(caps, num_blocks=16, prefix_caching=False),
                                     tmpdir=str(tmp_path / str(next(counter))))
                self.added: list[str] = []
                self.aborted: set[str] = set()

            @rule(prompt=st.lists(st.integers(0, 9), min_size=1, max_size=14),
                  new=st.integers(1, 3), salt=st.sampled_from([None, "t"]))
            def add(self, prompt: list[int], new: int, salt: str | None) -> None:
                rid = f"s{len(self.added)}"
                self.engine.add_request(RequestSpec(rid, tuple(prompt), max_new_tokens=new,
                                                    cache_salt=salt))
                self.added.append(rid)

            @rule(pick=st.integers(0, 50))
            def abort(self, pick: int) -> None:
                if self.added:
                    rid = self.added[pick % len(self.added)]
                    self.engine.abort(rid)
                    self.aborted.add(rid)

            @rule(n=st.integers(1, 4))
            def steps(self, n: int) -> None:
                for _ in range(n):
                    self.engine.step()

            @invariant()
            def model_agrees(self) -> None:
                for rid in self.added:
                    status = self.engine.requests[rid].status
                    if status is RequestStatus.ABORTED:
                        assert rid in self.aborted, f"{rid} aborted by nobody"

            def teardown(self) -> None:
                try:
                    for _ in range(400):
                        if self.engine.idle:
                            break
                        self.engine.step()
                    assert self.engine.idle, "engine did not go idle"
                    result = self.engine.result()
                    assert set(result.finished) | set(result.aborted) == set(self.added)
                    assert set(result.aborted) <= self.aborted
                    assert self.engine.pool.check_all_free() == []
                finally:
                    self.engine.shutdown()

        run_state_machine_as_test(Machine, settings=settings(
            max_examples=_examples(kvspec_profile, 8), stateful_step_count=25, deadline=None,
            database=None, suppress_health_check=list(HealthCheck),
            phases=_phases(kvspec_profile)))


def _later(spec: RequestSpec, steps: int) -> RequestSpec:
    """The same request, renamed and shifted ``steps`` later."""
    abort = None if spec.abort_at_step is None else spec.abort_at_step + steps
    return attrs.evolve(spec, request_id=f"{spec.request_id}-late",
                        arrival_step=spec.arrival_step + steps, abort_at_step=abort)


__all__ = ["TestEngine"]
__tracebackhide__ = hide_unless_harness_bug  # authors see their frames, not these
