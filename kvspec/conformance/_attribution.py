"""Whose failure it is: the clause a failed suite test broke, kvspec's own errors, and the
frames pytest shows.

``find_violation`` names what a failure broke (a ``ContractViolation`` naming one clause,
or None), ``harness_error`` says when kvspec's own code failed (not the connector's), and
``format_violation`` writes the message an author reads. The pytest plugin's recorder and
the harness's worker processes judge failures with them.

The harness and suite modules set ``__tracebackhide__ = hide_unless_harness_bug`` at
module level (pytest reads it from a frame's globals too). A failure that is the
connector's (a kvspec error, such as a ContractViolation the engine raised, or an
exception raised in connector code) then shows no harness frame: the clause message, the
reproduction and the connector's own frames are what an author reads. An exception raised
by the harness itself (a harness bug, or a plain ``assert`` of a suite test) keeps every
frame. ``pytest --fulltrace`` shows them all anyway.

Light at import: it imports neither pytest nor the Protocols (it looks them up in
``sys.modules``, where a failure that involves them has put them).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..protocols.errors import ContractViolation

__all__ = [
    "KVSPEC_DRIVERS", "find_violation", "format_violation", "harness_error",
    "hide_unless_harness_bug",
]

KVSPEC_DRIVERS = tuple(str(Path(__file__).parent / d) for d in ("harness", "suite", "graphs"))
"""The directories of kvspec's own driving code: the harness, the suite and the graphs."""


def hide_unless_harness_bug(excinfo: Any) -> bool:
    """``__tracebackhide__`` for the harness and suite modules (see the module docstring)."""
    if excinfo is None:
        return True
    if not isinstance(excinfo.value, Exception):  # pytest.skip / fail / xfail: their place
        return False
    errors = sys.modules.get("kvspec.protocols.errors")
    if errors is not None and isinstance(excinfo.value, errors.KVSpecError):
        return True
    tb = excinfo.tb
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return True
    return not tb.tb_frame.f_code.co_filename.startswith(KVSPEC_DRIVERS)


def find_violation(exc: BaseException) -> ContractViolation | None:
    """What a failed suite test broke, as a ContractViolation naming one clause, or None.

    In order: a ContractViolation anywhere in ``exc`` (exception groups, such as
    hypothesis's flaky failures, and explicit causes included); else a KVSpecError that
    names a clause (that clause); else a crash, an exception that is not a kvspec error
    escaping a connector's hook (ERR-010, naming the hook), a bare ``assert`` in the
    connector's code included. Plain asserts and errors of the suite's own code are not
    attributed.
    """
    errors = sys.modules.get("kvspec.protocols.errors")
    if errors is None:
        return None
    violation_cls: type[ContractViolation] = errors.ContractViolation
    chain = _chain(exc)
    for e in chain:
        if isinstance(e, violation_cls):
            return e
    for e in chain:
        if isinstance(e, errors.KVSpecError) and e.clause:
            return _as_violation(violation_cls, e.clause.upper(),
                                 f"{type(e).__name__}: {e.message}")
    if not isinstance(exc, Exception) or isinstance(exc, errors.KVSpecError):
        return None
    hook = _crashed_hook(exc)
    if hook is None:
        return None
    text = str(exc).strip().splitlines()
    if hook.rsplit(".", 1)[-1] in _scheduler_hooks() and _is_mutation(exc):
        return violation_cls(
            "SCH-012", observed=f"{hook} tried to change an input the engine owns "
            f"({type(exc).__name__}: {text[0][:300] if text else ''}); the suite hands views "
            "that refuse writes, where a real engine's objects would take the write "
            "silently and change what it computes",
            expected="scheduler hooks read the request, its kv_transfer_params, the block "
            "lists and the scheduler output, and keep what they need in their own state",
        )
    return violation_cls(
        "ERR-010", observed=f"{hook} raised {type(exc).__name__}"
        + (f": {text[0][:300]}" if text else ""),
        expected="the hook returns, or raises a KVSpecError saying what was wrong",
    )


@functools.cache
def _scheduler_hooks() -> frozenset[str]:
    """Scheduler-role hooks, read off the Protocol (a write to one of their inputs breaks
    SCH-012); imported on first use, as this module imports nothing heavy."""
    from kvspec.protocols import SchedulerConnector

    return frozenset(n for n in dir(SchedulerConnector)
                     if not n.startswith("_") and callable(getattr(SchedulerConnector, n)))


_READ_ONLY = ("'mappingproxy' object", "'tuple' object", "'frozenset' object")
_WRITES = ("does not support item assignment", "does not support item deletion",
           *(f"has no attribute '{m}'" for m in (
               "pop", "popitem", "update", "setdefault", "clear", "append", "extend",
               "insert", "remove", "add", "discard", "sort", "reverse", "__setitem__")))


def _is_mutation(exc: BaseException) -> bool:
    """True when ``exc`` is what a read-only view raises on a write: a frozen attrs view's
    ``FrozenInstanceError``, or the error of writing into a mappingproxy, tuple or
    frozenset (the shapes the views hand out)."""
    if type(exc).__name__ == "FrozenInstanceError":
        return True
    if not isinstance(exc, (TypeError, AttributeError)):
        return False
    text = str(exc)
    return text.startswith(_READ_ONLY) and any(w in text for w in _WRITES)


_KVSPEC_ROOT = str(Path(__file__).parent.parent)
_SAMPLE_CONNECTORS = str(Path(__file__).parent / "connectors")


def harness_error(exc: BaseException) -> BaseException | None:
    """The ``HarnessError`` in ``exc``'s chain that kvspec's own code raised (kvspec's
    failure), or None. One raised from a connector's code is the connector's like any
    other exception: a connector cannot pass its crash off as kvspec's."""
    errors = sys.modules.get("kvspec.protocols.errors")
    if errors is None:
        return None
    for e in _chain(exc):
        if isinstance(e, errors.HarnessError):
            tb = e.__traceback__
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            where = tb.tb_frame.f_code.co_filename if tb is not None else ""
            if where.startswith(_KVSPEC_ROOT) and not where.startswith(_SAMPLE_CONNECTORS):
                found: BaseException = e
                return found
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc``, the members of exception groups and explicit causes, depth first."""
    out: list[BaseException] = []
    stack: list[BaseException] = [exc]
    while stack and len(out) < 100:
        e = stack.pop()
        if any(e is seen for seen in out):
            continue
        out.append(e)
        if e.__cause__ is not None:
            stack.append(e.__cause__)
        inner = getattr(e, "exceptions", None)
        if isinstance(inner, tuple):
            stack.extend(x for x in reversed(inner) if isinstance(x, BaseException))
    return out


def _as_violation(cls: type[ContractViolation], clause: str, observed: str
                  ) -> ContractViolation:
    from ..spec import get_clause

    try:
        expected = get_clause(clause).rule
    except (KeyError, TypeError):
        expected = "what the clause requires"
    return cls(clause, observed=observed, expected=expected)


_KVSPEC_CORE = tuple(str(Path(__file__).parent.parent / d) for d in ("protocols", "vllm"))
"""kvspec code between the driver and the connector: protocol defaults, and the wrapper
that runs a vLLM connector (a crash names the vLLM connector's own function)."""


def _crashed_hook(exc: BaseException) -> str | None:
    """The connector function the suite's driver called (directly, or through a
    ``kvspec.protocols`` default method) when ``exc`` escaped, named as
    ``Class.method``; None when it did not escape from connector code."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    drivers = [i for i, f in enumerate(frames) if f.f_code.co_filename.startswith(KVSPEC_DRIVERS)]
    if not drivers:
        return None
    for frame in frames[drivers[-1] + 1:]:  # through kvspec's protocol defaults and wrapper
        code = frame.f_code
        if not code.co_filename.startswith(_KVSPEC_CORE):
            return getattr(code, "co_qualname", code.co_name)
    return None


def format_violation(exc: ContractViolation, connector_name: str) -> str:
    """``clause X (<title>) broken by <name>: observed: ...; expected: ...`` plus reproduction.

    The reproduction is the exception's optional ``reproduce`` text, then its notes (for
    example hypothesis's falsifying example), each on its own lines.
    """
    from ..spec import get_clause

    clause = (exc.clause or "?").upper()
    try:
        title = get_clause(clause).title
    except (KeyError, TypeError):
        title = "not a clause of this spec"
    text = (
        f"clause {clause} ({title}) broken by {connector_name}: "
        f"observed: {exc.observed}; expected: {exc.expected}"
    )
    extra: list[str] = []
    reproduce = getattr(exc, "reproduce", None)
    if isinstance(reproduce, str) and reproduce.strip():
        extra.append(reproduce.rstrip())
    for note in getattr(exc, "__notes__", None) or ():
        if isinstance(note, str) and note.strip():
            extra.append(note.rstrip())
    return "\n".join([text, *extra])
