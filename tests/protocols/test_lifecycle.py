"""Tests of kvspec.protocols.lifecycle against the request diagram of docs/spec/state-machines.md."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvspec.protocols.errors import ContractViolation, InvalidArgumentError
from kvspec.protocols.lifecycle import REQUEST_TRANSITIONS, TERMINAL_STATES, check_transition
from kvspec.protocols.views import RequestStatus
from kvspec.spec import get_clause

S = RequestStatus
DOC = Path(__file__).resolve().parents[2] / "docs" / "spec" / "state-machines.md"

# The arrows of the request stateDiagram, written out by hand (the doc is normative).
DIAGRAM = {
    (S.WAITING, S.WAITING),
    (S.WAITING, S.WAITING_FOR_REMOTE_KV),
    (S.WAITING, S.RUNNING),
    (S.WAITING_FOR_REMOTE_KV, S.WAITING),
    (S.WAITING_FOR_REMOTE_KV, S.PREEMPTED),
    (S.RUNNING, S.PREEMPTED),
    (S.PREEMPTED, S.RUNNING),
    (S.PREEMPTED, S.WAITING_FOR_REMOTE_KV),
    (S.PREEMPTED, S.WAITING),
    (S.RUNNING, S.FINISHED),
    (S.WAITING, S.ABORTED),
    (S.WAITING_FOR_REMOTE_KV, S.ABORTED),
    (S.RUNNING, S.ABORTED),
    (S.PREEMPTED, S.ABORTED),
}
ALL_PAIRS = set(itertools.product(S, S))
DISALLOWED = sorted(ALL_PAIRS - DIAGRAM, key=lambda p: (p[0].value, p[1].value))


def _doc_transitions() -> set[tuple[RequestStatus, RequestStatus]]:
    text = DOC.read_text()
    block = text.split("stateDiagram-v2", 1)[1].split("```", 1)[0]
    out = set()
    for a, b in re.findall(r"^\s*(\w+)\s*-->\s*(\w+)\s*:", block, flags=re.M):
        out.add((S[a], S[b]))
    return out


def test_hand_table_matches_the_doc() -> None:
    assert _doc_transitions() == DIAGRAM


def test_request_transitions_equal_the_diagram() -> None:
    table = {(a, b) for a, nexts in REQUEST_TRANSITIONS.items() for b in nexts}
    assert table == DIAGRAM
    assert set(REQUEST_TRANSITIONS) == set(S)


def test_transition_table_is_immutable() -> None:
    with pytest.raises(TypeError):
        REQUEST_TRANSITIONS[S.FINISHED] = frozenset({S.WAITING})  # type: ignore[index]
    assert isinstance(REQUEST_TRANSITIONS[S.WAITING], frozenset)


@pytest.mark.parametrize("old,new", sorted(DIAGRAM, key=lambda p: (p[0].value, p[1].value)),
                         ids=lambda s: s.value)
def test_every_diagram_transition_is_allowed(old: RequestStatus, new: RequestStatus) -> None:
    assert check_transition("req-1", old, new) is None


@pytest.mark.parametrize("old,new", DISALLOWED, ids=lambda s: s.value)
def test_disallowed_transitions_raise(old: RequestStatus, new: RequestStatus) -> None:
    with pytest.raises(ContractViolation) as info:
        check_transition("req-42", old, new)
    err = info.value
    assert err.clause is not None
    get_clause(err.clause)  # names a real clause
    expected_clause = "SCH-021" if old is S.WAITING_FOR_REMOTE_KV else "SCH-015"
    assert err.clause == expected_clause
    assert "observed" in str(err) and "expected" in str(err)
    assert err.observed == f"request 'req-42' moved from {old.value} to {new.value}"
    assert err.expected.startswith(f"from {old.value} only to ")
    for allowed in REQUEST_TRANSITIONS[old]:
        assert allowed.value in err.expected


def test_terminal_states() -> None:
    assert TERMINAL_STATES == {S.FINISHED, S.ABORTED}
    for t in TERMINAL_STATES:
        assert REQUEST_TRANSITIONS[t] == frozenset()
    non_terminal = set(S) - TERMINAL_STATES
    for s in non_terminal:
        assert REQUEST_TRANSITIONS[s], s


@pytest.mark.parametrize("terminal", sorted(TERMINAL_STATES, key=lambda s: s.value),
                         ids=lambda s: s.value)
@pytest.mark.parametrize("new", list(S), ids=lambda s: s.value)
def test_terminal_states_allow_nothing(terminal: RequestStatus, new: RequestStatus) -> None:
    with pytest.raises(ContractViolation, match=r"nothing \(terminal\)") as info:
        check_transition("r", terminal, new)
    assert info.value.clause == "SCH-015"


@pytest.mark.parametrize("old,new", [("waiting", S.RUNNING), (S.WAITING, "running"), (None, None)])
def test_non_status_arguments_rejected(old: object, new: object) -> None:
    with pytest.raises(InvalidArgumentError, match="states must be RequestStatus"):
        check_transition("r", old, new)  # type: ignore[arg-type]


def _can_reach_terminal(start: RequestStatus) -> bool:
    seen, todo = set(), [start]
    while todo:
        s = todo.pop()
        if s in TERMINAL_STATES:
            return True
        if s in seen:
            continue
        seen.add(s)
        todo.extend(REQUEST_TRANSITIONS[s])
    return False


def test_every_state_reaches_a_terminal_state() -> None:
    assert all(_can_reach_terminal(s) for s in S)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_random_walk_follows_the_table(data: st.DataObject) -> None:
    state = S.WAITING
    for _ in range(data.draw(st.integers(0, 30), label="steps")):
        nexts = sorted(REQUEST_TRANSITIONS[state], key=lambda s: s.value)
        if not nexts:
            assert state in TERMINAL_STATES
            break
        new = data.draw(st.sampled_from(nexts))
        check_transition("walk", state, new)
        state = new
        assert _can_reach_terminal(state)
    # Anything outside the table from here raises.
    bad = data.draw(st.sampled_from(list(S)))
    if bad in REQUEST_TRANSITIONS[state]:
        check_transition("walk", state, bad)
    else:
        with pytest.raises(ContractViolation):
            check_transition("walk", state, bad)


class RequestMachine(RuleBasedStateMachine):
    """A request driven through random transitions, allowed and not."""

    def __init__(self) -> None:
        super().__init__()
        self.state = S.WAITING

    @rule(new=st.sampled_from(list(S)))
    def move(self, new: RequestStatus) -> None:
        if new in REQUEST_TRANSITIONS[self.state]:
            check_transition("m", self.state, new)
            self.state = new
        else:
            with pytest.raises(ContractViolation):
                check_transition("m", self.state, new)

    @precondition(lambda self: self.state not in TERMINAL_STATES)
    @rule()
    def abort(self) -> None:
        check_transition("m", self.state, S.ABORTED)
        self.state = S.ABORTED

    @invariant()
    def terminal_is_reachable(self) -> None:
        assert _can_reach_terminal(self.state)


TestRequestMachine = RequestMachine.TestCase
TestRequestMachine.settings = settings(max_examples=50, stateful_step_count=20, deadline=None)
