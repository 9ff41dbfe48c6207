"""``kvspec bench offload``: the offload backend's store and load copies against a same-run
memory-copy ceiling (see docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ... import __version__
from .._args import DTYPE_NAMES, device, dtypes, heads, orders, positive_int, positive_ints
from .._output import cannot_chart, dump_json, write

if TYPE_CHECKING:
    from ...bench.offload import OffloadGrid, OffloadResult, StepOverhead, TargetCheck
    from .._args import Commands

__all__ = ["register"]


def register(commands: Commands) -> None:
    """Add ``kvspec bench offload`` and its options."""
    o = commands.add_parser(
        "offload", help="store/load throughput of the offload backend vs a memory-copy ceiling",
        description="Time the offload backend's store (KV caches -> host pool) and load "
                    "(host pool -> KV caches) copies over a grid, as ratios to a same-run "
                    "contiguous copy of the same bytes, and the per-step work outside the "
                    "copies. Lists are comma-separated; each axis defaults to the full grid, "
                    "or to the --quick grid.",
    )
    o.add_argument("--quick", action="store_true",
                   help="small preset grid (4 layers, 1x64 and 2x64, 32 blocks, 3 runs)")
    o.add_argument("--orders", type=orders, metavar="LIST",
                   help="stride orders, e.g. BLNHC,LBNHC (default), BLHNC,BHLNC,LBHNC,LHBNC")
    o.add_argument("--block-size", type=positive_ints, metavar="LIST",
                   help="tokens per block (default 16)")
    o.add_argument("--layers", type=positive_ints, metavar="LIST", help="layers (default 32)")
    o.add_argument("--heads", type=heads, metavar="LIST",
                   help="HEADSxSIZE pairs (default 1x64,8x128)")
    o.add_argument("--dtype", type=dtypes, metavar="LIST",
                   help=f"dtypes among {', '.join(DTYPE_NAMES)} (default bfloat16)")
    o.add_argument("--blocks", type=positive_ints, metavar="LIST",
                   help="blocks moved; the KV caches hold twice as many (default 256)")
    o.add_argument("--repeats", type=positive_int, metavar="N", help="timed runs (default 7)")
    o.add_argument("--warmup", type=int, choices=range(0, 100), metavar="N",
                   help="untimed runs first (default 2)")
    o.add_argument("--seed", type=int, default=0, help="seed of the block choice and bytes")
    o.add_argument("--device", type=device, default="cpu", metavar="DEVICE",
                   help="where the KV caches are: cpu (default) or cuda[:N]: the pool is "
                   "pinned and the ceilings are pinned copies each way (target 0.85)")
    o.add_argument("--overhead-blocks", type=positive_int, default=256, metavar="N",
                   help="blocks of the per-step overhead measurement (default 256)")
    o.add_argument("--overhead-repeats", type=positive_int, default=None, metavar="N",
                   help="timed runs of the per-step overhead measurement (default 51; "
                        "--quick: the grid's runs)")
    o.add_argument("--json", action="store_true", help="print the results as JSON")
    o.add_argument("--svg", metavar="PATH", help="also write a chart of the ratios to PATH")
    o.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Measure the grid and the per-step work; print them (and chart them)."""
    from ...bench.offload import (
        OVERHEAD_REPEATS,
        OffloadPoint,
        check_targets,
        measure_step_overhead,
        run_offload_bench,
    )

    if cannot_chart(args.svg):
        return 2
    grid = _grid(args)
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
        _chart(args.svg, results)
    if args.json:
        return _print_json(grid, overhead_repeats, results, overheads, checks)
    _print_text(args, grid, overhead_repeats, results, overheads, checks)
    return 0


def _grid(args: argparse.Namespace) -> OffloadGrid:
    from ...bench.offload import OffloadGrid

    base = OffloadGrid.quick() if args.quick else OffloadGrid()
    return OffloadGrid(
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


def _chart(path: str, results: Sequence[OffloadResult]) -> None:
    from ...bench._chart import bar_chart

    labels = [f"{r.point.order} {r.point.heads}x{r.point.head_size} {r.point.blocks} blk"
              for r in results]
    write(path, bar_chart(
        "kvspec bench offload: throughput / same-run copy", labels,
        [("store", [r.store_ratio for r in results]),
         ("load", [r.load_ratio for r in results])],
        targets=[("0.9", 0.9), ("0.7", 0.7)],
    ))


def _print_json(grid: OffloadGrid, overhead_repeats: int, results: Sequence[OffloadResult],
                overheads: Sequence[StepOverhead], checks: Sequence[TargetCheck]) -> int:
    from ...bench.offload import machine_info

    value: dict[str, Any] = {
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
    }
    return dump_json(value)


def _print_text(args: argparse.Namespace, grid: OffloadGrid, overhead_repeats: int,
                results: Sequence[OffloadResult], overheads: Sequence[StepOverhead],
                checks: Sequence[TargetCheck]) -> None:
    from ...bench.offload import format_table, machine_info

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
