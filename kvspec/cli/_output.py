"""What several commands do with their output: refuse an unwritable path before a long
run, check that charts can be drawn, write a file, print a report."""

from __future__ import annotations

import json
import sys
from typing import Any


def unwritable(flag: str, path: str) -> bool:
    """Say on stderr, and return True, when an output path cannot be written: checked
    before a long run, whose work would otherwise be lost at its end."""
    from ..conformance._paths import unwritable_reason

    reason = unwritable_reason(path)
    if reason is not None:
        print(f"kvspec: {flag} {path}: {reason}", file=sys.stderr)
    return reason is not None


def no_matplotlib() -> bool:
    """Say so (and return True) when ``--svg`` cannot draw: no matplotlib."""
    from ..bench._chart import MISSING

    if MISSING:
        print(f"kvspec: {MISSING}", file=sys.stderr)
    return bool(MISSING)


def cannot_chart(svg: str | None) -> bool:
    """True (said on stderr) when ``--svg PATH`` was given and cannot be written or drawn."""
    return bool(svg) and (unwritable("--svg", str(svg)) or no_matplotlib())


def write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` (UTF-8)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def emit(report: Any, as_json: bool) -> None:
    """Print a report: ``as_dict()`` as JSON, or its ``lines()``."""
    if as_json:
        json.dump(report.as_dict(), sys.stdout, indent=2)
        print()
    else:
        print("\n".join(report.lines()))


def dump_json(value: Any, indent: int = 2) -> int:
    """Print ``value`` as JSON and a newline on stdout; the exit code 0."""
    json.dump(value, sys.stdout, indent=indent)
    print()
    return 0
