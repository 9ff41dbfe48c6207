"""``kvspec vllm-connectors``: certify vLLM's own connectors and write their page
(``kvspec.vllm.certify.report``); runs under the vLLM environment."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ._output import unwritable
from ._vllm_env import rerun_under_vllm

if TYPE_CHECKING:
    from ._args import Commands

__all__ = ["register"]


def register(commands: Commands) -> None:
    """Add ``kvspec vllm-connectors`` and its options."""
    vc = commands.add_parser(
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
    vc.add_argument("--speculative", action="store_true",
                    help="run only the suite's speculative-decoding class (kvspec conform "
                         "vllm:NAME -- -k TestSpeculative) for the connectors named (default: "
                         "ExampleConnector NixlConnector); write "
                         "docs/vllm-connectors-speculative.md")
    vc.add_argument("--keep-reports", metavar="DIR",
                    help="also keep each connector's JSON conform report as DIR/NAME.json")
    vc.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Certify the connectors (under the vLLM environment) and write the page."""
    rerun = rerun_under_vllm("vllm-connectors", args, timeout_s=4 * 3600, required=True)
    if rerun is not None:
        return rerun
    if unwritable("--out", args.out):
        return 2
    from ..vllm.certify.report import main as certify

    argv = ["--out", args.out, *args.names]
    if args.render_only:
        argv.append("--render-only")
    if args.speculative:
        argv.append("--speculative")  # the page: docs/vllm-connectors-speculative.md
    if args.keep_reports:
        argv += ["--keep-reports", args.keep_reports]
    return certify(argv)
