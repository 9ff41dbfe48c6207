"""Measurement probes run inside an engine process (``EngineProcess.call``) by
``kvspec bench vllm``: they read what vLLM does not report, without changing it. vLLM's
objects are reached through the engine (``kvspec.vllm.offline``), never imported here."""

from __future__ import annotations

import gc
import time
from typing import Any

__all__ = ["collect", "copy_stats", "hook_time", "matched_tokens", "memcpy_gbps",
           "record_copy_stats", "record_hook_time", "record_matches"]

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
    from kvspec.vllm.offline import engine_connectors

    return engine_connectors(llm)


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


def _kvspec_workers() -> list[Any]:
    from kvspec.vllm.connector import KVSpecConnector

    return [w for c in KVSpecConnector.live() if (w := c.kvspec_worker) is not None]


def record_copy_stats(llm: Any) -> bool:
    """Keep a running total of the counters a kvspec worker adds up (the offload backend's
    ``bytes_loaded``, ``load_copy_us`` ...), which vLLM otherwise consumes every step;
    False when this engine runs no kvspec worker that counts."""
    found = False
    for worker in _kvspec_workers():
        count = getattr(worker, "_count", None)
        if count is None or hasattr(worker, "_kvspec_totals"):
            found = found or hasattr(worker, "_kvspec_totals")
            continue
        totals: dict[str, int] = {}

        def counted(_count: Any = count, _totals: dict[str, int] = totals,
                    **counts: int) -> None:
            for name, n in counts.items():
                _totals[name] = _totals.get(name, 0) + n
            _count(**counts)

        worker._kvspec_totals = totals
        worker._count = counted
        found = True
    return found


def copy_stats(llm: Any, clear: bool = True) -> dict[str, int]:
    """The counters ``record_copy_stats`` totalled since the last call (cleared unless
    ``clear`` is False)."""
    out: dict[str, int] = {}
    for worker in _kvspec_workers():
        totals = getattr(worker, "_kvspec_totals", None)
        if totals is None:
            continue
        for name, n in totals.items():
            out[name] = out.get(name, 0) + n
        if clear:
            totals.clear()
    return out


_EVICT: list[Any] = []


def memcpy_gbps(llm: Any, nbytes: int, repeats: int = 7, cold: bool = False) -> float:
    """The median GB/s of one contiguous host copy of ``nbytes`` in this process (the
    ceiling a load of that many bytes is compared with), after one untimed copy. ``cold``:
    before each timed copy, 512 MiB of other memory is written, so neither buffer is in
    the CPU caches (as a load's host slots, stored a request ago, are not): a copy from
    and to memory, not from cache to cache."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    if cold and not _EVICT:
        _EVICT.append(torch.empty(512 << 20, dtype=torch.uint8))
    times = []
    for i in range(repeats):
        if cold:
            _EVICT[0].fill_(i)
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    times.sort()
    return nbytes / times[len(times) // 2] / 1e9
