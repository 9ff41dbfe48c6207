"""The expected-failures file: read, match and write.

Format: plain UTF-8 text, one key per line. A key is
``<file>::<TopicClass>::<test>[<connector spec>]`` (``[<connector spec>-<other ids>]`` for a
test with further parameters), where ``<file>`` is the topic module's path relative to the
suite directory, for example::

    # kvspec expected failures
    test_declaration.py::TestDeclaration::test_declared_layer_hooks_are_implemented[mypkg.conn:Factory]
    test_scheduler.py::TestScheduler::test_full_hit[mypkg.conn:Factory]  # upstream issue 12

Blank lines are ignored; ``#`` starts a comment when it begins a line or follows whitespace.
A trailing comment becomes the xfail reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import attrs
import pytest

__all__ = ["KVSpecXfailWarning", "XfailEntry", "read_xfail_file", "write_xfail_file"]


class KVSpecXfailWarning(pytest.PytestWarning):
    """A line of the kvspec expected-failures file matches no collected test."""


@attrs.frozen
class XfailEntry:
    """One key of an expected-failures file.

    Attributes:
        key: The test key.
        line: Its 1-based line number.
        reason: The trailing comment, or "".
    """

    key: str
    line: int
    reason: str = ""


def _strip_comment(text: str) -> tuple[str, str]:
    if text.lstrip().startswith("#"):
        return "", ""
    for i, ch in enumerate(text):
        if ch == "#" and i > 0 and text[i - 1].isspace():
            return text[:i].strip(), text[i + 1:].strip()
    return text.strip(), ""


def read_xfail_file(path: str | Path) -> list[XfailEntry]:
    """Parse an expected-failures file.

    Raises:
        OSError: The file cannot be read.
    """
    entries: list[XfailEntry] = []
    for n, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        key, reason = _strip_comment(raw)
        if key:
            entries.append(XfailEntry(key, n, reason))
    return entries


def write_xfail_file(path: str | Path, keys: Iterable[str], header: Iterable[str] = ()) -> None:
    """Write keys, sorted and unique, after ``#`` header lines."""
    lines = [f"# {h}" if h else "#" for h in header]
    lines += sorted(set(keys))
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
