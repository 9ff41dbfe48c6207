"""Commands that need vLLM run again under the vLLM environment's python when this one
cannot import it: one helper for all of them."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys

RERUN_ENV = "KVSPEC_NO_RERUN"
"""Set in the re-run process: it goes on by itself, whatever it finds."""


def no_vllm(command: str) -> int:
    """Say that ``kvspec <command>`` needs the vLLM environment; the exit code 2."""
    print(f"kvspec {command}: no Python with vLLM: set KVSPEC_VLLM_PYTHON or run "
          "scripts/vllm_env.sh", file=sys.stderr)
    return 2


def _duration(seconds: int) -> str:
    return f"{seconds // 3600} h" if seconds >= 3600 and not seconds % 3600 else f"{seconds} s"


def rerun_under_vllm(command: str, args: argparse.Namespace, *, timeout_s: int,
                     required: bool = False, announce: bool = False) -> int | None:
    """Run this command line (``args.argv``) again under the vLLM environment's python
    when vLLM is not importable here; its exit code, or None to go on in this process
    (vLLM is here, this is the re-run, or there is no other python to run).

    ``required``: with no vLLM environment at all, say so and return 2. ``announce``:
    say on stderr which python runs it. A run longer than ``timeout_s`` ends with 1.
    """
    from ..bench.vllm_engine import vllm_python

    if importlib.util.find_spec("vllm") is not None or os.environ.get(RERUN_ENV):
        return None
    python = vllm_python()
    if python is None and required:
        return no_vllm(command)
    if python is None or python == sys.executable:
        return None  # the import then says what is missing
    if announce:
        print(f"kvspec {command}: vLLM is not importable here; running under {python}",
              file=sys.stderr, flush=True)
    return run_again(python, command, args, timeout_s)


def run_again(python: str, command: str, args: argparse.Namespace, timeout_s: int) -> int:
    """Run this command line (``args.argv``) under ``python``, marked as the re-run
    (``RERUN_ENV``); its exit code, or 1 after ``timeout_s``. Every engine environment's
    re-run goes through here."""
    env = dict(os.environ, **{RERUN_ENV: "1"})
    try:
        return subprocess.run([python, "-m", "kvspec", *args.argv], timeout=timeout_s,
                              check=False, env=env).returncode
    except subprocess.TimeoutExpired:
        print(f"kvspec {command}: timed out after {_duration(timeout_s)}", file=sys.stderr)
        return 1
