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


# ------------------------------------------------------------------ offline, in a browser

BROWSER_ENV = "KVSPEC_REQUIRE_BROWSER"
"""Set (CI sets it) to fail instead of skip when no headless Chromium is installed."""

_DIAGRAM_PAGES = ("spec/state-machines.md", "explanation/graph-replay.md")


def _chromium() -> str:
    import shutil

    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get(BROWSER_ENV):
            pytest.fail(f"{BROWSER_ENV} is set but no chromium is installed (apt-get install "
                        "chromium)")
        pytest.skip("needs a headless Chromium (Debian: apt-get install chromium)")
    return found


def _headless(chromium: str, url: str, profile: Path, *extra: str) -> str:
    """Load ``url`` in headless Chromium that can resolve no host but 127.0.0.1 (as on a
    machine without internet) and return the DOM once the page's scripts settled."""
    proc = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={profile}",
         "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
         "--virtual-time-budget=20000", *extra, url],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_diagrams_render_offline_in_a_headless_browser(
    site: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The state machines and the graph-replay diagram render with no network: Mermaid
    ships with the site (docs/hooks/mermaid_offline.py). A diagram Mermaid cannot parse, or
    a page that would need the CDN, leaves its ``<pre class="mermaid">`` source in place;
    a rendered one is replaced by a ``<div class="mermaid">``. Screenshots of three pages are
    left in the test's temporary directory."""
    import functools
    import http.server
    import threading

    chromium = _chromium()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.RequestHandlerClass.log_message = lambda *a, **k: None  # type: ignore[method-assign]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for source in _DIAGRAM_PAGES:
            fences = (ROOT / "docs" / source).read_text().count("```mermaid")
            assert fences, f"{source} has no diagram any more: update _DIAGRAM_PAGES"
            url = f"{base}/{source.removesuffix('.md')}/"
            dom = _headless(chromium, url, tmp_path / "profile", "--dump-dom")
            assert "assets/javascripts/mermaid.min.js" in dom, "the site does not load its Mermaid"
            assert dom.count('<pre class="mermaid"') == 0, (
                f"{url}: a diagram was left as source (Mermaid missing or a parse error)")
            assert dom.count('<div class="mermaid"') == fences, dom[-2000:]
        for page in ("", "spec/state-machines/", "benchmarks/"):
            shot = tmp_path / f"{page.strip('/').replace('/', '-') or 'home'}.png"
            _headless(chromium, f"{base}/{page}", tmp_path / "profile",
                      f"--screenshot={shot}", "--window-size=1280,1600",
                      "--hide-scrollbars")
            assert shot.stat().st_size > 10_000, f"{shot} looks empty"
    finally:
        server.shutdown()
        server.server_close()


def test_docstrings_hold_no_sphinx_roles() -> None:
    """Docstrings are read in three places: the reference site, ``--help`` and ``pytest
    --fixtures`` / ``help()``. A Sphinx role (``:class:`X```) renders only in the first, so
    none is used: code is written as double-backquoted literals everywhere."""
    role = re.compile(r":(?:py:)?(?:class|meth|func|data|mod|attr|exc|obj|const):`")
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "kvspec").rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if role.search(line)]
    assert not found, f"Sphinx roles in {found[:10]}"


def test_readme_and_home_page_count_the_clauses_of_the_registry() -> None:
    """The README and the home page state the size of the spec; they drifted once (112
    when the registry held 113)."""
    from collections import Counter

    clauses = list(CLAUSES.values()) if isinstance(CLAUSES, dict) else list(CLAUSES)
    must = Counter(c.level.value for c in clauses)["MUST"]
    readme = (ROOT / "README.md").read_text()
    home = (ROOT / "docs" / "index.md").read_text()
    assert f"{len(clauses)} clauses, {must} of them MUST" in readme
    assert f"{len(clauses)} clauses (MUST / SHOULD / MAY)" in home
