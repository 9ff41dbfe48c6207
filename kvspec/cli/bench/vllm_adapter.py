"""``kvspec bench vllm-adapter``: what the vLLM adapter adds to one engine step, measured
on real vLLM objects (``kvspec.bench.vllm_adapter``); runs under the vLLM environment."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from .._args import positive_int
from .._output import dump_json
from .._vllm_env import rerun_under_vllm

if TYPE_CHECKING:
    from .._args import Commands

__all__ = ["register"]


def register(commands: Commands) -> None:
    """Add ``kvspec bench vllm-adapter`` and its options."""
    va = commands.add_parser(
        "vllm-adapter", help="the vLLM adapter's translation work per engine step",
        description="Time what kvspec.vllm adds to one vLLM engine step that touches N KV "
                    "blocks, on real vLLM objects: request, block and scheduler-output "
                    "views, the step metadata's wrapping, the output translation. Runs under "
                    "the vLLM environment ($KVSPEC_VLLM_PYTHON or .venv-vllm).",
    )
    va.add_argument("--blocks", type=positive_int, default=256, metavar="N",
                    help="KV blocks the step touches (default 256)")
    va.add_argument("--running", type=positive_int, default=32, metavar="N",
                    help="decoding requests in the step (default 32)")
    va.add_argument("--repeats", type=positive_int, default=200, metavar="N",
                    help="timed runs per part (default 200)")
    va.add_argument("--json", action="store_true", help="print the results as JSON")
    va.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Measure (under the vLLM environment) and print each part's time."""
    rerun = rerun_under_vllm("bench vllm-adapter", args, timeout_s=600, required=True)
    if rerun is not None:
        return rerun
    from ...bench.vllm_adapter import measure

    r = measure(args.blocks, running=args.running, repeats=args.repeats)
    if args.json:
        return dump_json(r)
    print(f"kvspec bench vllm-adapter: vLLM {r['vllm']}; one step touching "
          f"{r['blocks']} blocks of {r['block_size']} tokens (one {r['blocks']}-block prompt) "
          f"and {r['running']} decoding requests; medians of {r['repeats']} runs")
    width = max(map(len, r["parts_us"]))
    for name, us in r["parts_us"].items():
        print(f"  {name:<{width}}  {us:8.1f} us")
    print(f"  {'adapter work per step (request already seen)':<{width}}  "
          f"{r['per_step_us']:8.1f} us")
    print(f"  {'adapter work per step (request new this step)':<{width}}  "
          f"{r['per_step_us_with_new_request']:8.1f} us")
    print(f"  (for scale, vLLM's own NewRequestData and get_block_ids for that request: "
          f"{r['vllm_own_us']:.1f} us)")
    return 0
