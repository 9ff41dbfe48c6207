"""Measurement probes run inside an engine process (``EngineProcess.call``) by
``kvspec bench vllm``: they read what vLLM does not report, without changing it."""

from __future__ import annotations

from typing import Any

__all__ = ["matched_tokens", "record_matches"]


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
