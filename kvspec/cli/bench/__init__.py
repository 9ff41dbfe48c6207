"""``kvspec bench NAME``: one module per benchmark, each adding its own parser and
printing its own report (the measurements themselves are ``kvspec.bench``'s)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import aggregate, graphs, nixl, offload, vllm, vllm_adapter

if TYPE_CHECKING:
    from .._args import Commands

__all__ = ["BENCHMARKS", "register"]

BENCHMARKS = (offload, nixl, vllm_adapter, aggregate, graphs, vllm)
"""The benchmark command modules, in the order ``kvspec bench --help`` lists them."""


def register(commands: Commands) -> None:
    """Add ``kvspec bench`` and each benchmark of ``BENCHMARKS`` under it."""
    b = commands.add_parser("bench", help="run a benchmark")
    benchmarks = b.add_subparsers(dest="benchmark", required=True)
    for module in BENCHMARKS:
        module.register(benchmarks)
