"""Recording a conformance run: header, per-clause summary, JSON report, expected failures.

One ``Recorder`` per pytest config, made by the plugin's ``pytest_configure``; the hooks of
``kvspec.conformance.plugin.hooks`` hand it the session's items and reports. It stays inert
(and imports nothing heavy) in sessions that hold no suite test and no ``kvspec_clause``
marker. Which clause a failure broke is judged by ``kvspec.conformance._attribution``.

Under pytest-xdist the workers collect and run the tests and the controller writes the
outputs: each test report of a tracked test carries what the controller needs (the
collection-time data and the violation) as the plain-data attribute ``REPORT_ATTR``,
which xdist serializes with the report.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from .._attribution import find_violation, format_violation, harness_error
from ._expected_failures import KVSpecXfailWarning, read_xfail_file, write_xfail_file
from ._suite_discovery import BASE_MODULE, connector_label, suite_dir, suite_files, xfail_key

if TYPE_CHECKING:
    from ...protocols.capabilities import Capabilities
    from ._selection import SuitePlan

__all__ = ["OUTCOMES", "REPORT_ATTR", "ConnectorInfo", "Recorder", "kvspec_version"]

OUTCOMES = ("pass", "fail", "skip", "xfail", "error")
"""The outcomes counted per clause, in column order. ``error``: kvspec's own harness or
engine adapter failed (a ``HarnessError``); the test says nothing about the connector."""

REPORT_ATTR = "kvspec"
"""The attribute of a tracked test's reports that carries its kvspec data (plain data)."""


def kvspec_version() -> str:
    """The version of the running kvspec package."""
    return str(getattr(sys.modules.get("kvspec"), "__version__", "unknown"))


def _spec_version() -> str:
    from ...spec import SPEC_VERSION

    return SPEC_VERSION


@dataclass
class ConnectorInfo:
    """A connector of the run: its spec, name and declaration.

    ``capabilities`` is None where the connector was not loaded (the xdist controller):
    there ``declared``, its declaration as plain data, comes from the workers' reports.
    """

    spec: str
    name: str
    capabilities: Capabilities | None
    declared: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.capabilities is not None and not self.declared:
            self.declared = self.capabilities.describe()

    def describe(self) -> dict[str, object]:
        """The declaration as plain data."""
        return dict(self.declared)

    def plain(self) -> dict[str, object]:
        """Spec, name and declaration as plain data (``from_plain`` reads it back)."""
        return {"spec": self.spec, "name": self.name, "capabilities": self.describe()}

    @classmethod
    def from_plain(cls, data: dict[str, Any]) -> ConnectorInfo:
        """The connector described by ``plain``'s data."""
        return cls(str(data["spec"]), str(data["name"]), None, dict(data["capabilities"]))

    def header(self) -> str:
        """One line naming the connector and its capabilities."""
        caps = ", ".join(f"{k}={_plain(v)}" for k, v in self.describe().items())
        return f"kvspec connector {self.name} ({self.spec}): {caps}"


def _plain(v: object) -> str:
    if isinstance(v, list):
        return "[" + ",".join(str(x) for x in v) + "]"
    return str(v)


@dataclass
class _Tracked:
    nodeid: str
    key: str | None
    connector: str | None
    clauses: list[str]
    outcome: str | None = None
    message: str = ""
    duration: float = 0.0
    violation: str | None = None
    broken: str | None = None  # the clause a ContractViolation named
    strict_xpass: bool = False
    listed: bool = False
    loads: dict[str, int] | None = None  # what the connector loaded in the test's engines
    kvspec_error: str | None = None  # kvspec's own failure (a HarnessError), not the connector's

    def plain(self) -> dict[str, Any]:
        """What a report carries to the xdist controller (set by the worker)."""
        return {"key": self.key, "connector": self.connector, "clauses": list(self.clauses),
                "violation": self.violation, "broken": self.broken, "listed": self.listed,
                "loads": self.loads, "kvspec_error": self.kvspec_error}

    def absorb(self, data: dict[str, Any]) -> None:
        """Take the worker's data from ``plain`` (the same values in a single process)."""
        self.key = data.get("key")
        self.connector = data.get("connector")
        self.clauses = list(data.get("clauses") or [])
        self.violation = data.get("violation")
        self.broken = data.get("broken")
        self.listed = bool(data.get("listed"))
        loads = data.get("loads")
        self.loads = dict(loads) if isinstance(loads, dict) else None
        error = data.get("kvspec_error")
        self.kvspec_error = error if isinstance(error, str) else None


def _crash_message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return str(crash.message)
    lines = str(report.longrepr).strip().splitlines()
    return lines[-1] if lines else "failed"


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr: object = report.longrepr
    if isinstance(longrepr, (tuple, list)) and len(longrepr) == 3:  # a list once serialized
        msg = str(longrepr[2])
    else:
        msg = str(longrepr)
    return msg.removeprefix("Skipped: ")


class Recorder:
    """The plugin's per-session state: the tracked tests, their outcomes and the outputs.

    Args:
        config: The pytest config.
        specs: The connector specs given with ``--kvspec-conformance`` (and the ini option).
    """

    def __init__(self, config: pytest.Config, specs: Sequence[str]) -> None:
        self.config = config
        self.specs = list(specs)
        self.connectors: dict[str, ConnectorInfo] = {}
        self.tracked: dict[str, _Tracked] = {}
        self.notes: list[str] = []
        self.report: dict[str, Any] | None = None
        self.plan: SuitePlan | None = None  # set by the plugin when connectors are given
        # An xdist worker: it runs tests, and its controller writes the outputs.
        self.worker = hasattr(config, "workerinput")

    # -- connectors ---------------------------------------------------------------------------

    def connector(self, connector: object) -> ConnectorInfo:
        """Load (once) and describe a connector given as a spec, class or factory."""
        from .._loader import load_factory

        label = connector_label(connector)
        info = self.connectors.get(label)
        if info is None:
            factory = load_factory(connector)  # type: ignore[arg-type]
            info = ConnectorInfo(label, factory.name, factory.capabilities)
            self.connectors[label] = info
        return info

    def load_connectors(self) -> None:
        """Load every connector given on the command line; a bad one is a usage error."""
        from ...protocols.errors import InvalidArgumentError

        for spec in self.specs:
            try:
                self.connector(spec)
            except InvalidArgumentError as e:
                raise pytest.UsageError(f"--kvspec-conformance={spec}: {e.message}") from e

    # -- header ----------------------------------------------------------------------------------

    def header_lines(self) -> list[str]:
        """Name kvspec, the spec and every connector under test (pytest's header)."""
        if not self.specs:
            return []
        profile = self.config.getoption("kvspec_profile", "default")
        lines = [f"kvspec {kvspec_version()}, spec {_spec_version()}, profile {profile}"]
        lines += [self.connectors[s].header() for s in self.specs if s in self.connectors]
        return lines

    # -- collection ------------------------------------------------------------------------------

    def track(self, session: pytest.Session, items: list[pytest.Item]) -> None:
        """Validate markers, bind connectors, apply capability skips and expected failures.

        Raises:
            pytest.UsageError: A bad marker, connector or expected-failures file.
        """
        self._collect_suite_if_missing(session, items)
        if self.plan is not None:
            self.plan.select(items)
        base = sys.modules.get(BASE_MODULE)
        suite_base: type | None = getattr(base, "ConformanceSuite", None)
        bad: list[str] = []
        for item in items:
            cls = getattr(item, "cls", None)
            is_suite = suite_base is not None and isinstance(cls, type) \
                and issubclass(cls, suite_base)
            clause_marks = list(item.iter_markers("kvspec_clause"))
            if not is_suite and not clause_marks:
                continue
            clauses = self._clauses(item, clause_marks, bad)
            tracked = _Tracked(item.nodeid, None, None, clauses)
            if is_suite:
                assert isinstance(cls, type)
                self._bind(item, cls, tracked, bad)
            self.tracked.setdefault(item.nodeid, tracked)
            # JUnit XML (and any report plugin) sees them as test properties
            item.user_properties.append(("kvspec_clauses", " ".join(clauses)))
            if tracked.connector:
                info = self.connectors.get(tracked.connector)
                item.user_properties.append(("kvspec_connector", tracked.connector))
                if info is not None:
                    item.user_properties.append(("kvspec_connector_name", info.name))
        if bad:
            raise pytest.UsageError("kvspec conformance:\n  " + "\n  ".join(bad))
        self._apply_xfail_file(items)

    def _collect_suite_if_missing(self, session: pytest.Session, items: list[pytest.Item]) -> None:
        # The plugin adds the suite directory to the paths to collect. pytest drops it when a
        # given path contains it, and then skips it when it lies in an ignored directory
        # (kvspec installed in the project's own .venv): collect its modules directly.
        if not self.specs or self.plan is None or not self.plan.collect:
            return
        root = suite_dir()
        if session.isinitpath(root):
            return  # collected as given, collection errors included
        for item in items:
            path = getattr(item, "path", None)
            if path is not None and Path(path).resolve().parent == root:
                return
        for file in suite_files():
            if self.config.hook.pytest_ignore_collect(collection_path=file, config=self.config):
                continue
            module = pytest.Module.from_parent(session, path=file)
            items.extend(session.genitems(module))

    def _clauses(self, item: pytest.Item, marks: Iterable[pytest.Mark], bad: list[str]) -> list[str]:
        from ...spec import get_clause

        out: list[str] = []
        for mark in marks:
            if not mark.args:
                bad.append(f"{item.nodeid}: kvspec_clause needs at least one clause ID")
            for arg in mark.args:
                try:
                    cid = get_clause(arg).id
                except (KeyError, TypeError) as e:
                    bad.append(f"{item.nodeid}: kvspec_clause({arg!r}): {e.args[0]}")
                    continue
                if cid not in out:
                    out.append(cid)
        return out

    def _bind(self, item: pytest.Item, cls: type, tracked: _Tracked, bad: list[str]) -> None:
        from ...protocols.errors import InvalidArgumentError
        from .._loader import capability_names, has_capability

        callspec = getattr(item, "callspec", None)
        params: dict[str, object] = dict(getattr(callspec, "params", {}) or {})
        ids = str(getattr(callspec, "id", "")) if callspec is not None else ""
        if "kvspec_factory" in params:
            connector: object = params["kvspec_factory"]
            label = connector_label(connector)
            extra = "" if ids == label else ids[len(label) + 1:] if ids.startswith(label + "-") \
                else ids
        else:
            connector = getattr(cls, "connector", None)
            if connector is None:
                return  # the kvspec_factory fixture reports the missing connector
            label = connector_label(connector)
            extra = ids
        module = getattr(item, "module", None)
        tracked.connector = label
        tracked.key = xfail_key(
            cls, getattr(module, "__file__", None),
            getattr(item, "originalname", item.name), label, extra,
        )
        try:
            info = self.connector(connector)
        except InvalidArgumentError as e:
            bad.append(f"{item.nodeid}: {e.message}")
            return
        known = capability_names()
        capabilities = info.capabilities
        assert capabilities is not None  # loaded just above
        for mark in item.iter_markers("kvspec_requires"):
            for name in mark.args:
                if name not in known:
                    bad.append(
                        f"{item.nodeid}: kvspec_requires({name!r}): unknown capability; "
                        f"known: {', '.join(known)}"
                    )
                elif not has_capability(capabilities, name):
                    item.add_marker(pytest.mark.skip(
                        reason=f"connector does not declare capability '{name}'"
                    ))
                    return

    def _apply_xfail_file(self, items: list[pytest.Item]) -> None:
        path = self.config.getoption("kvspec_xfail", None)
        if not path:
            return
        try:
            entries = read_xfail_file(path)
        except (OSError, UnicodeDecodeError) as e:
            raise pytest.UsageError(
                f"--kvspec-xfail={path}: cannot read it as UTF-8 text: {e}") from e
        by_key: dict[str, list[pytest.Item]] = {}
        for item in items:
            t = self.tracked.get(item.nodeid)
            if t is not None and t.key is not None:
                by_key.setdefault(t.key, []).append(item)
        for entry in entries:
            matched = by_key.get(entry.key, [])
            if not matched:
                warnings.warn(KVSpecXfailWarning(
                    f"kvspec xfail file line {entry.line} matches no test: {entry.key} "
                    f"({path})"
                ), stacklevel=1)
            for item in matched:
                reason = f"listed in kvspec xfail file {path} line {entry.line}"
                if entry.reason:
                    reason += f": {entry.reason}"
                item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
                self.tracked[item.nodeid].listed = True

    # -- running ---------------------------------------------------------------------------------

    def annotate(self, item: pytest.Item, call: pytest.CallInfo[None],
                 report: pytest.TestReport) -> None:
        """Rewrite the failure of a ContractViolation to name the clause and the connector.

        Every report of a tracked test carries the test's kvspec data as ``REPORT_ATTR``.
        """
        tracked = self.tracked.get(item.nodeid)
        if tracked is None:
            return
        engine = sys.modules.get("kvspec.conformance.harness.engine")
        if engine is not None and call.when in ("setup", "call"):
            tally = engine.take_load_tally()  # setup: drop what came before the test
            if call.when == "call" and tally["engines"]:  # None: the test ran no engine
                tracked.loads = tally
        if call.excinfo is not None:
            self._attribute(item, tracked, report, call.excinfo.value)
        data = tracked.plain()
        info = self.connectors.get(tracked.connector or "")
        if info is not None:
            data["connector_info"] = info.plain()
        setattr(report, REPORT_ATTR, data)

    def _attribute(self, item: pytest.Item, tracked: _Tracked, report: pytest.TestReport,
                   error: BaseException) -> None:
        ours = harness_error(error)
        if ours is not None:  # kvspec's own failure: no clause of the connector's is blamed
            text = (f"kvspec error (kvspec's own harness or engine adapter failed; this is "
                    f"not the connector's fault): {ours}")
            tracked.kvspec_error = text
            crash = getattr(report.longrepr, "reprcrash", None)
            if crash is not None:
                crash.message = text
            return
        exc = find_violation(error)
        if exc is None:
            return
        clause = (exc.clause or "?").upper()
        tracked.broken = clause
        item.user_properties.append(("kvspec_broken_clause", clause))  # JUnit: teardown
        if clause not in tracked.clauses:
            tracked.clauses.append(clause)
        info = self.connectors.get(tracked.connector or "")
        name = info.name if info is not None else (tracked.connector or "the code under test")
        text = format_violation(exc, name)
        tracked.violation = text
        longrepr: Any = report.longrepr
        crash = getattr(longrepr, "reprcrash", None)
        if crash is not None:
            crash.message = text
        if hasattr(longrepr, "addsection"):
            longrepr.addsection("kvspec contract violation", text)

    def _tracked_for(self, report: pytest.TestReport) -> _Tracked | None:
        """The tracked test of a report; on the xdist controller, made from the report."""
        data = getattr(report, REPORT_ATTR, None)
        t = self.tracked.get(report.nodeid)
        if not isinstance(data, dict):
            return t
        if t is None:
            t = self.tracked[report.nodeid] = _Tracked(report.nodeid, None, None, [])
        t.absorb(data)
        info = data.get("connector_info")
        if isinstance(info, dict) and info.get("spec") not in self.connectors:
            self.connectors[str(info["spec"])] = ConnectorInfo.from_plain(info)
        return t

    def fold(self, report: pytest.TestReport) -> None:
        """Fold one phase's report into the test's outcome."""
        t = self._tracked_for(report)
        if t is None:
            return
        t.duration += report.duration
        if t.outcome in ("fail", "error"):
            return
        if report.failed and t.kvspec_error:
            t.outcome, t.message = "error", t.kvspec_error
        elif report.failed:
            t.outcome = "fail"
            t.strict_xpass = str(report.longrepr).startswith("[XPASS(strict)]")
            t.message = (
                str(report.longrepr) if t.strict_xpass else t.violation or _crash_message(report)
            )
        elif report.skipped:
            if hasattr(report, "wasxfail"):
                t.outcome = "xfail"
                t.message = t.violation or report.wasxfail or "expected failure"
            else:
                t.outcome = "skip"
                t.message = _skip_reason(report)
        elif report.when == "call":
            t.outcome = "pass"
            t.message = f"XPASS {report.wasxfail}" if hasattr(report, "wasxfail") else ""

    # -- results ---------------------------------------------------------------------------------

    def done(self) -> list[_Tracked]:
        """The tracked tests that produced an outcome, in run order."""
        return [t for t in self.tracked.values() if t.outcome is not None]

    def clause_table(self) -> dict[str, dict[str, Any]]:
        """Per clause touched: outcome counts, level and title, sorted by clause ID.

        A test that failed with a ContractViolation fails only the clause it names; its other
        clauses were not fully checked and are not counted (a KVSpecError naming a clause
        and a hook's crash, ERR-010, are turned into one, see ``find_violation``). A
        failure that names no clause fails every clause the test is tagged with.
        """
        from ...spec import get_clause

        table: dict[str, dict[str, Any]] = {}
        for t in self.done():
            counted = [t.broken] if t.outcome in ("fail", "xfail") and t.broken else t.clauses
            for cid in counted:
                row = table.get(cid)
                if row is None:
                    try:
                        clause = get_clause(cid)
                        level, title = clause.level.value, clause.title
                    except (KeyError, TypeError):
                        level, title = "?", "not a clause of this spec"
                    row = table[cid] = {o: 0 for o in OUTCOMES} | {"level": level, "title": title}
                row[str(t.outcome)] += 1
        return dict(sorted(table.items()))

    def build_report(self, exitstatus: int) -> dict[str, Any]:
        """The JSON report of the run."""
        done = self.done()
        used = list(dict.fromkeys(
            self.specs + [t.connector for t in done if t.connector is not None]
        ))
        return {
            "kvspec_version": kvspec_version(),
            "spec_version": _spec_version(),
            "profile": self.config.getoption("kvspec_profile", "default"),
            "exit_code": int(exitstatus),
            "connectors": [
                {"spec": s, "name": self.connectors[s].name,
                 "capabilities": self.connectors[s].describe()}
                for s in used if s in self.connectors
            ],
            "tests": [
                {"nodeid": t.nodeid, "key": t.key, "outcome": t.outcome, "clauses": t.clauses,
                 "connector": t.connector, "duration": round(t.duration, 6),
                 "message": t.message, "loads": t.loads}
                for t in done
            ],
            "clauses": self.clause_table(),
        }

    def write_outputs(self, exitstatus: int) -> None:
        """Write the JSON report and the expected-failures file, if asked (not on a worker)."""
        if self.worker:
            return
        report_path = self.config.getoption("kvspec_report", None)
        write_path = self.config.getoption("kvspec_write_xfail", None)
        if not (self.done() or self.specs or report_path or write_path):
            return
        self.report = self.build_report(int(exitstatus))
        if report_path:
            path = Path(report_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.report, indent=2) + "\n", encoding="utf-8")
            temporary = {
                getattr(p, "kvspec_temporary_report", None)
                for p in self.config.pluginmanager.get_plugins()
            }
            if str(report_path) not in temporary:
                self.notes.append(f"kvspec: wrote the JSON report to {path}")
        if write_path:
            keys = [
                t.key for t in self.done() if t.key is not None and (
                    (t.outcome == "fail" and not t.strict_xpass)
                    or (t.outcome == "xfail" and t.listed)
                )
            ]
            write_xfail_file(write_path, keys, header=(
                "kvspec expected failures: one test key per line (written by "
                "--kvspec-write-xfail)",
                f"kvspec {kvspec_version()}, spec {_spec_version()}",
            ))
            self.notes.append(f"kvspec: wrote {len(set(keys))} expected failures to {write_path}")

    def write_summary(self, terminalreporter: Any) -> None:
        """Print the connectors and the per-clause table (pytest's terminal summary)."""
        done = self.done()
        if self.worker or (not done and not self.notes):
            return
        tr = terminalreporter
        tr.write_sep("=", "kvspec conformance")
        if done:
            used = list(dict.fromkeys(t.connector for t in done if t.connector is not None))
            for label in used:
                if label in self.connectors:
                    tr.write_line(self.connectors[label].header())
            table = self.clause_table()
            totals = {o: sum(1 for t in done if t.outcome == o) for o in OUTCOMES}
            tr.write_line(
                f"{'clause':<9} {'level':<7}" + "".join(f"{o:>6}" for o in OUTCOMES) + "  title"
            )
            for cid, row in table.items():
                counts = "".join(f"{row[o]:>6}" for o in OUTCOMES)
                line = f"{cid:<9} {row['level']:<7}{counts}  {row['title']}"
                tr.write_line(line, red=row["fail"] > 0)
            tr.write_line(
                f"{'total':<9} {'tests':<7}" + "".join(f"{totals[o]:>6}" for o in OUTCOMES)
                + f"  {len(done)} tests, {len(table)} clauses"
            )
            for label in used:  # the time each connector took, its tests' set-up to tear-down
                mine = [t for t in done if t.connector == label]
                tr.write_line(f"time     {label}: {len(mine)} tests in "
                              f"{sum(t.duration for t in mine):.1f} s")
        for note in self.notes:
            tr.write_line(note)

