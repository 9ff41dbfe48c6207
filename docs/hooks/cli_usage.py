"""mkdocs hook: write the command-line reference's usage lines from the argument parser.

On ``reference/cli.md``, the first ```` ```text ```` usage block of each ``## `kvspec ...` ``
section is replaced (or, where there is none, put under the heading), at build time, by
that command's usage as ``kvspec.cli.build_parser``'s parser prints it (92 columns), and
``<!-- cli:commands -->`` by the list of subcommands: the page
cannot drift from the parser. The option tables are checked against the parser by
``tests/docs/test_cli_reference.py``.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

_HEADING = re.compile(r"## `(kvspec[\w -]*)`\n")
_USAGE = re.compile(r"```text\nusage:.*?```", re.S)


def usages() -> dict[str, str]:
    """Per command (``"kvspec bench offload"``), its usage text at 92 columns."""
    from kvspec.cli import build_parser

    os.environ["COLUMNS"] = "92"  # argparse wraps to the terminal width
    out: dict[str, str] = {}

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        out[name] = parser.format_usage().strip()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, subparser in action.choices.items():
                    walk(f"{name} {sub}", subparser)

    walk("kvspec", build_parser())
    return out


def render(markdown: str) -> str:
    """``markdown`` with every usage block and the command list generated."""
    found = usages()
    top = [c.split()[1] for c in found if c.count(" ") == 1]
    markdown = markdown.replace(
        "<!-- cli:commands -->", ", ".join(f"`{c}`" for c in top))

    parts = re.split(r"(?m)^(?=## `kvspec)", markdown)
    for i, part in enumerate(parts):
        m = _HEADING.match(part)
        usage = found.get(m.group(1)) if m else None
        if usage is None or m is None:
            continue
        text = f"```text\n{usage}\n```"
        if _USAGE.search(part):
            parts[i] = _USAGE.sub(lambda _: text, part, count=1)
        else:  # a section without one gets it right under its heading
            parts[i] = f"{part[:m.end()]}\n{text}\n{part[m.end():]}"
    return "".join(parts)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Generate the usage lines of the command-line reference."""
    if page.file.src_uri != "reference/cli.md":
        return markdown
    return render(markdown)
