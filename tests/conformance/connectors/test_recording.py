"""The call recorder and the order checker: what it accepts, what it catches, and that the
reference harness's own order passes it (the vLLM side is in tests/vllm/test_call_order.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvspec.conformance.connectors.layerwise import LayerwiseStorageConnector
from kvspec.conformance.connectors.shared_storage import SharedStorageConnector
from kvspec.conformance.harness import Engine, HarnessConfig
from kvspec.conformance.harness.scenarios import SCENARIOS
from kvspec.conformance.connectors.recording import (
    Call,
    RecordingConnector,
    check_call_order,
    check_step_order,
    read_calls,
)
from kvspec.protocols import InvalidArgumentError

L = ["l0", "l1"]


def _calls(*rows: tuple[str, str, dict[str, Any]]) -> list[Call]:
    return [Call(i, role, 0 if role == "worker" else None, hook, fields)
            for i, (role, hook, fields) in enumerate(rows)]


def _step(step: int, *, late: bool = False, output_after_clear: bool = False,
          layers: bool = True) -> list[tuple[str, str, dict[str, Any]]]:
    w: list[tuple[str, str, dict[str, Any]]] = [("worker", "bind_connector_metadata", {})]
    start = ("worker", "start_load_kv", {"step": step})
    if not late:
        w.append(start)
    if layers:
        for name in L:
            w += [("worker", "wait_for_layer_load", {"layer": name}),
                  ("worker", "save_kv_layer", {"layer": name, "step": step})]
    if late:
        w.append(start)
    w.append(("worker", "wait_for_save", {}))
    out = ("worker", "build_connector_output", {"recving": []})
    clear = ("worker", "clear_connector_metadata", {})
    return w + ([clear, out] if output_after_clear else [out, clear])


def _engine_run(*steps: list[tuple[str, str, dict[str, Any]]],
                sync_step: int | None = None) -> list[Call]:
    rows: list[tuple[str, str, dict[str, Any]]] = [
        ("worker", "register_kv_caches", {"layers": L}),
        ("scheduler", "on_new_request", {"req": "r"}),
        ("scheduler", "get_num_new_matched_tokens",
         {"req": "r", "count": 32 if sync_step is not None else 0, "load_async": False}),
        ("scheduler", "update_state_after_alloc",
         {"req": "r", "external": 32 if sync_step is not None else 0}),
    ]
    for i, step in enumerate(steps):
        rows.append(("scheduler", "build_connector_meta",
                     {"step": i, "new": ["r"] if i == 0 else []}))
        rows += step
    rows += [("scheduler", "request_finished", {"req": "r"}), ("worker", "shutdown", {}),
             ("scheduler", "shutdown", {})]
    return _calls(*rows)


def test_both_allowed_orders_pass() -> None:
    """WRK-004 WRK-008: late start without sync loads, output before or after the clear."""
    calls = _engine_run(_step(0), _step(1, late=True), _step(2, output_after_clear=True),
                        _step(3, layers=False))
    assert check_call_order(calls) == []


@pytest.mark.parametrize("steps,sync,clause", [
    ([_step(0, late=True)], 0, "WRK-004"),  # a synchronous load must start before the layers
    ([_step(0)[:1] + _step(0)[3:5] + _step(0)[1:3] + _step(0)[5:]], None, "WRK-004"),
    ([_step(0)[:1] + _step(0)[1:2] * 2 + _step(0)[2:]], None, "WRK-004"),  # started twice
    ([_step(0)[:-2] + _step(0)[-1:]], None, "WRK-008"),  # no output for the step
    ([_step(0) + [("worker", "build_connector_output", {})]], None, "WRK-008"),  # two
    ([[r for r in _step(0) if r[1] != "wait_for_save"]], None, "WRK-007"),
    ([[_step(0)[0]] + [r for r in _step(0)[1:] if r[1] != "clear_connector_metadata"]
      + _step(1)], None, "WRK-003"),
    ([[("worker", "start_load_kv", {"step": 0})] + _step(0)[2:]], None, "DRY-001"),
    ([[("worker", "bind_connector_metadata", {}), ("worker", "handle_preemptions", {})]
      + _step(0)[1:]], None, "WRK-012"),
    ([_step(0)[:3] + [("worker", "save_kv_layer", {"layer": "l0"})] + _step(0)[3:]], None,
     "WRK-005"),
])
def test_violations_are_caught_with_their_clause(
        steps: list[list[tuple[str, str, dict[str, Any]]]], sync: int | None,
        clause: str) -> None:
    found = check_call_order(_engine_run(*steps, sync_step=sync))
    assert clause in {v.clause for v in found}, found


def test_scheduler_violations() -> None:
    calls = _calls(
        ("scheduler", "get_num_new_matched_tokens", {"req": "a", "count": 0}),  # SCH-001
        ("scheduler", "on_new_request", {"req": "b"}),
        ("scheduler", "update_state_after_alloc", {"req": "b", "external": 0}),  # SCH-008
        ("scheduler", "build_connector_meta", {"step": 1}),  # SCH-011: step 0 skipped
        ("scheduler", "update_connector_output", {}),
        ("scheduler", "update_connector_output", {}),  # SCH-019: more outputs than steps
        ("scheduler", "request_finished", {"req": "b"}),
        ("scheduler", "request_finished", {"req": "b"}),  # SCH-015
    )
    assert [v.clause for v in check_call_order(calls)] == [
        "SCH-001", "SCH-008", "SCH-011", "SCH-019", "SCH-015"]


def test_recording_connector_needs_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSPEC_RECORD_INNER", raising=False)
    monkeypatch.delenv("KVSPEC_RECORD_PATH", raising=False)
    with pytest.raises(InvalidArgumentError, match="KVSPEC_RECORD_INNER"):
        RecordingConnector()


def test_read_calls_rejects_garbage(tmp_path: Path) -> None:
    bad = tmp_path / "calls.jsonl"
    bad.write_text(json.dumps({"hook": "x"}) + "\n")
    with pytest.raises(InvalidArgumentError, match="not a recorded call"):
        read_calls(bad)


@pytest.mark.parametrize("factory,scenario", [
    (SharedStorageConnector, "preemption"), (SharedStorageConnector, "aborts"),
    (LayerwiseStorageConnector, "full-prompt-hit"),
])
def test_the_reference_harness_passes_its_own_checker(tmp_path: Path, factory: Any,
                                                      scenario: str) -> None:
    """The harness drives hooks in an order the checker accepts, alternating the orders the
    spec allows (WRK-004, WRK-008) and skipping empty outputs (SCH-019)."""
    path = tmp_path / "calls.jsonl"
    rec = RecordingConnector(factory(), path)
    cfg = HarnessConfig(prefix_caching=False, num_blocks=13 if scenario == "preemption" else 64)
    with Engine(rec, cfg, tmpdir=str(tmp_path)) as e:
        e.run(SCENARIOS[scenario])
    calls = read_calls(path)
    assert check_call_order(calls) == []
    hooks = [c.hook for c in calls]
    assert hooks.count("build_connector_meta") >= hooks.count("update_connector_output")
    windows = sum(1 for c in calls if c.hook == "bind_connector_metadata")
    assert hooks.count("build_connector_output") == windows


# ------------------------------------------------------------------ the speculative step (SPD-001)

T = ["t0", "t1"]
D = ["d0"]


def _layers(names: list[str]) -> list[str | tuple[str, str]]:
    return [x for n in names for x in (("wait_for_layer_load", n), ("save_kv_layer", n))]


def _spec_step(passes: int = 2, draft: list[str] = D) -> list[str | tuple[str, str]]:
    """vLLM's order with a drafter: target layers, outputs, draft passes, wait_for_save."""
    return (["bind_connector_metadata", "start_load_kv"] + _layers(T)
            + ["build_connector_output"] + _layers(draft) * passes
            + ["wait_for_save", "clear_connector_metadata"])


@pytest.mark.parametrize("passes,declared", [(1, 1), (2, 2), (3, None), (2, None)])
def test_check_step_order_accepts_the_drafters_order(passes: int, declared: int | None) -> None:
    """SPD-001: outputs before wait_for_save, draft layers' hooks once per draft pass."""
    assert check_step_order(_spec_step(passes), target_layers=T, draft_layers=D,
                            draft_passes=declared) == []


def test_check_step_order_plain_and_ngram_and_no_forward() -> None:
    plain = (["bind_connector_metadata", "start_load_kv"] + _layers(T)
             + ["wait_for_save", "build_connector_output", "clear_connector_metadata"])
    assert check_step_order(plain, target_layers=T) == []
    # n-gram drafting: no draft layers, the outputs still before wait_for_save
    ngram = (["start_load_kv"] + _layers(T) + ["build_connector_output", "wait_for_save"])
    assert check_step_order(ngram, target_layers=T, draft_passes=1) == []
    # a step with no forward under a drafter keeps the plain order
    idle = ["start_load_kv", "wait_for_save", "build_connector_output"]
    assert check_step_order(idle, target_layers=T, draft_layers=D, draft_passes=2,
                            forward=False) == []
    # the output built after the clear is not part of the bound step
    assert check_step_order(plain[:-2] + plain[-1:], target_layers=T) == []
    # vLLM 0.32's late start under a drafter: right after the target's forward, before the
    # output hooks and the draft passes (measured; WRK-004, SPD-001)
    late = (_layers(T) + ["start_load_kv", "build_connector_output"] + _layers(D) * 2
            + ["wait_for_save"])
    assert check_step_order(late, target_layers=T, draft_layers=D, draft_passes=2) == []


_WRONG: list[tuple[str, list[str | tuple[str, str]], dict[str, Any], str]] = [
    ("draft hooks before the target's",
     ["start_load_kv"] + _layers(D) + _layers(T) + ["build_connector_output"] + _layers(D)
     + ["wait_for_save"], {"draft_passes": 2}, "SPD-001"),
    ("draft hooks before the outputs",
     ["start_load_kv"] + _layers(T) + _layers(D) + ["build_connector_output"] + _layers(D)
     + ["wait_for_save"], {"draft_passes": 2}, "SPD-001"),
    ("plain order under a drafter (wait_for_save before the outputs)",
     ["start_load_kv"] + _layers(T) + _layers(D) * 2 + ["wait_for_save",
                                                        "build_connector_output"],
     {"draft_passes": 2}, "SPD-001"),
    ("no output in a speculative step",
     ["start_load_kv"] + _layers(T) + _layers(D) * 2 + ["wait_for_save"],
     {"draft_passes": 2}, "SPD-001"),
    ("outputs before wait_for_save with no drafter",
     ["start_load_kv"] + _layers(T) + ["build_connector_output", "wait_for_save"],
     {"draft_passes": 0}, "WRK-008"),
    ("draft hooks in a step declared with no drafter",
     ["start_load_kv"] + _layers(T) + _layers(D) + ["wait_for_save"],
     {"draft_passes": 0}, "WRK-005"),
    ("a target layer's hooks twice",
     ["start_load_kv"] + _layers(T) + ["build_connector_output"] + _layers(T[:1])
     + _layers(D) * 2 + ["wait_for_save"], {"draft_passes": 2}, "WRK-005"),
    ("a target layer's hooks twice, no drafter",
     ["start_load_kv"] + _layers(T) + _layers(T[:1]) + ["wait_for_save"],
     {"draft_passes": 0}, "WRK-005"),
    ("one draft pass where two were declared",
     ["start_load_kv"] + _layers(T) + ["build_connector_output"] + _layers(D)
     + ["wait_for_save"], {"draft_passes": 2}, "SPD-001"),
    ("a draft pass cut short",
     ["start_load_kv"] + _layers(T) + ["build_connector_output"] + _layers(D)
     + [("wait_for_layer_load", "d0"), "wait_for_save"], {"draft_passes": None}, "SPD-001"),
    ("wait_for_save before the last draft pass",
     ["start_load_kv"] + _layers(T) + ["build_connector_output"] + _layers(D)
     + ["wait_for_save"] + _layers(D), {"draft_passes": 2}, "WRK-007"),
    ("the output before the last target layer",
     ["start_load_kv"] + _layers(T[:1]) + ["build_connector_output"] + _layers(T[1:])
     + _layers(D) * 2 + ["wait_for_save"], {"draft_passes": 2}, "SPD-001"),
    ("start_load_kv between the target's layers",
     _layers(T[:1]) + ["start_load_kv"] + _layers(T[1:]) + ["build_connector_output"]
     + _layers(D) * 2 + ["wait_for_save"], {"draft_passes": 2}, "WRK-004"),
    ("start_load_kv after the output hooks",
     _layers(T) + ["build_connector_output", "start_load_kv"] + _layers(D) * 2
     + ["wait_for_save"], {"draft_passes": 2}, "SPD-001"),
    ("start_load_kv between two draft passes",
     _layers(T) + ["build_connector_output"] + _layers(D) + ["start_load_kv"] + _layers(D)
     + ["wait_for_save"], {"draft_passes": 2}, "SPD-001"),
    ("wait_for_save twice",
     ["start_load_kv"] + _layers(T) + ["build_connector_output"] + _layers(D) * 2
     + ["wait_for_save", "wait_for_save"], {"draft_passes": 2}, "WRK-007"),
]


@pytest.mark.parametrize("name,calls,kw,clause", _WRONG, ids=[w[0] for w in _WRONG])
def test_check_step_order_rejects_every_other_order(
        name: str, calls: list[str | tuple[str, str]], kw: dict[str, Any], clause: str) -> None:
    found = check_step_order(calls, target_layers=T, draft_layers=D, **kw)
    assert clause in {v.clause for v in found}, (name, found)


def test_check_step_order_rejects_malformed_calls() -> None:
    with pytest.raises(InvalidArgumentError, match="needs its layer"):
        check_step_order(["save_kv_layer"], target_layers=T)
    with pytest.raises(InvalidArgumentError, match="neither"):
        check_step_order([("save_kv_layer",)], target_layers=T)  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match="draft_passes"):
        check_step_order([], target_layers=T, draft_passes=-1)


def test_recorded_speculative_steps_checked(tmp_path: Path) -> None:
    """check_call_order reads the drafter from the recorded create_worker: the drafter's
    order passes, the plain order under a declared drafter does not."""
    spec = ([("worker", "bind_connector_metadata", {}), ("worker", "start_load_kv", {"step": 0})]
            + [("worker", h, {"layer": n}) for h, n in _layers(T)]  # type: ignore[misc]
            + [("worker", "build_connector_output", {})]
            + [("worker", h, {"layer": n}) for h, n in _layers(D) * 2]  # type: ignore[misc]
            + [("worker", "wait_for_save", {}), ("worker", "clear_connector_metadata", {})])
    head = [("worker", "create_worker", {"draft_layers": D, "speculative_tokens": 2}),
            ("worker", "register_kv_caches", {"layers": T + D}),
            ("scheduler", "build_connector_meta", {"step": 0, "new": []})]
    assert check_call_order(_calls(*head, *spec)) == []
    plain = [r for r in spec if r[1] != "build_connector_output"]
    plain.insert(-1, ("worker", "build_connector_output", {}))  # after wait_for_save
    assert "SPD-001" in {v.clause for v in check_call_order(_calls(*head, *plain))}
    # without the declaration the draft layers' repeated hooks are WRK-005
    assert "WRK-005" in {v.clause for v in check_call_order(_calls(*head, *spec),
                                                           speculative=False, draft_layers=[])}


@pytest.mark.parametrize("graph", ["eager", "full"])
def test_the_speculative_harness_passes_its_own_checker(tmp_path: Path, graph: str) -> None:
    """The harness's speculative steps (eagle: two draft passes) pass the checker."""
    from kvspec.protocols import GraphMode
    path = tmp_path / "calls.jsonl"
    rec = RecordingConnector(LayerwiseStorageConnector(), path)
    cfg = HarnessConfig(prefix_caching=False, speculative_tokens=2, draft_layers=1,
                        draft_passes=2,
                        graph_mode=GraphMode.FULL if graph == "full" else GraphMode.NONE)
    with Engine(rec, cfg, tmpdir=str(tmp_path)) as e:
        e.run(SCENARIOS["full-prompt-hit"])
    calls = read_calls(path)
    assert check_call_order(calls) == []
    hooks = [c.hook for c in calls]
    assert hooks.count("save_kv_layer") > 0
