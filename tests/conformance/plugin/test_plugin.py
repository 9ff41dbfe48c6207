"""The ways into the conformance suite: the pytest plugin, subclassing, run_conformance, the CLI.

Runs use tiny connectors written into the pytester directory, and only the suite module
``test_declaration.py`` (the ``kvrestrict`` plugin ignores the other suite modules), so that
these tests do not depend on the engine-driven suite modules.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import hypothesis

import pytest

# Imported before any in-process pytester run: pytester drops the modules a run imports
# first, and torch must not be imported twice.
import kvspec.conformance.plugin._recorder
import kvspec.conformance.plugin._run_conformance
import kvspec.conformance.suite.test_declaration
import kvspec.protocols  # noqa: F401
from kvspec import conformance
from kvspec.conformance.plugin import _suite_discovery

pytest_plugins = ["pytester"]

KVSPEC_ROOT = Path(conformance.__file__).resolve().parents[1]
DECLARATION = Path(kvspec.conformance.suite.test_declaration.__file__).resolve()

CONN = '''
from kvspec.protocols import Capabilities, HookGraphMode, SchedulerConnector, WorkerConnector


class Sched(SchedulerConnector):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return None

    def build_connector_meta(self, scheduler_output):
        return None


class Worker(WorkerConnector):
    def register_kv_caches(self, kv_caches, layout):
        pass

    def bind_connector_metadata(self, metadata):
        pass

    def clear_connector_metadata(self):
        pass

    def start_load_kv(self, forward_context):
        pass

    def wait_for_save(self):
        pass


class EagerWorker(Worker):
    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, forward_context):
        pass


class Good:
    name = "good"
    capabilities = Capabilities()

    def create_scheduler(self, config):
        return Sched()

    def create_worker(self, config, rank):
        return Worker()

    def create_executor(self, config):
        return None


class Eager(Good):
    name = "eager"
    capabilities = Capabilities(layer_hooks=HookGraphMode.EAGER)

    def create_worker(self, config, rank):
        return EagerWorker()


class Bad(Good):
    """Declares eager per-layer hooks, but its worker keeps the do-nothing defaults."""

    name = "bad"
    capabilities = Capabilities(layer_hooks=HookGraphMode.EAGER)
'''

RESTRICT = '''
from pathlib import Path

SUITE = Path(%r)


def pytest_ignore_collect(collection_path, config):
    path = Path(collection_path)
    if path.parent == SUITE and path.name.startswith("test_") and path.name != "test_declaration.py":
        return True
    return None
'''

DECLARATION_TESTS = sorted(
    name for name in vars(kvspec.conformance.suite.test_declaration.TestDeclaration)
    if name.startswith("test_")
)
HOOKS_KEY = "test_declaration.py::TestDeclaration::test_declared_layer_hooks_are_implemented"


@pytest.fixture
def kv(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.Pytester]:
    """A pytester directory with the connectors ``conn:Good``, ``conn:Eager``, ``conn:Bad``."""
    pytester.makepyfile(conn=CONN, kvrestrict=RESTRICT % str(DECLARATION.parent))
    pytester.syspathinsert()
    monkeypatch.setattr(_suite_discovery, "suite_files", lambda: [DECLARATION])
    monkeypatch.setenv("COLUMNS", "200")
    yield pytester


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "kvrestrict", "-p", "no:cacheprovider", *args)


def summary_row(result: pytest.RunResult, clause: str) -> list[int]:
    for line in result.outlines:
        m = re.match(rf"^{clause}\s+\w+\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\S", line)
        if m:
            return [int(x) for x in m.groups()]
    raise AssertionError(f"no summary row for {clause}:\n" + "\n".join(result.outlines))


# -- loading and collection ----------------------------------------------------------------------


def test_plugin_import_is_light() -> None:
    code = (
        "import sys, kvspec.conformance.plugin.hooks, kvspec.conformance\n"
        "heavy = [m for m in ('torch', 'kvspec.protocols', 'hypothesis') if m in sys.modules]\n"
        "print(heavy)\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_hook_lives_in_the_hooks_module() -> None:
    """One home for the pytest integration: no kvspec module but ``plugin/hooks.py``
    defines a pytest hook (a ``pytest_*`` function or method)."""
    import ast

    found = []
    for path in sorted(KVSPEC_ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and node.name.startswith("pytest_"):
                found.append(path.relative_to(KVSPEC_ROOT).as_posix())
    assert found and set(found) == {"conformance/plugin/hooks.py"}


def test_session_without_option_imports_nothing_heavy(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_light="""
        import sys

        def test_light():
            assert "torch" not in sys.modules
            assert "kvspec.protocols" not in sys.modules
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "kvspec")
    result.assert_outcomes(passed=1)


def test_options_are_registered(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    for option in ("--kvspec-conformance=SPEC", "--kvspec-profile", "--kvspec-report=PATH",
                   "--kvspec-xfail=PATH", "--kvspec-write-xfail=PATH", "kvspec_conformance"):
        assert option in result.stdout.str()
    result = pytester.runpytest("--kvspec-profile=huge")
    assert result.ret == pytest.ExitCode.USAGE_ERROR


def test_suite_is_not_collected_without_the_option(kv: pytest.Pytester) -> None:
    kv.makepyfile(test_mine="def test_mine(): pass")
    result = run(kv, "--co", "-q")
    assert result.ret == 0
    assert "test_mine.py::test_mine" in result.stdout.str()
    assert "TestDeclaration" not in result.stdout.str()


def test_suite_is_collected_with_the_option_once_per_connector(kv: pytest.Pytester) -> None:
    kv.makepyfile(test_mine="def test_mine(): pass")
    result = run(kv, "--co", "-q", "--kvspec-conformance=conn:Good",
                 "--kvspec-conformance=conn:Bad")
    assert result.ret == 0
    out = result.stdout.str()
    assert "test_mine.py::test_mine" in out
    for name in DECLARATION_TESTS:
        for spec in ("conn:Good", "conn:Bad"):
            assert f"test_declaration.py::TestDeclaration::{name}[{spec}]" in out
    assert f"{2 * len(DECLARATION_TESTS) + 1} tests collected" in out


def test_suite_modules_chosen_by_path_are_the_only_ones_run(kv: pytest.Pytester) -> None:
    result = kv.runpytest("-p", "no:cacheprovider", "--co", "-q",
                          "--kvspec-conformance=conn:Good", str(DECLARATION))
    assert f"{len(DECLARATION_TESTS)} tests collected" in result.stdout.str()


def test_ini_option_names_connectors(kv: pytest.Pytester) -> None:
    kv.makeini("[pytest]\nkvspec_conformance =\n    conn:Good\n    conn:Eager\n")
    result = run(kv, "--co", "-q")
    out = result.stdout.str()
    assert "test_capabilities_are_declared_and_constant[conn:Good]" in out
    assert "test_capabilities_are_declared_and_constant[conn:Eager]" in out


def test_suite_is_collected_where_python_files_does_not_match(kv: pytest.Pytester) -> None:
    result = run(kv, "--co", "-q", "-o", "python_files=check_*.py",
                 "--kvspec-conformance=conn:Good")
    assert f"{len(DECLARATION_TESTS)} tests collected" in result.stdout.str()


def test_bad_spec_is_a_usage_error(kv: pytest.Pytester) -> None:
    result = run(kv, "--kvspec-conformance=nosuchmodule:Factory")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kvspec-conformance=nosuchmodule:Factory*module "
                                 "'nosuchmodule' not found*"])
    result = run(kv, "--kvspec-conformance=conn:Nope")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*'conn' has no attribute 'Nope'*"])


def test_unknown_clause_in_a_marker_is_a_collection_error(kv: pytest.Pytester) -> None:
    kv.makepyfile(test_mine="""
        import pytest

        @pytest.mark.kvspec_clause("SCH-999")
        def test_mine():
            pass
    """)
    result = run(kv, "--strict-markers")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_mine.py::test_mine: kvspec_clause('SCH-999')*no clause*"])


def test_unknown_capability_in_a_marker_is_a_collection_error(kv: pytest.Pytester) -> None:
    kv.makepyfile(test_mine="""
        import pytest
        from kvspec.conformance import ConformanceSuite

        class TestMine(ConformanceSuite):
            connector = "conn:Good"

            @pytest.mark.kvspec_requires("flying")
            def test_fly(self):
                pass
    """)
    result = run(kv)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*kvspec_requires('flying'): unknown capability*"])


# -- running and reporting -----------------------------------------------------------------------


def test_capability_skip_names_the_capability(kv: pytest.Pytester) -> None:
    result = run(kv, "-rs", "--kvspec-conformance=conn:Good")
    result.assert_outcomes(passed=5, skipped=3)
    out = result.stdout.str()
    for name in ("layer_hooks", "capturable_hooks", "custom_aggregator"):
        assert f"connector does not declare capability '{name}'" in out


def test_header_names_versions_and_connectors(kv: pytest.Pytester) -> None:
    result = run(kv, "--kvspec-conformance=conn:Good", "--kvspec-conformance=conn:Eager")
    result.stdout.fnmatch_lines([
        "kvspec 0.1.0, spec 0.3, profile default",
        "kvspec connector good (conn:Good): async_loads=False, *layer_hooks=no_layer_hooks*",
        "kvspec connector eager (conn:Eager): *layer_hooks=eager*",
    ])
    result.assert_outcomes(passed=11, skipped=5)


def test_bad_factory_breaks_gra_001(kv: pytest.Pytester) -> None:
    result = run(kv, "-ra", "--kvspec-conformance=conn:Good", "--kvspec-conformance=conn:Bad")
    result.assert_outcomes(passed=10, failed=1, skipped=5)
    out = result.stdout.str()
    assert (
        "clause GRA-001 (Hook graph behaviour is declared) broken by bad: observed: layer_hooks "
        "is EAGER but Worker keeps the WorkerConnector default of wait_for_layer_load, "
        "save_kv_layer; expected: " in out
    )
    result.stdout.fnmatch_lines([
        f"FAILED *{HOOKS_KEY}[[]conn:Bad[]] - clause GRA-001 (Hook graph*",
    ])
    # pass / fail / skip / xfail: the declaration test passes twice, the hooks test fails
    # for Bad and is skipped for Good.
    assert summary_row(result, "GRA-001") == [2, 1, 1, 0]
    assert summary_row(result, "SCH-027") == [2, 0, 0, 0]
    assert summary_row(result, "DRY-005") == [0, 0, 2, 0]
    result.stdout.fnmatch_lines(["*= kvspec conformance =*", "clause *level *pass *fail *skip *xfail *error *title",
                                 "total *tests *10 *1 *5 *0 *0 *16 tests, 6 clauses"])
    rows = [line.split()[0] for line in result.outlines if re.match(r"^[A-Z]{3}-\d{3} ", line)]
    assert rows == sorted(rows) == ["DRY-005", "ERR-010", "EXE-012", "GRA-001", "SCH-027",
                                    "WRK-015"]


def test_violation_report_carries_reproduction_text(kv: pytest.Pytester) -> None:
    kv.makepyfile(test_mine="""
        import pytest
        from kvspec.conformance import ConformanceSuite

        class TestMine(ConformanceSuite):
            connector = "conn:Good"

            @pytest.mark.kvspec_clause("SCH-004")
            def test_full_hit(self):
                self.check(False, "SCH-005", observed="count 16 of 16 tokens",
                           expected="at most 15", reproduce="prompt: 16 tokens, block size 16")
    """)
    report = kv.path / "report.json"
    result = run(kv, f"--kvspec-report={report}")
    result.assert_outcomes(failed=1)
    text = ("clause SCH-005 (A full hit leaves one token to compute) broken by good: "
            "observed: count 16 of 16 tokens; expected: at most 15")
    result.stdout.fnmatch_lines([f"*{text}", "prompt: 16 tokens, block size 16"])
    data = json.loads(report.read_text())
    (test,) = data["tests"]
    assert test["message"] == text + "\nprompt: 16 tokens, block size 16"
    assert test["clauses"] == ["SCH-004", "SCH-005"]
    assert test["key"] == "test_mine.py::TestMine::test_full_hit[conn:Good]"
    # Only the clause the violation names fails; SCH-004 was not fully checked, so uncounted.
    assert data["clauses"]["SCH-005"]["fail"] == 1 and "SCH-004" not in data["clauses"]


def test_json_report(kv: pytest.Pytester) -> None:
    report = kv.path / "out" / "report.json"
    result = run(kv, "--kvspec-conformance=conn:Good", "--kvspec-conformance=conn:Bad",
                 f"--kvspec-report={report}")
    assert result.ret == 1
    assert f"kvspec: wrote the JSON report to {report}" in result.stdout.str()
    data = json.loads(report.read_text())
    assert data["kvspec_version"] == "0.1.0" and data["spec_version"] == "0.3"
    assert [(c["spec"], c["name"]) for c in data["connectors"]] == [
        ("conn:Good", "good"), ("conn:Bad", "bad")
    ]
    assert data["connectors"][1]["capabilities"]["layer_hooks"] == "eager"
    tests = {t["nodeid"].split("/")[-1]: t for t in data["tests"]}
    assert len(tests) == 2 * len(DECLARATION_TESTS)
    failed = tests[f"{HOOKS_KEY}[conn:Bad]"]
    assert failed["outcome"] == "fail" and failed["connector"] == "conn:Bad"
    assert failed["clauses"] == ["GRA-001"] and failed["duration"] >= 0
    assert failed["message"].startswith("clause GRA-001 (Hook graph behaviour is declared) broken")
    skipped = tests[f"{HOOKS_KEY}[conn:Good]"]
    assert skipped["outcome"] == "skip"
    assert skipped["message"] == "connector does not declare capability 'layer_hooks'"
    assert {t["outcome"] for t in data["tests"]} == {"pass", "fail", "skip"}
    assert data["clauses"]["GRA-001"] == {
        "pass": 2, "fail": 1, "skip": 1, "xfail": 0, "error": 0, "level": "MUST",
        "title": "Hook graph behaviour is declared",
    }
    assert list(data["clauses"]) == sorted(data["clauses"])


# -- expected failures ---------------------------------------------------------------------------


def test_xfail_file_marks_listed_tests_and_warns_about_unknown_lines(kv: pytest.Pytester) -> None:
    xfail = kv.path / "xfail.txt"
    xfail.write_text(textwrap.dedent(f"""\
        # known failures
        {HOOKS_KEY}[conn:Bad]   # upstream issue 7

        test_declaration.py::TestDeclaration::test_gone[conn:Bad]
    """))
    result = run(kv, "-rx", "--kvspec-conformance=conn:Bad", f"--kvspec-xfail={xfail}")
    assert result.ret == 0
    result.assert_outcomes(passed=5, skipped=2, xfailed=1)  # other warnings may come from
    out = result.stdout.str()  # modules earlier tests imported: count only ours
    assert out.count("KVSpecXfailWarning: kvspec xfail file line") == 1
    assert "KVSpecXfailWarning: kvspec xfail file line 4 matches no test: " \
        "test_declaration.py::TestDeclaration::test_gone[conn:Bad]" in out
    assert "upstream issue 7" in out
    assert summary_row(result, "GRA-001") == [1, 0, 0, 1]


def test_xfail_file_unexpected_pass_fails(kv: pytest.Pytester) -> None:
    xfail = kv.path / "xfail.txt"
    xfail.write_text(
        "test_declaration.py::TestDeclaration::test_capabilities_are_declared_and_constant"
        "[conn:Good]\n"
    )
    result = run(kv, "--kvspec-conformance=conn:Good", f"--kvspec-xfail={xfail}")
    assert result.ret == 1
    result.assert_outcomes(passed=4, skipped=3, failed=1)
    assert "[XPASS(strict)]" in result.stdout.str()
    assert summary_row(result, "GRA-001") == [0, 1, 1, 0]


def test_write_xfail_then_run_clean(kv: pytest.Pytester) -> None:
    xfail = kv.path / "xfail.txt"
    result = run(kv, "--kvspec-conformance=conn:Good", "--kvspec-conformance=conn:Bad",
                 f"--kvspec-write-xfail={xfail}")
    assert result.ret == 1
    assert f"kvspec: wrote 1 expected failures to {xfail}" in result.stdout.str()
    keys = [ln for ln in xfail.read_text().splitlines() if ln and not ln.startswith("#")]
    assert keys == [f"{HOOKS_KEY}[conn:Bad]"]
    # Rerun against the written file, and rewrite it: still the one (now expected) failure.
    result = run(kv, "--kvspec-conformance=conn:Good", "--kvspec-conformance=conn:Bad",
                 f"--kvspec-xfail={xfail}", f"--kvspec-write-xfail={xfail}")
    assert result.ret == 0
    result.assert_outcomes(passed=10, skipped=5, xfailed=1)
    keys = [ln for ln in xfail.read_text().splitlines() if ln and not ln.startswith("#")]
    assert keys == [f"{HOOKS_KEY}[conn:Bad]"]


# -- subclassing ---------------------------------------------------------------------------------


def test_make_suite_runs_the_same_tests_with_the_same_keys(kv: pytest.Pytester) -> None:
    kv.makepyfile(test_conformance="""
        from kvspec.conformance import make_suite

        globals().update(make_suite("conn:Bad"))
    """)
    listed = run(kv, "--co", "-q")
    names = sorted(re.findall(r"::TestDeclaration::(test_\w+)", listed.stdout.str()))
    assert names == DECLARATION_TESTS
    report = kv.path / "report.json"
    result = run(kv, "-rf", f"--kvspec-report={report}")
    result.assert_outcomes(passed=5, failed=1, skipped=2)
    assert "clause GRA-001 (Hook graph behaviour is declared) broken by bad" in result.stdout.str()
    assert summary_row(result, "GRA-001") == [1, 1, 0, 0]
    data = json.loads(report.read_text())
    keys = sorted(t["key"] for t in data["tests"])
    assert keys == sorted(f"test_declaration.py::TestDeclaration::{n}[conn:Bad]"
                          for n in DECLARATION_TESTS)
    xfail = kv.path / "xfail.txt"
    xfail.write_text(f"{HOOKS_KEY}[conn:Bad]\n")
    result = run(kv, f"--kvspec-xfail={xfail}")
    assert result.ret == 0
    result.assert_outcomes(passed=5, skipped=2, xfailed=1)


def test_make_suite_rejects_a_bad_connector(kv: pytest.Pytester) -> None:
    kv.makepyfile(test_conformance="""
        from kvspec.conformance import make_suite

        globals().update(make_suite("conn:Missing"))
    """)
    result = run(kv)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*InvalidArgumentError*'conn' has no attribute 'Missing'*"])


def test_profile_full_scales_hypothesis_examples(kv: pytest.Pytester) -> None:
    kv.makepyfile(test_mine="""
        from hypothesis import settings
        from kvspec.conformance import ConformanceSuite

        class TestMine(ConformanceSuite):
            connector = "conn:Good"

            def test_profile(self, kvspec_profile):
                assert kvspec_profile == "full"
                assert settings().max_examples == 10 * settings.get_profile("default").max_examples
    """)
    before = hypothesis.settings.get_current_profile_name()
    result = run(kv, "--kvspec-profile=full")
    result.assert_outcomes(passed=1)
    assert hypothesis.settings.get_current_profile_name() == before


def test_suite_class_without_connector_errors(kv: pytest.Pytester) -> None:
    kv.makepyfile(test_mine="""
        from kvspec.conformance import ConformanceSuite

        class TestMine(ConformanceSuite):
            def test_one(self):
                pass
    """)
    result = run(kv)
    result.assert_outcomes(errors=1)
    assert "no connector under test" in result.stdout.str()


# -- run_conformance and the CLI -----------------------------------------------------------------


def test_run_conformance(kv: pytest.Pytester) -> None:
    from kvspec.conformance import run_conformance

    good = run_conformance(["conn:Good"], extra_pytest_args=["-p", "kvrestrict", "-q"])
    assert good.exit_code == 0 and good.ok
    assert (good.passed, good.failed, good.skipped, good.xfailed) == (5, 0, 3, 0)
    assert good.clauses["GRA-001"]["pass"] == 1
    assert good.report["connectors"][0]["name"] == "good"

    report = kv.path / "r.json"
    bad = run_conformance(["conn:Bad"], report_path=report,
                          extra_pytest_args=["-p", "kvrestrict", "-q"])
    assert bad.exit_code == 1 and not bad.ok
    assert bad.failed == 1 and bad.clauses["GRA-001"]["fail"] == 1
    assert json.loads(report.read_text())["tests"] == list(bad.report["tests"])

    xfail = kv.path / "xfail.txt"
    xfail.write_text(f"{HOOKS_KEY}[conn:Bad]\n")
    listed = run_conformance(["conn:Bad"], xfail_path=xfail,
                             extra_pytest_args=["-p", "kvrestrict", "-q"])
    assert listed.exit_code == 0 and listed.xfailed == 1

    missing = run_conformance(["conn:Missing"], extra_pytest_args=["-p", "kvrestrict"])
    assert missing.exit_code == pytest.ExitCode.USAGE_ERROR and missing.report == {}


def test_cli_conform_defaults_and_passthrough(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvspec import cli

    calls: list[tuple[list[str], dict[str, object]]] = []

    def fake(specs: list[str], **kwargs: object) -> object:
        calls.append((list(specs), kwargs))
        return conformance.ConformanceResult.from_report(3, {})

    monkeypatch.setattr(conformance, "run_conformance", fake)
    assert cli.main(["conform"]) == 3
    assert calls[-1][0] == list(conformance.DEFAULT_CONNECTORS)
    assert cli.main(["conform", "a.b:C", "--profile", "full", "--report", "r.json", "--xfail",
                     "x.txt", "--write-xfail", "w.txt", "--", "-k", "decl", "-x"]) == 3
    specs, kwargs = calls[-1]
    assert specs == ["a.b:C"]
    assert kwargs.pop("progress") is sys.stderr  # progress lines: kvspec conform only
    assert kwargs == {
        "profile": "full", "report_path": "r.json", "xfail_path": "x.txt",
        "extra_pytest_args": ["-k", "decl", "-x", "--kvspec-write-xfail=w.txt"],
    }
    with pytest.raises(SystemExit):
        cli.main(["spec", "--", "-x"])


def test_cli_conform_exit_codes(kv: pytest.Pytester) -> None:
    env = {**os.environ, "COLUMNS": "200"}
    good = subprocess.run(
        [sys.executable, "-m", "kvspec", "conform", "conn:Good", "--", "-p", "kvrestrict", "-q"],
        cwd=kv.path, capture_output=True, text=True, env=env,
    )
    assert good.returncode == 0, good.stdout + good.stderr
    assert "5 passed, 3 skipped" in good.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "kvspec", "conform", "conn:Good", "conn:Bad", "--report",
         "r.json", "--", "-p", "kvrestrict", "-q"],
        cwd=kv.path, capture_output=True, text=True, env=env,
    )
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "clause GRA-001 (Hook graph behaviour is declared) broken by bad" in bad.stdout
    assert json.loads((kv.path / "r.json").read_text())["clauses"]["GRA-001"]["fail"] == 1

    # The connector author's day, item 8: no progress while the connectors ran. They run
    # one after another now, with a line on stderr as each starts and ends.
    progress = [line for line in bad.stderr.splitlines() if line.startswith("kvspec conform:")]
    secs = r"\d+(\.\d)?s"
    patterns = [
        rf"kvspec conform: connector 1/2: conn:Good: 8 tests \(elapsed {secs}\)$",
        rf"kvspec conform: connector 1/2: conn:Good: done, 8 tests in {secs} "
        rf"\(5 passed, 3 skipped; elapsed {secs}\)$",
        rf"kvspec conform: connector 2/2: conn:Bad: 8 tests \(elapsed {secs}, ETA {secs}\)$",
        rf"kvspec conform: connector 2/2: conn:Bad: done, 8 tests in {secs} "
        rf"\(5 passed, 1 failed, 2 skipped; elapsed {secs}\)$",
    ]
    assert len(progress) == len(patterns), bad.stderr
    for line, pattern in zip(progress, patterns):
        assert re.match(pattern, line), (line, pattern)
    # the tests ran connector by connector: Good's results all come before Bad's
    dots = "".join(line for line in bad.stdout.splitlines()
                   if line and set(line.split("[")[0].strip()) <= set(".sF"))
    assert dots.replace(" ", "").startswith(".....sss.....s"), bad.stdout
    assert "kvspec conform:" not in good.stdout + bad.stdout  # stdout is pytest's


def test_progress_names_a_long_test_while_it_runs(kv: pytest.Pytester) -> None:
    """The connector author's day, item 8: one suite test can run for a minute and more
    without output. The progress plugin of ``kvspec conform`` names such a test while it
    runs, from a thread, past pytest's capture of the test's output."""
    from kvspec.conformance.plugin._progress import format_seconds

    kv.makepyfile(slowconn="""
        import time

        from conn import Good


        class Slow(Good):
            name = "slow"

            def create_scheduler(self, config):
                time.sleep(1.0)
                return super().create_scheduler(config)
    """)
    # run_conformance's way, with a short heartbeat: the lines go to stderr, which pytest's
    # capture redirects while a test runs
    script = textwrap.dedent("""
        import sys

        import pytest

        from kvspec.conformance.plugin._progress import ConnectorProgress

        sys.path.insert(0, ".")
        progress = ConnectorProgress(["conn:Good", "slowconn:Slow"], sys.stderr,
                                     heartbeat_s=0.3)
        try:
            code = pytest.main(["-p", "kvrestrict", "-p", "no:cacheprovider", "-q",
                                "--kvspec-conformance=conn:Good",
                                "--kvspec-conformance=slowconn:Slow"], plugins=[progress])
        finally:
            progress.close()
        sys.exit(int(code))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=kv.path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "10 passed, 6 skipped" in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line]
    beats = [line for line in lines if "still running" in line]
    assert beats and all(re.match(
        r"kvspec conform: still running test_declaration\.py::TestDeclaration::test_\w+"
        r"\[slowconn:Slow\] \(\d\.\ds; connector 2/2, elapsed \d+\.\ds\)$", line)
        for line in beats), lines
    starts = [i for i, line in enumerate(lines) if re.search(r"connector \d/2: \S+: 8 tests", line)]
    ends = [i for i, line in enumerate(lines) if ": done, 8 tests in " in line]
    assert len(starts) == len(ends) == 2 and starts[0] < ends[0] < starts[1] < ends[1], lines
    assert all(starts[1] < i < ends[1] for i, line in enumerate(lines) if line in beats)
    assert "kvspec conform:" not in proc.stdout
    assert [format_seconds(s) for s in (0.04, 9.94, 9.96, 65, 3725)] == [
        "0.0s", "9.9s", "10s", "1m05s", "1h02m"]


@pytest.mark.parametrize("ini", ["pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg"])
def test_cli_conform_uses_the_rootdir_and_ini_file_of_the_current_directory(
        kv: pytest.Pytester, ini: str) -> None:
    """The connector author's day, item 4: ``kvspec conform`` run in a project took pytest's
    rootdir and ini file from kvspec's own source tree (the suite directory was its path
    argument), ignoring the project's ``addopts`` and ``filterwarnings``, and printed the
    suite's paths as ``../<kvspec>/...``. pytest finds them from the current directory now,
    as ``pytest`` run there does; the project's own tests are still not collected."""
    section = {"pytest.ini": "[pytest]", "pyproject.toml": "[tool.pytest.ini_options]",
               "tox.ini": "[pytest]", "setup.cfg": "[tool:pytest]"}[ini]
    quote = '"' if ini == "pyproject.toml" else ""
    (kv.path / ini).write_text(
        f"{section}\naddopts = {quote}-p kvrestrict -rfs{quote}\n"
        # the project's filter: the warning the connector gives fails its tests
        f"filterwarnings = {'[' if quote else ''}{quote}error::UserWarning:warnconn{quote}"
        f"{']' if quote else ''}\n"
    )
    kv.makepyfile(test_mine="def test_mine():\n    assert False\n")
    kv.makepyfile(warnconn="""
        import warnings

        from conn import Good


        class Warns(Good):
            name = "warns"

            def create_scheduler(self, config):
                warnings.warn("project filters make this an error", UserWarning)
                return super().create_scheduler(config)
    """)
    proc = subprocess.run(
        [sys.executable, "-m", "kvspec", "conform", "conn:Good", "warnconn:Warns"],
        cwd=kv.path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )
    out = proc.stdout
    assert f"rootdir: {kv.path}" in out.splitlines(), out
    assert f"configfile: {ini}" in out.splitlines(), out
    # addopts: only the suite module kvrestrict keeps, and the summary of -rfs
    assert re.search(r"^test_declaration\.py \.\.\.\.\.sss", out, re.M), out
    assert "SKIPPED [" in out and "test_engine.py" not in out and "test_mine" not in out
    assert "../" not in "".join(line.split(" ")[0] for line in out.splitlines())
    # filterwarnings: the warning of Warns' scheduler is an error in its tests
    assert proc.returncode == 1, out + proc.stderr
    assert "broken by warns: observed: Warns.create_scheduler raised UserWarning: project " \
           "filters make this an error" in out
    assert "1 failed, 5 passed, 10 skipped" in out
    failed = re.findall(r"^FAILED (\S+)", out, re.M)
    assert failed and all(f.endswith("[warnconn:Warns]") for f in failed), out


def test_suite_installed_in_a_project_virtualenv_is_collected(kv: pytest.Pytester) -> None:
    # kvspec installed (not editable) in <project>/.venv: pytest would skip the suite
    # directory, which lies in an ignored directory under the path it was given.
    site = kv.path / ".venv" / "lib" / "site-packages"
    shutil.copytree(KVSPEC_ROOT, site / "kvspec",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (kv.path / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (kv.path / "kvrestrict.py").write_text(
        RESTRICT % str(site / "kvspec" / "conformance" / "suite")
    )
    kv.makeini("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "kvrestrict", "-p", "no:cacheprovider", "-rs",
         "--kvspec-conformance=conn:Good", "-q"],
        cwd=kv.path, capture_output=True, text=True, env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "5 passed, 3 skipped" in out.stdout
    assert ".venv/lib/site-packages/kvspec/conformance/suite/test_declaration.py" in out.stdout


def test_unreadable_and_unwritable_paths_are_usage_errors_before_any_test(
        kv: pytest.Pytester) -> None:
    """Issue 14, defect 10: an expected-failures file that is not UTF-8 was an INTERNALERROR,
    and a report or write-xfail path that cannot be written failed only at the end, after
    the run's work. Both are usage errors now, and no test runs."""
    bad = kv.path / "xfail.txt"
    bad.write_bytes(b"\xff\xfe not utf-8\n")
    result = run(kv, "--kvspec-conformance=conn:Good", f"--kvspec-xfail={bad}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kvspec-xfail=*cannot read it as UTF-8 text*"])
    (kv.path / "adir").mkdir()
    for option in ("--kvspec-report", "--kvspec-write-xfail"):
        result = run(kv, "--kvspec-conformance=conn:Good", f"{option}={kv.path / 'adir'}")
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines([f"*{option}=*is a directory*"])
        assert "passed" not in result.stdout.str()


def test_cli_refuses_an_empty_spec_and_an_unwritable_output_at_once(kv: pytest.Pytester) -> None:
    for args in (["conform", ""], ["conform", "conn:Good", "--report", str(kv.path)],
                 ["bench", "offload", "--quick", "--svg", str(kv.path)]):
        proc = subprocess.run([sys.executable, "-m", "kvspec", *args], cwd=kv.path,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert ("empty connector spec" in proc.stderr) or ("is a directory" in proc.stderr)


@pytest.mark.parametrize("flag", [["--json"], ["--report", "-"]])
def test_cli_conform_prints_the_report_as_json_on_stdout(kv: pytest.Pytester, flag: list[str]
                                                          ) -> None:
    """Issue 18, item 7: ``conform`` had no --json and ``--report -`` wrote a file named
    ``-``. Both print the JSON report alone on stdout; pytest's output goes to stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvspec", "conform", "conn:Good", "conn:Bad", *flag, "--",
         "-p", "kvrestrict", "-q"],
        cwd=kv.path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["clauses"]["GRA-001"]["fail"] == 1
    assert "broken by bad" in proc.stderr
    assert not (kv.path / "-").exists()


def test_a_closed_pipe_ends_the_cli_quietly() -> None:
    """Issue 18, item 7: ``kvspec spec --json | head`` ended in a BrokenPipeError traceback."""
    proc = subprocess.run(
        f"{shlex.quote(sys.executable)} -m kvspec spec --json | head -c 10", shell=True,
        capture_output=True, text=True, timeout=60,
    )
    assert len(proc.stdout) == 10
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr


def test_junit_xml_carries_the_clauses_and_the_connector(kv: pytest.Pytester) -> None:
    """Issue 18, item 6: JUnit XML held no clause IDs. Each suite test case carries its
    clauses, connector and, when it failed, the clause it broke, as properties."""
    xml = kv.path / "junit.xml"
    result = run(kv, "--kvspec-conformance=conn:Bad", f"--junitxml={xml}", "-q")
    assert result.ret == 1
    root = ElementTree.parse(xml).getroot()
    props = {}
    for case in root.iter("testcase"):
        props[case.get("name")] = {p.get("name"): p.get("value") for p in case.iter("property")}
    failed = [p for p in props.values() if p.get("kvspec_broken_clause")]
    assert failed and all(p["kvspec_broken_clause"] == "GRA-001" for p in failed)
    assert all(p["kvspec_connector"] == "conn:Bad" and p["kvspec_clauses"]
               for p in props.values())


# -- xdist, node ids passed back, explicit paths ------------------------------------------------


def table_rows(result: pytest.RunResult) -> list[str]:
    """The clause table's rows and its total row, as printed."""
    return [line for line in result.outlines
            if re.match(r"^([A-Z]{3}-\d{3}|total) ", line)]


def comparable(report: Path) -> dict[str, Any]:
    """A JSON report with its tests sorted by node id and without durations."""
    data = json.loads(report.read_text())
    for test in data["tests"]:
        test.pop("duration")
    data["tests"].sort(key=lambda t: t["nodeid"])
    return data


def test_xdist_run_reports_what_a_serial_run_reports(kv: pytest.Pytester) -> None:
    """The connector author's day, item 1: under ``-n 2`` the clause table was empty, the JSON
    report held no test and --kvspec-write-xfail wrote no line: the workers ran the tests and
    the controller, which collects nothing, tracked none. Each report carries its test's
    kvspec data to the controller now, which writes every output as a serial run does."""
    pytest.importorskip("xdist")
    outputs = {}
    for mode in ("serial", "xdist"):
        report, xfail = kv.path / f"{mode}.json", kv.path / f"{mode}.txt"
        args = ["--kvspec-conformance=conn:Good", "--kvspec-conformance=conn:Bad",
                f"--kvspec-report={report}", f"--kvspec-write-xfail={xfail}"]
        result = run(kv, *args) if mode == "serial" else kv.runpytest_subprocess(
            "-p", "kvrestrict", "-p", "no:cacheprovider", "-n", "2", *args)
        result.assert_outcomes(passed=10, failed=1, skipped=5)
        assert f"kvspec: wrote 1 expected failures to {xfail}" in result.stdout.str()
        outputs[mode] = (table_rows(result), comparable(report),
                         xfail.read_text().splitlines()[2:])
    serial, xdist = outputs["serial"], outputs["xdist"]
    assert serial[0] and serial[0][-1].split()[2:7] == ["10", "1", "5", "0", "0"]
    assert xdist[0] == serial[0]
    assert xdist[1] == serial[1] and len(serial[1]["tests"]) == 16
    assert xdist[2] == serial[2] == [f"{HOOKS_KEY}[conn:Bad]"]


def test_failed_node_ids_can_be_passed_back_and_lf_reruns_them(kv: pytest.Pytester) -> None:
    """The connector author's day, item 2: the node id pytest prints for a failed suite test
    (relative to the suite directory, which lies outside the rootdir) was 'file or directory
    not found' when passed back. It selects the test now, with the flag or the ini key, from
    the rootdir or below it, and ``--lf`` reruns the suite's failures with the project's."""
    kv.makepyfile(test_mine="def test_mine():\n    assert False\n")
    flags = ["-p", "kvrestrict", "-rf"]  # with the cache plugin, for --lf
    first = kv.runpytest(*flags, "--kvspec-conformance=conn:Good", "--kvspec-conformance=conn:Bad")
    first.assert_outcomes(passed=10, failed=2, skipped=5)
    failed = re.findall(r"^FAILED (test_declaration\.py::\S+)", first.stdout.str(), re.M)
    assert failed == [f"{HOOKS_KEY}[conn:Bad]"]

    kv.makeini("[pytest]\nkvspec_conformance =\n    conn:Good\n    conn:Bad\n")
    again = kv.runpytest_subprocess(*flags, failed[0])
    again.assert_outcomes(failed=1)
    assert re.findall(r"^FAILED (\S+)", again.stdout.str(), re.M) == failed
    assert "GRA-001" in "\n".join(table_rows(again))

    rerun = kv.runpytest(*flags, "--lf")
    rerun.assert_outcomes(failed=2)
    assert sorted(re.findall(r"^FAILED (\S+)", rerun.stdout.str(), re.M)) == sorted(
        [*failed, "test_mine.py::test_mine"])

    # From a directory below the rootdir pytest prints the id relative to it: "../test_..".
    (kv.path / "sub").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(kv.path / "sub")
        below = run(kv, "--co", "-q", f"../{HOOKS_KEY}")
    assert below.ret == 0, below.stdout.str()
    assert f"{HOOKS_KEY}[conn:Good]" in below.stdout.str()
    assert "2 tests collected" in below.stdout.str()

    missing = run(kv, "--co", "test_declaration.py::TestDeclaration::test_gone")
    assert missing.ret == pytest.ExitCode.USAGE_ERROR
    missing.stderr.fnmatch_lines(["*not found in the conformance suite: "
                                  "test_declaration.py::TestDeclaration::test_gone*"])


def test_explicit_paths_restrict_collection_under_the_ini_key(kv: pytest.Pytester) -> None:
    """The connector author's day, item 3: with the ini key set, ``pytest test_x.py::test_x``
    collected the whole suite as well. Paths and node ids given restrict collection now; the
    suite is added only when none is given, or as far as they name it."""
    kv.makeini("[pytest]\nkvspec_conformance = conn:Good\n")
    kv.makepyfile(test_mine="def test_one():\n    pass\n\n\ndef test_two():\n    pass\n")
    result = kv.runpytest_subprocess("-p", "kvrestrict", "-p", "no:cacheprovider", "--co", "-q",
                                     "test_mine.py::test_one")
    assert result.ret == 0
    assert "test_mine.py::test_one" in result.stdout.str()
    assert "TestDeclaration" not in result.stdout.str()
    assert "1 test collected" in result.stdout.str()

    n = len(DECLARATION_TESTS)
    for args, count in ((["test_mine.py"], 2), ([], 2 + n),
                        (["test_mine.py::test_two", "test_declaration.py"], 1 + n),
                        (["test_declaration.py::TestDeclaration"], n),
                        ([f"{HOOKS_KEY}[conn:Good]", "test_mine.py::test_one"], 2)):
        result = run(kv, "--co", "-q", *args)
        assert result.ret == 0, result.stdout.str()
        assert f"{count} test{'s' if count > 1 else ''} collected" in result.stdout.str(), args
