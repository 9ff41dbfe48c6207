"""Whose failure it is: the clause a failure broke and the message an author reads."""

from __future__ import annotations

from kvspec.conformance._attribution import find_violation, format_violation
from kvspec.protocols import ContractViolation


def test_format_violation_appends_reproduction_and_notes() -> None:
    err = ContractViolation("sch-005", observed="16 of 16", expected="at most 15",
                            reproduce="prompt of 16 tokens")
    err.__notes__ = ["Falsifying example: test(n=16)"]  # what add_note does (3.11+)
    assert format_violation(err, "conn") == (
        "clause SCH-005 (A full hit leaves one token to compute) broken by conn: "
        "observed: 16 of 16; expected: at most 15\nprompt of 16 tokens\n"
        "Falsifying example: test(n=16)"
    )
    class Group(Exception):  # shaped like ExceptionGroup (3.11+)
        def __init__(self, *exceptions: BaseException) -> None:
            self.exceptions = exceptions

    group = Group(ValueError("x"), Group(err))
    assert find_violation(group) is err
    assert find_violation(ValueError("x")) is None
