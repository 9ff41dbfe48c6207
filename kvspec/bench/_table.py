"""The benchmarks' tables, as GitHub Markdown: printed on the terminal and pasted into
the benchmarks page as they are."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

__all__ = ["markdown_table"]

_NUMBER = re.compile(r"^[-+]?[\d.,]+( ?[a-zA-Z%/]+)?( \(.*\))?$")


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """One table: columns padded to their widest cell, a column whose cells all start with
    a number right-aligned (``---:``), the others left-aligned.

    Raises:
        ValueError: a row has another number of cells than the header.
    """
    body = [tuple(str(c) for c in row) for row in rows]
    for row in body:
        if len(row) != len(header):
            raise ValueError(f"a row has {len(row)} cells, the header {len(header)}: {row}")
    columns = list(zip(header, *body))
    right = [bool(body) and all(_NUMBER.match(c) for c in col[1:]) for col in columns]
    widths = [max(3, *(len(c) for c in col)) for col in columns]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if r else c.ljust(w)
                                 for c, w, r in zip(cells, widths, right)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if r else "-" * (w + 2)
                          for w, r in zip(widths, right)) + "|"
    return "\n".join([line(header), rule, *(line(row) for row in body)])
