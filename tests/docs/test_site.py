"""The reference site builds strictly, and every internal link in it resolves.

One strict ``mkdocs build`` into a temporary directory per session; then every ``href`` and
``src`` of every page that points inside the site must name a file that exists and, with a
``#fragment``, an element ``id`` (or ``name``) of that file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from kvspec.spec import CLAUSES

ROOT = Path(__file__).resolve().parents[2]
re_ids = re.compile(r"\[([A-Z]{3}-\d{3})\]")


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        for key in ("id", "name") if tag == "a" else ("id",):
            if values.get(key):
                self.ids.add(str(values[key]))
        for key in ("href", "src"):
            target = values.get(key)
            if target and tag in ("a", "link", "img", "script", "iframe", "source"):
                self.links.append(target)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"strict mkdocs build failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def _is_internal(link: str) -> bool:
    parts = urlsplit(link)
    return not (parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:")))


def _resolve(page: Path, link: str, site: Path) -> tuple[Path, str]:
    parts = urlsplit(link)
    if not parts.path:
        return page, unquote(parts.fragment)
    target = (page.parent / unquote(parts.path)).resolve()
    if parts.path.endswith("/") or target.is_dir():
        target = target / "index.html"
    return target, unquote(parts.fragment)


def test_every_internal_link_resolves(site: Path) -> None:
    pages = {p.resolve(): _parse(p) for p in site.rglob("*.html") if p.name != "404.html"}
    assert len(pages) > 30
    broken: list[str] = []
    checked = 0
    for path, page in pages.items():
        for link in page.links:
            if not _is_internal(link):
                continue
            target, fragment = _resolve(path, link, site)
            where = f"{path.relative_to(site.resolve())}: {link}"
            checked += 1
            if not target.is_file():
                broken.append(f"{where} (no file {target})")
                continue
            if fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if fragment not in ids:
                    broken.append(f"{where} (no id {fragment!r})")
    assert checked > 500
    assert not broken, "broken internal links:\n" + "\n".join(broken)


def test_every_clause_has_its_anchor_and_is_searchable(site: Path) -> None:
    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    locations = {doc["location"] for doc in index["docs"]}
    for clause in CLAUSES:
        page = site / "spec" / clause.area.name.lower() / "index.html"
        assert clause.anchor in _parse(page).ids, f"{clause.id}: no anchor on {page}"
        location = f"spec/{clause.area.name.lower()}/#{clause.anchor}"
        assert location in locations, f"{clause.id} is not in the search index"


def test_reference_pages_document_the_public_api(site: Path) -> None:
    from kvspec import protocols

    ids: set[str] = set()
    for page in (site / "reference").rglob("*.html"):
        ids |= _parse(page).ids
    missing = [
        name for name in protocols.__all__
        if not any(i.startswith("kvspec.protocols.") and i.endswith("." + name) for i in ids)
    ]
    assert not missing, f"kvspec.protocols names with no reference entry: {missing}"


def test_compatibility_page_maps_every_sourced_clause() -> None:
    text = (ROOT / "docs" / "compatibility.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip(): line for line in text.splitlines()
            if line.startswith("| ") and line.count("|") == 3}
    by_source: dict[str, list[str]] = {}
    for clause in CLAUSES:
        for source in clause.sources:
            by_source.setdefault(source, []).append(clause.id)
    for source, ids in by_source.items():
        assert source in rows, f"compatibility.md has no row for source {source!r}"
        listed = set(re_ids.findall(rows[source].split("|")[2]))
        assert listed == set(ids), f"{source}: page lists {sorted(listed)}, registry {ids}"


def test_the_home_page_connector_is_clean_under_mypy_strict(tmp_path: Path) -> None:
    """Issue 18, item 12: the first code a newcomer saw failed ``mypy --strict``."""
    import subprocess
    import sys

    text = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    m = re.search(r'```python title="mypkg/conn.py"\n(.*?)```', text, re.S)
    assert m is not None
    (tmp_path / "conn.py").write_text(m.group(1), encoding="utf-8")
    # kvspec is installed editable here, which mypy cannot follow: point it at the checkout
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "mypy", "--strict", "conn.py"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
