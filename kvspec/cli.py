"""The ``kvspec`` command line.

``kvspec spec`` prints the clause table and counts; ``kvspec spec --write-docs DIR`` renders
the clause blocks of the spec pages from the registry, ``--check-docs DIR`` fails if they are
stale. ``kvspec conform [SPEC ...]`` runs the conformance suite against connector factories
(by default the project's own) and exits with pytest's exit code; arguments after ``--`` go
to pytest. A later issue adds ``kvspec bench``.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from . import __version__
from .spec import CLAUSES, ENGINE_VERSIONS, SPEC_VERSION, Area, Level, counts

__all__ = ["main"]


def _spec(args: argparse.Namespace) -> int:
    if args.write_docs or args.check_docs:
        from .spec._render import sync_docs

        target = Path(args.write_docs or args.check_docs)
        if not target.is_dir():
            print(f"kvspec spec: {target} is not a directory (expected docs/spec)", file=sys.stderr)
            return 2
        changed = sync_docs(target, check=bool(args.check_docs))
        verb = "stale" if args.check_docs else "rewrote"
        for page in changed:
            print(f"{verb} {page}")
        if not changed:
            print(f"{target}: clause blocks match the registry ({len(CLAUSES)} clauses)")
        return 1 if (args.check_docs and changed) else 0

    areas = [Area[a.upper()] for a in args.area] if args.area else list(Area)
    levels = {Level[lv.upper()] for lv in args.level} if args.level else set(Level)
    selected = [c for c in CLAUSES if c.area in areas and c.level in levels]
    if args.json:
        json.dump(
            {
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
            },
            sys.stdout,
            indent=2,
        )
        print()
        return 0

    print(f"kvspec {__version__}, spec {SPEC_VERSION} (read from {ENGINE_VERSIONS[0]} to "
          f"{ENGINE_VERSIONS[-1].split()[-1]})")
    print()
    width = max(len(c.title) for c in selected) if selected else 10
    for c in selected:
        print(f"{c.id}  {c.level.value:<6}  {c.title:<{width}}")
        if args.verbose:
            for line in textwrap.wrap(c.rule, 88):
                print(f"{'':16}{line}")
    print()
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
    return 0


def _conform(args: argparse.Namespace) -> int:
    from .conformance import DEFAULT_CONNECTORS, run_conformance

    # Like ``python -m``: connector modules in the current directory are importable.
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    specs = list(args.specs) or list(DEFAULT_CONNECTORS)
    extra = list(args.pytest_args)
    if args.write_xfail:
        extra.append(f"--kvspec-write-xfail={args.write_xfail}")
    result = run_conformance(
        specs, profile=args.profile, report_path=args.report, xfail_path=args.xfail,
        extra_pytest_args=extra,
    )
    return result.exit_code


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvspec", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--version", action="version", version=f"kvspec {__version__} (spec {SPEC_VERSION})")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("spec", help="print the clause table and counts")
    s.add_argument("--area", action="append", choices=[a.name for a in Area] + [a.name.lower() for a in Area],
                   help="only this area (repeatable)")
    s.add_argument("--level", action="append", choices=["MUST", "SHOULD", "MAY", "must", "should", "may"],
                   help="only this level (repeatable)")
    s.add_argument("-v", "--verbose", action="store_true", help="print each clause's rule")
    s.add_argument("--json", action="store_true", help="print the clauses as JSON")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--write-docs", metavar="DIR", help="rewrite the clause blocks of DIR/<area>.md")
    g.add_argument("--check-docs", metavar="DIR", help="exit 1 if DIR's clause blocks are stale")
    s.set_defaults(func=_spec)
    c = sub.add_parser(
        "conform", help="run the conformance suite against connector factories",
        description="Run the kvspec conformance suite against each connector factory "
                    "(pkg.module:Factory); with none, against the project's own connectors. "
                    "Arguments after -- are passed to pytest. Exits with pytest's exit code.",
    )
    c.add_argument("specs", nargs="*", metavar="SPEC",
                   help="connector factory import path, pkg.module:Factory (repeatable)")
    c.add_argument("--profile", choices=["default", "full"], default="default",
                   help="'full' runs ten times the hypothesis examples")
    c.add_argument("--report", metavar="PATH", help="write the JSON report to PATH")
    c.add_argument("--xfail", metavar="PATH", help="expected-failures file")
    c.add_argument("--write-xfail", metavar="PATH",
                   help="write the keys of the failing tests to PATH")
    c.set_defaults(func=_conform, pytest_args=[])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    parser = _parser()
    args = parser.parse_args(argv)
    if passthrough:
        if args.command != "conform":
            parser.error(f"arguments after -- are only for 'kvspec conform': {passthrough}")
        args.pytest_args = passthrough
    result: int = args.func(args)
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
