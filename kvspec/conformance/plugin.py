"""The pytest plugin of the kvspec conformance suite (entry point ``pytest11: kvspec``).

Options:

``--kvspec-conformance=SPEC`` (repeatable; ini: ``kvspec_conformance``, one spec a line)
    Run the suite against the connector ``SPEC`` (``pkg.module:Factory``): when pytest is
    given no path, the modules of the installed ``kvspec/conformance/suite/`` are collected
    in addition to ``testpaths`` (or the current directory); paths and node ids given on the
    command line restrict collection as usual, and the node ids pytest prints for suite tests
    (``test_engine.py::TestEngine::...``) are accepted back (``._selection``). Every suite
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

import fnmatch
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ._xfail import KVSpecXfailWarning

if TYPE_CHECKING:
    from ..protocols.capabilities import Capabilities
    from ..protocols.connector import ConnectorFactory
    from ._report import Recorder

__all__ = [
    "KVSpecXfailWarning",
    "connector_specs",
    "kvspec_capabilities",
    "kvspec_factory",
    "kvspec_profile",
    "kvspec_tmpdir",
]

_RECORDER = pytest.StashKey["Recorder"]()
_PREVIOUS_PROFILE = pytest.StashKey[str]()
FULL_PROFILE = "kvspec-full"
FULL_FACTOR = 10


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
    parser.addini(
        "kvspec_conformance", type="linelist", default=[],
        help="connector factories to run the kvspec conformance suite against, one a line",
    )


def connector_specs(config: pytest.Config) -> list[str]:
    """The connector specs of a session: the command-line options, then the ini lines."""
    given = list(config.getoption("kvspec_conformance", None) or [])
    given += [str(s) for s in config.getini("kvspec_conformance") or []]
    return list(dict.fromkeys(s.strip() for s in given if s.strip()))


def _check_writable(path: str | None, flag: str) -> None:
    """Refuse, before any test runs, an output path that cannot be written: the run's
    work would be lost at its end (pytest.UsageError naming the option)."""
    if path:
        from ._paths import unwritable_reason

        reason = unwritable_reason(path)
        if reason is not None:
            raise pytest.UsageError(f"{flag}={path}: {reason}")


@pytest.hookimpl(trylast=True)  # after hypothesis's own plugin has loaded its profile
def pytest_configure(config: pytest.Config) -> None:
    """Register the markers and the run recorder; with connectors, add the suite."""
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
    from ._report import Recorder

    for option, flag in (("kvspec_report", "--kvspec-report"),
                         ("kvspec_write_xfail", "--kvspec-write-xfail")):
        _check_writable(config.getoption(option, None), flag)
    specs = connector_specs(config)
    recorder = Recorder(config, specs)
    config.stash[_RECORDER] = recorder
    config.pluginmanager.register(recorder, "kvspec-conformance-recorder")
    if config.getoption("kvspec_profile", "default") == "full":
        _load_full_profile(config)
    if specs:
        from ._selection import plan_suite

        recorder.plan = plan_suite(config)
        recorder.load_connectors()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Restore the hypothesis profile and drop the recorder."""
    previous = config.stash.get(_PREVIOUS_PROFILE, None)
    if previous is not None:
        from hypothesis import settings

        settings.load_profile(previous)
    recorder = config.stash.get(_RECORDER, None)
    if recorder is not None and config.pluginmanager.is_registered(recorder):
        config.pluginmanager.unregister(recorder)


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


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Skip the suite modules that none of the suite node ids given on the command line names."""
    recorder = config.stash.get(_RECORDER, None)
    plan = recorder.plan if recorder is not None else None
    if plan is not None and plan.ignores(Path(collection_path)):
        return True
    return None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    """Collect, of a suite module, only the tests the suite node ids given name (if any)."""
    report: pytest.CollectReport = yield
    recorder = collector.config.stash.get(_RECORDER, None)
    plan = recorder.plan if recorder is not None else None
    if plan is not None and plan.names and report.result:
        report.result = [node for node in report.result if plan.keeps(node)]
    return report


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    """Collect the suite modules even where ``python_files`` would not match them."""
    if not connector_specs(parent.config) or not file_path.name.startswith("test_") \
            or file_path.suffix != ".py":
        return None
    from ._suites import suite_dir

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


@pytest.fixture(scope="class")
def kvspec_factory(request: pytest.FixtureRequest) -> ConnectorFactory:
    """The connector factory under test.

    Its spec is the ``--kvspec-conformance`` parameter, or else the ``connector`` attribute
    of the test class (set by ``kvspec.conformance.make_suite``).
    """
    from ._loader import load_factory

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
