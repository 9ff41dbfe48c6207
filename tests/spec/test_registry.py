"""The clause registry and docs/spec/ must say the same thing."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

import kvspec
from kvspec.spec import CLAUSES, Area, Clause, Level, clauses_in, counts, get_clause
from kvspec.spec._render import render_area, sync_docs

ROOT = Path(__file__).resolve().parents[2]
SPEC_DIR = ROOT / "docs" / "spec"
HEADING = re.compile(r"^### ([A-Z]{3}-\d{3}): (.+?) \{ #([a-z]{3}-\d{3}) \}$", re.M)
CITED = re.compile(r"\b(SCH|WRK|EXE|EVT|LAY|KVG|SPD|STG|DRY|GRA|HSK|STO|ERR)-(\d{3})\b")


def _doc_clauses() -> dict[str, tuple[Path, str]]:
    found: dict[str, tuple[Path, str]] = {}
    for page in sorted(SPEC_DIR.glob("*.md")):
        for m in HEADING.finditer(page.read_text(encoding="utf-8")):
            assert m.group(1) not in found, f"{m.group(1)} appears in {found.get(m.group(1))} and {page}"
            assert m.group(3) == m.group(1).lower(), f"{m.group(1)} has anchor #{m.group(3)}"
            found[m.group(1)] = (page, m.group(2))
    return found


def test_every_docs_clause_is_in_the_registry_and_back() -> None:
    docs = _doc_clauses()
    registry = {c.id for c in CLAUSES}
    assert sorted(set(docs) - registry) == [], "clauses in docs/spec but not in the registry"
    assert sorted(registry - set(docs)) == [], "clauses in the registry but not in docs/spec"


def test_docs_clause_text_matches_the_registry() -> None:
    stale = sync_docs(SPEC_DIR, check=True)
    assert stale == [], f"run `kvspec spec --write-docs docs/spec`; stale pages: {stale}"


def test_each_clause_is_on_its_area_page() -> None:
    for cid, (page, title) in _doc_clauses().items():
        clause = get_clause(cid)
        assert page.name == clause.area.page
        assert title == clause.title


def test_at_least_sixty_must_clauses() -> None:
    musts = [c for c in CLAUSES if c.level is Level.MUST]
    assert len(musts) >= 60
    assert sum(v[Level.MUST] for v in counts().values()) == len(musts)


def test_every_area_has_clauses_in_id_order() -> None:
    for area in Area:
        ids = [c.id for c in clauses_in(area)]
        assert ids, f"{area.name} has no clause"
        assert ids == [f"{area.name}-{i:03d}" for i in range(1, len(ids) + 1)], "IDs have gaps"


def test_clause_ids_cited_in_the_code_exist() -> None:
    registry = {c.id for c in CLAUSES}
    unknown = set()
    for path in (ROOT / "kvspec").rglob("*.py"):
        for m in CITED.finditer(path.read_text(encoding="utf-8")):
            if m.group(0) not in registry:
                unknown.add(f"{path.relative_to(ROOT)}: {m.group(0)}")
    for page in (ROOT / "docs").rglob("*.md"):
        for m in CITED.finditer(page.read_text(encoding="utf-8")):
            if m.group(0) not in registry:
                unknown.add(f"{page.relative_to(ROOT)}: {m.group(0)}")
    assert sorted(unknown) == []


PENDING_MUST: dict[str, str] = {
    # Clauses no test or harness check covers yet; listed in docs/spec/index.md too.
    "STG-009": "the harness zeroes new attention blocks after handle_preemptions, but no faithful planted write-before-zeroing bug: kvspec's handle_preemptions gets only preempted ids (vLLM 0.32's gets the step's metadata every step), so a connector cannot know its load targets before the zeroing without a protocol change (issue 50)",
    "STG-012": "no rank without attention data in the harness yet (issue 50)",
}


def test_every_must_clause_is_tested_or_listed_as_pending() -> None:
    """A MUST clause is covered when a test or a suite test (kvspec's or the HiCache
    storage suite's, kvspec/sglang) names it, or the harness raises it. The rest must be listed as pending, here and in the spec's index page."""
    text = "".join(p.read_text(encoding="utf-8")
                   for d in ("tests", "kvspec/conformance/suite", "kvspec/sglang")
                   for p in (ROOT / d).rglob("*.py") if p.name != "test_registry.py")
    harness = "".join(p.read_text(encoding="utf-8")
                      for p in (ROOT / "kvspec/conformance/harness").rglob("*.py"))
    uncovered = {c.id for c in CLAUSES if c.level is Level.MUST and c.id not in text
                 and f'"{c.id}"' not in harness}
    assert uncovered == set(PENDING_MUST), "cover these clauses or list them as pending"
    index = (SPEC_DIR / "index.md").read_text(encoding="utf-8")
    for cid in PENDING_MUST:
        assert cid in index.split("## Pending")[-1], f"{cid} missing from the pending list"


def test_render_has_anchor_level_and_rationale() -> None:
    block = render_area(Area.LAY)
    assert "### LAY-003: Block budget and capacity are distinct { #lay-003 }" in block
    assert "**MUST.**" in block and "*Rationale:*" in block


def test_get_clause_rejects_unknown_ids() -> None:
    assert get_clause("sch-005").id == "SCH-005"
    with pytest.raises(KeyError, match="no clause 'SCH-999'"):
        get_clause("SCH-999")
    with pytest.raises(TypeError):
        get_clause(5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"id": "XYZ-001"}, "does not match AREA-NNN"),
        ({"id": "SCH-1"}, "does not match AREA-NNN"),
        ({"rule": "The connector does things."}, "must state its level"),
        ({"rule": "two\nlines MUST"}, "must be one line"),
        ({"title": " "}, "non-empty"),
    ],
)
def test_clause_validation(kwargs: dict[str, str], message: str) -> None:
    base = {"id": "SCH-001", "level": Level.MUST, "title": "t", "rule": "X MUST y.",
            "rationale": "r"}
    with pytest.raises(ValueError, match=message):
        Clause(**{**base, **kwargs})  # type: ignore[arg-type]


def test_clauses_are_frozen() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        CLAUSES[0].rule = "changed"  # type: ignore[misc]


def test_clause_urls_point_to_area_pages() -> None:
    c = get_clause("GRA-002")
    assert c.url == "spec/gra.md#gra-002"
    assert (ROOT / "docs" / c.url.split("#")[0]).exists()


def test_version_is_exposed() -> None:
    assert kvspec.__version__


def test_protocols_implement_this_spec_version() -> None:
    import kvspec.protocols
    import kvspec.spec

    assert kvspec.protocols.SPEC_VERSION == kvspec.spec.SPEC_VERSION


def test_sources_link_every_upstream_pull_request_and_issue() -> None:
    """Issue 18, item 10: sources named 'vLLM PR 27743 (seed 002)', unlinked."""
    from kvspec.spec._render import link_source

    assert link_source("vLLM PR 27026 / issue 26675") == (
        "[vLLM PR 27026](https://github.com/vllm-project/vllm/pull/27026) / "
        "[issue 26675](https://github.com/vllm-project/vllm/issues/26675)")
    assert link_source("kvcached PR 313") == (
        "[kvcached PR 313](https://github.com/ovg-project/kvcached/pull/313)")
    assert link_source("vLLM 0.28-0.33 KVConnectorBase_V1") == "vLLM 0.28-0.33 KVConnectorBase_V1"
    for clause in CLAUSES:
        for source in clause.sources:
            assert "seed" not in source
            if "PR " in source or "issue " in source:
                assert "](https://github.com/" in link_source(source)


def test_the_site_renders_clause_blocks_from_the_registry() -> None:
    """Issue 18, item 11: the site's clause blocks come from the registry at build time (a
    mkdocs hook), whatever the page's source holds."""
    import importlib.util
    from types import SimpleNamespace

    from kvspec.spec._render import BEGIN, END, render_area

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("spec_pages", root / "docs/hooks/spec_pages.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    stale = f"# Errors\n\n{BEGIN.format(area='ERR')}\nstale text\n{END}\n"
    page = SimpleNamespace(file=SimpleNamespace(src_uri="spec/err.md"))
    built = hook.on_page_markdown(stale, page, None, None)
    assert render_area(Area.ERR) in built and "stale text" not in built
    other = SimpleNamespace(file=SimpleNamespace(src_uri="tutorial.md"))
    assert hook.on_page_markdown(stale, other, None, None) == stale
