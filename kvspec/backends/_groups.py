"""What the reference backends share about KV-cache groups (KVG-001..KVG-004): which
group keys the blocks, and how far a match may reach when some positions lack a group's
block."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvspec.protocols import (
    CapabilityError,
    EngineConfigView,
    GroupKind,
    KVCacheGroup,
    KVCacheLayout,
)

__all__ = ["spine_of", "storage_of", "whole_prefix"]

_MOVED = (GroupKind.FULL, GroupKind.SLIDING_WINDOW)


def spine_of(config: EngineConfigView, backend: str, *, states: bool = False) -> int:
    """The group whose block positions key a hybrid engine's blocks: its first
    full-attention group (0 with one group). With ``states``, state groups (of any block
    size: vLLM's RUNNING state block is ``max_model_len`` tokens) are accepted beside them.

    Raises:
        CapabilityError: a group of another kind than full or sliding-window attention (or
            state, with ``states``) or of another block size, or no full-attention group
            (KVG-002).
    """
    groups = config.kv_cache_groups
    for i, g in enumerate(groups):
        if states and g.kind is GroupKind.STATE:
            continue
        if g.kind not in _MOVED or g.block_size != config.block_size:
            raise CapabilityError(
                f"KV-cache group {i} ({g.kind.value}, block size {g.block_size}) is not one "
                f"the {backend} backend moves; expected full or sliding-window attention "
                f"with the engine's block size {config.block_size}", clause="KVG-002")
    spine = next((i for i, g in enumerate(groups) if g.kind is GroupKind.FULL), None)
    if groups and spine is None:
        raise CapabilityError(
            f"the {backend} backend needs a full-attention KV-cache group to key blocks by",
            clause="KVG-002")
    return spine or 0


def whole_prefix(groups: Sequence[KVCacheGroup], spine: int, start: int, n: int,
                 block_size: int, lacks: Callable[[int, int], bool]) -> int:
    """The longest ``m <= n`` blocks after block ``start`` for which every group other
    than the spine has each block a match of ``start + m`` blocks needs (KVG-003):
    ``lacks(group, position)`` says it does not."""
    while n > 0:
        end = (start + n) * block_size
        if not any(lacks(j, i) for j, g in enumerate(groups) if j != spine
                   for i in g.needed_blocks(end) if i >= start):
            return n
        n -= 1
    return 0


def storage_of(layout: KVCacheLayout, offsets: Sequence[int]) -> list[int]:
    """The layer storage (``layout.layer_slots`` value) each byte offset of block 0 lies
    in, for a layer-outermost layout: which group's ids address it (KVG-008)."""
    if layout.num_storage_layers == 1:  # the L stride of a size-1 dim means nothing
        return [0] * len(offsets)
    return [o // layout.layer_stride_bytes for o in offsets]
