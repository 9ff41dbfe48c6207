"""The argument types the commands share: each parses one option's text or raises
``argparse.ArgumentTypeError`` with what was expected."""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # What ``add_subparsers`` returns: each command module's ``register`` adds its parser.
    Commands = argparse._SubParsersAction[argparse.ArgumentParser]

ORDER_NAMES = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
DTYPE_NAMES = ("float16", "bfloat16", "float32")


def csv(text: str) -> list[str]:
    """``"a, b"`` as ``["a", "b"]``; at least one item."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def orders(text: str) -> tuple[str, ...]:
    """Stride orders among ``ORDER_NAMES``, any case."""
    out = tuple(t.upper() for t in csv(text))
    bad = [t for t in out if t not in ORDER_NAMES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown order {bad[0]!r}; expected {', '.join(ORDER_NAMES)}")
    return out


def positive_ints(text: str) -> tuple[int, ...]:
    """``"16,32"`` as ``(16, 32)``: positive ints."""
    try:
        out = tuple(int(t) for t in csv(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive ints separated by commas, got {text!r}") from None
    if any(v <= 0 for v in out):
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return out


def positive_int(text: str) -> int:
    """One positive int."""
    values = positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive int, got {text!r}")
    return values[0]


def int_list(text: str) -> list[int]:
    """``"1,2,8"`` as ``[1, 2, 8]``: positive ints."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected ints >= 1, got {text!r}")
    return values


def heads(text: str) -> tuple[tuple[int, int], ...]:
    """``"1x64,8x128"`` as ``((1, 64), (8, 128))``: HEADSxSIZE pairs."""
    out = []
    for item in csv(text):
        parts = item.lower().split("x")
        try:
            count, size = (int(v) for v in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected HEADSxSIZE such as 8x128, got {item!r}") from None
        if count <= 0 or size <= 0:
            raise argparse.ArgumentTypeError(f"expected positive HEADSxSIZE, got {item!r}")
        out.append((count, size))
    return tuple(out)


def dtypes(text: str) -> tuple[str, ...]:
    """Dtype names among ``DTYPE_NAMES``, any case."""
    out = tuple(t.lower() for t in csv(text))
    bad = [t for t in out if t not in DTYPE_NAMES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown dtype {bad[0]!r}; expected {', '.join(DTYPE_NAMES)}")
    return out


def device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``."""
    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text
