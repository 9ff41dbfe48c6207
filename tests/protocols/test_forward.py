"""Tests of kvspec.protocols.forward against the DRY/GRA clauses and the normative table
"What the engine binds and calls" of docs/spec/state-machines.md."""

from __future__ import annotations

import itertools
from pathlib import Path

import attrs
import pytest

from kvspec.protocols.capabilities import HookGraphMode
from kvspec.protocols.errors import CapabilityError, InvalidArgumentError
from kvspec.protocols.forward import (
    ForwardPlan,
    GraphMode,
    GraphModeDecision,
    HookPlacement,
    MetadataBinding,
    plan_forward,
    resolve_graph_mode,
)
from kvspec.protocols.views import ForwardKind
from kvspec.spec import get_clause

K, G, H = ForwardKind, GraphMode, HookGraphMode
B, P = MetadataBinding, HookPlacement

DOC = Path(__file__).resolve().parents[2] / "docs" / "spec" / "state-machines.md"

ALL_COMBOS = list(itertools.product(K, G, H))


def _invalid_reason(kind: ForwardKind, mode: GraphMode, hooks: HookGraphMode) -> type | None:
    if mode is G.NONE and kind in (K.CAPTURE, K.REPLAY):
        return InvalidArgumentError
    if mode is G.FULL and hooks is H.EAGER:
        return CapabilityError
    return None


VALID = [c for c in ALL_COMBOS if _invalid_reason(*c) is None]
INVALID = [c for c in ALL_COMBOS if _invalid_reason(*c) is not None]


def _id(v: object) -> str:
    return v.name if hasattr(v, "name") else str(v)  # type: ignore[attr-defined]


# ------------------------------------------------------------------ the doc's table

# Row label in the doc -> (forward kind, graph modes the row covers).
ROWS = {
    "Profile": (K.PROFILE, (G.NONE, G.PIECEWISE, G.FULL)),
    "Warm-up": (K.WARMUP, (G.NONE, G.PIECEWISE, G.FULL)),
    "Capture, PIECEWISE": (K.CAPTURE, (G.PIECEWISE,)),
    "Capture, FULL": (K.CAPTURE, (G.FULL,)),
    "Real (eager)": (K.REAL, (G.NONE, G.PIECEWISE, G.FULL)),
    "Replay, PIECEWISE": (K.REPLAY, (G.PIECEWISE,)),
    "Replay, FULL": (K.REPLAY, (G.FULL,)),
}
COLUMNS = (H.NO_LAYER_HOOKS, H.EAGER, H.CAPTURABLE)

# The same table, transcribed by hand, so that a doc edit shows up as a test failure.
HAND_TABLE = {
    "Profile": ("nothing", "nothing", "nothing"),
    "Warm-up": ("nothing", "nothing", "dummy; hooks eager; no output"),
    "Capture, PIECEWISE": ("nothing", "nothing", "dummy; hooks eager between pieces; no output"),
    "Capture, FULL": ("nothing", "never (downgraded or refused, GRA-002)",
                      "dummy; hooks captured; no output"),
    "Real (eager)": ("step; no hooks; output", "step; hooks eager; output",
                     "step; hooks eager; output"),
    "Replay, PIECEWISE": ("step; no hooks; output", "step; hooks eager between pieces; output",
                          "step; hooks eager between pieces; output"),
    "Replay, FULL": ("step; no hooks; output", "never (GRA-002)", "step; hooks replayed; output"),
}


def _doc_table() -> dict[str, tuple[str, ...]]:
    text = DOC.read_text()
    start = text.index("| Forward | No per-layer hooks | Eager per-layer hooks |")
    rows: dict[str, tuple[str, ...]] = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = tuple(cells[1:])
    return rows


def test_doc_table_matches_transcription() -> None:
    assert _doc_table() == HAND_TABLE


def _expected_from_cell(cell: str) -> tuple[MetadataBinding, HookPlacement, bool] | None:
    """Parse one cell into (binding, layer hooks, collect output); None means 'never'."""
    if cell.startswith("never"):
        return None
    if cell == "nothing":
        return (B.NONE, P.NOT_CALLED, False)
    what, hooks, output = (p.strip() for p in cell.split(";"))
    binding = {"step": B.STEP, "dummy": B.DUMMY}[what]
    placement = {
        "no hooks": P.NOT_CALLED,
        "hooks eager": P.EAGER,
        "hooks eager between pieces": P.EAGER,
        "hooks captured": P.CAPTURED,
        "hooks replayed": P.REPLAYED,
    }[hooks]
    collect = {"output": True, "no output": False}[output]
    return (binding, placement, collect)


def _cells() -> list[tuple[str, ForwardKind, GraphMode, HookGraphMode, str]]:
    out = []
    for label, cells in HAND_TABLE.items():
        kind, modes = ROWS[label]
        for mode in modes:
            for hooks, cell in zip(COLUMNS, cells):
                out.append((label, kind, mode, hooks, cell))
    return out


CELLS = _cells()


def test_table_covers_every_valid_combination() -> None:
    covered = {(k, m, h) for _, k, m, h, cell in CELLS if _expected_from_cell(cell) is not None
               and not (m is G.FULL and h is H.EAGER)}
    assert covered == set(VALID)
    assert len(VALID) == 34
    # The FULL + eager cells say "never" or are resolved away before planning.
    for _, k, m, h, cell in CELLS:
        if m is G.FULL and h is H.EAGER and k in (K.CAPTURE, K.REPLAY):
            assert cell.startswith("never") and "GRA-002" in cell


@pytest.mark.parametrize(
    "label,kind,mode,hooks,cell", CELLS,
    ids=[f"{c[0]}|{c[2].name}|{c[3].name}" for c in CELLS],
)
def test_plan_matches_doc_cell(
    label: str, kind: ForwardKind, mode: GraphMode, hooks: HookGraphMode, cell: str
) -> None:
    expected = _expected_from_cell(cell)
    if mode is G.FULL and hooks is H.EAGER:
        # Either the doc says "never" or the mode must be resolved first (GRA-002).
        with pytest.raises(CapabilityError) as info:
            plan_forward(kind, mode, hooks)
        assert info.value.clause == "GRA-002"
        return
    assert expected is not None
    binding, placement, collect = expected
    plan = plan_forward(kind, mode, hooks)
    assert plan.kind is kind
    assert plan.graph_mode is mode
    assert plan.binding is binding
    assert plan.layer_hooks is placement
    assert plan.collect_output is collect
    # Bind, start_load_kv and wait_for_save are called exactly when something is bound
    # (GRA-007: they stay eager, so they run even when the per-layer hooks are captured).
    assert plan.start_load is (binding is not B.NONE)
    assert plan.wait_for_save is (binding is not B.NONE)
    assert plan.calls_connector is (binding is not B.NONE)


# -------------------------------------------------------------------- invalid combos


@pytest.mark.parametrize("kind,mode,hooks", INVALID, ids=_id)
def test_invalid_combinations_raise(kind: ForwardKind, mode: GraphMode, hooks: HookGraphMode) -> None:
    err_type = _invalid_reason(kind, mode, hooks)
    assert err_type is not None
    with pytest.raises(err_type) as info:
        plan_forward(kind, mode, hooks)
    if err_type is CapabilityError:
        assert info.value.clause == "GRA-002"
        assert "resolve_graph_mode" in str(info.value)
    else:
        assert not isinstance(info.value, CapabilityError)
        assert "needs a graph mode" in str(info.value)
        assert kind.value in str(info.value)


def test_invalid_combo_count() -> None:
    # 6 CAPTURE/REPLAY x NONE, plus 5 kinds x FULL x EAGER.
    assert len(INVALID) == 11


@pytest.mark.parametrize(
    "args",
    [("real", G.NONE, H.EAGER), (K.REAL, "none", H.EAGER), (K.REAL, G.NONE, "eager"),
     (None, None, None)],
)
def test_plan_forward_rejects_non_enums(args: tuple[object, object, object]) -> None:
    with pytest.raises(InvalidArgumentError, match="must be a"):
        plan_forward(*args)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- invariants

PLANS = [(c, plan_forward(*c)) for c in VALID]


def test_invariant_no_hook_without_binding() -> None:  # DRY-001
    for (kind, mode, hooks), plan in PLANS:
        if plan.binding is B.NONE:
            assert plan.start_load is False, (kind, mode, hooks)
            assert plan.wait_for_save is False, (kind, mode, hooks)
            assert plan.layer_hooks is P.NOT_CALLED, (kind, mode, hooks)
            assert plan.collect_output is False, (kind, mode, hooks)
            assert plan.calls_connector is False


def test_invariant_profile_calls_nothing() -> None:  # DRY-002
    profile = [(c, p) for c, p in PLANS if c[0] is K.PROFILE]
    assert len(profile) == 8
    for _, plan in profile:
        assert plan.binding is B.NONE
        assert (plan.start_load, plan.wait_for_save, plan.collect_output) == (False, False, False)
        assert plan.layer_hooks is P.NOT_CALLED
        assert "DRY-002" in plan.clauses


def test_invariant_no_layer_hooks_never_get_layer_hooks() -> None:  # DRY-003
    for (kind, mode, hooks), plan in PLANS:
        if hooks is H.NO_LAYER_HOOKS:
            assert plan.layer_hooks is P.NOT_CALLED, (kind, mode)
            assert "DRY-003" in plan.clauses


def test_invariant_dummy_kinds_never_collect_output() -> None:  # DRY-008
    dummies = [(c, p) for c, p in PLANS if c[0].is_dummy]
    assert {c[0] for c, _ in dummies} == {K.PROFILE, K.WARMUP, K.CAPTURE}
    for _, plan in dummies:
        assert plan.collect_output is False
        assert plan.binding is not B.STEP


def test_invariant_dummy_binding_only_for_capturable() -> None:  # DRY-004, DRY-005
    for (kind, mode, hooks), plan in PLANS:
        if kind in (K.WARMUP, K.CAPTURE):
            if hooks is H.CAPTURABLE:
                assert plan.binding is B.DUMMY, (kind, mode)
                assert "DRY-005" in plan.clauses
            else:
                assert plan.binding is B.NONE, (kind, mode, hooks)
                assert "DRY-004" in plan.clauses
        if plan.binding is B.DUMMY:
            assert kind in (K.WARMUP, K.CAPTURE) and hooks is H.CAPTURABLE


def test_invariant_real_and_replay_bind_step_and_collect() -> None:
    for (kind, mode, hooks), plan in PLANS:
        if kind in (K.REAL, K.REPLAY):
            assert plan.binding is B.STEP, (kind, mode, hooks)
            assert plan.collect_output is True
            assert plan.start_load is True and plan.wait_for_save is True
            if hooks is not H.NO_LAYER_HOOKS:
                # GRA-010: a declared per-layer hook is never lost in a real step.
                assert plan.layer_hooks in (P.EAGER, P.REPLAYED)
        else:
            assert plan.binding is not B.STEP
            assert plan.collect_output is False


def test_invariant_replayed_and_captured_placements() -> None:
    for (kind, mode, hooks), plan in PLANS:
        is_full_cap = mode is G.FULL and hooks is H.CAPTURABLE
        assert (plan.layer_hooks is P.REPLAYED) == (is_full_cap and kind is K.REPLAY), (kind, mode, hooks)
        assert (plan.layer_hooks is P.CAPTURED) == (is_full_cap and kind is K.CAPTURE), (kind, mode, hooks)


def test_invariant_eager_hooks_only_eager_or_not_called() -> None:  # GRA-002, GRA-003
    for (kind, mode, hooks), plan in PLANS:
        if hooks is H.EAGER:
            assert plan.layer_hooks in (P.EAGER, P.NOT_CALLED), (kind, mode)
        if mode is not G.FULL:
            assert plan.layer_hooks in (P.EAGER, P.NOT_CALLED), (kind, mode, hooks)


@pytest.mark.parametrize("combo,plan", PLANS, ids=[f"{k.name}-{m.name}-{h.name}" for (k, m, h), _ in PLANS])
def test_plan_clauses_exist(combo: tuple[ForwardKind, GraphMode, HookGraphMode], plan: ForwardPlan) -> None:
    assert isinstance(plan.clauses, tuple)
    assert plan.clauses, combo
    assert len(set(plan.clauses)) == len(plan.clauses)
    for cid in plan.clauses:
        assert get_clause(cid).id == cid


def test_plan_is_frozen() -> None:
    plan = plan_forward(K.REAL, G.NONE, H.EAGER)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        plan.binding = B.NONE  # type: ignore[misc]


def test_plan_is_deterministic() -> None:
    for combo in VALID:
        assert plan_forward(*combo) == plan_forward(*combo)


# --------------------------------------------------------------- resolve_graph_mode


def test_full_with_eager_hooks_is_downgraded() -> None:
    d = resolve_graph_mode(G.FULL, H.EAGER)
    assert isinstance(d, GraphModeDecision)
    assert d.requested is G.FULL
    assert d.effective is G.PIECEWISE
    assert d.downgraded is True
    assert "GRA-002" in d.reason
    assert d.reason.startswith("downgraded to PIECEWISE")
    # The downgraded mode plans without error.
    assert plan_forward(K.REPLAY, d.effective, H.EAGER).layer_hooks is P.EAGER


def test_full_with_eager_hooks_strict_is_refused() -> None:
    with pytest.raises(CapabilityError) as info:
        resolve_graph_mode(G.FULL, H.EAGER, strict=True)
    assert info.value.clause == "GRA-002"
    assert "refusing FULL" in str(info.value)
    assert "PIECEWISE" in str(info.value)


OTHER_COMBOS = [(m, h) for m in G for h in H if not (m is G.FULL and h is H.EAGER)]


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("mode,hooks", OTHER_COMBOS, ids=_id)
def test_other_modes_are_unchanged(mode: GraphMode, hooks: HookGraphMode, strict: bool) -> None:
    d = resolve_graph_mode(mode, hooks, strict=strict)
    assert d == GraphModeDecision(mode, mode, "as requested")
    assert d.downgraded is False


@pytest.mark.parametrize("args", [("full", H.EAGER), (G.FULL, "eager"), (None, None)])
def test_resolve_rejects_non_enums(args: tuple[object, object]) -> None:
    with pytest.raises(InvalidArgumentError, match="must be a"):
        resolve_graph_mode(*args)  # type: ignore[arg-type]


def test_resolved_mode_always_plans() -> None:
    """Whatever the request, the resolved mode yields a plan for every kind it supports."""
    for mode, hooks in itertools.product(G, H):
        eff = resolve_graph_mode(mode, hooks).effective
        for kind in K:
            if eff is G.NONE and kind in (K.CAPTURE, K.REPLAY):
                continue
            assert isinstance(plan_forward(kind, eff, hooks), ForwardPlan)
