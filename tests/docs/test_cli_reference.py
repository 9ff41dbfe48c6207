"""docs/reference/cli.md documents exactly the options of the ``kvspec`` argument parser."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kvspec import __version__
from kvspec.cli import build_parser
from kvspec.spec import SPEC_VERSION

CLI_PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "cli.md"
_HEADING = re.compile(r"^## `(kvspec[\w -]*)`$")
_CELL_CODE = re.compile(r"`([^`]+)`")


def parser_options() -> dict[str, set[str]]:
    """Per command (``"kvspec conform"``), its option strings and positional names."""
    out: dict[str, set[str]] = {}

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        names: set[str] = set()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    walk(f"{name} {sub_name}", sub)
                continue
            if action.option_strings:
                if name != "kvspec" and "--help" in action.option_strings:
                    continue  # documented once, under `kvspec`
                names.update(action.option_strings)
            else:
                names.add(str(action.metavar or action.dest))
        # commands that only dispatch to subcommands have no page section of their own
        if names or name == "kvspec":
            out[name] = names

    walk("kvspec", build_parser())
    return out


def documented_options() -> dict[str, set[str]]:
    """Per ``## `kvspec ...` `` section of the page, the names in its tables' first column."""
    out: dict[str, set[str]] = {}
    section: str | None = None
    for line in CLI_PAGE.read_text(encoding="utf-8").splitlines():
        m = _HEADING.match(line)
        if m:
            section = m.group(1)
            out[section] = set()
            continue
        if section is None or not line.startswith("| `"):
            continue
        first_cell = line.split("|")[1]
        for code in _CELL_CODE.findall(first_cell):
            name = code.split()[0]
            if name != "--":  # "-- ARGS": what follows goes to pytest, not an option
                out[section].add(name)
    return out


def test_every_command_has_a_section() -> None:
    assert set(documented_options()) == set(parser_options())


@pytest.mark.parametrize("command", sorted(parser_options()))
def test_documented_options_match_the_parser(command: str) -> None:
    documented = documented_options().get(command, set())
    actual = parser_options()[command]
    assert documented == actual, (
        f"{command}: documented but not in the parser: {sorted(documented - actual)}; "
        f"in the parser but not documented: {sorted(actual - documented)}"
    )


def test_documented_version_string() -> None:
    text = CLI_PAGE.read_text(encoding="utf-8")
    assert f"`kvspec {__version__} (spec {SPEC_VERSION})`" in text


def test_usage_lines_are_generated_from_the_parser() -> None:
    """Issue 18, item 11: the page said 'three subcommands' and its usage line lacked
    ``demo``. The build hook writes every usage block and the subcommand list from the
    parser; the page's source holds the same text, so it reads true unbuilt too."""
    import importlib.util

    hook_path = CLI_PAGE.parents[1] / "hooks" / "cli_usage.py"
    spec = importlib.util.spec_from_file_location("cli_usage_hook", hook_path)
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    source = CLI_PAGE.read_text(encoding="utf-8")
    built = hook.render(source)
    usages = hook.usages()
    assert set(usages) >= {"kvspec", "kvspec conform", "kvspec demo pd", "kvspec bench vllm"}
    for command, usage in usages.items():
        if command in ("kvspec bench", "kvspec demo"):
            continue  # dispatchers: no section of their own
        assert f"```text\n{usage}\n```" in built, command
        assert f"```text\n{usage}\n```" in source, f"{command}: the page's usage is stale"
    assert "`spec`, `conform`, `bench`, `demo`" in built
