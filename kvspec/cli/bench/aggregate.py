"""``kvspec bench aggregate``: kvspec's executor aggregator against vLLM's on one trace;
vLLM's arm runs where vLLM is (the command re-runs itself under the vLLM environment)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ... import __version__
from .._args import int_list, positive_int
from .._output import dump_json
from .._vllm_env import rerun_under_vllm

if TYPE_CHECKING:
    from .._args import Commands

__all__ = ["register"]


def register(commands: Commands) -> None:
    """Add ``kvspec bench aggregate`` and its options."""
    ag = commands.add_parser(
        "aggregate", help="kvspec's executor aggregator against vLLM's, on one trace",
        description="Aggregate one synthetic trace of per-rank finished reports with "
                    "kvspec's StandardAggregator (expect() registrations included) and "
                    "vLLM's KVOutputAggregator, runs interleaved, medians per step and the "
                    "kvspec/vLLM ratio. vLLM's arm needs the vLLM environment "
                    "($KVSPEC_VLLM_PYTHON or .venv-vllm): the command reruns itself there "
                    "when this interpreter has no vLLM; without one it measures kvspec only.",
    )
    ag.add_argument("--ranks", type=int_list, default=[1, 2, 8, 16], metavar="N,N",
                    help="world sizes (default 1,2,8,16)")
    ag.add_argument("--requests", type=int_list, default=[1000, 20000], metavar="N,N",
                    help="requests per trace, finishing 10 per step (default 1000,20000)")
    ag.add_argument("--repeats", type=positive_int, default=15, metavar="N",
                    help="timed runs per arm and point (default 15)")
    ag.add_argument("--json", action="store_true", help="print the results as JSON")
    ag.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Measure every (ranks, requests) point, arms interleaved; print the ratios."""
    rerun = rerun_under_vllm("bench aggregate", args, timeout_s=1800)
    if rerun is not None:
        return rerun
    from ...bench.aggregate import AggregatePoint, format_results, run_aggregate_bench

    points = [AggregatePoint(r, n) for n in args.requests for r in args.ranks]

    def progress(i: int, n: int, p: AggregatePoint) -> None:
        print(f"[{i + 1}/{n}] {p.ranks} ranks, {p.requests} requests", file=sys.stderr,
              flush=True)

    results = run_aggregate_bench(points, repeats=args.repeats, progress=progress)
    if args.json:
        return dump_json({"kvspec_version": __version__, "repeats": args.repeats,
                          "results": [r.as_dict() for r in results]}, indent=1)
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
