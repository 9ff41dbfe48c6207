"""A real vLLM engine in a child process, driven from this one (no vLLM import here).

vLLM run in-process rewrites ``os.environ`` and torch's threading of its host, so every
engine the tests, ``kvspec demo vllm`` and ``kvspec bench vllm`` start runs in its own
process (``kvspec.bench._vllm_engine_host``), under the interpreter of an environment
where vLLM is installed (``vllm_python``). Every wait is bounded: a command that does not answer in
time raises ``EngineError`` and the process is killed on close.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from kvspec.protocols import KVSpecError

__all__ = ["EngineError", "EngineProcess", "vllm_python"]

_MARK = "KVSPEC-RESULT "
_log = logging.getLogger(__name__)
_ROOT = Path(__file__).resolve().parents[2]


class EngineError(KVSpecError):
    """A vLLM engine process failed to start, answered with an error, or timed out."""


def vllm_python() -> str | None:
    """The interpreter of an environment with vLLM: ``$KVSPEC_VLLM_PYTHON``, this
    interpreter when it imports vLLM, or the checkout's ``.venv-vllm`` (built by
    ``scripts/vllm_env.sh``); None when there is none."""
    env = os.environ.get("KVSPEC_VLLM_PYTHON")
    if env:
        return env
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin is not None:  # not a namespace package of that name
        return sys.executable
    local = _ROOT / ".venv-vllm" / "bin" / "python"
    return str(local) if local.exists() else None


class EngineProcess:
    """One vLLM engine (``kvspec.bench._vllm_engine_host``) in a child process.

    Args:
        spec: The engine spec (``factory``, ``kv_role``, ``extra``, ``block_size``, ...;
            see ``kvspec.bench._vllm_engine_host``).
        python: The interpreter to run it with (default ``vllm_python``).
        env: Extra environment variables for the child.
        log: Where the child's own output goes (a file), default discarded.
        start_timeout_s: How long the engine may take to start.

    Raises:
        EngineError: no vLLM environment, or the engine did not start in time.
    """

    def __init__(self, spec: Mapping[str, Any], *, python: str | None = None,
                 env: Mapping[str, str] | None = None, log: IO[str] | None = None,
                 start_timeout_s: float = 300.0) -> None:
        exe = python or vllm_python()
        if exe is None or not shutil.which(exe) and not Path(exe).exists():
            raise EngineError(
                "no Python with vLLM found: set KVSPEC_VLLM_PYTHON or run "
                "scripts/vllm_env.sh to build .venv-vllm")
        child_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                     **(env or {})}
        self._log = log
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._proc = subprocess.Popen(
            [exe, "-m", "kvspec.bench._vllm_engine_host"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env, bufsize=1,
        )
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name="kvspec-vllm-engine-reader")
        self._reader.start()
        self.tail: list[str] = []
        """The child's last lines of output, for error messages."""
        self._send(dict(spec))
        ready = self._receive(start_timeout_s, "start")
        self.pid = int(ready["pid"])

    @property
    def process(self) -> subprocess.Popen[str]:
        """The child process."""
        return self._proc

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _send(self, obj: Mapping[str, Any]) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(obj) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise EngineError(f"the engine process is gone ({e}); its last output:\n"
                              + "".join(self.tail[-30:])) from e

    def _receive(self, timeout_s: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise EngineError(f"the engine did not answer {what} within {timeout_s:.0f} s;"
                                  " its last output:\n" + "".join(self.tail[-30:]))
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                code = self._proc.wait(timeout=10)
                raise EngineError(f"the engine exited with code {code} during {what}; its "
                                  "last output:\n" + "".join(self.tail[-40:]))
            if line.startswith(_MARK):
                answer: dict[str, Any] = json.loads(line[len(_MARK):])
                if "error" in answer:
                    raise EngineError(f"{what}: {answer['error']}\n"
                                      + answer.get("traceback", ""))
                return answer
            self.tail = (self.tail + [line])[-200:]
            if self._log is not None:
                self._log.write(line)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int = 8,
                 kv_transfer_params: Sequence[Mapping[str, Any] | None] | None = None,
                 batch: bool = False, timeout_s: float = 300.0) -> list[dict[str, Any]]:
        """Generate greedily for each prompt (token ids), one request at a time (or all at
        once with ``batch``); returns per request ``tokens``, ``num_cached_tokens``,
        ``kv_transfer_params``, ``seconds``."""
        self._send({"op": "generate", "prompts": [list(p) for p in prompts],
                    "max_tokens": max_tokens, "batch": batch,
                    "kv_transfer_params": list(kv_transfer_params)
                    if kv_transfer_params is not None else None})
        results: list[dict[str, Any]] = self._receive(timeout_s, "generate")["results"]
        return results

    def call(self, fn: str, *, timeout_s: float = 120.0, **args: Any) -> Any:
        """Run ``fn(llm, **args)`` (``"pkg.module:function"``) in the engine process."""
        self._send({"op": "call", "fn": fn, "args": args})
        return self._receive(timeout_s, f"call {fn}")["value"]

    def overhead(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """The adapter's translation time per role (see ``KVSpecConnector.adapter_overhead``)."""
        self._send({"op": "overhead"})
        value: dict[str, Any] = self._receive(timeout_s, "overhead")["value"]
        return value

    def layout(self, timeout_s: float = 60.0) -> dict[str, Any] | None:
        """The KV-cache layout the adapter registered in the engine (order, packing,
        ``opaque_pages``, ``bytes_per_token``, ...), or None without a kvspec connector."""
        self._send({"op": "layout"})
        value: dict[str, Any] | None = self._receive(timeout_s, "layout")["value"]
        return value

    def close(self, timeout_s: float = 60.0) -> int | None:
        """Ask the engine to exit (its connector shuts down); kill it if it does not."""
        if self._proc.poll() is None:
            self.resume()
            try:
                self._send({"op": "exit"})
                self._receive(timeout_s, "exit")
                self._proc.wait(timeout=timeout_s)
            except (EngineError, subprocess.TimeoutExpired):
                self.kill()
        return self._proc.returncode

    def pause(self) -> None:
        """Stop the engine process (SIGSTOP) so it takes no CPU while others are measured;
        ``resume`` continues it. A paused engine answers nothing."""
        if self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Continue an engine stopped by ``pause`` (SIGCONT)."""
        if self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """Kill the engine process now (a crash, as far as its peers can tell)."""
        if self._proc.poll() is None:
            self._proc.kill()  # SIGKILL ends a stopped (paused) process too
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover - the kernel's business
                _log.warning("engine process %d did not end 30 s after SIGKILL",
                             self._proc.pid)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
