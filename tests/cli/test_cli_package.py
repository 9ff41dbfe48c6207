"""The command line as a registry of small command modules (issue 36, item 4): each
command adds its own parser, one helper re-runs a command under the vLLM environment,
and no function of ``kvspec/cli`` is longer than 60 lines."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvspec.cli
from kvspec.cli import COMMANDS, build_parser, main
from kvspec.cli import _vllm_env

CLI = Path(kvspec.cli.__file__).resolve().parent


def _functions() -> list[tuple[str, int]]:
    out = []
    for path in sorted(CLI.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                assert node.end_lineno is not None
                out.append((f"{path.relative_to(CLI)}:{node.name}", node.end_lineno - first + 1))
    return out


def test_no_function_of_the_cli_is_over_60_lines() -> None:
    found = _functions()
    assert len(found) > 30  # the walk saw the package
    assert [(name, n) for name, n in found if n > 60] == []


def _subcommands(parser: argparse.ArgumentParser) -> list[str]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(action.choices)


def test_the_parser_is_built_from_the_registered_command_modules() -> None:
    parser = build_parser()
    assert _subcommands(parser) == ["spec", "conform", "bench", "demo", "vllm-connectors"]
    assert len(COMMANDS) == 5 and all(callable(m.register) for m in COMMANDS)
    bench = parser._subparsers._group_actions[0].choices["bench"]  # type: ignore[union-attr]
    assert _subcommands(bench) == ["offload", "nixl", "vllm-adapter", "aggregate", "graphs",
                                   "vllm"]
    demo = parser._subparsers._group_actions[0].choices["demo"]  # type: ignore[union-attr]
    assert _subcommands(demo) == ["pd", "vllm"]


@pytest.mark.parametrize("module", ["kvspec", "kvspec.cli"])
def test_python_dash_m_runs_the_command_line(module: str) -> None:
    proc = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0 and proc.stdout.startswith("kvspec ")


class _Ran:
    def __init__(self, code: int = 0, timeout: bool = False) -> None:
        self.code, self.timeout = code, timeout
        self.calls: list[tuple[list[str], dict[str, Any]]] = []

    def __call__(self, cmd: list[str], **kwargs: Any) -> Any:
        self.calls.append((cmd, kwargs))
        if self.timeout:
            raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])
        return subprocess.CompletedProcess(cmd, self.code)


@pytest.fixture
def no_vllm_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_vllm_env.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delenv(_vllm_env.RERUN_ENV, raising=False)


def test_a_vllm_command_reruns_its_own_command_line_under_the_vllm_python(
        monkeypatch: pytest.MonkeyPatch, no_vllm_here: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVSPEC_VLLM_PYTHON", "/elsewhere/python")
    ran = _Ran(code=3)
    monkeypatch.setattr(_vllm_env.subprocess, "run", ran)
    assert main(["bench", "aggregate", "--ranks", "2", "--repeats", "1"]) == 3
    ((cmd, kwargs),) = ran.calls
    assert cmd == ["/elsewhere/python", "-m", "kvspec", "bench", "aggregate", "--ranks", "2",
                   "--repeats", "1"]
    assert kwargs["env"][_vllm_env.RERUN_ENV] == "1" and kwargs["timeout"] == 1800
    assert capsys.readouterr().err == ""  # aggregate re-runs quietly; conform says so

    ran.timeout = True
    assert main(["vllm-connectors", "--render-only"]) == 1
    assert capsys.readouterr().err == "kvspec vllm-connectors: timed out after 4 h\n"


def test_a_command_that_needs_vllm_says_so_without_any_vllm_python(
        monkeypatch: pytest.MonkeyPatch, no_vllm_here: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("kvspec.bench.vllm_engine.vllm_python", lambda: None)
    for argv in (["bench", "vllm-adapter"], ["vllm-connectors"]):
        assert main(argv) == 2
        assert "no Python with vLLM" in capsys.readouterr().err
