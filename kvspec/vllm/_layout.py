"""vLLM's KV-cache tensors as a kvspec ``KVCacheLayout``, and the layout negotiation.

vLLM hands ``register_kv_caches`` one tensor per attention layer, all views into one
buffer. Their shape depends on the attention backend: ``[B, H, N, 2*D]`` on vLLM-CPU (K and
V concatenated in the last dim, kernel-packed pages: K transposed, then V), ``[2, B, N, H,
D]`` for split-K/V GPU backends (any stride order). ``describe_kv_caches`` turns them
into kvspec's storage shape (a view, never a copy: LAY-009) and the descriptor that is true
of them (LAY-006, LAY-014), after checking the layout with the connector's offer (LAY-010).
No vLLM import: the tensors and sizes are passed in.

State layers (vLLM's ``MambaSpec`` groups) reach ``register_kv_caches`` in the same dict, as
int8 byte views ``(blocks, 1, 1, content_bytes)`` whose block stride is the padded page
(they alias the attention layers' pages, one block id per group at a time).
``describe_state_caches`` splits them off and describes each state group with a
``StateLayout`` (STG-001): its components from the spec's ``shapes`` and ``dtypes``, conv
state first, at consecutive byte offsets (vLLM's ``bind_kv_cache`` reads them so), the
padded pitch, and the conv layout vLLM baked into the conv shape.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from kvspec.protocols import (
    Capabilities,
    ConvLayout,
    InvalidArgumentError,
    KVCacheLayout,
    KVPacking,
    LayoutMismatchError,
    LayoutOffer,
    StateLayout,
    StrideOrder,
    negotiate_layout,
)

__all__ = ["Described", "StateSpec", "describe_kv_caches", "describe_state_caches",
           "required_layout_name", "state_component_names"]

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


@attrs.frozen
class StateSpec:
    """What the adapter reads off one vLLM ``MambaSpec`` (no vLLM import here).

    Attributes:
        layer_names: The group's layers.
        shapes: Each component's shape on this rank (``MambaSpec.shapes``), conv first.
        dtypes: Each component's dtype (``MambaSpec.dtypes``).
        page_bytes: The page pitch (``MambaSpec.page_size_bytes``: the padded page).
        mamba_type: The spec's ``mamba_type`` name (``MAMBA2``, ``GDN_ATTN``, ...).
        tp_replicated: ``MambaSpec.tp_replicated``.
    """

    layer_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    page_bytes: int
    mamba_type: str
    tp_replicated: bool = False


_CONV_FIRST = frozenset({"MAMBA1", "MAMBA2", "GDN_ATTN", "SHORT_CONV", "KDA"})
"""``mamba_type`` names whose first component is a convolution state (vLLM's
``mamba_utils`` state shapes): its dims follow ``VLLM_SSM_CONV_STATE_LAYOUT``."""


def state_component_names(mamba_type: str, count: int) -> tuple[str, ...]:
    """Component names of a state page: ``conv`` then ``ssm`` for the kinds with a conv
    state, then ``extra1``...; ``state0``... for any other kind."""
    if mamba_type.upper() in _CONV_FIRST:
        names = ["conv", "ssm"][:count]
        return (*names, *(f"extra{i}" for i in range(1, count - len(names) + 1)))
    return tuple(f"state{i}" for i in range(count))


def describe_state_caches(
    kv_caches: Mapping[str, torch.Tensor],
    specs: Mapping[int, StateSpec],
    *,
    num_blocks: int,
    conv_layout: str | None,
    tp_size: int,
    tp_rank: int,
) -> tuple[dict[str, torch.Tensor], dict[int, StateLayout]]:
    """Split the state layers off vLLM's registered caches and describe each state group
    (STG-001): the tensors by layer name (vLLM's byte views, untouched: LAY-009) and each
    group's ``StateLayout`` by its index in vLLM's group order, checked against every one of
    its layers' tensors.

    Raises:
        LayoutMismatchError: a state layer is missing, or its tensor is not the byte view its
            spec implies (LAY-008).
        InvalidArgumentError: ``conv_layout`` is not "SD", "DS" or None (STG-010).
    """
    conv: ConvLayout | None = None
    if conv_layout is not None:
        try:
            conv = ConvLayout(conv_layout)
        except ValueError:
            raise InvalidArgumentError(
                f"vLLM's conv-state layout is {conv_layout!r}; expected 'SD' or 'DS' "
                "(VLLM_SSM_CONV_STATE_LAYOUT)", clause="STG-010") from None
    tensors: dict[str, torch.Tensor] = {}
    layouts: dict[int, StateLayout] = {}
    for index, spec in specs.items():
        names = state_component_names(spec.mamba_type, len(spec.shapes))
        first = kv_caches.get(spec.layer_names[0]) if spec.layer_names else None
        if first is None:
            raise LayoutMismatchError(
                f"state group {index}: vLLM registered no tensor for layer "
                f"{spec.layer_names[:1]}", clause="LAY-008")
        layout = StateLayout.contiguous(
            list(zip(names, spec.shapes, spec.dtypes)), num_blocks,
            page_pitch_bytes=spec.page_bytes, block_capacity=int(first.shape[0]),
            conv_layout=conv if names[0] == "conv" else None,
            tp_size=tp_size, tp_rank=tp_rank, tp_replicated=spec.tp_replicated)
        for name in spec.layer_names:
            tensor = kv_caches.get(name)
            if tensor is None:
                raise LayoutMismatchError(
                    f"state group {index}: vLLM registered no tensor for layer {name!r}",
                    clause="LAY-008")
            try:
                layout.check_tensor(tensor)
            except LayoutMismatchError as e:
                raise LayoutMismatchError(f"state layer {name!r}: {e.message}",
                                          clause="LAY-008") from None
            tensors[name] = tensor
        layouts[index] = layout
    return tensors, layouts

