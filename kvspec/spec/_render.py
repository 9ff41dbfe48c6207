"""Render registry clauses as the Markdown blocks of docs/spec/ pages.

Each area page holds its clauses between two marker lines::

    <!-- clauses:SCH -->
    ...generated...
    <!-- /clauses -->

``kvspec spec --write-docs`` rewrites those blocks; the registry test fails when a page's
block differs from what this module renders.
"""

from __future__ import annotations

import re
from pathlib import Path

from . import clauses_in
from ._model import Area, Clause

__all__ = ["render_area", "render_clause", "link_source", "sync_docs", "BEGIN", "END"]

BEGIN = "<!-- clauses:{area} -->"
END = "<!-- /clauses -->"


_UPSTREAM = {"vLLM": "vllm-project/vllm", "kvcached": "ovg-project/kvcached",
             "vllm-ascend": "vllm-project/vllm-ascend", "SGLang": "sgl-project/sglang"}
_REF = re.compile(r"\b(?:(?P<repo>vllm-ascend|vLLM|kvcached|SGLang) )?(?P<kind>PR|issue) (?P<num>\d+)")


def link_source(tag: str) -> str:
    """A source tag as Markdown, each upstream pull request and issue it names linked:
    ``vLLM PR 27026 / issue 26675`` links both to vLLM's GitHub."""
    repo = "vLLM"

    def link(m: re.Match[str]) -> str:
        nonlocal repo
        repo = m.group("repo") or repo
        path = "pull" if m.group("kind") == "PR" else "issues"
        return f"[{m.group(0)}](https://github.com/{_UPSTREAM[repo]}/{path}/{m.group('num')})"

    return _REF.sub(link, tag)


def render_clause(clause: Clause) -> str:
    """Render one clause as a Markdown section with a stable anchor."""
    lines = [
        f"### {clause.id}: {clause.title} {{ #{clause.anchor} }}",
        "",
        f"**{clause.level.value}.** {clause.rule}",
        "",
        f"*Rationale:* {clause.rationale}",
    ]
    if clause.sources:
        lines += ["", f"*Sources:* {'; '.join(map(link_source, clause.sources))}"]
    return "\n".join(lines) + "\n"


def render_area(area: Area) -> str:
    """Render every clause of an area, in ID order, with the block markers."""
    body = "\n".join(render_clause(c) for c in clauses_in(area))
    return f"{BEGIN.format(area=area.name)}\n\n{body}\n{END}"


def _block_re(area: Area) -> re.Pattern[str]:
    return re.compile(re.escape(BEGIN.format(area=area.name)) + r".*?" + re.escape(END), re.S)


def sync_docs(spec_dir: Path, *, check: bool = False) -> list[Path]:
    """Rewrite (or, with ``check``, compare) the clause blocks of every area page.

    Returns:
        The pages that changed (or, with ``check``, that differ from the registry).

    Raises:
        FileNotFoundError: An area page is missing.
        ValueError: A page lacks its marker block.
    """
    stale: list[Path] = []
    for area in Area:
        page = spec_dir / area.page
        text = page.read_text(encoding="utf-8")
        pattern = _block_re(area)
        if not pattern.search(text):
            raise ValueError(f"{page} has no '{BEGIN.format(area=area.name)}' ... '{END}' block")
        new = pattern.sub(lambda _m: render_area(area), text, count=1)
        if new != text:
            stale.append(page)
            if not check:
                page.write_text(new, encoding="utf-8")
    return stale
