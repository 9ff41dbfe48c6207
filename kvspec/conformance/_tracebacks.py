"""What pytest shows of a failed suite test: the connector's frames, not the harness's.

The harness and suite modules set ``__tracebackhide__ = hide_unless_harness_bug`` at
module level (pytest reads it from a frame's globals too). A failure that is the
connector's (a kvspec error, such as a ContractViolation the engine raised, or an
exception raised in connector code) then shows no harness frame: the clause message, the
reproduction and the connector's own frames are what an author reads. An exception raised
by the harness itself (a harness bug, or a plain ``assert`` of a suite test) keeps every
frame. ``pytest --fulltrace`` shows them all anyway.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

__all__ = ["hide_unless_harness_bug"]

_OWN = tuple(str(Path(__file__).parent / d) for d in ("harness", "suite", "graphs"))


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
    return not tb.tb_frame.f_code.co_filename.startswith(_OWN)
