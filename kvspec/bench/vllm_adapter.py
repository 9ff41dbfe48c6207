"""``kvspec bench vllm-adapter``: what the vLLM adapter adds to one engine step.

Times each of the adapter's translations on a sample step of real vLLM objects
(``kvspec.vllm.sample_step``): medians of ``repeats`` runs, after one untimed run. The
connector's own hooks are not timed, only what the adapter adds. Runs where vLLM is
importable (the CLI re-runs itself under the vLLM environment).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["measure"]


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def measure(blocks: int = 256, block_size: int = 32, running: int = 32,
            repeats: int = 200) -> dict[str, Any]:
    """Time the adapter's per-step translations for a ``blocks``-block step; returns the
    microseconds of each part and their sum, and the ``vllm`` version measured."""
    from kvspec.vllm.sample_step import FIRST_SIGHT, adapter_step_parts

    step = adapter_step_parts(blocks, block_size, running)
    parts = {name: _median_us(fn, repeats) for name, fn in step.parts.items()}
    steady = sum(v for k, v in parts.items() if k != FIRST_SIGHT)
    return {"blocks": blocks, "block_size": block_size, "running": running,
            "repeats": repeats, "parts_us": parts,
            "per_step_us": steady,
            "per_step_us_with_new_request": steady + parts[FIRST_SIGHT],
            "vllm_own_us": _median_us(step.vllm_own, repeats),
            "vllm": step.vllm_version}
