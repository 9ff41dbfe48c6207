"""``kvspec conform [SPEC ...]``: the conformance suite against connector factories (by
default the project's own); exits with pytest's exit code. Arguments after ``--`` go to
pytest; ``vllm:`` connectors run under the vLLM environment, ``hicache:`` storage backends of
SGLang under the SGLang environment."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..protocols.errors import InvalidArgumentError, TransferTimeoutError
from ._args import device
from ._output import unwritable
from ._sglang_env import rerun_under_sglang
from ._vllm_env import rerun_under_vllm

if TYPE_CHECKING:
    from ._args import Commands

__all__ = ["register"]


def register(commands: Commands) -> None:
    """Add ``kvspec conform`` and its options."""
    c = commands.add_parser(
        "conform", help="run the conformance suite against connector factories",
        description="Run the kvspec conformance suite against each connector factory "
                    "(pkg.module:Factory); with none, against the project's own connectors. "
                    "Arguments after -- are passed to pytest. Exits with pytest's exit code.",
    )
    c.add_argument("specs", nargs="*", metavar="SPEC",
                   help="connector factory import path, pkg.module:Factory (repeatable); or an "
                        "SGLang HiCache storage backend, hicache:NAME or hicache:pkg.module:Class")
    c.add_argument("--profile", choices=["default", "full"], default="default",
                   help="'full' runs ten times the hypothesis examples")
    c.add_argument("--report", metavar="PATH",
                   help="write the JSON report to PATH ('-': to stdout, as --json)")
    c.add_argument("--json", action="store_true",
                   help="print the JSON report on stdout (pytest's output goes to stderr)")
    c.add_argument("--xfail", metavar="PATH", help="expected-failures file")
    c.add_argument("--write-xfail", metavar="PATH",
                   help="write the keys of the failing tests to PATH")
    c.add_argument("--extra", metavar="KEY=VALUE", action="append", default=[],
                   help="the connector's own configuration (vLLM's kv_connector_extra_config): "
                        "VALUE is JSON when it parses, else a string (repeatable)")
    c.add_argument("--extra-file", metavar="PATH", action="append", default=[],
                   help="the connector's configuration as a JSON object, or TOML (.toml)")
    c.add_argument("--device", type=device, default="cpu", metavar="DEVICE",
                   help="where the harness runs the KV caches and forwards: cpu (default; "
                   "graphs emulated) or cuda[:N] (real CUDA graphs); sets $KVSPEC_DEVICE")
    c.add_argument("--page", metavar="PATH",
                   help="hicache: backends only: keep each backend's run beside PATH "
                        "(PATH-data/NAME.json, PATH without .md) and write the results page "
                        "of every kept run to PATH (docs/sglang-backends.md); exits 1 if a "
                        "failure has no explanation")
    c.add_argument("--service", metavar="CMD",
                   help="start CMD (a service the connector needs) before the engines and "
                        "stop it after")
    c.add_argument("--service-wait", metavar="HOST:PORT",
                   help="wait until the service accepts connections on HOST:PORT")
    c.add_argument("--service-timeout", metavar="S", type=float, default=60.0,
                   help="the longest wait for the service (default 60)")
    c.set_defaults(func=run, pytest_args=[])


def run(args: argparse.Namespace) -> int:
    """Run the suite; pytest's exit code, or 2 for a bad command line."""
    # Like ``python -m``: connector modules in the current directory are importable.
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    refused = _refuse_or_configure(args)
    if refused is not None:
        return refused
    hicache = [s for s in args.specs if s.startswith("hicache:")]
    if hicache:
        return _run_hicache(args, hicache)
    if args.page:
        print("kvspec conform: --page writes the page of hicache: backends; connectors' pages "
              "come from kvspec vllm-connectors", file=sys.stderr)
        return 2
    if any(s.startswith("vllm:") for s in args.specs):
        rerun = rerun_under_vllm("conform", args, timeout_s=5400, announce=True)
        if rerun is not None:
            return rerun
    return _run_suite(args)


def _refuse_or_configure(args: argparse.Namespace) -> int | None:
    """2 (said on stderr) for a bad command line; else set the environment every engine
    reads (the connector's configuration, the device) and return None."""
    if any(not s.strip() for s in args.specs):
        print("kvspec conform: an empty connector spec; expected 'pkg.module:Factory'",
              file=sys.stderr)
        return 2
    try:
        extra = _parse_extra(args.extra, args.extra_file)
    except InvalidArgumentError as e:
        print(f"kvspec conform: {e}", file=sys.stderr)
        return 2
    if extra:  # every engine, worker processes included, reads it from the environment
        from ..conformance.harness.config import EXTRA_ENV

        os.environ[EXTRA_ENV] = json.dumps(extra)
    if args.device != "cpu":  # like the extra: every engine reads it from the environment
        from ..conformance.suite._harness_runs import DEVICE_ENV

        os.environ[DEVICE_ENV] = args.device
    for flag, path in (("--report", _report_path(args)), ("--write-xfail", args.write_xfail)):
        if path and unwritable(flag, path):
            return 2
    return None


def _report_path(args: argparse.Namespace) -> str | None:
    path: str | None = None if args.report == "-" else args.report
    return path


def _run_suite(args: argparse.Namespace) -> int:
    from ..conformance import DEFAULT_CONNECTORS, run_conformance

    as_json = args.json or args.report == "-"
    specs = list(args.specs) or list(DEFAULT_CONNECTORS)
    pytest_args = list(args.pytest_args)
    if args.write_xfail:
        pytest_args.append(f"--kvspec-write-xfail={args.write_xfail}")
    service: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if args.service:
        from .._service import running_service

        service = running_service(args.service, args.service_wait,
                                  timeout_s=args.service_timeout)
    # With --json, stdout holds the JSON report alone: pytest's output goes to stderr.
    try:
        with service, (contextlib.redirect_stdout(sys.stderr) if as_json
                       else contextlib.nullcontext()):
            result = run_conformance(
                specs, profile=args.profile, report_path=_report_path(args),
                xfail_path=args.xfail, extra_pytest_args=pytest_args, progress=sys.stderr,
            )
    except (InvalidArgumentError, TransferTimeoutError) as e:  # the service did not start
        print(f"kvspec conform: {e}", file=sys.stderr)
        return 2
    if as_json:
        json.dump(dict(result.report), sys.stdout, indent=2, default=_plain_json)
        sys.stdout.write("\n")
    return result.exit_code


def _run_hicache(args: argparse.Namespace, specs: Sequence[str]) -> int:
    """The HiCache storage suite (kvspec.sglang) on each ``hicache:`` backend, one pytest
    session each, under the SGLang environment; the worst exit code. ``--report`` and
    ``--json`` give one report of every backend (each test's ``connector`` is
    ``hicache:NAME``); ``--page`` keeps each run and rewrites the results page."""
    if len(specs) != len(args.specs):
        print("kvspec conform: hicache: backends and connectors run in separate commands",
              file=sys.stderr)
        return 2
    if args.page and unwritable("--page", args.page):
        return 2
    rerun = rerun_under_sglang("conform", args, timeout_s=1800)
    if rerun is not None:
        return rerun
    from ..sglang import parse_target
    from ..sglang._loader import check_available

    targets = [spec.removeprefix("hicache:") for spec in specs]
    for target in targets:
        try:  # the suite's directories are under pytest's, in the temporary directory
            check_available(parse_target(target), _parse_extra(args.extra, args.extra_file),
                            Path(tempfile.gettempdir()))
        except (InvalidArgumentError, ImportError) as e:  # ImportError: BackendUnavailableError
            print(f"kvspec conform: {e}", file=sys.stderr)
            return 2
    as_json = args.json or args.report == "-"
    code, reports, runs = 0, [], []
    for target in targets:
        run, rc = _run_one_backend(args, target, quiet=as_json)
        code = max(code, rc)
        runs.append(run)
        if run.report is not None:
            reports.append((target, run.report))
    from ..sglang.report import merge_reports

    merged = merge_reports(reports)
    path = _report_path(args)
    if path and merged:
        Path(path).write_text(json.dumps(merged, indent=2, default=_plain_json) + "\n")
    if as_json:
        json.dump(merged, sys.stdout, indent=2, default=_plain_json)
        sys.stdout.write("\n")
    if args.page:
        code = max(code, _write_page(args.page, runs))
    return code


def _run_one_backend(args: argparse.Namespace, target: str, *, quiet: bool) -> tuple[Any, int]:
    """One pytest session of the suite on ``target``: its ``BackendRun`` and exit code (2,
    and a run that did not happen, for ``nixl`` without the nixl package)."""
    import importlib.util
    import time

    import pytest

    from ..sglang import HICACHE_EXTRA_ENV, HICACHE_TARGET_ENV
    from ..sglang.report import BackendRun, environment_versions

    if target == "nixl" and importlib.util.find_spec("nixl") is None:
        reason = ("the nixl package is not installed in this SGLang environment (SGLang's "
                  "nixl backend imports it; pip install nixl==1.5.1 there)")
        print(f"kvspec conform: hicache:nixl: {reason}", file=sys.stderr)
        return BackendRun(target, None, 0.0, reason, versions=environment_versions()), (
            0 if args.page else 2)
    suite = Path(__file__).resolve().parents[1] / "sglang" / "_cli_suite.py"
    os.environ[HICACHE_TARGET_ENV] = target
    os.environ[HICACHE_EXTRA_ENV] = json.dumps(_parse_extra(args.extra, args.extra_file))
    sys.modules.pop("kvspec.sglang._cli_suite", None)  # it reads the target at import
    with tempfile.TemporaryDirectory(prefix="kvspec-hicache-") as tmp:
        out = Path(tmp) / "report.json"
        argv = [str(suite), "-p", "no:cacheprovider", "-q", *args.pytest_args,
                f"--kvspec-report={out}"]
        start = time.monotonic()
        with contextlib.redirect_stdout(sys.stderr) if quiet else contextlib.nullcontext():
            rc = int(pytest.main(argv))
        seconds = time.monotonic() - start
        report = json.loads(out.read_text()) if out.exists() else None
    why = None if report is not None else f"pytest ended with exit code {rc} and no report"
    return BackendRun(target, report, seconds, why, versions=environment_versions()), rc


def _write_page(page: str, runs: Sequence[Any]) -> int:
    """Keep ``runs`` beside ``page`` and render it from every kept run; 1 if a failure has
    no explanation (each is printed), else 0."""
    from ..sglang.report import load_runs, render_page, save_run, unexplained

    data = Path(page).with_suffix("")
    data = data.with_name(data.name + "-data")
    for run in runs:
        save_run(run, data)
    kept = load_runs(data)
    Path(page).write_text(render_page(kept, data_dir=_shown(data)))
    print(f"kvspec conform: wrote {page} ({len(kept)} kept runs in {_shown(data)})",
          file=sys.stderr)
    missing = unexplained(kept)
    for line in missing:
        print(f"kvspec conform: UNEXPLAINED failure {line}", file=sys.stderr)
    return 1 if missing else 0


def _shown(path: Path) -> str:
    """``path`` relative to the current directory where it is inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _parse_extra(pairs: Sequence[str], files: Sequence[str]) -> dict[str, Any]:
    """The connector configuration of ``--extra-file`` (JSON, or TOML by its .toml suffix)
    then ``--extra KEY=VALUE`` (VALUE as JSON when it parses, else as a string).

    Raises:
        InvalidArgumentError: a file that cannot be read or holds no object, a pair without
            ``=``, or a ``kvspec.`` key (the harness's own).
    """
    out: dict[str, Any] = {}
    for name in files:
        out.update(_extra_file(name))
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise InvalidArgumentError(f"--extra {pair!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = json.loads(raw)
        except ValueError:
            out[key.strip()] = raw
    if any(k.startswith("kvspec.") for k in out):
        raise InvalidArgumentError("--extra: 'kvspec.' keys are the harness's own")
    return out


def _extra_file(name: str) -> dict[str, Any]:
    path = Path(name)
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".toml":  # tomllib: Python 3.11 and newer
            import importlib

            value: Any = importlib.import_module("tomllib").loads(text)
        else:
            value = json.loads(text)
    except (OSError, ValueError, ImportError) as e:
        raise InvalidArgumentError(f"--extra-file {name}: {e}; expected a JSON object "
                                   "(or a TOML file ending in .toml)") from None
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"--extra-file {name} holds a {type(value).__name__}; "
                                   "expected an object of the connector's configuration")
    return value


def _plain_json(value: object) -> object:
    """The report's frozen mappings and tuples as JSON objects and arrays."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, (tuple, frozenset, set)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
