"""Measurement probes run inside an engine process (``EngineProcess.call``) by
``kvspec bench vllm``: they read what vLLM does not report, without changing it."""

from __future__ import annotations

import gc
import time
from typing import Any

__all__ = ["collect", "hook_time", "matched_tokens", "record_hook_time", "record_matches"]

# The per-step hooks vLLM calls on a connector (scheduler side, then worker side) whose time
# ``record_hook_time`` adds up; the names any V1 connector has, whoever wrote it.
_HOOKS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "on_new_request", "update_connector_output", "request_finished", "take_events",
    "has_pending_block_frees", "has_pending_push_work", "get_finished_count",
    "bind_connector_metadata", "clear_connector_metadata", "start_load_kv",
    "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
    "get_transfer_results", "get_block_ids_with_load_errors", "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events", "build_connector_worker_meta", "handle_preemptions",
    "finish_forward", "has_connector_metadata",
)


def _scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def record_matches(llm: Any) -> bool:
    """Wrap the scheduler-side connector's ``get_num_new_matched_tokens`` so that the last
    count it returned for each request is kept (``matched_tokens`` reads it). vLLM's own
    ``num_cached_tokens`` is not the connector's count for P/D requests."""
    conn = _scheduler(llm).connector
    if conn is None or getattr(conn, "_kvspec_matches", None) is not None:
        return conn is not None
    matches: dict[str, int] = {}
    inner = conn.get_num_new_matched_tokens

    def recorded(request: Any, num_computed_tokens: int) -> Any:
        count, is_async = inner(request, num_computed_tokens)
        if count:
            matches[request.request_id] = int(count)
        return count, is_async

    conn.get_num_new_matched_tokens = recorded
    conn._kvspec_matches = matches
    return True


def matched_tokens(llm: Any, clear: bool = True) -> dict[str, int]:
    """The recorded matches by request id (cleared unless ``clear`` is False)."""
    conn = _scheduler(llm).connector
    matches: dict[str, int] = getattr(conn, "_kvspec_matches", None) or {}
    out = dict(matches)
    if clear:
        matches.clear()
    return out


def _connectors(llm: Any) -> list[Any]:
    """The engine's scheduler-side connector and, in this process, its worker-side one."""
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    found = [_scheduler(llm).connector]
    if has_kv_transfer_group():
        found.append(get_kv_transfer_group())
    return [c for c in found if c is not None]


def record_hook_time(llm: Any) -> bool:
    """Time every call vLLM makes into the connector's per-step hooks (``_HOOKS``), on both
    sides, from the outermost call in (a hook calling another counts once); ``hook_time``
    reads the total. Works for any V1 connector: each hook is wrapped on the instance
    (about a microsecond per call, the same for every connector). False without one."""
    conns = _connectors(llm)
    if not conns or getattr(conns[0], "_kvspec_hook_ns", None) is not None:
        return bool(conns)
    total = [0]
    depth = [0]
    clock = time.perf_counter_ns

    def timed(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    total[0] += clock() - start
        return call

    for conn in conns:
        for name in _HOOKS:
            fn = getattr(conn, name, None)
            if callable(fn):
                setattr(conn, name, timed(fn))
        conn._kvspec_hook_ns = total
    return True


def hook_time(llm: Any, clear: bool = True) -> float:
    """Microseconds spent in the connector's hooks since the last call (or since
    ``record_hook_time``); cleared unless ``clear`` is False."""
    conns = _connectors(llm)
    total = getattr(conns[0], "_kvspec_hook_ns", None) if conns else None
    if total is None:
        return 0.0
    out: float = total[0] / 1e3
    if clear:
        total[0] = 0
    return out


def collect(llm: Any) -> int:
    """Run a full garbage collection, so that the next timed request starts from the same
    collector state in every arm (a collection that would fall inside one request of one
    arm measures the collector, not the connector); returns what it freed."""
    return gc.collect()
