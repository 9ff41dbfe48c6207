"""``kvspec conform hicache:...`` runs again under the SGLang environment's python when this
one cannot import SGLang (``$KVSPEC_SGLANG_PYTHON`` or the checkout's ``.venv-sglang``,
built by ``scripts/sglang_env.sh``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ._vllm_env import RERUN_ENV, run_again

_ROOT = Path(__file__).resolve().parents[2]


def sglang_python() -> str | None:
    """The interpreter of an environment with SGLang: ``$KVSPEC_SGLANG_PYTHON``, this
    interpreter when it imports SGLang, or the checkout's ``.venv-sglang``; None if none."""
    env = os.environ.get("KVSPEC_SGLANG_PYTHON")
    if env:
        return env
    from ..sglang.suite import have_sglang

    if have_sglang():
        return sys.executable
    local = _ROOT / ".venv-sglang" / "bin" / "python"
    return str(local) if local.exists() else None


def rerun_under_sglang(command: str, args: argparse.Namespace, *, timeout_s: int) -> int | None:
    """Run this command line (``args.argv``) again under the SGLang environment's python
    when SGLang is not importable here; its exit code (2 when there is no such python), or
    None to go on in this process (SGLang is here, or this is the re-run)."""
    from ..sglang.suite import have_sglang

    if have_sglang() or os.environ.get(RERUN_ENV):
        return None
    python = sglang_python()
    if python is None or python == sys.executable:
        print(f"kvspec {command}: no Python with SGLang: set KVSPEC_SGLANG_PYTHON or run "
              "scripts/sglang_env.sh", file=sys.stderr)
        return 2
    print(f"kvspec {command}: SGLang is not importable here; running under {python}",
          file=sys.stderr, flush=True)
    return run_again(python, command, args, timeout_s)
