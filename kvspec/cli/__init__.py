"""The ``kvspec`` command line.

One module per command, each adding its own parser and options (``register``) and
printing its own report: ``kvspec spec`` (``kvspec.cli.spec``) prints the clause table and
counts and keeps the spec pages' clause blocks in sync; ``kvspec conform [SPEC ...]``
(``kvspec.cli.conform``) runs the conformance suite against connector factories and exits
with pytest's exit code, arguments after ``--`` going to pytest; ``kvspec bench NAME``
(``kvspec.cli.bench``) and ``kvspec demo NAME`` (``kvspec.cli.demo``) run the benchmarks
and demonstrations; ``kvspec vllm-connectors`` (``kvspec.cli.vllm_connectors``) certifies
vLLM's own connectors. ``main`` builds the parser from ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .. import __version__
from ..spec import SPEC_VERSION
from . import bench, conform, demo, spec, vllm_connectors

__all__ = ["COMMANDS", "build_parser", "main"]

COMMANDS = (spec, conform, bench, demo, vllm_connectors)
"""The command modules, in the order ``kvspec --help`` lists them; each has
``register(commands)``, which adds its parser with a ``func`` that runs it."""


def build_parser() -> argparse.ArgumentParser:
    """The ``kvspec`` argument parser, every command of ``COMMANDS`` registered."""
    p = argparse.ArgumentParser(prog="kvspec", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--version", action="version", version=f"kvspec {__version__} (spec {SPEC_VERSION})")
    commands = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(commands)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    parser = build_parser()
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
