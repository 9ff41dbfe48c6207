"""``kvspec demo NAME``: one module per demonstration, each adding its own parser and
printing its own report (the demonstrations themselves are ``kvspec.demo``'s)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import pd, vllm

if TYPE_CHECKING:
    from .._args import Commands

__all__ = ["DEMOS", "register"]

DEMOS = (pd, vllm)
"""The demonstration command modules, in the order ``kvspec demo --help`` lists them."""


def register(commands: Commands) -> None:
    """Add ``kvspec demo`` and each demonstration of ``DEMOS`` under it."""
    d = commands.add_parser("demo", help="run a reference backend end to end")
    demos = d.add_subparsers(dest="demo", required=True)
    for module in DEMOS:
        module.register(demos)
