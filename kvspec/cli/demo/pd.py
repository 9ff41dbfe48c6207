"""``kvspec demo pd``: prefill/decode disaggregation over NIXL, two engines in two
processes (``kvspec.demo.pd``)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from .._args import orders, positive_int
from .._output import emit

if TYPE_CHECKING:
    from .._args import Commands

__all__ = ["register"]


def register(commands: Commands) -> None:
    """Add ``kvspec demo pd`` and its options."""
    pd = commands.add_parser(
        "pd", help="prefill/decode disaggregation over NIXL, two engines in two processes",
        description="A prefill engine and a decode engine, each in its own process, hand "
                    "requests off through the NIXL backend; every KV byte the decode model "
                    "reads is checked. Prints what moved and how fast.",
    )
    pd.add_argument("--requests", type=positive_int, default=8, metavar="N",
                    help="requests handed off (default 8)")
    pd.add_argument("--prompt-tokens", type=positive_int, default=257, metavar="N",
                    help="tokens per prompt (default 257)")
    pd.add_argument("--layers", type=positive_int, default=8, metavar="N",
                    help="layers (default 8)")
    pd.add_argument("--heads", type=positive_int, default=4, metavar="N",
                    help="KV heads (default 4)")
    pd.add_argument("--head-size", type=positive_int, default=64, metavar="N",
                    help="channels per head (default 64)")
    pd.add_argument("--order", type=orders, default=("BLNHC",), metavar="ORDER",
                    help="KV stride order (default BLNHC)")
    pd.add_argument("--prefill-tp", type=positive_int, default=1, metavar="N",
                    help="TP size of the prefill engine (default 1); must divide --heads")
    pd.add_argument("--decode-tp", type=positive_int, default=1, metavar="N",
                    help="TP size of the decode engine (default 1); must divide --heads")
    pd.add_argument("--json", action="store_true", help="print the report as JSON")
    pd.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the hand-offs; print the report. 1 unless every request finished."""
    from ...demo.pd import PDOptions, run_pd_demo

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
    emit(report, args.json)
    return 0 if report.finished == options.requests else 1
