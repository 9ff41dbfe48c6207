"""mkdocs hook: link every clause ID (``SCH-005``) outside the spec pages to its anchor.

The API reference renders docstrings, which name clauses in plain text ("(SCH-005)"); this
turns each mention in a page's text into a link to the clause on its spec page. Text inside
links, code, headings and the spec pages themselves is left alone.
"""

from __future__ import annotations

import re
from typing import Any

_ID = re.compile(r"\b(SCH|WRK|EXE|EVT|LAY|KVG|SPD|STG|GRA|DRY|HSK|STO|ERR)-(\d{3})\b")
_TAG = re.compile(r"(<[^>]+>)")
_SKIP = ("a", "code", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "script", "style")


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Link the clause IDs of ``html`` (not on spec pages) to their spec anchors."""
    if page.file.src_uri.startswith("spec/"):
        return html
    targets: dict[str, str] = {}
    for area in ("sch", "wrk", "exe", "evt", "lay", "kvg", "gra", "dry", "hsk", "sto", "err"):
        spec = files.get_file_from_path(f"spec/{area}.md")
        if spec is not None:
            targets[area] = spec.url_relative_to(page.file)
    depth: dict[str, int] = {name: 0 for name in _SKIP}
    out: list[str] = []
    for piece in _TAG.split(html):
        if piece.startswith("<"):
            m = re.match(r"<(/?)([a-zA-Z0-9]+)", piece)
            if m and m.group(2).lower() in depth and not piece.endswith("/>"):
                name = m.group(2).lower()
                depth[name] += -1 if m.group(1) else 1
                depth[name] = max(depth[name], 0)
            out.append(piece)
        elif any(depth.values()):
            out.append(piece)
        else:
            out.append(_ID.sub(lambda m: _link(m, targets), piece))
    return "".join(out)


def _link(m: re.Match[str], targets: dict[str, str]) -> str:
    area = m.group(1).lower()
    url = targets.get(area)
    if url is None:
        return m.group(0)
    return f'<a href="{url}#{area}-{m.group(2)}">{m.group(0)}</a>'
