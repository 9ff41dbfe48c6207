"""vLLM's KV-cache tensors as a kvspec ``KVCacheLayout``, and the layout negotiation.

vLLM hands ``register_kv_caches`` one tensor per attention layer, all views into one
buffer. Their shape depends on the attention backend: ``[B, H, N, 2*D]`` on vLLM-CPU (K and
V concatenated in the last dim, kernel-packed pages: K transposed, then V), ``[2, B, N, H,
D]`` for split-K/V GPU backends (any stride order). ``describe_kv_caches`` turns them
into kvspec's storage shape (a view, never a copy: LAY-009) and the descriptor that is true
of them (LAY-006, LAY-014), after checking the layout with the connector's offer (LAY-010).
No vLLM import: the tensors and sizes are passed in.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from kvspec.protocols import (
    Capabilities,
    KVCacheLayout,
    KVPacking,
    LayoutMismatchError,
    LayoutOffer,
    StrideOrder,
    negotiate_layout,
)

__all__ = ["Described", "describe_kv_caches", "required_layout_name"]

BACKEND = "vLLM attention backend"
PROVIDER = "vLLM KV-cache allocator"


@attrs.frozen
class Described:
    """The connector's view of vLLM's caches: tensors in kvspec's storage shape, by layer
    name in vLLM's order, and their descriptor."""

    tensors: Mapping[str, torch.Tensor]
    layout: KVCacheLayout


def required_layout_name(capabilities: Capabilities) -> str | None:
    """What ``get_required_kvcache_layout`` tells vLLM: the connector's most preferred
    stride order (vLLM 0.32 knows the same six names), or None when it accepts every order.
    vLLM drops the preference with a warning when its backends cannot use it; the
    negotiation at registration then refuses the connector with a typed error (LAY-010)."""
    orders = capabilities.accepted_layouts
    return orders[0].name if orders else None


def _storage_view(
    t: torch.Tensor, heads: int, block_size: int, head_size: int
) -> tuple[torch.Tensor, KVPacking]:
    """``t`` as kvspec's per-layer storage shape: ``(B, H, N, C)`` or ``(2, B, H, N, D)``."""
    shape = tuple(t.shape)
    if t.dim() == 4 and shape[1:] == (heads, block_size, 2 * head_size):
        return t, KVPacking.CONCAT
    if t.dim() == 4 and shape[1:] == (block_size, heads, 2 * head_size):
        return t.permute(0, 2, 1, 3), KVPacking.CONCAT
    if t.dim() == 5 and shape[0] == 2 and shape[2:] == (block_size, heads, head_size):
        return t.permute(0, 1, 3, 2, 4), KVPacking.SPLIT
    if t.dim() == 5 and shape[0] == 2 and shape[2:] == (heads, block_size, head_size):
        return t, KVPacking.SPLIT
    raise LayoutMismatchError(
        f"a vLLM KV-cache tensor has shape {shape}; expected [B, H, N, 2*D] or [B, N, H, 2*D]"
        f" (K and V concatenated) or [2, B, N, H, D] or [2, B, H, N, D] (split), with "
        f"H={heads} KV heads, N={block_size} tokens per block, D={head_size}",
        clause="LAY-008",
    )


def describe_kv_caches(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    capabilities: Capabilities,
    num_blocks: int,
    num_heads: int,
    block_size: int,
    head_size: int,
    opaque_pages: bool,
    vllm_layout: str | None,
) -> Described:
    """Describe vLLM's per-layer caches and check the connector accepts them.

    ``opaque_pages`` is True on vLLM-CPU (kernel-packed pages, LAY-014); ``vllm_layout``
    is the stride-order name vLLM resolved (``KVCacheConfig.kv_cache_layout``), checked
    against the strides.

    Raises:
        LayoutMismatchError: the tensors are not views of one buffer in one of the shapes
            vLLM uses, or their strides contradict ``vllm_layout`` (LAY-008).
        LayoutNegotiationError: the connector refuses vLLM's order or packing, or needs
            token rows in opaque pages; the message names who refused what (LAY-010,
            LAY-014).
    """
    if not kv_caches:
        raise LayoutMismatchError("vLLM registered no KV-cache tensor", clause="LAY-008")
    views: dict[str, torch.Tensor] = {}
    packings = set()
    for name, tensor in kv_caches.items():
        if not isinstance(tensor, torch.Tensor):
            raise LayoutMismatchError(
                f"KV cache of layer {name!r} is a {type(tensor).__name__}, not a tensor",
                clause="LAY-008",
            )
        views[name], packing = _storage_view(tensor, num_heads, block_size, head_size)
        packings.add(packing)
    if len(packings) != 1:
        raise LayoutMismatchError(
            "vLLM's layers mix concatenated and split K/V caches; expected one packing",
            clause="LAY-008",
        )
    packing = packings.pop()
    order = None
    if vllm_layout is not None:
        order = StrideOrder.parse(vllm_layout)
    layout = KVCacheLayout.from_layer_tensors(
        list(views.values()), packing=packing, num_blocks=num_blocks, num_heads=num_heads,
        head_size_k=head_size, head_size_v=head_size, restridable=False,
        opaque_pages=opaque_pages,
        order=order if order is not None and len(views) > 1 else None,
    )
    engine = LayoutOffer(BACKEND, (layout.order,), (packing,), can_restride=False,
                         opaque_pages=opaque_pages)
    provider = LayoutOffer(PROVIDER, (layout.order,), (packing,), can_restride=False)
    negotiate_layout(capabilities.layout_offer(), engine, provider)
    return Described(views, layout)
