"""Every pytest hook and fixture of the kvspec plugin (entry point ``pytest11: kvspec``).

The hooks here only connect pytest to plain objects: the options and collection to
``_selection`` and ``_suite_discovery``, a session's tests and reports to its
``_recorder.Recorder``, and the progress lines of ``kvspec conform`` to a
``_progress.ConnectorProgress``. Module functions hold the hooks that reach the config from
their arguments; ``SessionHooks``, one per config, holds those that do not (a test's
reports) and the others of the recorder and the progress lines.

Options:

``--kvspec-conformance=SPEC`` (repeatable; ini: ``kvspec_conformance``, one spec a line)
    Run the suite against the connector ``SPEC`` (``pkg.module:Factory``): when pytest is
    given no path, the modules of the installed ``kvspec/conformance/suite/`` are collected
    in addition to ``testpaths`` (or the current directory); paths and node ids given on the
    command line restrict collection as usual, and the node ids pytest prints for suite tests
    (``test_engine.py::TestEngine::...``) are accepted back (``_selection``). Every suite
    test runs once per connector, with the spec as its id. Without it the suite is never
    collected.
``--kvspec-profile=default|full``
    ``full`` loads the hypothesis settings profile ``kvspec-full`` (ten times the examples)
    and is what the ``kvspec_profile`` fixture returns.
``--kvspec-report=PATH``
    Write the JSON report: versions, connectors, one entry per test (outcome, clauses,
    connector, duration, message) and per-clause counts.
``--kvspec-xfail=PATH``
    Mark the tests listed in an expected-failures file as strict xfails (format in
    ``kvspec.conformance``); a line matching no test warns with
    ``KVSpecXfailWarning``.
``--kvspec-write-xfail=PATH``
    At the end, write the keys of the suite tests that failed to ``PATH``.

Markers: ``kvspec_clause(*ids)`` names the clauses a test checks (validated at collection);
``kvspec_requires(*capabilities)`` skips a suite test whose connector does not declare one
of the capabilities; ``kvspec_startup`` marks the one test that still runs (and reports
why) when an engine on the connector does not start. Fixtures: ``kvspec_factory``, ``kvspec_capabilities``,
``kvspec_profile``, ``kvspec_tmpdir``.

Importing this module imports neither torch, nor ``kvspec.protocols``, nor hypothesis:
they are imported only when a session holds suite tests or asks for the full profile.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ._expected_failures import KVSpecXfailWarning
from ._selection import SUITE_ONLY_OPTION, connector_specs

if TYPE_CHECKING:
    from ...protocols.capabilities import Capabilities
    from ...protocols.connector import ConnectorFactory
    from ._progress import ConnectorProgress
    from ._recorder import Recorder

__all__ = [
    "KVSpecXfailWarning",
    "SessionHooks",
    "connector_specs",
    "kvspec_capabilities",
    "kvspec_factory",
    "kvspec_profile",
    "kvspec_tmpdir",
]

_SESSION = pytest.StashKey["SessionHooks"]()
_PREVIOUS_PROFILE = pytest.StashKey[str]()
FULL_PROFILE = "kvspec-full"
FULL_FACTOR = 10


# -- options and configuration -------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add the ``--kvspec-*`` options and the ``kvspec_conformance`` ini option."""
    group = parser.getgroup("kvspec", "kvspec conformance suite")
    group.addoption(
        "--kvspec-conformance", action="append", default=[], metavar="SPEC",
        dest="kvspec_conformance",
        help="run the kvspec conformance suite against this connector factory "
             "(pkg.module:Factory); repeatable",
    )
    group.addoption(
        "--kvspec-profile", choices=("default", "full"), default="default",
        dest="kvspec_profile",
        help=f"'full' multiplies hypothesis examples by {FULL_FACTOR} (default: default)",
    )
    group.addoption(
        "--kvspec-report", metavar="PATH", default=None, dest="kvspec_report",
        help="write the kvspec conformance report as JSON to PATH",
    )
    group.addoption(
        "--kvspec-xfail", metavar="PATH", default=None, dest="kvspec_xfail",
        help="expected-failures file: listed suite tests are strict xfails",
    )
    group.addoption(
        "--kvspec-write-xfail", metavar="PATH", default=None, dest="kvspec_write_xfail",
        help="write the keys of the failing suite tests to PATH at the end",
    )
    group.addoption(  # kvspec conform's (run_conformance), not for people: not in --help
        SUITE_ONLY_OPTION, action="store_true", default=False, dest="kvspec_suite_only",
        help=argparse.SUPPRESS,
    )
    parser.addini(
        "kvspec_conformance", type="linelist", default=[],
        help="connector factories to run the kvspec conformance suite against, one a line",
    )


@pytest.hookimpl(tryfirst=True, specname="pytest_configure")  # before plan_suite, below
def pytest_configure_suite_only(config: pytest.Config) -> None:
    """Under ``kvspec conform``: collect the suite in place of the project's own tests."""
    if config.getoption("kvspec_suite_only", False):
        from ._selection import collect_suite_only

        collect_suite_only(config)


@pytest.hookimpl(trylast=True)  # after hypothesis's own plugin has loaded its profile
def pytest_configure(config: pytest.Config) -> None:
    """Register the markers and the session's hooks; with connectors, plan the suite."""
    config.addinivalue_line(
        "markers", "kvspec_clause(*clause_ids): the kvspec spec clauses this test checks"
    )
    config.addinivalue_line(
        "markers",
        "kvspec_requires(*capabilities): skip unless the connector under test declares them",
    )
    config.addinivalue_line(
        "markers",
        "kvspec_startup: runs even when an engine on the connector does not start (the test "
        "that reports why; every other suite test is then skipped)",
    )
    from ._progress import ConnectorProgress
    from ._recorder import Recorder

    for option, flag in (("kvspec_report", "--kvspec-report"),
                         ("kvspec_write_xfail", "--kvspec-write-xfail")):
        _check_writable(config.getoption(option, None), flag)
    specs = connector_specs(config)
    recorder = Recorder(config, specs)
    progress = next((p for p in config.pluginmanager.get_plugins()
                     if isinstance(p, ConnectorProgress)), None)
    if progress is not None:
        progress.attach(config)
    session = SessionHooks(recorder, progress)
    config.stash[_SESSION] = session
    config.pluginmanager.register(session, "kvspec-conformance-recorder")
    if config.getoption("kvspec_profile", "default") == "full":
        _load_full_profile(config)
    if specs:
        from ._selection import plan_suite

        recorder.plan = plan_suite(config)
        recorder.load_connectors()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Restore the hypothesis profile, stop the progress lines and drop the session's hooks."""
    previous = config.stash.get(_PREVIOUS_PROFILE, None)
    if previous is not None:
        from hypothesis import settings

        settings.load_profile(previous)
    session = config.stash.get(_SESSION, None)
    if session is None:
        return
    if session.progress is not None:
        session.progress.close()
    if config.pluginmanager.is_registered(session):
        config.pluginmanager.unregister(session)


def _check_writable(path: str | None, flag: str) -> None:
    """Refuse, before any test runs, an output path that cannot be written: the run's
    work would be lost at its end (pytest.UsageError naming the option)."""
    if path:
        from .._paths import unwritable_reason

        reason = unwritable_reason(path)
        if reason is not None:
            raise pytest.UsageError(f"{flag}={path}: {reason}")


def _load_full_profile(config: pytest.Config) -> None:
    from hypothesis import settings

    current = getattr(settings, "get_current_profile_name", None)  # hypothesis >= 6.1xx
    config.stash[_PREVIOUS_PROFILE] = str(
        current() if current is not None else getattr(settings, "_current_profile", "default")
    )
    base = settings.default
    assert base is not None
    settings.register_profile(
        FULL_PROFILE, parent=base, max_examples=base.max_examples * FULL_FACTOR
    )
    settings.load_profile(FULL_PROFILE)


# -- collection ----------------------------------------------------------------------------------


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Skip the suite modules that none of the suite node ids given on the command line names."""
    session = config.stash.get(_SESSION, None)
    plan = session.recorder.plan if session is not None else None
    if plan is not None and plan.ignores(Path(collection_path)):
        return True
    return None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    """Collect, of a suite module, only the tests the suite node ids given name (if any)."""
    report: pytest.CollectReport = yield
    session = collector.config.stash.get(_SESSION, None)
    plan = session.recorder.plan if session is not None else None
    if plan is not None and plan.names and report.result:
        report.result = [node for node in report.result if plan.keeps(node)]
    return report


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    """Collect the suite modules even where ``python_files`` would not match them."""
    if not connector_specs(parent.config) or not file_path.name.startswith("test_") \
            or file_path.suffix != ".py":
        return None
    from ._suite_discovery import suite_dir

    if file_path.parent.resolve() != suite_dir():
        return None
    patterns = parent.config.getini("python_files")
    if any(fnmatch.fnmatch(file_path.name, pat) for pat in patterns):
        return None  # pytest's python plugin collects it
    module: pytest.Module = pytest.Module.from_parent(parent, path=file_path)
    return module


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run each suite test once per ``--kvspec-conformance`` connector (ids: the specs)."""
    cls = metafunc.cls
    if cls is None or "kvspec_factory" not in metafunc.fixturenames:
        return
    base = sys.modules.get("kvspec.conformance.suite._base")
    suite_base = getattr(base, "ConformanceSuite", None)
    if suite_base is None or not issubclass(cls, suite_base) or cls.connector is not None:
        return
    specs = connector_specs(metafunc.config)
    if specs:
        metafunc.parametrize("kvspec_factory", specs, ids=specs, indirect=True, scope="class")


# -- a session's recording and progress ------------------------------------------------------------


class SessionHooks:
    """The hooks of one pytest config's session, over its recorder and progress lines.

    Registered by ``pytest_configure`` (one per config: pytester and nested sessions get
    their own), because some of these hooks, such as a test's reports, carry no config
    from which to find the session's state.

    Args:
        recorder: The session's outcomes, summary and JSON report.
        progress: The progress lines ``kvspec conform`` prints, or None.
    """

    def __init__(self, recorder: Recorder, progress: ConnectorProgress | None) -> None:
        self.recorder = recorder
        self.progress = progress

    def pytest_report_header(self) -> list[str]:
        """Name kvspec, the spec and every connector under test."""
        return self.recorder.header_lines()

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, session: pytest.Session,
                                      items: list[pytest.Item]) -> None:
        """Validate markers, bind connectors, apply capability skips and expected failures."""
        self.recorder.track(session, items)

    @pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
    def pytest_collection_modifyitems_order(self, items: list[pytest.Item]) -> None:
        """Under ``kvspec conform``: run the connectors one after another (after selection
        and deselection)."""
        if self.progress is not None:
            self.progress.order(items)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """Count each connector's tests, for the progress lines."""
        if self.progress is not None:
            self.progress.note_collected(session)

    @pytest.hookimpl(tryfirst=True)  # before the terminal reporter writes the test's path
    def pytest_runtest_logstart(self, nodeid: str) -> None:
        """Announce a connector when its first test starts."""
        if self.progress is not None:
            self.progress.note_start(nodeid)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        """Name the clause and the connector in a violation's failure; attach the test's
        kvspec data to its reports."""
        report: pytest.TestReport = yield
        self.recorder.annotate(item, call, report)
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Fold each phase's report into the test's outcome and the progress lines."""
        self.recorder.fold(report)
        if self.progress is not None:
            self.progress.note_report(report)

    def pytest_sessionfinish(self, exitstatus: int) -> None:
        """Write the JSON report and the expected-failures file; end the progress lines."""
        self.recorder.write_outputs(int(exitstatus))
        if self.progress is not None:
            self.progress.finish()

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """Print the connectors and the per-clause table."""
        self.recorder.write_summary(terminalreporter)


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="class")
def kvspec_factory(request: pytest.FixtureRequest) -> ConnectorFactory:
    """The connector factory under test.

    Its spec is the ``--kvspec-conformance`` parameter, or else the ``connector`` attribute
    of the test class (set by ``kvspec.conformance.make_suite``).
    """
    from .._loader import load_factory

    spec = getattr(request, "param", None)
    if spec is None and request.cls is not None:
        spec = getattr(request.cls, "connector", None)
    if spec is None:
        pytest.fail(
            "kvspec: no connector under test; run pytest with "
            "--kvspec-conformance=pkg.module:Factory or bind the suite to a connector with "
            "kvspec.conformance.make_suite",
            pytrace=False,
        )
    factory = load_factory(spec)
    unavailable = getattr(factory, "unavailable_reason", None)
    if isinstance(unavailable, str) and unavailable:
        pytest.skip(f"{factory.name} cannot run here: {unavailable}")
    return factory


@pytest.fixture(scope="class")
def kvspec_capabilities(kvspec_factory: ConnectorFactory) -> Capabilities:
    """The declared capabilities of the connector under test."""
    return kvspec_factory.capabilities


@pytest.fixture(scope="session")
def kvspec_profile(request: pytest.FixtureRequest) -> str:
    """The conformance profile: ``"default"`` or ``"full"``."""
    return str(request.config.getoption("kvspec_profile", "default"))


@pytest.fixture
def kvspec_tmpdir(tmp_path: Path) -> Path:
    """A fresh scratch directory for one test (the connector's ``extra["kvspec.tmpdir"]``)."""
    return tmp_path
