"""The kvspec error hierarchy.

Every error kvspec raises is a ``KVSpecError``. Errors that reject a caller's input
also derive from the matching builtin (``ValueError``, ``TypeError``, ``TimeoutError``) so
generic handlers keep working. Each error message says what was wrong and what was
expected; errors that enforce a numbered clause carry its ID in ``KVSpecError.clause``.

This module imports nothing else of kvspec (clause ERR-001).
"""

from __future__ import annotations

__all__ = [
    "CapabilityError",
    "CompatibilityError",
    "ContractViolation",
    "DoubleReportError",
    "HarnessError",
    "InvalidArgumentError",
    "InvalidBlockIdError",
    "KVSpecError",
    "LayoutError",
    "LayoutMismatchError",
    "LayoutNegotiationError",
    "MalformedMetadataError",
    "MetadataNotBoundError",
    "ReportError",
    "TransferTimeoutError",
    "UnknownRequestError",
    "UnsupportedOperationError",
]


class KVSpecError(Exception):
    """Base class of every error raised by kvspec.

    Args:
        message: What was wrong and what was expected, in one or two sentences.
        clause: The ID of the spec clause the error enforces (``"EXE-003"``), if any.
    """

    def __init__(self, message: str, *, clause: str | None = None) -> None:
        if not isinstance(message, str) or not message:
            raise TypeError("KVSpecError needs a non-empty message string")
        self.message = message
        self.clause = clause
        super().__init__(f"[{clause}] {message}" if clause else message)

    def __reduce__(self) -> tuple[object, ...]:
        # Keep errors picklable for same-process tools (pytest-xdist, multiprocessing
        # results). kvspec itself never unpickles data from a peer (ERR-006).
        return (_rebuild, (type(self), self.message, self.clause, self.__dict__))


def _rebuild(
    cls: type[KVSpecError], message: str, clause: str | None, state: dict[str, object]
) -> KVSpecError:
    err = cls.__new__(cls)
    KVSpecError.__init__(err, message, clause=clause)
    err.__dict__.update(state)
    return err


class InvalidArgumentError(KVSpecError, ValueError):
    """A public entry was given a value it does not accept (ERR-002)."""


class InvalidBlockIdError(InvalidArgumentError):
    """A block id is negative, not an int, or outside the engine's block budget (ERR-003)."""


class UnknownRequestError(InvalidArgumentError):
    """A request id was named that the receiver does not know, or no longer tracks (ERR-004).

    Attributes:
        request_id: The unknown request id, if given.
        rank: The worker rank whose report named it, when raised by an aggregator (EXE-003).
        direction: The transfer direction reported (a ``Direction``), when raised by an
            aggregator.
    """

    def __init__(
        self,
        message: str,
        *,
        request_id: str | None = None,
        rank: int | None = None,
        direction: object | None = None,
        clause: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.rank = rank
        self.direction = direction
        super().__init__(message, clause=clause)


class MalformedMetadataError(InvalidArgumentError):
    """Connector, handshake or worker metadata failed to decode or validate (ERR-005)."""


class LayoutError(KVSpecError):
    """Base class of layout errors (LAY clauses)."""


class LayoutMismatchError(LayoutError, ValueError):
    """A tensor does not match the layout descriptor it was registered with (LAY-008)."""


class LayoutNegotiationError(LayoutError):
    """No layout satisfies every party; the message names who refused what (LAY-010).

    Attributes:
        refusals: One line per refusal, ``"<party> refused <what>: <why>"``.
    """

    def __init__(
        self, message: str, *, refusals: tuple[str, ...] = (), clause: str | None = "LAY-010"
    ) -> None:
        self.refusals = tuple(refusals)
        detail = "".join(f"\n  - {r}" for r in self.refusals)
        super().__init__(message + detail, clause=clause)
        self.message = message + detail


class ReportError(KVSpecError):
    """Base class of completion-accounting errors raised by aggregators (EXE clauses).

    Attributes:
        rank: The worker rank whose report was rejected, if known.
        request_id: The request the report named, if any.
        direction: The transfer direction reported (a ``Direction``), if any.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        request_id: str | None = None,
        direction: object | None = None,
        clause: str | None = None,
    ) -> None:
        self.rank = rank
        self.request_id = request_id
        self.direction = direction
        super().__init__(message, clause=clause)


class DoubleReportError(ReportError):
    """A rank reported the same request and direction twice (EXE-002)."""


class CapabilityError(KVSpecError):
    """A connector was used in a way its declared capabilities exclude, or declared
    capabilities that contradict each other."""


class UnsupportedOperationError(CapabilityError, NotImplementedError):
    """An optional hook was called that the connector did not implement.

    Raised by documented Protocol defaults, never by a required method.
    """


class MetadataNotBoundError(KVSpecError):
    """A worker hook ran while no connector metadata was bound (DRY-001)."""


class CompatibilityError(KVSpecError):
    """Two peers disagree at handshake: layout, dtype, block size or spec version (HSK-003)."""


class TransferTimeoutError(KVSpecError, TimeoutError):
    """A wait exceeded its timeout; kvspec never waits without one (ERR-007)."""


class HarnessError(KVSpecError):
    """kvspec's own engine harness or engine adapter failed, not the connector under test.

    Raised where kvspec plays the engine (the conformance harness, the wrapper that runs a
    vLLM connector inside it) and its own code could not do what the engine does: build an
    engine object, translate a view, resolve a layout. The conformance report counts such a
    test as ``error`` against kvspec and never as a broken clause of the connector.
    """


class ContractViolation(KVSpecError):
    """A connector broke a MUST clause, as observed by an engine or the conformance harness.

    Attributes:
        clause: The clause that was broken (always set).
        observed: What the connector did.
        expected: What the clause requires.
        reproduce: How to reproduce it (configuration, workload, step), if known.
    """

    def __init__(
        self, clause: str, *, observed: str, expected: str, reproduce: str | None = None
    ) -> None:
        if not isinstance(clause, str) or not clause:
            raise TypeError("ContractViolation needs the ID of the clause that was broken")
        self.observed = observed
        self.expected = expected
        self.reproduce = reproduce
        super().__init__(f"observed: {observed}; expected: {expected}", clause=clause)
