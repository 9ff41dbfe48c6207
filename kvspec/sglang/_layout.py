"""SGLang's HiCache host pools described with kvspec's layout descriptor.

A storage key names one page of the host pool: ``page_size`` tokens, every layer, K and V.
Seen as kvspec's logical KV space, a page is a *block* (``B`` = pages, ``N`` = tokens in a
page), so the pool's ``kv_buffer`` is a ``KVCacheLayout`` and a page's bytes are its block's
regions (``block_region_offsets``), in ascending byte order. That order is also the order
of SGLang's own flat page (``get_data_page``) for the layouts accepted here, so the zero-copy
and the generic interfaces store the same bytes.

Accepted (shapes from sglang 0.5.23, ``mem_cache/pool_host``): MHA ``layer_first``
``[2, L, tokens, H, D]`` (order LBNHC, K/V split outermost) and ``page_first_direct``
``[2, pages, L, N, H, D]`` (BLNHC); MLA ``layer_first`` ``[L, tokens, 1, C]`` and
``page_first_direct`` ``[pages, L, N, 1, C]``. Refused with ``LayoutMismatchError``:
``page_first`` (a page is ``N L H C``: tokens outside layers, none of the six stride
orders, LAY-001), ``page_head`` and any other layout (LAY-001), and a buffer whose shape or
strides do not match its layout name (LAY-008).
"""

from __future__ import annotations

from typing import Any

import torch

from ..protocols.errors import LayoutMismatchError
from ..protocols.layout import KVCacheLayout, KVPacking

__all__ = ["describe_host_pool"]

_ORDERLESS = {"page_first": "N L H C (tokens outside layers)",
              "page_head": "H N L C (heads outside tokens, layers inside)"}


def describe_host_pool(pool: Any) -> KVCacheLayout:
    """The ``KVCacheLayout`` of ``pool.kv_buffer``: one block per page of ``pool.page_size``
    tokens, ``num_blocks`` = pages.

    Raises:
        LayoutMismatchError: the layout has no kvspec stride order (LAY-001), or the buffer
            is not a contiguous CPU tensor of the shape its layout names (LAY-008).
    """
    name, page = getattr(pool, "layout", None), getattr(pool, "page_size", None)
    buf = getattr(pool, "kv_buffer", None)
    if name in _ORDERLESS or name not in ("layer_first", "page_first_direct"):
        how = _ORDERLESS.get(str(name), "a layout kvspec.sglang does not know")
        raise LayoutMismatchError(
            f"SGLang's {name!r} host layout stores a page as {how}, which is none of the six "
            "stride orders a KVCacheLayout describes; use --hicache-mem-layout layer_first or "
            "page_first_direct", clause="LAY-001")
    if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" or not buf.is_contiguous() \
            or type(page) is not int or page < 1:
        raise LayoutMismatchError(
            f"expected the host pool's kv_buffer to be a contiguous CPU tensor and page_size an "
            f"int >= 1, got {type(buf).__name__} and {page!r}", clause="LAY-008")
    mla = buf.dim() == (4 if name == "layer_first" else 5)
    try:
        if not mla:  # [2, L, T, H, D] or [2, P, L, N, H, D]  ->  (L, S, B, H, N, D)
            if name == "layer_first":
                _, layers, tokens, heads, dim = buf.shape
                view = buf.view(2, layers, tokens // page, page, heads, dim).permute(1, 0, 2, 4, 3, 5)
            else:
                view = buf.permute(2, 0, 1, 4, 3, 5)
            return KVCacheLayout.from_tensor(view, packing=KVPacking.SPLIT, num_blocks=view.shape[2],
                                             num_heads=view.shape[3], head_size_k=view.shape[5])
        # MLA: [L, T, 1, C] or [P, L, N, 1, C]  ->  (L, B, H, N, C), K = the latent part
        if name == "layer_first":
            layers, tokens, heads, width = buf.shape
            view = buf.view(layers, tokens // page, page, heads, width).permute(0, 1, 3, 2, 4)
        else:
            view = buf.permute(1, 0, 3, 2, 4)
        latent = getattr(pool, "kv_lora_rank", None)
        if type(latent) is not int or not 0 < latent < view.shape[4]:
            raise LayoutMismatchError(f"an MLA host pool with kv_lora_rank={latent!r} and "
                                      f"{view.shape[4]} channels", clause="LAY-008")
        return KVCacheLayout.from_tensor(view, packing=KVPacking.CONCAT, num_blocks=view.shape[1],
                                         num_heads=view.shape[2], head_size_k=latent,
                                         head_size_v=view.shape[4] - latent)
    except (RuntimeError, ValueError) as e:  # a shape that does not fit its layout name
        raise LayoutMismatchError(f"the {name!r} host buffer of shape {tuple(buf.shape)} with "
                                  f"page_size {page}: {e}", clause="LAY-008") from e
