"""Tests of kvspec.protocols.errors: the hierarchy, message format and pickling (ERR-001)."""

from __future__ import annotations

import ast
import copy
import inspect
import pickle

import pytest

from kvspec.protocols import errors
from kvspec.protocols.errors import (
    CapabilityError,
    CompatibilityError,
    ContractViolation,
    DoubleReportError,
    InvalidArgumentError,
    InvalidBlockIdError,
    KVSpecError,
    LayoutError,
    LayoutMismatchError,
    LayoutNegotiationError,
    MalformedMetadataError,
    MetadataNotBoundError,
    ReportError,
    TransferTimeoutError,
    UnknownRequestError,
    UnsupportedOperationError,
)

ALL_ERRORS = [getattr(errors, name) for name in errors.__all__]

INPUT_ERRORS = [
    InvalidArgumentError,
    InvalidBlockIdError,
    UnknownRequestError,
    MalformedMetadataError,
    LayoutMismatchError,
]


def _make(cls: type[KVSpecError]) -> KVSpecError:
    """One instance of each error class, with its class-specific attributes set."""
    if cls is ContractViolation:
        return ContractViolation("SCH-015", observed="two calls", expected="one call")
    if cls is LayoutNegotiationError:
        return LayoutNegotiationError(
            "no layout fits", refusals=("backend refused HND: unsupported",)
        )
    if issubclass(cls, ReportError):
        return cls("bad report", rank=3, request_id="req-7", clause="EXE-002")
    return cls("something was wrong; expected something else", clause="ERR-002")


# ------------------------------------------------------------------------ hierarchy


def test_all_lists_every_error_class() -> None:
    defined = {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__
    }
    assert defined == set(errors.__all__)
    assert len(ALL_ERRORS) == 17


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_every_error_derives_from_kvspec_error(cls: type[Exception]) -> None:
    assert issubclass(cls, KVSpecError)
    assert issubclass(cls, Exception)


@pytest.mark.parametrize("cls", INPUT_ERRORS, ids=lambda c: c.__name__)
def test_input_errors_are_value_errors(cls: type[Exception]) -> None:
    assert issubclass(cls, ValueError)
    err = _make(cls)
    with pytest.raises(ValueError):
        raise err


def test_specific_builtin_bases() -> None:
    assert issubclass(TransferTimeoutError, TimeoutError)
    assert issubclass(TransferTimeoutError, OSError)  # TimeoutError is an OSError
    assert issubclass(UnsupportedOperationError, NotImplementedError)
    assert issubclass(UnsupportedOperationError, CapabilityError)
    assert issubclass(InvalidBlockIdError, InvalidArgumentError)
    assert issubclass(UnknownRequestError, InvalidArgumentError)
    assert issubclass(MalformedMetadataError, InvalidArgumentError)
    assert issubclass(LayoutMismatchError, LayoutError)
    assert issubclass(LayoutNegotiationError, LayoutError)
    assert issubclass(DoubleReportError, ReportError)
    # Errors that are not input errors are not ValueErrors.
    for cls in (CapabilityError, CompatibilityError, ContractViolation, MetadataNotBoundError,
                ReportError, LayoutNegotiationError, TransferTimeoutError):
        assert not issubclass(cls, ValueError), cls


def test_errors_module_imports_nothing_of_kvspec() -> None:
    """ERR-001: the error module is the root of the import graph."""
    tree = ast.parse(inspect.getsource(errors))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"relative import of {node.module}"
            assert not (node.module or "").startswith("kvspec")
        elif isinstance(node, ast.Import):
            assert all(not a.name.startswith("kvspec") for a in node.names)


# ---------------------------------------------------------------------- formatting


def test_message_with_clause_is_prefixed() -> None:
    err = KVSpecError("block id 5 is out of range; expected < 4", clause="LAY-012")
    assert str(err) == "[LAY-012] block id 5 is out of range; expected < 4"
    assert err.message == "block id 5 is out of range; expected < 4"
    assert err.clause == "LAY-012"
    assert err.args == ("[LAY-012] block id 5 is out of range; expected < 4",)


def test_message_without_clause_is_plain() -> None:
    err = InvalidArgumentError("x must be an int")
    assert str(err) == "x must be an int"
    assert err.clause is None
    assert "[" not in str(err)


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_clause_in_str(cls: type[KVSpecError]) -> None:
    err = _make(cls)
    assert err.clause is not None
    assert str(err).startswith(f"[{err.clause}] ")


@pytest.mark.parametrize("bad", ["", None, 3, b"msg"])
def test_empty_or_non_str_message_raises_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match="non-empty message"):
        KVSpecError(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="non-empty message"):
        InvalidArgumentError(bad, clause="ERR-002")  # type: ignore[arg-type]


def test_contract_violation_formats_observed_and_expected() -> None:
    err = ContractViolation("SCH-015", observed="request_finished called twice",
                            expected="exactly once")
    assert err.clause == "SCH-015"
    assert err.observed == "request_finished called twice"
    assert err.expected == "exactly once"
    assert str(err) == "[SCH-015] observed: request_finished called twice; expected: exactly once"


def test_report_error_carries_rank_and_request_id() -> None:
    err = DoubleReportError("rank 2 reported req-1 twice", rank=2, request_id="req-1",
                            clause="EXE-002")
    assert err.rank == 2
    assert err.request_id == "req-1"
    assert err.clause == "EXE-002"
    assert str(err) == "[EXE-002] rank 2 reported req-1 twice"
    plain = ReportError("bad")
    assert plain.rank is None and plain.request_id is None and plain.clause is None


def test_layout_negotiation_error_lists_refusals() -> None:
    refusals = ("backend refused LBHNC: kernel needs NHD", "provider refused restride: vmm")
    err = LayoutNegotiationError("no layout satisfies every party", refusals=list(refusals))
    assert err.refusals == refusals
    assert isinstance(err.refusals, tuple)
    assert err.clause == "LAY-010"
    assert err.message == (
        "no layout satisfies every party"
        "\n  - backend refused LBHNC: kernel needs NHD"
        "\n  - provider refused restride: vmm"
    )
    assert str(err) == "[LAY-010] " + err.message


def test_layout_negotiation_error_without_refusals() -> None:
    err = LayoutNegotiationError("nothing to negotiate", clause=None)
    assert err.refusals == ()
    assert str(err) == "nothing to negotiate"


# ------------------------------------------------------------------------ pickling


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_pickle_round_trip_keeps_attributes(cls: type[KVSpecError]) -> None:
    err = _make(cls)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert str(back) == str(err)
    assert back.args == err.args
    assert back.message == err.message
    assert back.clause == err.clause
    assert vars(back) == vars(err)
    if isinstance(err, ContractViolation):
        assert (back.observed, back.expected) == ("two calls", "one call")
    if isinstance(err, ReportError):
        assert (back.rank, back.request_id) == (3, "req-7")
    if isinstance(err, LayoutNegotiationError):
        assert back.refusals == ("backend refused HND: unsupported",)


@pytest.mark.parametrize("cls", [ContractViolation, DoubleReportError, LayoutNegotiationError])
def test_copy_keeps_attributes(cls: type[KVSpecError]) -> None:
    err = _make(cls)
    for dup in (copy.copy(err), copy.deepcopy(err)):
        assert type(dup) is cls
        assert vars(dup) == vars(err)
        assert str(dup) == str(err)
