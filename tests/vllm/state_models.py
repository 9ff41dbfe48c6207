"""Tiny state-space hybrids for tests/vllm/test_state_space.py, written by transformers.

vLLM's dummy weights (uniform in +-1e-3) leave a model's next token almost a function of the
current token, so a wrong state would not show. These checkpoints are transformers' own
seeded initialisation, saved as safetensors: the state layers' outputs matter, and noise
over a loaded state changes the tokens. Prompts are token ids (no tokenizer).
"""

from __future__ import annotations

from pathlib import Path

NEMOTRON_H = {
    "layers_block_type": ["mamba", "attention"], "hidden_size": 128, "mamba_num_heads": 4,
    "mamba_head_dim": 32, "n_groups": 1, "ssm_state_size": 16, "conv_kernel": 4,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
    "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 512,
    "torch_dtype": "float32", "tie_word_embeddings": False,
}
"""NemotronH with one Mamba2 layer and one attention layer: in vLLM 0.32 a state group
(conv (3, 160) + ssm (4, 32, 16), fp32: 10,112 content bytes padded to a 32,768-byte page)
beside a full-attention group of 32-token blocks."""


def nemotron_h(directory: Path, seed: int = 0) -> str:
    """Write the tiny NemotronH (seeded weights) to ``directory``; return its path."""
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    if not (directory / "model.safetensors").exists():
        torch.manual_seed(seed)
        NemotronHForCausalLM(NemotronHConfig(**NEMOTRON_H)).save_pretrained(directory)
    return str(directory)
