"""The results page of SGLang's HiCache storage backends (docs/sglang-backends.md).

``kvspec conform hicache:NAME ... --page PATH`` runs the STO suite on each backend (one
pytest session each), keeps each run as ``<PATH without .md>-data/NAME.json`` beside the
page, and renders the page from every kept run: per backend, each check's outcome with its
clauses, and every failure under the finding (``FINDINGS``) that explains it. A failure no
finding explains is rendered as ``UNEXPLAINED`` and makes the command fail. This module
imports neither SGLang nor pytest.
"""

from __future__ import annotations

import datetime
import json
import platform
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ..protocols.errors import InvalidArgumentError

__all__ = ["BACKENDS", "FINDINGS", "BackendRun", "Finding", "environment_versions", "load_runs",
           "merge_reports", "render_page", "save_run", "unexplained"]

BACKENDS: Mapping[str, str] = {
    "file": "SGLang's built-in `file` backend (`HiCacheFile`): one file per page under "
            "`file_storage_path`, driven through the generic `batch_get` / `batch_set`, as "
            "SGLang's controller drives it.",
    "nixl": "SGLang's built-in `nixl` backend (`HiCacheNixl`, POSIX plugin), driven through "
            "the zero-copy `batch_get_v1` / `batch_set_v1`.",
    "kvspec": "kvspec's own backend (`kvspec.sglang.backend.KVSpecHiCacheStorage`), loaded "
              "as SGLang's `dynamic` option loads it, zero copy "
              "([how it works](sglang-hicache.md#kvspecs-backend-in-sglang)).",
}
"""The backends the page always lists, in its order, with what each is."""


@attrs.frozen
class Finding:
    """One known failure cause.

    Attributes:
        id: Its name on the page (``FILE-1``).
        backends: The targets it explains failures of.
        clause: The clause the failures break.
        tests: Names of the checks it explains (without parameters).
        title: One line.
        text: What happens, where in the backend's code, and what it costs.
    """

    id: str
    backends: tuple[str, ...]
    clause: str
    tests: tuple[str, ...]
    title: str
    text: str


FINDINGS: tuple[Finding, ...] = (
    Finding(
        "FILE-1", ("file",), "STO-003",
        ("test_damaged_object_reads_as_a_miss", "test_failed_load_reads_as_a_miss"),
        "`HiCacheFile.get` raises on an object it cannot read",
        "SGLang 0.5.23's `HiCacheFile.get` (`mem_cache/hicache_storage.py`, lines 846-868) "
        "catches only `FileNotFoundError`. A truncated or emptied page file makes its "
        "`readinto` come up short and it raises `IOError(\"Short read ...\")`; a file it "
        "cannot open (here: no file descriptor left) raises `OSError`. SGLang's controller "
        "logs the exception and counts the whole prefetch batch as missed, good pages "
        "before the bad one included (older controllers lost the prefetch thread). Fix: "
        "catch `OSError` in `get` and return `None`. "
        "[The interface, in detail](sglang-hicache.md#the-file-backend-hicachefile-hicache_storagepy-lines-728-1108)."),
    Finding(
        "NIXL-1", ("nixl",), "STO-007", ("test_rank_coordinates_never_alias",),
        "the NIXL backend's keys carry no pipeline or context-parallel rank",
        "SGLang 0.5.23's `HiCacheNixl` (`mem_cache/storage/nixl/hicache_nixl.py`, lines "
        "97-114) suffixes every key with `_{model}_{tp_rank}_{tp_size}` only. Pipeline "
        "stages hold different layers and attention-CP ranks different slices of a page, "
        "yet with `pp_size > 1` or `attn_cp_size > 1` their pages get the same object: a "
        "rank counts, and loads, another rank's shard. The `file` backend adds "
        "`_{pp_size}_{pp_rank}` and `_cp{rank}_{size}` (`hicache_storage.py` lines 749-757). "
        "Fix: the same suffix in `HiCacheNixl`."),
    Finding(
        "NIXL-2", ("nixl",), "STO-004", ("test_damaged_object_reads_as_a_miss",),
        "one damaged object makes the NIXL backend miss its whole batch",
        "SGLang 0.5.23's `HiCacheNixl._batch_xfer` (`hicache_nixl.py`, lines 753-781) moves a "
        "batch in one NIXL transfer and answers that transfer's single success for every "
        "page. With page 1 of 3 truncated (or emptied) on disk, page 0, stored and intact "
        "and counted by `batch_exists`, misses too: the controller loses every page of the "
        "batch (up to 128) for one bad object, where STO-003 asks that only the pages from "
        "the bad one on are lost. Fix: on a failed batch, transfer page by page, or check "
        "each object's size first."),
)
"""Every failure the page may show, explained."""


@attrs.frozen
class BackendRun:
    """One backend's run of the suite.

    Attributes:
        target: What followed ``hicache:`` (``file``, ``kvspec``, ``pkg.module:Class``).
        report: The run's JSON report (``--kvspec-report``), or None when it did not run.
        seconds: The wall time of its pytest session.
        reason: Why it did not run (None when it ran).
        date: The day it ran (ISO).
        versions: SGLang's, kvspec's and the platform's versions.
    """

    target: str
    report: Mapping[str, Any] | None
    seconds: float
    reason: str | None = None
    date: str = attrs.field(factory=lambda: datetime.date.today().isoformat())
    versions: Mapping[str, str] = attrs.field(factory=dict)

    def tests(self) -> list[Mapping[str, Any]]:
        """The report's tests (none when it did not run)."""
        return list(self.report.get("tests", [])) if self.report else []

    def plain(self) -> dict[str, Any]:
        """As JSON: the report's tests reduced to what the page shows."""
        tests = [{"test": _test_name(t["nodeid"]), "outcome": t["outcome"],
                  "clauses": list(t.get("clauses") or []), "message": _tidy(t.get("message") or ""),
                  "duration": round(float(t.get("duration") or 0.0), 2)} for t in self.tests()]
        return {"target": self.target, "seconds": round(self.seconds, 1), "reason": self.reason,
                "date": self.date, "versions": dict(self.versions),
                "tests": tests if self.report is not None else None}

    @classmethod
    def from_plain(cls, data: Mapping[str, Any]) -> BackendRun:
        """Read back what ``plain`` wrote."""
        tests = data.get("tests")
        report = None if tests is None else {"tests": [
            {"nodeid": t["test"], **{k: v for k, v in t.items() if k != "test"}} for t in tests]}
        return cls(data["target"], report, float(data["seconds"]), data.get("reason"),
                   data.get("date", ""), data.get("versions") or {})


def _test_name(nodeid: str) -> str:
    return nodeid.rsplit("::", 1)[-1]


_TMP = re.compile(r"/tmp/[^\s';,]*/")


def _tidy(message: str) -> str:
    """A failure message without the run's scratch directories."""
    return _TMP.sub(".../", message.replace("\n", " ")).strip()


def _broken(message: str) -> str:
    """The clause a failure message names (``clause STO-003 (...) broken by ...``)."""
    m = re.match(r"clause (\S+) ", message)
    return m.group(1) if m else ""


def _data_name(target: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", target) + ".json"


def save_run(run: BackendRun, data: Path) -> None:
    """Keep ``run`` as ``data/<target>.json``."""
    data.mkdir(parents=True, exist_ok=True)
    (data / _data_name(run.target)).write_text(json.dumps(run.plain(), indent=1) + "\n")


def load_runs(data: Path) -> list[BackendRun]:
    """Every run kept in ``data``.

    Raises:
        InvalidArgumentError: a kept run is not one ``save_run`` wrote.
    """
    runs = []
    for path in sorted(data.glob("*.json")) if data.is_dir() else []:
        try:
            runs.append(BackendRun.from_plain(json.loads(path.read_text())))
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgumentError(f"{path} is not a kept HiCache run: {e}") from None
    return runs


def _explain(target: str, test: Mapping[str, Any]) -> Finding | None:
    clause, name = _broken(test.get("message") or ""), _test_name(test["nodeid"]).split("[")[0]
    return next((f for f in FINDINGS if target in f.backends and f.clause == clause
                 and name in f.tests), None)


def unexplained(runs: Sequence[BackendRun]) -> list[str]:
    """``target: test`` of every failure (or error) no finding explains."""
    return [f"{run.target}: {_test_name(t['nodeid'])}" for run in runs for t in run.tests()
            if t["outcome"] in ("fail", "error") and _explain(run.target, t) is None]


def merge_reports(runs: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """One JSON report of several backends' (``(target, report)``): their tests, each with
    ``connector`` ``hicache:<target>``, and the clause table summed."""
    if not runs:
        return {}
    head = dict(runs[0][1])
    tests: list[dict[str, Any]] = []
    clauses: dict[str, dict[str, Any]] = {}
    for target, report in runs:
        tests += [{**t, "connector": f"hicache:{target}"} for t in report.get("tests", [])]
        for cid, row in (report.get("clauses") or {}).items():
            if cid not in clauses:
                clauses[cid] = dict(row)
                continue
            for k, v in row.items():
                if isinstance(v, int) and not isinstance(v, bool):
                    clauses[cid][k] = clauses[cid].get(k, 0) + v
    head.update(connectors=[{"spec": f"hicache:{t}", "name": t, "capabilities": {}} for t, _ in runs],
                tests=tests, clauses=dict(sorted(clauses.items())),
                exit_code=max(int(r.get("exit_code") or 0) for _, r in runs))
    return head


def _counts(run: BackendRun) -> dict[str, int]:
    out = {"pass": 0, "fail": 0, "skip": 0, "xfail": 0, "error": 0}
    for t in run.tests():
        out[t["outcome"]] = out.get(t["outcome"], 0) + 1
    return out


def _result(run: BackendRun) -> str:
    if run.report is None:
        return f"not run: {run.reason}"
    found = sorted({f.id for t in run.tests() if (f := _explain(run.target, t)) is not None})
    bad = [t for t in run.tests() if t["outcome"] in ("fail", "error")]
    if not bad:
        return "passes every check it ran"
    missing = len(bad) - sum(1 for t in bad if _explain(run.target, t) is not None)
    return (f"findings: {', '.join(found)}" if found else "") + (
        f"{'; ' if found else ''}{missing} UNEXPLAINED" if missing else "")


def render_page(runs: Sequence[BackendRun], *, data_dir: str = "docs/sglang-backends-data") -> str:
    """The Markdown page: a summary row per backend (``BACKENDS`` first, whether they ran
    or not, then any other kept run), a section per backend with every check's outcome and
    clauses, and its failures under their findings."""
    by_target = {r.target: r for r in runs}
    for name in BACKENDS:
        by_target.setdefault(name, BackendRun(name, None, 0.0, "no kept run", ""))
    order = [*BACKENDS, *sorted(t for t in by_target if t not in BACKENDS)]
    ran = [by_target[t] for t in order if by_target[t].report is not None]
    versions = ran[0].versions if ran else {}
    lines = [
        "# SGLang's HiCache storage backends under kvspec's suite", "",
        "<!-- Generated by `kvspec conform hicache:NAME ... --page docs/sglang-backends.md`; "
        "do not edit by hand. -->", "",
        f"Rendered from the runs kept in `{data_dir}/` ("
        + ", ".join(f"{k} {v}" for k, v in versions.items()) + "). Each backend ran as "
        "`kvspec conform hicache:NAME` in the environment `scripts/sglang_env.sh` builds: "
        "the [STO suite](sglang-hicache.md) creates it as SGLang's cache controller does, "
        "with SGLang's real CPU host pool, and each check names the [clauses](spec/sto.md) "
        "it checks; a failure names the one it broke. `kvspec conform hicache:NAME --page "
        "docs/sglang-backends.md` reruns one backend and rewrites this page; a failure no "
        "finding explains makes it fail.", "",
        "| backend | checks | passed | failed | skipped | xfailed | time | run on | result |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for target in order:
        run = by_target[target]
        if run.report is None:
            lines.append(f"| {target} | - | - | - | - | - | - | {run.date or '-'} | {_result(run)} |")
            continue
        c = _counts(run)
        lines.append(f"| {target} | {len(run.tests())} | {c['pass']} | {c['fail'] + c['error']} | "
                     f"{c['skip']} | {c['xfail']} | {run.seconds:.0f} s | {run.date} | {_result(run)} |")
    for target in order:
        lines += _section(by_target[target])
    return "\n".join(lines).rstrip() + "\n"


def _section(run: BackendRun) -> list[str]:
    lines = ["", f"## {run.target}", ""]
    if run.target in BACKENDS:
        lines += [BACKENDS[run.target], ""]
    if run.report is None:
        return [*lines, f"Not run: {run.reason}."]
    c = _counts(run)
    lines += [f"{c['pass']} passed, {c['fail'] + c['error']} failed, {c['skip']} skipped of "
              f"{len(run.tests())} checks in {run.seconds:.0f} s ({run.date}).", "",
              "| check | clauses | outcome | note |", "|---|---|---|---|"]
    for t in run.tests():
        outcome, note = t["outcome"], ""
        if outcome in ("fail", "error"):
            found = _explain(run.target, t)
            outcome = f"**{outcome}** ({_broken(t.get('message') or '') or '?'})"
            note = found.id if found else "UNEXPLAINED"
        elif outcome in ("skip", "xfail"):
            note = _tidy(t.get("message") or "").replace("|", "\\|")
        lines.append(f"| `{_test_name(t['nodeid'])}` | {', '.join(t.get('clauses') or [])} | "
                     f"{outcome} | {note} |")
    failed = [t for t in run.tests() if t["outcome"] in ("fail", "error")]
    if not failed:
        return lines
    lines += ["", "### Failures"]
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for t in failed:
        found = _explain(run.target, t)
        groups.setdefault(found.id if found else "UNEXPLAINED", []).append(t)
    for fid, tests in groups.items():
        finding = next((f for f in FINDINGS if f.id == fid), None)
        title = f"{fid}: {finding.title} ({finding.clause})" if finding else "UNEXPLAINED"
        lines += ["", f"#### {title}", ""]
        if finding:
            lines += [finding.text, ""]
        lines += [f"- `{_test_name(t['nodeid'])}`: {_tidy(t.get('message') or '')}" for t in tests]
    return lines


def environment_versions() -> dict[str, str]:
    """SGLang's, torch's and kvspec's versions and the platform, for a run's record."""
    from importlib import metadata

    out = {}
    for dist in ("sglang", "torch", "kvspec"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    out["platform"] = f"{platform.machine()} {platform.system()}"
    return out
