"""docs/sglang-backends.md, the results page ``kvspec conform hicache:... --page`` writes:
generated from the runs kept beside it, every failure explained. Needs no SGLang."""

from __future__ import annotations

from pathlib import Path

from kvspec.sglang.report import (
    BACKENDS,
    BackendRun,
    load_runs,
    merge_reports,
    render_page,
    unexplained,
)

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "sglang-backends.md"
DATA = ROOT / "docs" / "sglang-backends-data"


def test_the_committed_page_is_rendered_from_the_kept_runs() -> None:
    runs = load_runs(DATA)
    assert PAGE.read_text() == render_page(runs, data_dir="docs/sglang-backends-data")


def test_the_committed_page_has_no_unexplained_failure() -> None:
    runs = {r.target: r for r in load_runs(DATA)}
    assert unexplained(list(runs.values())) == []
    page = PAGE.read_text()
    assert "UNEXPLAINED" not in page
    for name in BACKENDS:
        assert f"\n## {name}\n" in page
    # the file and kvspec backends ran, with every check; kvspec's passes them all
    assert runs["file"].report is not None and runs["kvspec"].report is not None
    kvspec = [t["outcome"] for t in runs["kvspec"].tests()]
    assert len(kvspec) >= 20 and set(kvspec) == {"pass"}
    failed = {t["nodeid"] for t in runs["file"].tests() if t["outcome"] == "fail"}
    assert failed == {"test_damaged_object_reads_as_a_miss[truncated]",
                      "test_damaged_object_reads_as_a_miss[empty]",
                      "test_failed_load_reads_as_a_miss"}
    assert "#### FILE-1: " in page


def _run(target: str, message: str) -> BackendRun:
    return BackendRun(target, {"tests": [
        {"nodeid": "x.py::T::test_a", "outcome": "pass", "clauses": ["STO-001"], "message": ""},
        {"nodeid": "x.py::T::test_damaged_object_reads_as_a_miss[empty]", "outcome": "fail",
         "clauses": ["STO-003"], "message": message}]}, 3.0, date="2026-01-01")


def test_a_failure_no_finding_explains_is_shown_and_counted() -> None:
    known = "clause STO-003 (A bad object reads as a miss) broken by the code under test: x"
    assert unexplained([_run("file", known)]) == []
    other = _run("file", "clause STO-004 (What exists can be read) broken by the code under test: y")
    assert unexplained([other]) == ["file: test_damaged_object_reads_as_a_miss[empty]"]
    page = render_page([other])
    assert "#### UNEXPLAINED" in page and "1 UNEXPLAINED" in page
    # a backend that was not run still has its row and section, with the reason
    assert "| nixl | - |" in page and "Not run: no kept run." in page
    # the same STO-003 failure of another backend is not the file backend's finding
    assert unexplained([_run("kvspec", known)]) != []


def test_kept_runs_round_trip_and_reports_merge(tmp_path: Path) -> None:
    from kvspec.sglang.report import save_run

    run = _run("pkg.mod:Cls", "clause STO-003 (t) broken by the code under test: at /tmp/pytest-of-x/y/z")
    save_run(run, tmp_path)
    (back,) = load_runs(tmp_path)
    assert back.target == "pkg.mod:Cls" and back.tests()[1]["message"].endswith("at .../z")
    merged = merge_reports([
        ("file", {"tests": [{"nodeid": "a"}], "clauses": {"STO-001": {"pass": 1, "fail": 0}}}),
        ("kvspec", {"tests": [{"nodeid": "a"}], "clauses": {"STO-001": {"pass": 1, "fail": 1}}})])
    assert [t["connector"] for t in merged["tests"]] == ["hicache:file", "hicache:kvspec"]
    assert merged["clauses"]["STO-001"] == {"pass": 2, "fail": 1}
