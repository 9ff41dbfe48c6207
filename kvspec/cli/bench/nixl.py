"""``kvspec bench nixl``: the NIXL backend's transfers against raw NIXL and a memory copy,
and the heterogeneous-TP hand-off."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ... import __version__
from .._args import positive_int
from .._output import cannot_chart, dump_json, write

if TYPE_CHECKING:
    from ...bench.nixl import NixlResult
    from ...bench.nixl_tp import TpResult
    from .._args import Commands

__all__ = ["register"]


def register(commands: Commands) -> None:
    """Add ``kvspec bench nixl`` and its options."""
    n = commands.add_parser(
        "nixl", help="NIXL backend transfers vs raw NIXL and a memory copy",
        description="Time the NIXL backend's READs end to end (load request to finished "
                    "report) against one raw prepared NIXL READ of the same bytes and a "
                    "same-run memcpy, for block- and layer-outermost layouts, with the "
                    "descriptors per transfer and the control-plane work per step.",
    )
    n.add_argument("--quick", action="store_true",
                   help="32 blocks of 4 layers, 3 runs (a smoke run)")
    n.add_argument("--blocks", type=positive_int, metavar="N",
                   help="blocks per transfer (default 256)")
    n.add_argument("--layers", type=positive_int, metavar="N", help="layers (default 32)")
    n.add_argument("--repeats", type=positive_int, metavar="N", help="timed runs (default 9)")
    n.add_argument("--json", action="store_true", help="print the results as JSON")
    n.add_argument("--svg", metavar="PATH", help="also write a chart of the ratios to PATH")
    n.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Measure the layouts and the TP hand-offs; print them (and chart them)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO lines to stdout
    from ...bench.nixl import NixlPoint, check_nixl_targets, default_points, machine_info, run_nixl_bench

    if cannot_chart(args.svg):
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
    tp_results = _measure_tp(quick=args.quick, repeats=repeats)
    if args.svg:
        _chart(args.svg, results)
    if args.json:
        return dump_json({"kvspec_version": __version__, "machine": machine_info(),
                          "results": [r.as_dict() for r in results], "targets": targets,
                          "tp": [r.as_dict() for r in tp_results]})
    _print_text(repeats, results, targets, tp_results)
    return 0


def _measure_tp(*, quick: bool, repeats: int) -> list[TpResult]:
    from ...bench.nixl_tp import default_tp_points, measure_tp_point

    tp_points = default_tp_points(32, 2) if quick else default_tp_points()
    tp_results = []
    for i, tp_point in enumerate(tp_points):
        print(f"[TP {i + 1}/{len(tp_points)}] {tp_point.order} at TP 1->1, 2->1, 1->2, "
              f"{tp_point.blocks} blocks x {tp_point.layers} layers", file=sys.stderr,
              flush=True)
        tp_results += measure_tp_point(tp_point, repeats=repeats, warmup=1 if quick else 2)
    return tp_results


def _chart(path: str, results: Sequence[NixlResult]) -> None:
    from ...bench._chart import bar_chart

    labels = [f"{r.point.order} {r.point.page_bytes // 1024} KiB pages" for r in results]
    write(path, bar_chart(
        "kvspec bench nixl: throughput / raw NIXL and / memcpy", labels,
        [("vs raw NIXL", [r.vs_raw for r in results]),
         ("vs memcpy", [r.vs_memcpy for r in results])],
        targets=[("0.9", 0.9)],
    ))


def _print_text(repeats: int, results: Sequence[NixlResult], targets: Sequence[str],
                tp_results: Sequence[TpResult]) -> None:
    from ...bench.nixl import format_nixl_table, machine_info
    from ...bench.nixl_tp import format_tp_table

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
