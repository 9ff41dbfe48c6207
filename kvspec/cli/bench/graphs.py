"""``kvspec bench graphs``: one step under FULL graphs with capturable hooks against
PIECEWISE graphs and eager."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ... import __version__
from .._args import device, heads, positive_int
from .._output import dump_json

if TYPE_CHECKING:
    from .._args import Commands

__all__ = ["register"]


def register(commands: Commands) -> None:
    """Add ``kvspec bench graphs`` and its options."""
    gr = commands.add_parser(
        "graphs", help="one step under FULL graphs with capturable hooks vs PIECEWISE",
        description="Time one padding step of the harness's toy model with the "
                    "capturable-hooks offload backend (offload-layerwise) under FULL graphs "
                    "(hooks captured), PIECEWISE graphs (hooks and attention eager between "
                    "captured pieces: what an engine must do for eager hooks) and eagerly, "
                    "interleaved, medians; prints piecewise/full. Meaningful on cuda; on cpu "
                    "the graphs are the emulator's.",
    )
    gr.add_argument("--device", type=device, default="cpu", metavar="DEVICE",
                    help="cpu (default; emulated graphs) or cuda[:N]")
    gr.add_argument("--layers", type=positive_int, default=32, metavar="N",
                    help="layers (default 32)")
    gr.add_argument("--heads", type=heads, default=[(8, 128)], metavar="HxD",
                    help="KV heads x head size (default 8x128)")
    gr.add_argument("--tokens", type=positive_int, default=256, metavar="N",
                    help="tokens of the step, the captured size (default 256)")
    gr.add_argument("--blocks", type=positive_int, default=256, metavar="N",
                    help="KV blocks of 16 tokens (default 256)")
    gr.add_argument("--repeats", type=positive_int, default=50, metavar="N",
                    help="timed rounds (default 50)")
    gr.add_argument("--json", action="store_true", help="print the result as JSON")
    gr.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Measure the three modes; print the result."""
    import torch

    from ...bench.graphs import run_graphs_bench

    if args.device != "cpu" and not torch.cuda.is_available():
        print(f"kvspec bench graphs: --device {args.device}: CUDA is not available on this "
              "machine", file=sys.stderr)
        return 2
    if len(args.heads) != 1:
        print("kvspec bench graphs: --heads takes one HxD", file=sys.stderr)
        return 2
    (heads_, head_size), = args.heads
    if args.tokens > args.blocks * 16:
        print(f"kvspec bench graphs: --tokens {args.tokens} does not fit --blocks "
              f"{args.blocks} of 16 tokens", file=sys.stderr)
        return 2
    result = run_graphs_bench(device=args.device, layers=args.layers, heads=heads_,
                              head_size=head_size, tokens=args.tokens, blocks=args.blocks,
                              repeats=args.repeats)
    if args.json:
        return dump_json({"kvspec_version": __version__, "result": result.as_dict()})
    if args.device != "cpu":
        print(f"device: {torch.cuda.get_device_name(args.device)}, torch {torch.__version__}")
    print("\n".join(result.lines()))
    return 0
