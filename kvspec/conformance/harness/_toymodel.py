"""The toy model: KV that is a deterministic function of the token prefix, layer and tenant.

The KV of the token at position ``p`` of a request, in layer ``l`` and head ``h``, channel
``c``, depends only on the tokens ``[0, p]``, the request's cache salt and LoRA id, ``l``,
``h`` and ``c``. So the harness can recompute and check any block byte for byte after any
step. The salt is mixed in although real KV does not depend on it: that makes a connector
that shares KV across tenants (SCH-020) produce detectably wrong bytes.

Values are small integers in [-100, 100], exact in every float and int8 dtype, so byte
equality is value equality. ``POISON`` is outside that range: the harness writes it into
freed blocks, and finding it in loaded KV proves a read after free (SCH-017).
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["POISON", "ToyModel", "prefix_hashes", "tenant_seed", "weights_seed"]

POISON = 111
"""The value written into freed blocks; never produced by the model (nor are the other
poisons, ``POISON + 2``, ``+ 4``, ``+ 6``, ``+ 8`` and ``POISON - 5``, see the worker runtime)."""

_MASK = (1 << 61) - 1
_VOCAB = 997


def tenant_seed(cache_salt: str | None, lora_id: int | None) -> int:
    """A 61-bit seed that separates tenants (salt) and adapters (LoRA)."""
    digest = hashlib.blake2b(f"{cache_salt!r}|{lora_id!r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


def weights_seed(seed: int, generation: int) -> int:
    """``seed`` under the model's weights of ``generation`` (0: the first weights, ``seed``
    itself): the harness changes the weights at a cache reset (SCH-032), so the KV of the
    same tokens differs before and after it, as it does after a real weight update."""
    if generation == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}|{generation}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


def prefix_hashes(tokens: tuple[int, ...], seed: int) -> list[int]:
    """Per position ``p``, a 61-bit hash of ``tokens[: p + 1]`` under ``seed``."""
    out: list[int] = []
    h = seed
    for t in tokens:
        h = ((h ^ (t + 0x9E3779B97F4A7C15)) * 0x100000001B3 + 0x632BE59BD9B4E019) & _MASK
        out.append(h)
    return out


class ToyModel:
    """Computes the KV of any token, and the next token of any prefix.

    Args:
        num_layers: Layers of the model.
        num_heads: KV heads of the whole model (TP ranks hold slices).
        head_size_k: Channels of K per head.
        head_size_v: Channels of V per head.
    """

    def __init__(self, num_layers: int, num_heads: int, head_size_k: int, head_size_v: int) -> None:
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.head_size_k = head_size_k
        self.head_size_v = head_size_v
        self._chan = torch.arange(head_size_k + head_size_v, dtype=torch.int64)
        self._heads = torch.arange(num_heads, dtype=torch.int64)

    def next_token(self, prefix_hash: int) -> int:
        """The token the model samples after a prefix with this hash."""
        return (prefix_hash >> 7) % _VOCAB

    def generate(self, prompt: tuple[int, ...], seed: int, max_new_tokens: int) -> tuple[int, ...]:
        """Prompt plus ``max_new_tokens`` greedily generated tokens."""
        tokens = list(prompt)
        hashes = prefix_hashes(tuple(tokens), seed)
        h = hashes[-1]
        for _ in range(max_new_tokens):
            t = self.next_token(h)
            tokens.append(t)
            h = prefix_hashes((t,), h)[0]
        return tuple(tokens)

    def kv(self, hashes: list[int], layer: int, heads: range | None = None) -> torch.Tensor:
        """KV of the positions with these prefix hashes: int64 ``[T, H, Ck + Cv]``.

        ``heads`` selects a slice of the model's heads (a TP rank's share).
        """
        hs = self._heads if heads is None else self._heads[heads.start : heads.stop]
        base = torch.tensor([h % 1_000_003 for h in hashes], dtype=torch.int64)
        vals = base[:, None, None] + layer * 31 + hs[None, :, None] * 7 + self._chan[None, None, :] * 3
        return vals % 201 - 100
