"""What the vLLM benchmarks share: their prompts, the no-work prompt, one timed request and
the fleet of engine processes an arm runs on (``kvspec.bench.vllm`` and
``kvspec.bench.vllm_long``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["NO_WORK", "PROBES", "Fleet", "prompts", "timed"]

PROBES = "kvspec.bench._vllm_probes"


def prompts(lengths: Sequence[int], seed: int) -> list[list[int]]:
    return [[(seed * 7919 + 31 * i * (n + 3) + n) % 500 + 1 for i in range(n)]
            for n in lengths]


NO_WORK = [7, 3, 11, 5, 13, 2, 17, 9, 19, 4, 23, 6, 29, 8, 31, 10]  # < one block: nothing
# to store, load or hand off


def timed(engine: Any, prompt: list[int], params: dict[str, Any] | None = None) -> float:
    engine.call(f"{PROBES}:collect")  # every timed request starts from the same GC state
    r = engine.generate([prompt], max_tokens=1,
                        kv_transfer_params=None if params is None else [params])[0]
    return float(r["seconds"]) * 1e3


class Fleet:
    """The engines of a run; only the ones an arm needs run at a time."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.engines: dict[str, Any] = {}
        self.startup: dict[str, float] = {}
        self.say = say

    def start(self, name: str, spec: dict[str, Any], env: dict[str, str] | None = None) -> Any:
        from kvspec.bench.vllm_engine import EngineProcess

        self.say(f"starting engine {name} (10-60 s)...")
        t0 = time.monotonic()
        e = EngineProcess(spec, env={"PYTHONPATH": "", **(env or {})})
        self.startup[name] = time.monotonic() - t0
        self.engines[name] = e
        e.pause()
        return e

    def only(self, *names: str) -> None:
        for n, e in self.engines.items():
            if n in names:
                e.resume()
            else:
                e.pause()

    def close(self) -> None:
        for e in self.engines.values():
            e.close(timeout_s=60)
