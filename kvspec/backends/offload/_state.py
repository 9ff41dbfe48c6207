"""The host copies of state groups' states (STG-001): one row of content bytes per pool slot.

A state-space hybrid's slot holds, beside its attention regions (``HostPool``), each state
layer's content bytes of the state after the slot's block (when the store read it at that
boundary, STG-006). Only content bytes move: a state page's padding to the attention page
is never copied (LAY-004). A job's state columns name, per position, the state group's block
or the null block (KVG-004); each non-null one is copied layer by layer through
``StateLayout.block_bytes`` (a few states per job: one per request and boundary).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvspec.protocols import NULL_BLOCK_ID, InvalidArgumentError, StateLayout

__all__ = ["StatePool"]


class StatePool:
    """Host memory for the states of ``slots`` pool slots.

    Args:
        tensors: The state layers' tensors, by layer name (``register_state_caches``).
        layouts: Each state group's layout, by group index.
        layers: Each state group's layer names, by group index.
        slots: Pool capacity, in slots (the attention pool's).

    Raises:
        InvalidArgumentError: a group's layer has no tensor (STG-001).
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], layouts: Mapping[int, StateLayout],
                 layers: Mapping[int, Sequence[str]], slots: int) -> None:
        self._parts: dict[int, list[tuple[torch.Tensor, int, int]]] = {}
        offset = 0
        for group, layout in sorted(layouts.items()):
            parts = []
            for name in layers[group]:
                tensor = tensors.get(name)
                if tensor is None:
                    raise InvalidArgumentError(
                        f"state group {group}: no tensor registered for layer {name!r}",
                        clause="STG-001")
                layout.check_tensor(tensor)
                parts.append((tensor, offset, layout.content_bytes))
                offset += layout.content_bytes
            self._parts[group] = parts
        self._layouts = dict(layouts)
        self.bytes_per_slot = offset
        """Content bytes of every state layer, per slot."""
        self.host = torch.zeros(slots, max(1, offset), dtype=torch.uint8)
        """``[slots, bytes_per_slot]``: the states, on the host."""

    def move(self, columns: Mapping[int, Sequence[int]], slots: Sequence[int],
             store: bool) -> int:
        """Copy each non-null state block of ``columns`` (by group, pairwise with
        ``slots``) into its slot (``store``) or back; return the bytes moved."""
        moved = 0
        for group, column in columns.items():
            layout = self._layouts[group]
            for block, slot in zip(column, slots):
                if block == NULL_BLOCK_ID:
                    continue
                for tensor, offset, nbytes in self._parts[group]:
                    device = layout.block_bytes(tensor, block)
                    host = self.host[slot, offset:offset + nbytes]
                    if store:
                        host.copy_(device)
                    else:
                        device.copy_(host)
                    moved += nbytes
        return moved
