"""The tutorial (docs/tutorial.md) runs as written: every file it shows, every command.

The page is read as a script:

* a fenced block with ``title="path"`` is a file: it is written (blocks with the same title
  are appended, in order) relative to the current directory; a line
  ``--8<-- "file:section"`` in it is that section of a file of the repository, as the
  ``pymdownx.snippets`` extension includes it in the site (the tutorial's connector is
  ``kvspec/conformance/connectors/tiny.py``);
* a ```` ```bash ```` block holds commands, one a line, run with bash in the current
  directory (``cd`` carries over to later commands); it must exit 0, or with N when the
  line before the block is ``<!-- tutorial: exit N -->``;
* a ```` ```text ```` block right after a command is an excerpt of its output: each line must
  appear in the output, in order; a line ``...`` stands for any lines, and a line ending
  with ``...`` matches any output line that contains the text before it.

The commands run in an empty temporary directory with this interpreter's ``bin`` directory
first on PATH, so ``python`` and ``pytest`` are the ones kvspec is installed in.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
TUTORIAL = DOCS / "tutorial.md"
TINY = ROOT / "kvspec" / "conformance" / "connectors" / "tiny.py"

_FENCE = re.compile(r"^```(\w*)(.*)$")
_TITLE = re.compile(r'title="([^"]+)"')
_EXIT = re.compile(r"^<!-- tutorial: exit (\d+) -->$")
_SNIPPET = re.compile(r'^--8<-- "([^":]+)(?::([\w-]+))?"$')
_SECTION = re.compile(r"--8<-- \[(start|end):([\w-]+)\]")


def snippet(path: str, section: str | None) -> list[str]:
    """The lines ``--8<-- "path:section"`` includes: the section's lines (the whole file
    without a section), section markers dropped, as ``pymdownx.snippets`` does."""
    lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
    if section is not None:
        marks = [(i, m.groups()) for i, line in enumerate(lines) if (m := _SECTION.search(line))]
        start = next(i for i, mark in marks if mark == ("start", section))
        end = next(i for i, mark in marks if mark == ("end", section))
        lines = lines[start + 1:end]
    return [line for line in lines if not _SECTION.search(line)]


def _expand(body: list[str]) -> list[str]:
    out: list[str] = []
    for line in body:
        m = _SNIPPET.match(line)
        out.extend(snippet(m.group(1), m.group(2)) if m else [line])
    return out


@attrs.frozen
class File:
    path: str
    text: str


@attrs.frozen
class Command:
    line: str
    exit_code: int = 0


@attrs.frozen
class Output:
    text: str


Step = File | Command | Output


def parse(markdown: str) -> list[Step]:
    """The tutorial's files, commands and output excerpts, in page order."""
    steps: list[Step] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        lang, info = m.group(1), m.group(2)
        body: list[str] = []
        i += 1
        while lines[i] != "```":
            body.append(lines[i])
            i += 1
        start = i - len(body) - 1
        previous = lines[start - 1].strip() if start > 0 else ""
        exit_match = _EXIT.match(previous)
        title = _TITLE.search(info)
        if title:
            body = _expand(body)
        text = "\n".join(body) + "\n"
        if title:
            steps.append(File(title.group(1), text))
        elif lang == "bash":
            for command in _commands(body):
                steps.append(Command(command, int(exit_match.group(1)) if exit_match else 0))
        elif lang == "text" and steps and isinstance(steps[-1], Command):
            steps.append(Output(text))
        i += 1
    return steps


def _commands(body: list[str]) -> list[str]:
    out: list[str] = []
    pending = ""
    for raw in body:
        line = raw.rstrip()
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    return out


def check_excerpt(excerpt: str, output: str) -> None:
    """Assert that the excerpt's lines appear in ``output`` in order."""
    got = output.splitlines()
    pos = 0
    for want in excerpt.splitlines():
        want = want.rstrip()
        if not want or want == "...":
            continue
        prefix = want.endswith("...")
        needle = want[:-3].rstrip() if prefix else want
        for j in range(pos, len(got)):
            if (needle in got[j]) if prefix else (got[j].rstrip() == want or want in got[j]):
                pos = j + 1
                break
        else:
            raise AssertionError(
                f"tutorial output line not found (in order): {want!r}\n--- output ---\n{output}"
            )


def test_tutorial_parses_into_files_and_commands() -> None:
    steps = parse(TUTORIAL.read_text(encoding="utf-8"))
    files = {s.path for s in steps if isinstance(s, File)}
    assert files == {"tinycache/__init__.py", "tinycache/connector.py", "tinycache/greedy.py"}
    commands = [s for s in steps if isinstance(s, Command)]
    assert any("--kvspec-conformance=tinycache.connector:TinyCache" in c.line for c in commands)
    assert [c.exit_code for c in commands if c.exit_code] == [1]
    for step in steps:
        if isinstance(step, File) and step.path.endswith(".py"):
            compile(step.text, step.path, "exec")  # each part is valid on its own too


def test_tutorial_shows_the_whole_tiny_connector() -> None:
    """The page's ``tinycache/connector.py`` is ``kvspec.conformance.connectors.tiny``, all
    of it, in order: the tutorial runs the module's code, and the module is what it shows."""
    steps = parse(TUTORIAL.read_text(encoding="utf-8"))
    shown = "\n".join(s.text for s in steps
                      if isinstance(s, File) and s.path == "tinycache/connector.py")
    module = "\n".join(snippet(str(TINY.relative_to(ROOT)), None))
    assert [line for line in shown.splitlines() if line.strip()] == [
        line for line in module.splitlines() if line.strip()]


def test_tiny_connector_loads_from_the_package() -> None:
    """The suite can load the module's factory by its import path."""
    from kvspec.conformance import load_factory

    factory = load_factory("kvspec.conformance.connectors.tiny:TinyCache")
    assert factory.name == "tinycache"


def test_tutorial_runs_as_written(tmp_path: Path) -> None:
    steps = parse(TUTORIAL.read_text(encoding="utf-8"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["COLUMNS"] = "120"
    env.pop("PYTHONPATH", None)
    cwd = tmp_path
    written: set[Path] = set()
    last = ""
    pwd_file = tmp_path.parent / f"{tmp_path.name}.pwd"
    for step in steps:
        if isinstance(step, File):
            path = cwd / step.path
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a" if path in written else "w", encoding="utf-8") as f:
                f.write(step.text if path not in written else "\n\n" + step.text)
            written.add(path)
        elif isinstance(step, Command):
            script = f'{step.line}\nrc=$?\npwd > "{pwd_file}"\nexit $rc\n'
            proc = subprocess.run(
                ["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                timeout=300,
            )
            last = proc.stdout + proc.stderr
            assert proc.returncode == step.exit_code, (
                f"`{step.line}` exited {proc.returncode}, the tutorial says {step.exit_code}"
                f"\n--- output ---\n{last}"
            )
            cwd = Path(pwd_file.read_text().strip())
        else:
            check_excerpt(step.text, last)
    assert (cwd / "known-failures.txt").is_file()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
