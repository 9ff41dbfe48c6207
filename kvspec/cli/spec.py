"""``kvspec spec``: the clause table and counts, as text or JSON; ``--write-docs DIR``
renders the clause blocks of the spec pages from the registry, ``--check-docs DIR`` fails
if they are stale."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .. import __version__
from ..spec import CLAUSES, ENGINE_VERSIONS, SPEC_VERSION, Area, Clause, Level, counts
from ._output import dump_json

if TYPE_CHECKING:
    from ._args import Commands

__all__ = ["register"]


def register(commands: Commands) -> None:
    """Add ``kvspec spec`` and its options."""
    s = commands.add_parser("spec", help="print the clause table and counts")
    s.add_argument("--area", action="append", choices=[a.name for a in Area] + [a.name.lower() for a in Area],
                   help="only this area (repeatable)")
    s.add_argument("--level", action="append", choices=["MUST", "SHOULD", "MAY", "must", "should", "may"],
                   help="only this level (repeatable)")
    s.add_argument("-v", "--verbose", action="store_true", help="print each clause's rule")
    s.add_argument("--json", action="store_true", help="print the clauses as JSON")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--write-docs", metavar="DIR", help="rewrite the clause blocks of DIR/<area>.md")
    g.add_argument("--check-docs", metavar="DIR", help="exit 1 if DIR's clause blocks are stale")
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the selected clauses (or sync the docs); the exit code."""
    if args.write_docs or args.check_docs:
        return _sync_docs(args.write_docs or args.check_docs, check=bool(args.check_docs))
    areas = [Area[a.upper()] for a in args.area] if args.area else list(Area)
    levels = {Level[lv.upper()] for lv in args.level} if args.level else set(Level)
    selected = [c for c in CLAUSES if c.area in areas and c.level in levels]
    if args.json:
        return dump_json({
            "kvspec_version": __version__,
            "spec_version": SPEC_VERSION,
            "clauses": [
                {
                    "id": c.id, "level": c.level.value, "area": c.area.name,
                    "title": c.title, "rule": c.rule, "rationale": c.rationale,
                    "sources": list(c.sources),
                }
                for c in selected
            ],
        })
    _print_clauses(selected, verbose=args.verbose)
    _print_counts(areas)
    return 0


def _sync_docs(directory: str, *, check: bool) -> int:
    from ..spec._render import sync_docs

    target = Path(directory)
    if not target.is_dir():
        print(f"kvspec spec: {target} is not a directory (expected docs/spec)", file=sys.stderr)
        return 2
    changed = sync_docs(target, check=check)
    verb = "stale" if check else "rewrote"
    for page in changed:
        print(f"{verb} {page}")
    if not changed:
        print(f"{target}: clause blocks match the registry ({len(CLAUSES)} clauses)")
    return 1 if (check and changed) else 0


def _print_clauses(selected: Sequence[Clause], *, verbose: bool) -> None:
    print(f"kvspec {__version__}, spec {SPEC_VERSION} (read from {ENGINE_VERSIONS[0]} to "
          f"{ENGINE_VERSIONS[-1].split()[-1]})")
    print()
    width = max(len(c.title) for c in selected) if selected else 10
    for c in selected:
        print(f"{c.id}  {c.level.value:<6}  {c.title:<{width}}")
        if verbose:
            for line in textwrap.wrap(c.rule, 88):
                print(f"{'':16}{line}")
    print()


def _print_counts(areas: Sequence[Area]) -> None:
    table = counts()
    print(f"{'area':<5} {'MUST':>5} {'SHOULD':>7} {'MAY':>4}  {'total':>5}  name")
    total = {lv: 0 for lv in Level}
    for area in areas:
        row = table[area]
        for lv in Level:
            total[lv] += row[lv]
        print(f"{area.name:<5} {row[Level.MUST]:>5} {row[Level.SHOULD]:>7} {row[Level.MAY]:>4}"
              f"  {sum(row.values()):>5}  {area.value}")
    print(f"{'all':<5} {total[Level.MUST]:>5} {total[Level.SHOULD]:>7} {total[Level.MAY]:>4}"
          f"  {sum(total.values()):>5}")
