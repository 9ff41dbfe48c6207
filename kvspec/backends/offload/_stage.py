"""The capturable per-layer store path of the offloading backend (``store_path="layerwise"``).

Instead of the background thread gathering a finished request's blocks from the KV caches,
the gather runs inside the forward, layer by layer, as device work of fixed shape on
persistent buffers, so it can be captured in a CUDA graph and replayed (GRA-004, GRA-005):

* ``save_idx`` (int64 ``[S]``): the blocks this forward stores, filled in place before the
  forward (``start_load_kv``, outside any captured region, GRA-007); unused entries name
  block 0, which is only read;
* ``staging`` (``[S, block elements]`` in the KV's integer dtype of the same width): the
  stored blocks in the host pool's slot format, written by the hooks.

``save_kv_layer`` gathers the layer's ``S`` blocks along the block dim and writes them at the
layer's positions in each staged block: one slice copy when the layer's bytes are one run
of the slot (layer-major layouts), else one column scatter with a position index built at
registration. After the forward, ``SaveStage.drain`` copies the first ``n`` staged rows
into the pool's slots, one contiguous copy per run of consecutive slots.

Blocks stored this way are held by the engine's delayed free until reported (SCH-016), so
reading them during a later forward is safe; a forward's stores are capped at ``S`` blocks
and the rest wait for the next forward.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvspec.protocols import InvalidArgumentError, KVCacheLayout, KVPacking

from ._pool import HostPool

__all__ = ["SaveStage"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size: byte-exact moves for every dtype."""
    return t.view(_INT_OF_SIZE[t.element_size()])


class _Layer:
    """What one layer storage's hook needs, built at registration."""

    __slots__ = ("kv", "dim", "positions", "run", "index")

    def __init__(self, kv: torch.Tensor, dim: int, positions: torch.Tensor, index: int) -> None:
        self.kv = kv
        self.dim = dim
        self.index = index
        first = int(positions[0])
        contiguous = bool(torch.equal(
            positions, torch.arange(first, first + positions.numel(), dtype=torch.int64)
        ))
        self.run: tuple[int, int] | None = (first, first + positions.numel()) if contiguous \
            else None
        self.positions = positions.to(kv.device)


class SaveStage:
    """The persistent buffers and hooks of the per-layer store path of one worker.

    Args:
        kv_caches: The registered layer tensors, in layer order.
        layout: Their layout (checked by the worker, LAY-008).
        pool: The worker's host pool; staged blocks are copied into its slots.
        stage_blocks: ``S``, the most blocks one forward stores.

    Raises:
        InvalidArgumentError: ``stage_blocks`` < 1.
    """

    def __init__(
        self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout, pool: HostPool,
        stage_blocks: int,
    ) -> None:
        if stage_blocks < 1:
            raise InvalidArgumentError(
                f"stage_blocks must be >= 1, got {stage_blocks}", clause="ERR-002"
            )
        tensors = list(kv_caches.values())
        esize = layout.element_size
        device = tensors[0].device
        self.size = stage_blocks
        self.pool = pool
        per_block = pool.bytes_per_block // esize
        self.save_idx = torch.zeros(stage_blocks, dtype=torch.int64, device=device)
        """Persistent: the blocks of this forward's stores, padded with block 0."""
        self.staging = torch.zeros(
            stage_blocks, per_block, dtype=_INT_OF_SIZE[esize], device=device
        )
        """Persistent: the staged blocks, in the pool's slot format."""
        self._host = pool.host.view(_INT_OF_SIZE[esize]).view(pool.slots, per_block)
        # Slot position (in elements) of each element of a block: regions ascend in the slot.
        starts = layout.block_region_offsets([0])[0] // esize  # element offsets, block 0
        region = layout.region_nbytes // esize
        base = tensors[0].storage_offset()
        dim = 1 if layout.packing is KVPacking.SPLIT else 0
        self._layers: dict[str, _Layer | None] = {}
        seen: set[int] = set()
        for name, tensor, slot in zip(kv_caches, tensors, layout.layer_slots):
            if slot in seen:  # a layer sharing an earlier layer's storage (LAY-011)
                self._layers[name] = None
                continue
            seen.add(slot)
            block0 = tensor.select(dim, 0)
            offsets = torch.full((), int(block0.storage_offset() - base), dtype=torch.int64)
            for size, stride in zip(block0.shape, block0.stride()):
                offsets = offsets[..., None] + torch.arange(size, dtype=torch.int64) * stride
            flat = offsets.reshape(-1)
            which = torch.searchsorted(starts, flat, right=True) - 1
            positions = which * region + (flat - starts[which])
            self._layers[name] = _Layer(_bits(tensor), dim, positions, len(seen) - 1)
        self.saved = torch.zeros(len(seen), dtype=torch.int32, device=device)
        """Persistent: 1 for each layer storage whose hook ran since ``fill`` (set by
        the hook itself, so a replayed graph sets it too)."""
        self._batch: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())

    @property
    def buffers(self) -> Mapping[str, torch.Tensor]:
        """The persistent buffers the captured hooks read and write (GRA-005)."""
        return {"save_idx": self.save_idx, "staging": self.staging, "saved": self.saved}

    @property
    def pending(self) -> int:
        """Blocks staged by the current forward and not yet drained."""
        return len(self._batch[0])

    def fill(self, block_ids: tuple[int, ...], slots: tuple[int, ...]) -> None:
        """Point ``save_idx`` at this forward's ``block_ids`` (at most ``size``),
        before the forward and outside any captured region (GRA-007)."""
        n = len(block_ids)
        if n > self.size or n != len(slots):
            raise InvalidArgumentError(
                f"{n} blocks and {len(slots)} slots for a stage of {self.size}",
                clause="ERR-002",
            )
        index = torch.zeros(self.size, dtype=torch.int64)
        if n:
            index[:n] = torch.tensor(block_ids, dtype=torch.int64)
        self.save_idx.copy_(index, non_blocking=True)
        self.saved.zero_()
        self._batch = (block_ids, slots)

    @property
    def complete(self) -> bool:
        """Whether every layer storage's hook ran since ``fill`` (reads the device flags:
        call outside captured regions)."""
        return bool(self.saved.all())

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Gather ``kv_layer``'s staged blocks into the staging: fixed-shape device work on
        the persistent buffers, no host sync, capturable (GRA-004, WRK-006).

        Raises:
            InvalidArgumentError: an unregistered layer, or ``kv_layer`` not shaped like
                its registered tensor.
        """
        try:
            layer = self._layers[layer_name]
        except KeyError:
            raise InvalidArgumentError(
                f"save_kv_layer: unknown layer {layer_name!r}; expected one of "
                f"{list(self._layers)}", clause="ERR-002",
            ) from None
        if layer is None:
            return
        if not isinstance(kv_layer, torch.Tensor) or kv_layer.shape != layer.kv.shape:
            raise InvalidArgumentError(
                f"save_kv_layer({layer_name!r}): kv_layer must be the layer's registered "
                f"tensor of shape {tuple(layer.kv.shape)}", clause="WRK-006",
            )
        blocks = _bits(kv_layer).index_select(layer.dim, self.save_idx)
        if layer.dim:
            blocks = blocks.movedim(layer.dim, 0)
        rows = blocks.reshape(self.size, -1)
        if layer.run is not None:
            self.staging[:, layer.run[0]:layer.run[1]].copy_(rows)
        else:
            self.staging.index_copy_(1, layer.positions, rows)
        self.saved[layer.index].fill_(1)

    def drain(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """After the forward: copy the staged blocks into their pool slots (one copy per
        run of consecutive slots; complete on return) and return the ``(block_ids,
        slots)`` stored.

        Raises:
            InvalidArgumentError: some layer's hook did not run since ``fill`` (check
                ``complete`` first).
        """
        block_ids, slots = self._batch
        if block_ids and not self.complete:
            raise InvalidArgumentError(
                "drain before every layer's save_kv_layer ran", clause="WRK-006"
            )
        self._batch = ((), ())
        if not block_ids:
            return block_ids, slots
        plan = self.pool.plan(block_ids, slots)
        for slot, pos, n in plan.runs:
            self._host[slot:slot + n].copy_(self.staging[pos:pos + n])
        return block_ids, slots

    def cancel(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Forget the staged batch without storing it (no forward ran); return it."""
        batch, self._batch = self._batch, ((), ())
        return batch

    def release(self) -> None:
        """Drop every buffer and tensor reference (WRK-015)."""
        empty = torch.empty(0, dtype=torch.int64)
        self.save_idx = empty
        self.staging = empty.view(0, 0)
        self.saved = empty
        self._host = empty.view(0, 0)
        self._layers = {}
