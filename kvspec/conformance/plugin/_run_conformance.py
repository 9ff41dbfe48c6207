"""Running the suite from Python, without a pytest command line."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any

import attrs

from ...protocols.errors import InvalidArgumentError

__all__ = ["ConformanceResult", "run_conformance"]


def _frozen_mapping(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(value))


@attrs.frozen
class ConformanceResult:
    """What a conformance run found.

    Attributes:
        exit_code: pytest's exit code (0: every test passed or was skipped or xfailed).
        passed: Suite tests that passed.
        failed: Suite tests that failed (an unexpected pass of a listed test counts here).
        skipped: Suite tests skipped (capabilities the connector does not declare).
        xfailed: Suite tests that failed as the expected-failures file said.
        errors: Suite tests that kvspec itself could not run: its harness or engine adapter
            failed (a ``HarnessError``), which says nothing about the connector.
        clauses: Per clause ID: ``pass``, ``fail``, ``skip``, ``xfail``, ``error`` counts, ``level``
            and ``title``.
        report: The whole JSON report (empty if pytest stopped before writing it).
    """

    exit_code: int
    passed: int
    failed: int
    skipped: int
    xfailed: int
    clauses: Mapping[str, Mapping[str, Any]] = attrs.field(converter=_frozen_mapping)
    report: Mapping[str, Any] = attrs.field(converter=_frozen_mapping)
    errors: int = 0

    @property
    def ok(self) -> bool:
        """True if pytest exited with 0."""
        return self.exit_code == 0

    @classmethod
    def from_report(cls, exit_code: int, report: Mapping[str, Any]) -> ConformanceResult:
        """Build the result from a JSON report as ``--kvspec-report`` writes it."""
        tests = report.get("tests", [])
        count = {o: sum(1 for t in tests if t.get("outcome") == o)
                 for o in ("pass", "fail", "skip", "xfail", "error")}
        return cls(
            exit_code=int(exit_code), passed=count["pass"], failed=count["fail"],
            skipped=count["skip"], xfailed=count["xfail"], errors=count["error"],
            clauses=report.get("clauses", {}), report=report,
        )


def run_conformance(
    specs: Sequence[str],
    *,
    profile: str = "default",
    report_path: str | Path | None = None,
    xfail_path: str | Path | None = None,
    extra_pytest_args: Sequence[str] = (),
    progress: IO[str] | None = None,
) -> ConformanceResult:
    """Run the conformance suite in this process, against each connector, and return the result.

    This is ``pytest --kvspec-conformance=SPEC ...`` with the plugin loaded and a JSON
    report, so it works from any runner or script. pytest prints its usual output.

    pytest finds its rootdir and ini file (``pytest.ini``, ``pyproject.toml``, ``tox.ini``,
    ``setup.cfg``) from the current directory, as ``pytest`` run there does, so the
    project's ``addopts``, ``filterwarnings`` and markers apply; it then collects the
    suite, not the project's own tests (unless ``extra_pytest_args`` names paths).

    Args:
        specs: Connector specs (``"pkg.module:Factory"``), at least one.
        profile: ``"default"`` or ``"full"`` (ten times the hypothesis examples).
        report_path: Also keep the JSON report there.
        xfail_path: An expected-failures file (see ``kvspec.conformance``).
        extra_pytest_args: More pytest arguments (``-x``, ``-k name``, ``-q``...).
        progress: Run the connectors one after another and write a line to this stream as
            each starts (``connector 2/6: SPEC: 58 tests (elapsed 40s, ETA 2m10s)``) and
            ends (its outcomes and time). ``kvspec conform`` passes stderr. None: no lines,
            pytest's order.

    Raises:
        InvalidArgumentError: No spec, a spec that is not a string, or an unknown profile.
    """
    import pytest

    from . import hooks
    from ._progress import ConnectorProgress
    from ._selection import SUITE_ONLY_OPTION

    if isinstance(specs, str):
        specs = [specs]
    specs = list(specs)
    if not specs or not all(isinstance(s, str) and s for s in specs):
        raise InvalidArgumentError(
            f"run_conformance needs one or more connector spec strings, got {specs!r}"
        )
    if profile not in ("default", "full"):
        raise InvalidArgumentError(f"profile must be 'default' or 'full', got {profile!r}")
    with tempfile.TemporaryDirectory(prefix="kvspec-conformance-") as tmp:
        out = Path(report_path) if report_path is not None else Path(tmp) / "report.json"
        if out.exists():
            out.unlink()
        args = [f"--kvspec-conformance={s}" for s in specs]
        args += [f"--kvspec-profile={profile}", f"--kvspec-report={out}", "-p", "no:cacheprovider",
                 # kvspec is imported before pytest starts, so it cannot be assert-rewritten
                 "-W", "ignore::pytest.PytestAssertRewriteWarning",
                 # No path argument: pytest takes its rootdir and ini file from the current
                 # directory, and the plugin then collects the suite in place of the
                 # project's tests (an option, so that xdist workers see it too).
                 SUITE_ONLY_OPTION]
        if xfail_path is not None:
            args.append(f"--kvspec-xfail={xfail_path}")
        args += [str(a) for a in extra_pytest_args]
        # The plugin is normally loaded from its entry point; pass the module itself only
        # when that entry point is not going to load it (kvspec run from a source tree).
        plugins: list[object] = [] if _entry_point_loads_plugin() else [hooks]
        if report_path is None:
            plugins.append(_TemporaryReport(str(out)))
        shown = ConnectorProgress(specs, progress) if progress is not None else None
        if shown is not None:
            plugins.append(shown)
        try:
            exit_code = int(pytest.main(args, plugins=plugins))
        finally:
            if shown is not None:
                shown.close()
        report: dict[str, Any] = {}
        if out.exists():
            report = json.loads(out.read_text(encoding="utf-8"))
    return ConformanceResult.from_report(exit_code, report)


@attrs.frozen
class _TemporaryReport:
    # Tells the recorder that the report file is a temporary one, not worth announcing.
    kvspec_temporary_report: str


def _entry_point_loads_plugin() -> bool:
    import os
    from importlib.metadata import entry_points

    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    # kvspec.conformance.plugin: the value of kvspec releases before the hooks had a module of
    # their own (the package still loads them, see its pytest_plugins)
    values = {"kvspec.conformance.plugin.hooks", "kvspec.conformance.plugin"}
    return any(ep.value in values for ep in entry_points(group="pytest11"))
