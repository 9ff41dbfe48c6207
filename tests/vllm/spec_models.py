"""Tiny drafters for the speculative-decoding tests (tests/vllm/test_speculative.py).

The target is the engine host's tiny Llama with vLLM's dummy weights
(``kvspec.bench._vllm_engine_host``). vLLM fills every floating-point parameter with
``uniform(-1e-3, 1e-3)`` from a generator seeded 1234, so the embedding and the LM head
(both ``[vocab, hidden]``) hold the same matrix ``E`` and every RMSNorm weight is ``E[0]``
(the stream's first ``hidden`` values). Attention and MLP add terms a thousand times
smaller than the embedding, so the target's greedy next token is, to within rounding,
``G(t) = argmax_j E[j] . (E[0] * E[t])``: it depends on the current token alone.

A drafter with dummy weights proposes noise (acceptance 0), which cannot show whether the
draft layers' loaded KV was used. The drafters here are written as safetensors checkpoints
(loaded with the draft's own ``draft_load_config``) whose output is ``E[0] * E[t]`` scaled,
so that they predict ``G`` as the target does, plus an attention layer whose weights are
small enough that its KV, as computed, does not move the argmax, and large enough that
noise over that KV does: acceptance is high with the right draft KV and drops without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

HIDDEN = 128
INTER = 256
VOCAB = 512
HEADS = 2
HEAD_DIM = 64
SCALE = 1e3  # the drafter's hidden state ~ 1e-3, far above its attention's ~ 1e-5


def dummy_matrix(shape: tuple[int, ...]) -> torch.Tensor:
    """What vLLM's dummy loader writes into a float32 parameter of ``shape``."""
    gen = torch.Generator().manual_seed(1234)
    return torch.empty(shape, dtype=torch.float32).uniform_(-1e-3, 1e-3, generator=gen)


def _small(shape: tuple[int, ...], seed: int, scale: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=gen) * 2 - 1) * scale


def _attention(prefix: str, seed: int) -> dict[str, torch.Tensor]:
    """q, k, v of the size that makes the KV matter under noise; o tiny, so that the
    computed KV adds ~1e-5 to a hidden state of ~1e-3."""
    qkv = HEADS * HEAD_DIM
    return {
        f"{prefix}.q_proj.weight": _small((qkv, HIDDEN), seed, 0.05),
        f"{prefix}.k_proj.weight": _small((qkv, HIDDEN), seed + 1, 0.05),
        f"{prefix}.v_proj.weight": _small((qkv, HIDDEN), seed + 2, 0.05),
        f"{prefix}.o_proj.weight": _small((HIDDEN, qkv), seed + 3, 1e-3),
    }


def _mlp(prefix: str, seed: int) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}.gate_proj.weight": _small((INTER, HIDDEN), seed, 1e-3),
        f"{prefix}.up_proj.weight": _small((INTER, HIDDEN), seed + 1, 1e-3),
        f"{prefix}.down_proj.weight": _small((HIDDEN, INTER), seed + 2, 1e-3),
    }


def _write(directory: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, sort_keys=True))
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(directory / "model.safetensors"))
    return str(directory)


def _base_config() -> dict[str, Any]:
    return {"hidden_size": HIDDEN, "intermediate_size": INTER, "num_attention_heads": HEADS,
            "num_key_value_heads": HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB,
            "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "float32"}


def eagle_llama(directory: Path) -> str:
    """An EAGLE head for the tiny Llama (``EagleLlamaForCausalLM``, one layer, the
    target's embedding and LM head shared): ``fc`` keeps ``SCALE * E[0] * embed(t)``."""
    w = dummy_matrix((VOCAB, HIDDEN))[0]
    fc = torch.zeros(HIDDEN, 2 * HIDDEN)
    fc[:, :HIDDEN] = torch.diag(w * SCALE)
    tensors = {"fc.weight": fc, **_attention("layers.0.self_attn", 10),
               **_mlp("layers.0.mlp", 20),
               "layers.0.post_attention_layernorm.weight": torch.full((HIDDEN,), 1e-3)}
    config = {**_base_config(), "architectures": ["EagleLlamaForCausalLM"],
              "model_type": "llama", "num_hidden_layers": 1}
    return _write(directory, config, tensors)


MIMO = {"architectures": ["MiMoForCausalLM"], "model_type": "qwen2", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
        "num_hidden_layers": 2, "vocab_size": VOCAB, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "torch_dtype": "float32", "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False}
"""A tiny MiMo (Qwen2 with one MTP layer), the smallest family vLLM 0.32 runs ``mtp`` for
on CPU (dense, no MLA, no MoE). The engine host writes it with dummy weights."""


def mimo_mtp(directory: Path) -> str:
    """MiMo's MTP layer for the dummy tiny MiMo, as a checkpoint holding only what vLLM's
    ``MiMoMTP`` loads: ``token_layernorm = E[0]`` gives ``E[0] * E[t]`` (normalised), the
    input projection keeps it, the final norm (ones) rescales it; embedding and LM head
    are the target's dummy ``E``."""
    e = dummy_matrix((VOCAB, HIDDEN))
    proj = torch.zeros(HIDDEN, 2 * HIDDEN)
    proj[:, HIDDEN:] = torch.eye(HIDDEN)  # cat([hidden, embeds]): keep the token's part
    p = "model.mtp_layers.0"
    qkv = HEADS * HEAD_DIM
    tensors = {
        "model.embed_tokens.weight": e, "lm_head.weight": e.clone(),
        f"{p}.token_layernorm.weight": e[0] * SCALE,
        f"{p}.hidden_layernorm.weight": torch.ones(HIDDEN),
        f"{p}.input_proj.weight": proj,
        f"{p}.final_layernorm.weight": torch.ones(HIDDEN),
        f"{p}.input_layernorm.weight": torch.ones(HIDDEN),
        f"{p}.post_attention_layernorm.weight": torch.full((HIDDEN,), 1e-3),
        **_attention(f"{p}.self_attn", 30), **_mlp(f"{p}.mlp", 40),
        f"{p}.self_attn.q_proj.bias": torch.zeros(qkv),
        f"{p}.self_attn.k_proj.bias": torch.zeros(qkv),
        f"{p}.self_attn.v_proj.bias": torch.zeros(qkv),
    }
    # The MTP layer's input is normalised (~1): o_proj small keeps attention ~1e-2 of it.
    tensors[f"{p}.self_attn.o_proj.weight"] = _small((HIDDEN, qkv), 33, 1e-4)
    return _write(directory, dict(MIMO), tensors)
