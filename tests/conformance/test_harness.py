"""The harness engine itself: block pool, toy model, engine behaviour, worker processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvspec.conformance.connectors.null import NullConnector, NullMetadata, NullWorker
from kvspec.conformance.connectors.shared_storage import SharedStorageConnector
from kvspec.conformance.harness import (
    Engine,
    HarnessConfig,
    RequestSpec,
    Workload,
    run_disaggregated,
)
from kvspec.conformance.harness._blockpool import BlockPool, block_hashes
from kvspec.conformance.harness._toymodel import POISON, ToyModel, prefix_hashes, tenant_seed
from kvspec.conformance.harness.scenarios import SCENARIOS
from kvspec.protocols import (
    ConnectorStats,
    ContractViolation,
    InvalidArgumentError,
    KVPacking,
    KVSpecError,
    RequestStatus,
    TransferTimeoutError,
)

# -- block pool -------------------------------------------------------------------------


class BlockPoolMachine(RuleBasedStateMachine):
    """The pool against a model: references, caching and eviction never lose or share blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(8, prefix_caching=True)
        self.owned: list[list[int]] = []  # blocks held by simulated requests
        self.cached: dict[bytes, int] = {}

    @rule(n=st.integers(0, 4))
    def allocate(self, n: int) -> None:
        free_before = self.pool.num_free
        got = self.pool.allocate(n)
        if n > free_before:
            assert got is None
            return
        assert got is not None and len(got) == n and len(set(got)) == n
        held = {b for blocks in self.owned for b in blocks}
        assert not held & set(got), "a held block was handed out again"
        for b in got:  # evicted cache entries disappear
            for h in [h for h, cb in self.cached.items() if cb == b]:
                del self.cached[h]
        self.owned.append(got)

    @precondition(lambda self: self.owned)
    @rule(i=st.integers(0, 100), cache=st.booleans())
    def free(self, i: int, cache: bool) -> None:
        blocks = self.owned.pop(i % len(self.owned))
        if cache:
            for b in blocks:
                h = bytes([b, len(self.cached)])
                self.pool.cache(b, h)
                if self.pool.lookup([h]) == [b]:
                    self.cached[h] = b
        released = self.pool.free(blocks)
        assert set(released) <= set(blocks)
        assert not set(released) & set(self.cached.values()), "a cached block was released"

    @rule()
    def hit(self) -> None:
        for h, b in list(self.cached.items()):
            assert self.pool.lookup([h]) == [b]

    @invariant()
    def accounting(self) -> None:
        held = sum(len(b) for b in self.owned)
        assert self.pool.num_free + held == 8
        assert sorted(self.pool.check_all_free()) == sorted(b for bl in self.owned for b in bl)


TestBlockPool = BlockPoolMachine.TestCase
TestBlockPool.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_block_hashes_chain_and_salt() -> None:
    toks = tuple(range(12))
    plain = block_hashes(toks, 4, None, None)
    assert len(plain) == 3 and len(set(plain)) == 3
    assert block_hashes(toks[:8], 4, None, None) == plain[:2]  # chained prefix
    assert block_hashes(toks, 4, "a", None)[0] != plain[0]
    assert block_hashes(toks, 4, None, 1)[0] != plain[0]
    assert block_hashes((99,) + toks[1:], 4, None, None)[2] != plain[2]  # parent changes all


# -- toy model --------------------------------------------------------------------------


def test_toy_model_is_deterministic_and_tenant_sensitive() -> None:
    m = ToyModel(2, 4, 3, 3)
    seed = tenant_seed(None, None)
    hs = prefix_hashes((1, 2, 3), seed)
    a, b = m.kv(hs, 0), m.kv(hs, 0)
    assert a.shape == (3, 4, 6) and bool((a == b).all())
    assert not bool((m.kv(hs, 1) == a).all())
    other = prefix_hashes((1, 2, 3), tenant_seed("salt", None))
    assert not bool((m.kv(other, 0) == a).all())
    assert int(a.abs().max()) <= 100 and POISON > 100
    assert m.kv(hs, 0, range(2, 4)).equal(a[:, 2:4])
    assert m.generate((1, 2), seed, 3)[:2] == (1, 2) and len(m.generate((1, 2), seed, 3)) == 5


# -- engine -----------------------------------------------------------------------------


def test_null_connector_serves_every_scenario() -> None:
    for name, wl in SCENARIOS.items():
        cfg = HarnessConfig(num_blocks=12 if name == "preemption" else 48)
        with Engine(NullConnector(), cfg) as e:
            result = e.run(wl)
        assert set(result.finished) | set(result.aborted) == {r.request_id for r in wl.requests}


def test_preemption_and_aborts_happen() -> None:
    with Engine(NullConnector(), HarnessConfig(num_blocks=12)) as e:
        assert e.run(SCENARIOS["preemption"]).preemptions > 0
    with Engine(NullConnector(), HarnessConfig()) as e:
        result = e.run(SCENARIOS["aborts"])
    assert {"abort-waiting", "abort-running"} <= set(result.aborted)


def test_shared_storage_round_trip_loads_verified_blocks(tmp_path: os.PathLike[str]) -> None:
    """The second identical prompt is served from storage: 12 of its 16 prompt tokens."""
    with Engine(SharedStorageConnector(), HarnessConfig(prefix_caching=False),
                tmpdir=str(tmp_path)) as e:
        result = e.run(SCENARIOS["full-prompt-hit"])
    assert result.external_tokens["again"] == 12  # one block short: a token left (SCH-005)
    assert result.external_tokens["longer"] == 16


def test_tenants_do_not_share_stored_kv(tmp_path: os.PathLike[str]) -> None:
    with Engine(SharedStorageConnector(), HarnessConfig(prefix_caching=False),
                tmpdir=str(tmp_path)) as e:
        result = e.run(SCENARIOS["tenants"])
    for n, hit in ((17, 16), (14, 12)):  # two prompts, 4*4+1 and 3*4+2 tokens
        assert f"salted-a-{n}" not in result.external_tokens
        assert f"lora-{n}" not in result.external_tokens
        assert result.external_tokens[f"plain-again-{n}"] == hit


def test_async_scheduling_builds_next_metadata_before_output() -> None:
    order: list[str] = []

    class Recording(NullConnector):
        def create_scheduler(self, config):  # type: ignore[no-untyped-def]
            s = super().create_scheduler(config)
            build, update = s.build_connector_meta, s.update_connector_output
            s.build_connector_meta = lambda out: (order.append(f"build {out.step_id}"), build(out))[1]  # type: ignore[method-assign]
            s.update_connector_output = lambda o: (order.append("output"), update(o))[1]  # type: ignore[method-assign]
            return s

        def create_worker(self, config, rank):  # type: ignore[no-untyped-def]
            w = super().create_worker(config, rank)
            # a non-empty output every step: the engine may skip empty ones (SCH-019)
            w.get_kv_connector_stats = lambda: ConnectorStats({"steps": 1})  # type: ignore[method-assign]
            return w

    with Engine(Recording(), HarnessConfig(async_scheduling=True)) as e:
        e.run(Workload([RequestSpec("a", (1, 2, 3, 4, 5), max_new_tokens=3)]))
    assert order[:4] == ["build 0", "build 1", "output", "build 2"]


def test_violation_carries_reproduction() -> None:
    from kvspec.conformance.connectors.broken import FullPromptHitConnector

    with pytest.raises(ContractViolation) as info:
        with Engine(FullPromptHitConnector(), HarnessConfig(prefix_caching=False)) as e:
            e.run(SCENARIOS["full-prompt-hit"])
    err = info.value
    assert err.clause == "SCH-005"
    assert err.reproduce is not None
    assert "Workload(name='full-prompt-hit'" in err.reproduce
    assert "prefix_caching=False" in err.reproduce and "at step" in err.reproduce


@pytest.mark.parametrize("config", [
    HarnessConfig(prefix_caching=False),
    HarnessConfig(prefix_caching=False, order="HND", packing=KVPacking.SPLIT, dtype="float16",
                  extra={"storage_dir": ""}),
])
def test_the_reproduction_is_python_that_fails_the_same_way(
    tmp_path: os.PathLike[str], config: HarnessConfig
) -> None:
    """Issue 18, item 5: the reproduction was not code one could paste and run (no imports,
    the engine got a name, not the factory). It is now a script: run in a fresh
    interpreter, it fails with the same clause at the same step."""
    from kvspec.conformance.connectors.broken import FullPromptHitConnector

    with pytest.raises(ContractViolation) as info:
        with Engine(FullPromptHitConnector(), config) as e:
            e.run(SCENARIOS["full-prompt-hit"])
    script = Path(tmp_path) / "repro.py"
    script.write_text(info.value.reproduce or "")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "ContractViolation: [SCH-005]" in out.stderr
    step = (info.value.reproduce or "").splitlines()[0]
    assert step.startswith("# reproduce: fails at step ")


def test_two_engines_hand_off_through_shared_storage(tmp_path: os.PathLike[str]) -> None:
    wl = Workload([RequestSpec(f"r{i}", tuple(range(i, i + 13)), max_new_tokens=3)
                   for i in range(2)])
    prefill, decode = run_disaggregated(SharedStorageConnector(), wl, tmpdir=str(tmp_path))
    assert set(prefill.finished) == set(decode.finished) == {"r0", "r1"}
    assert decode.external_tokens == {"r0": 12, "r1": 12}


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="divisible"):
        HarnessConfig(num_heads=3, tp_size=2)
    with pytest.raises(InvalidArgumentError, match="repeats a request id"):
        Workload([RequestSpec("a", (1,)), RequestSpec("a", (2,))])
    with pytest.raises(InvalidArgumentError, match="prompt"):
        RequestSpec("a", ())


def test_requests_end_in_terminal_states() -> None:
    with Engine(NullConnector(), HarnessConfig()) as e:
        e.run(SCENARIOS["aborts"])
        assert {r.status for r in e.requests.values()} <= {RequestStatus.FINISHED,
                                                           RequestStatus.ABORTED}


def test_a_worker_that_does_not_start_in_time_fails_typed_and_is_reaped() -> None:
    """ERR-007: the start of a worker process (spawn, imports, the worker role, the
    registration) has its own bound, worker_start_timeout_s, longer by default than the
    bound on each later answer, so a busy machine starting several ranks is not taken for a
    connector that hangs; when it expires the error names the rank, and no process is left."""
    from slow_start import SlowStartConnector

    def children() -> set[int]:
        out = set()
        for entry in Path("/proc").iterdir():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                out.add(int(entry.name))
        return out

    before = children()
    t = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="worker rank 0 did not start within 2"):
        Engine(SlowStartConnector(), HarnessConfig(tp_size=2, worker_start_timeout_s=2),
               factory_spec="slow_start:SlowStartConnector")
    assert time.monotonic() - t < 20
    left = children() - before
    assert not left
    assert HarnessConfig().worker_start_timeout_s > HarnessConfig().worker_timeout_s


def test_dead_worker_process_fails_fast_without_hanging() -> None:
    e = Engine(NullConnector(), HarnessConfig(tp_size=2, worker_timeout_s=20))
    procs = list(e.workers.procs)  # type: ignore[attr-defined]
    try:
        e.add_request(RequestSpec("a", tuple(range(9)), max_new_tokens=4))
        e.step()
        os.kill(procs[1].pid, signal.SIGKILL)
        t = time.monotonic()
        with pytest.raises(KVSpecError, match="worker rank 1 died"):
            for _ in range(10):
                e.step()
        assert time.monotonic() - t < 10
    finally:
        e.shutdown()
    assert [p.poll() is not None for p in procs] == [True, True]  # both reaped, none left


def test_per_layer_hooks_run_in_spec_order() -> None:
    """With eager per-layer hooks the engine calls, per forward: bind, start_load_kv, then
    per layer wait_for_layer_load before and save_kv_layer after the layer's write, then
    wait_for_save, output, clear (WRK-003, WRK-004, WRK-005, WRK-006, WRK-007, WRK-008:
    the output is collected with the metadata bound, as vLLM 0.32 does); on odd steps
    start_load_kv comes after the forward, as vLLM 0.32 does without synchronous loads;
    zero-token steps skip the layers."""
    from kvspec.conformance.connectors.null import NullWorker
    from kvspec.protocols import Capabilities, HookGraphMode

    calls: list[str] = []

    class Worker(NullWorker):
        def bind_connector_metadata(self, metadata):  # type: ignore[no-untyped-def]
            calls.append("bind")
            super().bind_connector_metadata(metadata)

        def start_load_kv(self, forward_context):  # type: ignore[no-untyped-def]
            calls.append(f"start {forward_context.num_tokens}")
            super().start_load_kv(forward_context)

        def wait_for_layer_load(self, layer_name: str) -> None:
            calls.append(f"wait {layer_name[-6]}")

        def save_kv_layer(self, layer_name, kv_layer, forward_context):  # type: ignore[no-untyped-def]
            calls.append(f"save {layer_name[-6]}")

        def wait_for_save(self) -> None:
            calls.append("wait_for_save")

        def clear_connector_metadata(self) -> None:
            calls.append("clear")
            super().clear_connector_metadata()

        def get_finished(self, finished_req_ids):  # type: ignore[no-untyped-def]
            calls.append("output")
            return frozenset(), frozenset()

    class Layerwise(NullConnector):
        @property
        def capabilities(self) -> Capabilities:
            return Capabilities(layer_hooks=HookGraphMode.EAGER)

        def create_worker(self, config, rank):  # type: ignore[no-untyped-def]
            return Worker(config, rank)

    with Engine(Layerwise(), HarnessConfig(num_layers=2)) as e:
        e.add_request(RequestSpec("a", (1, 2, 3), max_new_tokens=2))
        e.step()
        assert calls == ["bind", "start 3", "wait 0", "save 0", "wait 1", "save 1",
                         "wait_for_save", "output", "clear"]
        calls.clear()
        e.step()  # odd steps: no sync load, so start after the forward (WRK-004 allows both)
        assert calls == ["bind", "wait 0", "save 0", "wait 1", "save 1", "start 1",
                         "wait_for_save", "output", "clear"]
        calls.clear()
        e.step()  # nothing scheduled: no layer runs, the output hooks still do (WRK-008)
        assert calls == ["bind", "start 0", "wait_for_save", "output", "clear"]


def test_engine_uses_the_connectors_own_aggregator(tmp_path: os.PathLike[str]) -> None:
    """A connector's executor role replaces the standard aggregator (EXE-012)."""
    from collections.abc import Sequence

    from kvspec.protocols import KVConnectorOutput, StandardAggregator

    seen: list[int] = []

    class Counting(StandardAggregator):
        def aggregate(self, outputs: Sequence[KVConnectorOutput]) -> KVConnectorOutput:
            seen.append(len(outputs))
            return super().aggregate(outputs)

    class WithExecutor(SharedStorageConnector):
        def create_executor(self, config):  # type: ignore[no-untyped-def]
            return Counting(config.world_size)

    with Engine(WithExecutor(), HarnessConfig(prefix_caching=False), tmpdir=str(tmp_path)) as e:
        result = e.run(SCENARIOS["full-prompt-hit"])
    assert seen and set(seen) == {1} and len(seen) == result.steps
    assert result.external_tokens["again"] == 12  # its counting let the load complete


def _eager_hooks_connector() -> NullConnector:
    from kvspec.conformance.connectors.null import NullWorker
    from kvspec.protocols import Capabilities, HookGraphMode

    class Worker(NullWorker):
        def wait_for_layer_load(self, layer_name: str) -> None:
            self.metadata_seen = True

        def save_kv_layer(self, layer_name, kv_layer, forward_context):  # type: ignore[no-untyped-def]
            self.metadata_seen = True

    class Eager(NullConnector):
        @property
        def capabilities(self) -> Capabilities:
            return Capabilities(layer_hooks=HookGraphMode.EAGER)

        def create_worker(self, config, rank):  # type: ignore[no-untyped-def]
            return Worker(config, rank)

    return Eager()


def test_full_graphs_downgrade_for_eager_hooks_and_lose_nothing() -> None:
    """GRA-002: FULL is downgraded to PIECEWISE for eager hooks, which then run every step."""
    from kvspec.protocols import GraphMode

    with Engine(_eager_hooks_connector(), HarnessConfig(graph_mode=GraphMode.FULL)) as e:
        assert e.workers.runtime.mode is GraphMode.PIECEWISE  # type: ignore[attr-defined]
        e.run(SCENARIOS["single"])


def test_strict_engine_refuses_full_graphs_for_eager_hooks() -> None:
    from kvspec.protocols import CapabilityError, GraphMode

    with pytest.raises(CapabilityError) as info:
        Engine(_eager_hooks_connector(), HarnessConfig(graph_mode=GraphMode.FULL, strict_graphs=True))
    assert info.value.clause == "GRA-002"


def test_a_naive_engine_losing_hooks_under_full_replay_fails_gra010(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM issue 29608: an engine that runs FULL graphs with eager per-layer hooks skips them
    at every replay. The harness must fail that loudly (GRA-010), never pass silently."""
    from kvspec.conformance.harness import _worker_runtime
    from kvspec.protocols import GraphMode, GraphModeDecision, HookGraphMode, plan_forward

    def naive_resolve(requested, hooks, *, strict=False):  # type: ignore[no-untyped-def]
        return GraphModeDecision(requested, requested, "naive: no downgrade")

    def naive_plan(kind, mode, hooks):  # type: ignore[no-untyped-def]
        if mode is GraphMode.FULL and hooks is HookGraphMode.EAGER:
            mode = GraphMode.PIECEWISE  # the plan still promises the eager hooks...
        return plan_forward(kind, mode, hooks)

    monkeypatch.setattr(_worker_runtime, "resolve_graph_mode", naive_resolve)
    monkeypatch.setattr(_worker_runtime, "plan_forward", naive_plan)
    with pytest.raises(ContractViolation) as info:
        with Engine(_eager_hooks_connector(), HarnessConfig(graph_mode=GraphMode.FULL)) as e:
            e.run(SCENARIOS["single"])  # ...but the FULL replay runs no Python
    assert info.value.clause == "GRA-010"
    assert "0 per-layer hook calls in a replay step" in info.value.observed


class _FailingShutdownWorker(NullWorker):
    def shutdown(self) -> None:
        raise RuntimeError("cannot release the registration")


class FailingShutdownConnector(NullConnector):
    """Module level, so worker processes can import it by name."""

    def create_worker(self, config, rank):  # type: ignore[no-untyped-def]
        return _FailingShutdownWorker(config, rank)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_connector_shutdown_failure_is_reported(tp_size: int) -> None:
    """In-process or in worker processes, a failing worker shutdown surfaces (WRK-015)."""
    e = Engine(FailingShutdownConnector(), HarnessConfig(tp_size=tp_size))
    e.run(SCENARIOS["single"])
    with pytest.raises(ContractViolation) as info:
        e.shutdown()
    assert info.value.clause == "WRK-015"
    assert "cannot release the registration" in info.value.observed


class _CrashingLoadWorker(NullWorker):
    def start_load_kv(self, forward_context):  # type: ignore[no-untyped-def]
        raise RuntimeError("shape mismatch in my loader")


class CrashingLoadConnector(NullConnector):
    """Module level, so worker processes can import it by name."""

    def create_worker(self, config, rank):  # type: ignore[no-untyped-def]
        return _CrashingLoadWorker(config, rank)


def test_a_hook_that_crashes_in_a_worker_process_names_err010_as_in_process() -> None:
    """A connector's crash in a worker process got no clause (a bare "worker rank 0
    raised"), where the same crash in process is ERR-010 naming the hook: the worker
    process now judges it where the traceback is, with the same words."""
    from kvspec.conformance._attribution import find_violation

    with pytest.raises(ContractViolation) as info:
        with Engine(CrashingLoadConnector(), HarnessConfig(tp_size=2)) as e:
            e.run(SCENARIOS["single"])
    assert info.value.clause == "ERR-010"
    with pytest.raises(RuntimeError) as crash:  # in process: the report judges the crash
        with Engine(CrashingLoadConnector(), HarnessConfig(tp_size=1)) as e:
            e.run(SCENARIOS["single"])
    same = find_violation(crash.value)
    assert same is not None and same.clause == "ERR-010"
    assert same.observed == ("_CrashingLoadWorker.start_load_kv raised RuntimeError: "
                             "shape mismatch in my loader")
    assert info.value.observed == f"rank 0: {same.observed}"


def test_an_engine_that_failed_to_start_does_not_disable_leak_checks() -> None:
    """A constructor that raises must not leave the engine registered as live, or every
    later engine in the process would skip its thread-leak check (WRK-015)."""
    from kvspec.protocols import CapabilityError, GraphMode

    with pytest.raises(CapabilityError):
        Engine(_eager_hooks_connector(), HarnessConfig(graph_mode=GraphMode.FULL, strict_graphs=True))
    assert Engine._live == []
    e = Engine(NullConnector(), HarnessConfig())
    e.shutdown()
    assert Engine._live == []


def test_a_blocking_scheduler_hook_fails_sch025() -> None:
    class Slow(NullConnector):
        def create_scheduler(self, config):  # type: ignore[no-untyped-def]
            s = super().create_scheduler(config)
            build = s.build_connector_meta
            s.build_connector_meta = lambda out: (time.sleep(0.3), build(out))[1]  # type: ignore[method-assign]
            return s

    with pytest.raises(ContractViolation) as info:
        with Engine(Slow(), HarnessConfig(hook_budget_s=0.1)) as e:
            e.run(SCENARIOS["single"])
    assert info.value.clause == "SCH-025"
    assert "build_connector_meta took" in info.value.observed


@pytest.mark.parametrize(("poison", "clause"), [
    ("PREEMPTED_POISON", "WRK-012"), ("FREED_POISON", "SCH-017"), ("ALLOC_POISON", "WRK-011"),
])
def test_each_poison_found_in_a_loaded_block_names_its_clause(
    tmp_path: os.PathLike[str], poison: str, clause: str
) -> None:
    """Issue 15: the blocks a preemption freed get their own poison, written after
    handle_preemptions returned, so a transfer that still read them is reported as WRK-012
    (it was reported as SCH-017, a read after request_finished, which it is not)."""
    from kvspec.conformance.harness import _worker_runtime

    rt = _worker_runtime.WorkerRuntime(NullConnector(), HarnessConfig(), 0, str(tmp_path))
    rt.register()
    try:
        value = float(getattr(_worker_runtime, poison))
        got = torch.full((8, 4, 4), value)  # the 8 tokens read: positions x heads x chans
        r = {"id": "r", "blocks": [3, 5], "ext": (4, 8), "tokens": list(range(9))}
        v = rt._attribute(r, [], 5, 0, got, torch.zeros(8, 4, 4))
        assert v["clause"] == clause, v
    finally:
        rt.shutdown()


@pytest.mark.parametrize(("whose", "clause"), [
    ("own", "WRK-011"), ("other", "WRK-013"), ("preempted", "WRK-012"),
])
def test_allocation_poison_tells_whose_never_written_bytes_were_loaded(
    tmp_path: os.PathLike[str], whose: str, clause: str
) -> None:
    """Issue 35: every step's allocations get their own poison value (``alloc_poison``).
    Loading the block's own allocation poison means the load never wrote it (WRK-011);
    another allocation's means the connector stored bytes it read late, from blocks the
    engine had handed out since (WRK-013), or reallocated after a preemption (WRK-012).
    One shared value made both races read as 'never written', whichever run won."""
    from kvspec.conformance.harness import _worker_runtime

    rt = _worker_runtime.WorkerRuntime(NullConnector(), HarnessConfig(), 0, str(tmp_path))
    rt.register()
    try:
        empty = {"step": 0, "sync_loads": False, "poison_freed": [], "poison_preempted": [],
                 "poison_alloc": [], "preempted": [], "finished": [], "reqs": []}
        rt.step({**empty, "step": 3, "poison_preempted": [7]}, NullMetadata())
        rt.step({**empty, "step": 4, "poison_alloc": [7, 9]}, NullMetadata())
        rt.step({**empty, "step": 6, "poison_alloc": [3, 5]}, NullMetadata())
        found = {"own": 6, "other": 4, "preempted": 4}[whose]
        if whose == "other":
            rt._reused.clear()
        assert _worker_runtime.alloc_poison(4) != _worker_runtime.alloc_poison(6)
        got = torch.full((8, 4, 4), float(_worker_runtime.alloc_poison(found)))
        r = {"id": "r", "blocks": [3, 5], "ext": (4, 8), "tokens": list(range(9))}
        v = rt._attribute(r, [], 5, 0, got, torch.zeros(8, 4, 4))
        assert v["clause"] == clause, v
    finally:
        rt.shutdown()


def test_allocation_poisons_are_exact_and_outside_the_models_values() -> None:
    """Every step's value survives bfloat16 and float16 exactly, differs from the other
    poisons and the toy model's range, and repeats only after more steps than a run has."""
    from kvspec.conformance.harness import _worker_runtime

    values = [_worker_runtime.alloc_poison(s) for s in range(len(_worker_runtime._ALLOC_VALUES))]
    assert len(set(values)) == len(values) > 500
    assert not {_worker_runtime.FREED_POISON, _worker_runtime.PREEMPTED_POISON} & set(values)
    assert all(abs(v) > 100 for v in values)
    for dtype in (torch.bfloat16, torch.float16):
        t = torch.tensor(values, dtype=torch.float32)
        assert torch.equal(t.to(dtype).to(torch.float32), t)


def test_a_run_out_of_steps_names_the_requests_left() -> None:
    """Issue 15: a run that never finished said only 'did not finish in 500 steps'. It now
    names the requests left and their states (here, one the connector defers forever)."""
    from kvspec.conformance.connectors.null import NullScheduler

    class _Deferring(NullScheduler):
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                       ) -> tuple[int | None, bool]:
            return None, False

    class _Connector(NullConnector):
        def create_scheduler(self, config: Any) -> Any:
            return _Deferring(config)

    with pytest.raises(AssertionError, match="did not finish in 20 steps.*r waiting"):
        with Engine(_Connector(), HarnessConfig()) as e:
            e.run(Workload([RequestSpec("r", (1, 2, 3, 4, 5))]), max_steps=20)


def test_after_a_lost_transfer_later_engines_wait_only_the_cap(
        tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 35: a connector that never reports its sends costs the first engine the whole
    transfer timeout (SCH-016); later engines on the same connector class wait at most
    LOST_TRANSFER_CAP_S, and their verdicts say so. Other connectors keep the timeout."""
    from kvspec.conformance.connectors.broken import NoSendReportConnector
    from kvspec.conformance.harness import engine as engine_module

    monkeypatch.setattr(engine_module, "_LOST_TRANSFERS", set())
    cfg = HarnessConfig(prefix_caching=False, transfer_timeout_s=2.0)
    wl = SCENARIOS["full-prompt-hit"]
    verdicts = []
    for i in range(2):
        start = time.monotonic()
        with pytest.raises(ContractViolation) as info:
            with Engine(NoSendReportConnector(), cfg, tmpdir=f"{tmp_path}/{i}") as e:
                assert e.config.transfer_timeout_s == (2.0 if i == 0 else 1.0)
                e.run(wl)
        verdicts.append((info.value.clause, time.monotonic() - start, str(info.value)))
    assert [v[0] for v in verdicts] == ["SCH-016", "SCH-016"]
    assert verdicts[0][1] >= 2.0 and verdicts[1][1] < 2.0
    assert "capped" not in verdicts[0][2] and "capped at 1 s" in verdicts[1][2]
    with Engine(SharedStorageConnector(), cfg, tmpdir=f"{tmp_path}/other") as e:
        assert e.config.transfer_timeout_s == 2.0


def test_a_preempted_request_queues_behind_requests_whose_loads_ended() -> None:
    """CI at df5c010: the 'preemption' scenario ran out of steps about one run in eight on a
    busy machine, whatever the connector. Two requests whose async loads had ended waited
    holding 6 of the 11 blocks; the preempted request, queued before them, took the other
    4, needed a fifth, preempted itself, and did so again every step. It now queues behind
    the requests that hold loaded blocks, which can run and free them."""
    from kvspec.protocols import RequestStatus

    with Engine(NullConnector(), HarnessConfig(num_blocks=12)) as e:
        for rid in ("loaded", "victim", "new"):
            e.add_request(RequestSpec(rid, tuple(range(13))))
        loaded, victim = e.requests["loaded"], e.requests["victim"]
        loaded.recv_done, loaded.blocks = True, e.pool.allocate(3) or []
        e.waiting.remove(victim)
        victim.status, victim.blocks = RequestStatus.RUNNING, e.pool.allocate(4) or []
        e.running.append(victim)
        e._preempt(victim, [])
        assert [r.rid for r in e.waiting] == ["loaded", "victim", "new"]
        assert e.pool.num_free == 7 and victim.status is RequestStatus.PREEMPTED
        e.run(Workload([]))  # and the three run to completion
        assert {r.status for r in e.requests.values()} == {RequestStatus.FINISHED}


def test_sleep_is_refused_for_a_connector_without_sleep_mode_and_a_sleeping_engine_does_not_step(
        tmp_path: Path) -> None:
    """WRK-020 in the harness: the refusal names the connector and the capability; the
    engine refuses to step while asleep and to wake while awake."""
    from kvspec.conformance.connectors import SharedStorageConnector
    from kvspec.conformance.connectors.null import NullConnector
    from kvspec.protocols import CapabilityError, InvalidArgumentError

    with Engine(NullConnector(), HarnessConfig(), tmpdir=str(tmp_path / "n")) as engine:
        with pytest.raises(CapabilityError, match="WRK-020.*sleep_mode"):
            engine.sleep()
    with Engine(SharedStorageConnector(), HarnessConfig(prefix_caching=False),
                tmpdir=str(tmp_path / "s")) as engine:
        with pytest.raises(InvalidArgumentError):
            engine.wake()
        engine.sleep()
        assert engine.asleep
        with pytest.raises(InvalidArgumentError, match="asleep"):
            engine.step()
        engine.wake()
        engine.run(Workload([RequestSpec("r", tuple(range(13)), max_new_tokens=2)]))
