"""mkdocs hook: render the spec pages' clause blocks from the clause registry at build time.

Each area page (``spec/sch.md`` ...) holds its clauses between ``<!-- clauses:SCH -->`` and
``<!-- /clauses -->``; the built site takes them from ``kvspec.spec`` itself, so the site
cannot show a clause other than the registry's. ``kvspec spec --write-docs docs/spec``
keeps the source files in step for readers of the repository, and the registry test fails
when they are stale.
"""

from __future__ import annotations

from typing import Any


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace a spec page's clause block with the registry's rendering."""
    from kvspec.spec import Area
    from kvspec.spec._render import _block_re, render_area

    for area in Area:
        if page.file.src_uri == f"spec/{area.page}":
            return _block_re(area).sub(lambda _m: render_area(area), markdown, count=1)
    return markdown
