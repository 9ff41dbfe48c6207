"""Head-sliced block runs: which bytes of a peer's block hold which of this rank's heads.

Under tensor parallelism rank ``r`` of ``T`` holds the KV heads ``r*H .. r*H+H-1`` of the
model (``H = heads // T``). When a producer and a consumer run different TP sizes, a
consumer rank reads each producer rank whose heads overlap its own, and only those heads:
with 2 producer ranks and 1 consumer rank, the consumer reads half of its block from each;
with 1 producer rank and 2 consumer ranks, each consumer rank reads half of the producer's
block.

``head_runs`` turns two layouts (``LayoutSummary``, which carries the element
strides) and the two head ranges into pairs of byte runs of block 0: the unit of data is one
head's channels of one token (K and V together for CONCAT, one of them for SPLIT), in one
layer storage; units that are contiguous on both sides merge into one run. Head-split
layouts (``H`` outside ``N``: HND and the other ``..H N C`` orders) give one run per layer
storage (and K/V half for SPLIT); token-major layouts (NHD) give one per token as well.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from kvspec.protocols.errors import CompatibilityError, InvalidArgumentError

from ._descriptors import BlockRuns, LayoutSummary

__all__ = ["head_runs", "overlap"]

_MAX_UNITS: Final = 1 << 22


def overlap(a: range, b: range) -> range:
    """The heads two contiguous head ranges share (empty when they do not)."""
    return range(max(a.start, b.start), max(max(a.start, b.start), min(a.stop, b.stop)))


def _unit_offsets(
    summary: LayoutSummary, heads: range, first_head: int, element_size: int
) -> npt.NDArray[np.int64]:
    """Byte offsets in block 0 of every (layer storage, K/V, head, token) unit of
    ``heads`` (model head numbers; the side's first head is ``first_head``), in that
    logical order."""
    strides = summary.strides
    if summary.packing == "SPLIT":
        s_layer, s_kv, _, s_head, s_token, s_chan = strides
        halves = 2
    else:
        s_layer, _, s_head, s_token, s_chan = strides
        s_kv, halves = 0, 1
    if s_chan != 1:
        raise CompatibilityError(
            f"a head's channels are not contiguous (channel stride {s_chan}); heterogeneous "
            f"TP reads whole heads", clause="HSK-003",
        )
    layer = np.arange(summary.storage_layers, dtype=np.int64) * s_layer
    kv = np.arange(halves, dtype=np.int64) * s_kv
    head = (np.arange(heads.start, heads.stop, dtype=np.int64) - first_head) * s_head
    token = np.arange(summary.block_size, dtype=np.int64) * s_token
    elems = (layer[:, None, None, None] + kv[None, :, None, None]
             + head[None, None, :, None] + token[None, None, None, :])
    return elems.reshape(-1) * element_size


def head_runs(
    local: LayoutSummary,
    local_heads: range,
    remote: LayoutSummary,
    remote_heads: range,
    element_size: int,
) -> tuple[BlockRuns, BlockRuns]:
    """The paired runs of block 0 that move the heads both ranges share from ``remote``'s
    block to ``local``'s: ``(local runs, remote runs)``, pairwise of equal length, ascending
    in the local block.

    Args:
        local: The reading rank's layout.
        local_heads: The model heads it holds (``len == local.num_heads``).
        remote: The read rank's layout.
        remote_heads: The model heads that rank holds.
        element_size: Bytes per element (the two dtypes are equal).

    Raises:
        InvalidArgumentError: a head range does not match its layout, or the ranges share
            no head.
        CompatibilityError: the layouts differ in packing, layer storages, block size or
            head sizes, or a head's channels are not contiguous (HSK-003).
    """
    for name, summary, heads in (("local", local, local_heads), ("remote", remote, remote_heads)):
        if not isinstance(heads, range) or heads.step != 1 or len(heads) != summary.num_heads:
            raise InvalidArgumentError(
                f"{name} heads must be a range of {summary.num_heads} consecutive heads, "
                f"got {heads!r}"
            )
    for key in ("packing", "storage_layers", "block_size", "head_size_k", "head_size_v"):
        if getattr(local, key) != getattr(remote, key):
            raise CompatibilityError(
                f"layout {key} differs: {getattr(local, key)!r} here, "
                f"{getattr(remote, key)!r} at the peer", clause="HSK-003",
            )
    shared = overlap(local_heads, remote_heads)
    if not shared:
        raise InvalidArgumentError(
            f"heads {local_heads} and {remote_heads} do not overlap: nothing to read"
        )
    units = local.storage_layers * len(shared) * local.block_size * (
        2 if local.packing == "SPLIT" else 1
    )
    if units > _MAX_UNITS:
        raise InvalidArgumentError(f"{units} head units per block exceed {_MAX_UNITS}")
    width = local.head_size_k if local.packing == "SPLIT" else (
        local.head_size_k + local.head_size_v
    )
    nbytes = width * element_size
    mine = _unit_offsets(local, shared, local_heads.start, element_size)
    theirs = _unit_offsets(remote, shared, remote_heads.start, element_size)
    order = np.argsort(mine, kind="stable")
    mine, theirs = mine[order], theirs[order]
    # A new run starts wherever either side is not contiguous with the previous unit.
    breaks = np.flatnonzero((np.diff(mine) != nbytes) | (np.diff(theirs) != nbytes)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [mine.size])))
    lengths = (counts * nbytes).tolist()
    return (
        tuple(zip(mine[starts].tolist(), lengths)),
        tuple(zip(theirs[starts].tolist(), lengths)),
    )
