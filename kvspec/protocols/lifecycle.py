"""The request state machine of docs/spec/state-machines.md, as data.

Engines and the conformance harness check every request transition against
``REQUEST_TRANSITIONS`` with ``check_transition``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from .errors import ContractViolation, InvalidArgumentError
from .views import RequestStatus

__all__ = ["REQUEST_TRANSITIONS", "TERMINAL_STATES", "check_transition"]

_S = RequestStatus

REQUEST_TRANSITIONS: Mapping[RequestStatus, frozenset[RequestStatus]] = MappingProxyType({
    _S.WAITING: frozenset({_S.WAITING, _S.WAITING_FOR_REMOTE_KV, _S.RUNNING, _S.ABORTED}),
    _S.WAITING_FOR_REMOTE_KV: frozenset({_S.WAITING, _S.PREEMPTED, _S.ABORTED}),
    _S.RUNNING: frozenset({_S.PREEMPTED, _S.FINISHED, _S.ABORTED}),
    # A preempted request waits in the queue as PREEMPTED until it runs again (vLLM 0.32),
    # also after an async load it was given meanwhile; engines that re-queue it as WAITING
    # are allowed too.
    _S.PREEMPTED: frozenset({_S.WAITING, _S.WAITING_FOR_REMOTE_KV, _S.RUNNING, _S.ABORTED}),
    _S.FINISHED: frozenset(),
    _S.ABORTED: frozenset(),
})
"""For each request state, the states it may move to next."""

TERMINAL_STATES: frozenset[RequestStatus] = frozenset({_S.FINISHED, _S.ABORTED})
"""States a request never leaves; its blocks are freed now or after a delayed free."""


def check_transition(request_id: str, old: RequestStatus, new: RequestStatus) -> None:
    """Raise ContractViolation if a request may not move from ``old`` to ``new``.

    Raises:
        InvalidArgumentError: a state is not a RequestStatus.
        ContractViolation: the transition is not in ``REQUEST_TRANSITIONS``.
    """
    if not isinstance(old, RequestStatus) or not isinstance(new, RequestStatus):
        raise InvalidArgumentError(f"states must be RequestStatus, got {old!r} -> {new!r}")
    if new not in REQUEST_TRANSITIONS[old]:
        allowed = sorted(s.value for s in REQUEST_TRANSITIONS[old]) or ["nothing (terminal)"]
        clause = "SCH-021" if old is _S.WAITING_FOR_REMOTE_KV else "SCH-015"
        raise ContractViolation(
            clause,
            observed=f"request {request_id!r} moved from {old.value} to {new.value}",
            expected=f"from {old.value} only to {', '.join(allowed)}",
        )
