"""The host buffer pool of one worker rank, and the vectorised block gathers and scatters.

The pool is one contiguous ``uint8`` tensor of ``slots * bytes_per_block`` bytes, allocated
once (pinned when CUDA is available), viewed as ``[slots, bytes_per_block]``. A slot holds
one block of this rank, every layer storage (LAY-011), the block's regions concatenated in
ascending byte order; padding is never copied (LAY-004).

The KV caches are reached through one flat ``uint8`` view of the buffer behind the layer
tensors, starting at layer 0's first byte, so that :meth:`KVCacheLayout.block_region_offsets`
are indices into it (LAY-006). Blocks move with one indexed op per direction and job, never
a Python loop over layers or blocks, by one of three paths (:attr:`HostPool.path`):

``"block"``
    one region per block (unpadded block-outermost layouts, LAY-013): a
    ``[block_capacity, region_nbytes]`` view of the KV buffer with the block stride, indexed
    by block id.
``"rows"``
    every region offset is a multiple of ``region_nbytes``: a ``[rows, region_nbytes]`` view
    of the KV buffer indexed by ``offset // region_nbytes``.
``"bytes"``
    anything else: a byte index ``offsets[:, :, None] + arange(region_nbytes)`` over the
    flat view.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvspec.protocols import InvalidArgumentError, KVCacheLayout, LayoutMismatchError

__all__ = ["HostPool", "OffloadCapacityError"]


class OffloadCapacityError(InvalidArgumentError):
    """The host pool (``offload_slots`` blocks of this rank's size) exceeds the byte budget
    ``offload_bytes``, or a slot index is outside the pool (ERR-002)."""


def _flat_bytes(tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A flat uint8 view of ``nbytes`` bytes starting at ``tensor``'s first element."""
    storage = tensor.untyped_storage()
    start = tensor.storage_offset() * tensor.element_size()
    if start + nbytes > storage.nbytes():
        raise LayoutMismatchError(
            f"the layer tensors' buffer holds {storage.nbytes() - start} bytes from layer 0; "
            f"the layout spans {nbytes}",
            clause="LAY-008",
        )
    whole = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    whole.set_(storage, 0, (storage.nbytes(),), (1,))
    return whole[start:start + nbytes]


class HostPool:
    """Host memory for ``slots`` blocks of one rank, and the copies to and from the KV caches.

    Args:
        kv_layer0: The first registered layer tensor; every layer is a view of its buffer
            at the offsets the layout states (checked by the worker, LAY-008).
        layout: The descriptor of the registered tensors (LAY-007).
        slots: Capacity of the pool, in blocks.
        budget_bytes: The byte budget per rank the pool must fit in.

    Raises:
        OffloadCapacityError: ``slots * bytes_per_block > budget_bytes``.
        LayoutMismatchError: the buffer is smaller than the layout's span (LAY-008).
    """

    def __init__(
        self, kv_layer0: torch.Tensor, layout: KVCacheLayout, slots: int, budget_bytes: int
    ) -> None:
        self.layout = layout
        self.region_nbytes = layout.region_nbytes
        self.regions_per_block = layout.regions_per_block
        self.bytes_per_block = self.region_nbytes * self.regions_per_block
        """Bytes of one block of this rank, every layer storage, without padding."""
        self.slots = slots
        need = slots * self.bytes_per_block
        if need > budget_bytes:
            raise OffloadCapacityError(
                f"offload_slots={slots} blocks of {self.bytes_per_block} bytes need {need} "
                f"bytes of host memory per rank; the budget offload_bytes is {budget_bytes}. "
                f"Raise offload_bytes or lower offload_slots to at most "
                f"{budget_bytes // self.bytes_per_block}",
                clause="ERR-002",
            )
        self.device = kv_layer0.device
        self._kv = _flat_bytes(kv_layer0, layout.span_bytes)
        pin = torch.cuda.is_available()
        self.host = torch.zeros(need, dtype=torch.uint8, pin_memory=pin).view(
            slots, self.bytes_per_block
        )
        """The pool: ``[slots, bytes_per_block]`` uint8 on the host."""
        bases = layout.block_region_offsets([0])[0]
        base0 = int(bases[0])
        r = self.region_nbytes
        self._rows: torch.Tensor | None = None
        self._blocks: torch.Tensor | None = None
        if self.regions_per_block == 1 and (
            (layout.block_capacity - 1) * layout.block_stride_bytes + base0 + r <= layout.span_bytes
        ):
            self.path = "block"
            self._blocks = torch.as_strided(
                self._kv, (layout.block_capacity, r), (layout.block_stride_bytes, 1),
                self._kv.storage_offset() + base0,
            )
        elif layout.block_stride_bytes % r == 0 and all(int(b) % r == 0 for b in bases):
            self.path = "rows"
            self._rows = self._kv[: (layout.span_bytes // r) * r].view(-1, r)
        else:
            self.path = "bytes"
        self._arange = torch.arange(r, dtype=torch.int64, device=self.device)

    def _check_slots(self, slots: Sequence[int]) -> torch.Tensor:
        bad = [s for s in slots if not 0 <= s < self.slots]
        if bad:
            raise OffloadCapacityError(
                f"slot {bad[0]} is outside the host pool [0, {self.slots}); the scheduler "
                "and the workers must agree on offload_slots",
                clause="ERR-002",
            )
        return torch.tensor(list(slots), dtype=torch.int64)

    def _index(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The indexed view and the index of the regions of ``block_ids``, in block order."""
        layout = self.layout
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        offsets = layout.block_region_offsets(ids)  # [n, R], range-checked (LAY-012)
        if self.path == "block":
            assert self._blocks is not None
            return self._blocks, ids
        if self.path == "rows":
            assert self._rows is not None
            return self._rows, (offsets // self.region_nbytes).reshape(-1)
        index = (offsets[:, :, None] + self._arange[None, None, :]).reshape(-1)
        return self._kv, index

    def store(self, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        """Copy the blocks ``block_ids`` of the KV caches into the pool's ``slots``, pairwise,
        with one gather and one scatter.

        Raises:
            InvalidBlockIdError: a block id outside ``[0, num_blocks)`` (LAY-012).
            OffloadCapacityError: a slot outside the pool.
        """
        if not block_ids:
            return
        slot_index = self._check_slots(slots)
        view, index = self._index(block_ids)
        assert index is not None
        data = view.index_select(0, index).reshape(len(block_ids), self.bytes_per_block)
        self.host.index_copy_(0, slot_index, data.to("cpu"))

    def load(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy the pool's ``slots`` into the blocks ``block_ids`` of the KV caches, pairwise,
        with one gather and one scatter.

        Raises:
            InvalidBlockIdError: a block id outside ``[0, num_blocks)`` (LAY-012).
            OffloadCapacityError: a slot outside the pool.
        """
        if not block_ids:
            return
        slot_index = self._check_slots(slots)
        view, index = self._index(block_ids)
        assert index is not None
        data = self.host.index_select(0, slot_index).to(self.device, non_blocking=True)
        src = data.reshape(-1, view.shape[1]) if view.dim() == 2 else data.reshape(-1)
        view.index_copy_(0, index, src)

    def release(self) -> None:
        """Drop the references to the KV caches and the host memory (WRK-015)."""
        empty = torch.empty(0, dtype=torch.uint8)
        self._kv = self._arange = empty
        self._rows = self._blocks = None
        self.host = empty.view(0, 0)
