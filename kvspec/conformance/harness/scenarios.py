"""Fixed scenarios: one workload per trap connector authors have hit (BRIEF section 1).

Each is small enough to run in milliseconds against an in-process engine, and named so a
failure says which trap it reproduced.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from .workload import RequestSpec, Workload

__all__ = ["SCENARIOS"]

_P = tuple(range(1, 18))  # a 17-token prompt: 4 full blocks of 4 and one token


def _w(name: str, *reqs: RequestSpec) -> Workload:
    return Workload(reqs, name=name)


SCENARIOS: Mapping[str, Workload] = MappingProxyType({
    # One request, start to finish: metadata every step, one request_finished (SCH-011, SCH-015).
    "single": _w("single", RequestSpec("r0", _P, max_new_tokens=3)),
    # The same prompt again after the first finished: a full-prompt hit must leave one token
    # to compute (SCH-005); the rematch must have no side effects (SCH-001).
    "full-prompt-hit": _w(
        "full-prompt-hit",
        RequestSpec("first", _P[:16], max_new_tokens=2),
        RequestSpec("again", _P[:16], max_new_tokens=2, arrival_step=8),
        RequestSpec("longer", _P + (40, 41, 42, 43), max_new_tokens=2, arrival_step=16),
    ),
    # Shared prefixes arriving together and apart: prefix cache, partial hits (SCH-007).
    "shared-prefix": _w(
        "shared-prefix",
        RequestSpec("a", _P, max_new_tokens=2),
        RequestSpec("b", _P[:9] + (50, 51, 52), max_new_tokens=2),
        RequestSpec("c", _P[:13] + (60,), max_new_tokens=3, arrival_step=10),
    ),
    # The engine's prefix cache kept only the first block of a prompt the connector stored
    # whole: a partial local hit the connector extends. Its loads must land after the local
    # blocks, never on them (SCH-007, SCH-010); the blocks it skips stay poisoned.
    "partial-local-hit": _w(
        "partial-local-hit",
        RequestSpec("first", _P[:16], max_new_tokens=2),
        RequestSpec("longer", _P[:16] + (30, 31, 32, 33, 34), max_new_tokens=2,
                    arrival_step=8, local_cache_blocks=1),
        RequestSpec("again", _P[:16] + (30, 31, 32, 33, 35), max_new_tokens=2,
                    arrival_step=16, local_cache_blocks=2),
    ),
    # The same tokens under other tenants and adapters never share KV (SCH-020). Two prompts
    # of 17 and 14 tokens (4*4+1 and 3*4+2), without a common prefix, because a connector may
    # hit only some lengths: vLLM's ExampleConnector never hits a k*bs+1 prompt it stored,
    # and with the first prompt alone it escaped this scenario while sharing KV across salts.
    "tenants": _w(
        "tenants",
        *(r for i, p in enumerate((_P, tuple(range(101, 115)))) for r in (
            RequestSpec(f"plain-{len(p)}", p, max_new_tokens=2, arrival_step=40 * i),
            RequestSpec(f"salted-a-{len(p)}", p, max_new_tokens=2, cache_salt="tenant-a",
                        arrival_step=40 * i + 8),
            RequestSpec(f"salted-b-{len(p)}", p, max_new_tokens=2, cache_salt="tenant-b",
                        arrival_step=40 * i + 16),
            RequestSpec(f"lora-{len(p)}", p, max_new_tokens=2, lora_id=1,
                        arrival_step=40 * i + 24),
            RequestSpec(f"plain-again-{len(p)}", p, max_new_tokens=2, arrival_step=40 * i + 32),
        )),
    ),
    # Aborts at every stage: waiting, just allocated (possibly waiting for remote KV),
    # running, and after finishing (SCH-015, SCH-021).
    "aborts": _w(
        "aborts",
        RequestSpec("seed", _P, max_new_tokens=2),
        RequestSpec("abort-waiting", _P[:6], arrival_step=1, abort_at_step=1),
        RequestSpec("abort-loading", _P, max_new_tokens=2, arrival_step=8, abort_at_step=9),
        RequestSpec("abort-while-loading", _P[:12] + (9,), max_new_tokens=2, arrival_step=10,
                    abort_while_loading=True),
        RequestSpec("abort-running", tuple(range(100, 160)), max_new_tokens=4, arrival_step=8,
                    abort_at_step=10),
        RequestSpec("abort-late", _P[:5], max_new_tokens=1, arrival_step=2, abort_at_step=30),
    ),
    # More demand than blocks: running requests are preempted and matched again (SCH-022).
    "preemption": _w(
        "preemption",
        *(RequestSpec(f"p{i}", tuple(range(10 * i, 10 * i + 14)), max_new_tokens=6,
                      arrival_step=i % 2) for i in range(6)),
        # the first prompts again, while memory is still tight: loads under preemption
        *(RequestSpec(f"p{i}-again", tuple(range(10 * i, 10 * i + 14)), max_new_tokens=3,
                      arrival_step=step) for i, step in ((0, 10), (1, 14), (2, 18))),
    ),
    # Long prompts in small chunks; requests finishing while others load (SCH-009, SCH-011).
    "chunked": _w(
        "chunked",
        RequestSpec("long", tuple(range(200, 262)), max_new_tokens=2),
        RequestSpec("long-again", tuple(range(200, 262)), max_new_tokens=2, arrival_step=12),
        RequestSpec("short", _P[:7], max_new_tokens=4, arrival_step=13),
    ),
})
"""The fixed scenarios, by name."""
