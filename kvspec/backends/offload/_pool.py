"""The host buffer pool of one worker rank, and the vectorised block gathers and scatters.

The pool is one contiguous tensor of ``slots * bytes_per_block`` bytes, allocated once
(pinned when CUDA is available). A slot holds one block of this rank, every layer storage
(LAY-011), the block's regions concatenated in ascending byte order; padding is never
copied (LAY-004).

The KV caches are reached through one flat view of the buffer behind the layer tensors,
starting at layer 0's first byte, so that ``KVCacheLayout.block_region_offsets`` are
indices into it (LAY-006). Both sides are viewed with the widest element (16, 8, 4, 2 or 1
bytes) that divides the region size, every region offset, the block stride and layer 0's
byte offset: PyTorch's indexed copies move one element per inner-loop step, so copying
4 KiB regions as 256 sixteen-byte elements instead of 4096 bytes is what makes them run at
memory speed. Bytes are copied, never interpreted (no arithmetic, no NaN canonicalisation).

A job is planned once, on the engine's thread (``HostPool.plan``): the range checks and
the runs of consecutive slots. A job of few regions on the host (at most ``_FEW``: a
prefix hit of a few blocks) is moved region by region with ``ctypes.memmove`` between the
addresses the plan's checked ids give: each PyTorch op costs microseconds of dispatch,
more than copying a 16 KiB region, and tens of microseconds in an engine step whose
forward just evicted the caches. Any other job (``HostPool.store``, ``HostPool.load``,
mostly on the worker's background thread) builds the index of the regions to move, with a few
vectorised ops, and moves each run with one indexed op per direction, never a Python loop
over layers or blocks: ``index_select`` into the pool's rows (store) and ``index_copy_``
from them (load), on one of three paths (``HostPool.path``):

``"block"``
    one region per block (unpadded block-outermost layouts, LAY-013): a
    ``[block_capacity, region]`` view of the KV buffer with the block stride, indexed by
    block id; one index entry per block.
``"rows"``
    every region offset is a multiple of the region size (layer-outermost and padded
    layouts whose pitch is whole regions): a ``[rows, region]`` view of the KV buffer
    indexed by ``offset // region``; one index entry per region.
``"elements"``
    anything else: an element index ``offsets[:, :, None] + arange(region)`` over the flat
    view; one index entry per element.

The scheduler places a job's blocks in consecutive slots whenever it can (its free list
hands out the lowest slots first), so a job is usually one run.

With several KV-cache groups (KVG-001, ``group_storages``) a slot holds, for each group,
the regions of the layer storages its layers use, at that group's block id: a storage that
layers of two groups share (vLLM's hybrid allocator) is held once per group. A grouped plan
(``CopyPlan.columns``) gathers the rows of every non-null id into a temporary and scatters
them (two copies, ``_grouped``); null ids are never read or written (KVG-004). Only the
``"rows"`` and ``"block"`` paths with a layer-outermost order move several groups.
"""

from __future__ import annotations

import array
import ctypes
from collections.abc import Callable, Sequence

import attrs
import torch

from kvspec.protocols import (
    NULL_BLOCK_ID,
    InvalidArgumentError,
    InvalidBlockIdError,
    KVCacheLayout,
    LayoutMismatchError,
)

from .._groups import storage_of

__all__ = ["CopyPlan", "HostPool", "OffloadCapacityError"]

_WIDE: tuple[tuple[int, torch.dtype], ...] = (
    (16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16),
    (1, torch.uint8),
)


class OffloadCapacityError(InvalidArgumentError):
    """The host pool (``offload_slots`` blocks of this rank's size) exceeds the byte budget
    ``offload_bytes``, or a slot index is outside the pool (ERR-002)."""


def _flat_bytes(tensor: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, int]:
    """A flat uint8 view of the whole storage behind ``tensor``, and the byte offset of
    ``tensor``'s first element in it (checked to leave ``nbytes`` bytes)."""
    storage = tensor.untyped_storage()
    start = int(tensor.storage_offset()) * tensor.element_size()
    if start + nbytes > storage.nbytes():
        raise LayoutMismatchError(
            f"the layer tensors' buffer holds {storage.nbytes() - start} bytes from layer 0; "
            f"the layout spans {nbytes}",
            clause="LAY-008",
        )
    whole = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    whole.set_(storage, 0, (storage.nbytes(),), (1,))
    return whole, start


def _int64_tensor(values: Sequence[int]) -> torch.Tensor:
    """``values`` as an int64 CPU tensor, without a per-element Python conversion."""
    buf = array.array("q", values)
    return torch.frombuffer(buf, dtype=torch.int64) if buf else torch.empty(0, dtype=torch.int64)


_SMALL = 128
"""Up to this many rows, ``HostPool._index`` computes them in Python."""

_FEW = 64
"""Up to this many regions, a host-memory job is moved with one ``memmove`` per region."""


def _runs(slots: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """``(first slot, first job position, length)`` of each run of consecutive slots."""
    n = len(slots)
    first = slots[0]
    if slots[-1] - first == n - 1 and tuple(slots) == tuple(range(first, first + n)):
        return ((first, 0, n),)
    runs = []
    start = 0
    for i in range(1, n + 1):
        if i == n or slots[i] != slots[i - 1] + 1:
            runs.append((slots[start], start, i - start))
            start = i
    return tuple(runs)


@attrs.frozen
class CopyPlan:
    """A checked, ready-to-run block move between the KV caches and the pool.

    Attributes:
        block_ids: Engine blocks, in job order.
        slots: Pool slots, pairwise with ``block_ids``.
        runs: ``(first slot, first job position, length)`` per run of consecutive slots;
            one indexed op per run and direction.
        columns: With several KV-cache groups, each group's block ids, pairwise with
            ``slots`` (``NULL_BLOCK_ID``: not moved, KVG-004); empty with one group.
    """

    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    runs: tuple[tuple[int, int, int], ...]
    columns: tuple[tuple[int, ...], ...] = ()


class HostPool:
    """Host memory for ``slots`` blocks of one rank, and the copies to and from the KV caches.

    Args:
        kv_layer0: The first registered layer tensor; every layer is a view of its buffer
            at the offsets the layout states (checked by the worker, LAY-008).
        layout: The descriptor of the registered tensors (LAY-007).
        slots: Capacity of the pool, in blocks.
        host: The host memory of an earlier pool over the same layout, kept (its contents
            included) when the KV tensors were re-allocated at an engine's wake (WRK-019);
            None allocates a fresh one.
        budget_bytes: The byte budget per rank the pool must fit in.
        group_storages: With several KV-cache groups, the layer storages (``layer_slots``
            values) each group's layers use, in group order; empty with one group.

    Raises:
        OffloadCapacityError: ``slots * bytes_per_block > budget_bytes``.
        LayoutMismatchError: the buffer is smaller than the layout's span (LAY-008), or
            several groups with a layout the grouped copies do not cover (LAY-010).
    """

    def __init__(
        self, kv_layer0: torch.Tensor, layout: KVCacheLayout, slots: int, budget_bytes: int,
        group_storages: Sequence[frozenset[int]] = (),
        host: torch.Tensor | None = None,
    ) -> None:
        self.layout = layout
        self.region_nbytes = layout.region_nbytes
        self.regions_per_block = layout.regions_per_block
        bases = [int(b) for b in layout.block_region_offsets([0])[0]]
        entries = self._entries(layout, bases, group_storages)
        self.bytes_per_block = self.region_nbytes * (len(entries) or self.regions_per_block)
        """Bytes of one slot: one block of this rank, every layer storage (per group that
        uses it), without padding."""
        self.slots = slots
        self.num_blocks = layout.num_blocks
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
        whole, start = _flat_bytes(kv_layer0, layout.span_bytes)
        r = self.region_nbytes
        stride = layout.block_stride_bytes
        self.element_bytes, dtype = next(
            (w, d) for w, d in _WIDE
            if all(x % w == 0 for x in (r, stride, start, whole.nbytes, *bases))
        )
        """Bytes per element of the indexed copies (16 for the usual layouts)."""
        w = self.element_bytes
        pin = torch.cuda.is_available()
        if host is not None:  # the pool of an earlier registration, kept (sleep and wake)
            if host.dtype != torch.uint8 or tuple(host.shape) != (slots, self.bytes_per_block):
                raise LayoutMismatchError(
                    f"the kept host pool is {tuple(host.shape)} {host.dtype}; the tensors "
                    f"restored need ({slots}, {self.bytes_per_block}) uint8", clause="WRK-019")
            self.host = host
        else:
            self.host = torch.zeros(need, dtype=torch.uint8, pin_memory=pin).view(
                slots, self.bytes_per_block
            )
        """The pool: ``[slots, bytes_per_block]`` uint8 on the host."""
        kv = whole.view(dtype)  # the whole storage, in wide elements
        base = start // w
        rows = r // w
        self._view: torch.Tensor
        self._bases = torch.tensor(bases, dtype=torch.int64) // w  # region starts, elements
        if self.regions_per_block == 1 and (
            (layout.block_capacity - 1) * stride + bases[0] + r <= layout.span_bytes
        ):
            self.path = "block"
            self._view = torch.as_strided(
                kv, (layout.block_capacity, rows), (stride // w, 1), base + bases[0] // w
            )
            self.entries_per_block = 1
        elif stride % r == 0 and all(b % r == 0 for b in bases):
            self.path = "rows"
            self._view = kv[base: base + (layout.span_bytes // r) * rows].view(-1, rows)
            self._bases = torch.tensor(bases, dtype=torch.int64) // r
            self.entries_per_block = self.regions_per_block
        else:
            self.path = "elements"
            self._view = kv[base: base + layout.span_bytes // w]
            self.entries_per_block = self.regions_per_block * rows
        self.columns = len(group_storages) if entries else 0
        """KV-cache groups the pool moves (0: one group, plans without columns)."""
        self._entry_col = self._entry_base = torch.empty(0, dtype=torch.int64)
        self._stride_entries = stride // (r if self.path == "rows" else w)
        self._entry_stride = self._stride_entries  # rows per block id, grouped plans
        if entries:
            if self.path == "elements":
                raise LayoutMismatchError(
                    "the offload backend moves several KV-cache groups only when every "
                    "region offset is a multiple of the region size", clause="LAY-010")
            self.entries_per_block = len(entries)
            self._entry_col = torch.tensor([c for c, _ in entries], dtype=torch.int64)
            if self.path == "block":  # one region per block: the view's row is the id
                self._entry_base = torch.zeros(len(entries), 1, dtype=torch.int64)
                self._entry_stride = 1
            else:
                self._entry_base = self._bases[[i for _, i in entries]].unsqueeze(1)
        self._bases_list: list[int] = self._bases.tolist()
        self._arange = torch.arange(rows, dtype=torch.int64)
        host = self.host.view(dtype)
        self._host = host.view(-1, rows) if self.path != "elements" else host.view(-1)
        self._host_blocks = (host.view(slots, self.entries_per_block, rows)
                             if self.path != "elements" else host)
        """``[slots, entries_per_block, rows]``: a slot's regions (not the elements path)."""
        # For the few-region moves: the tensors (held, so the addresses stay valid while a
        # move runs, even across ``release``), layer 0's first byte, the pool's first byte.
        # Only where every region of every block id below num_blocks lies inside the
        # buffer checked above (raw addresses have no bounds check of their own).
        inside = (self.num_blocks - 1) * stride + max(bases) + r <= layout.span_bytes
        self._addrs: tuple[torch.Tensor, torch.Tensor, int, int] | None = (
            (whole, self.host, whole.data_ptr() + start, self.host.data_ptr())
            if self.device.type == "cpu" and inside and not entries else None
        )
        self._byte_bases = bases
        self._stride_bytes = stride
        self.layer_chunks = () if entries else self._layer_chunks(layout, bases)
        """Per layer storage (LAY-011), the ``[lo, hi)`` range of its regions within a block,
        when a load can be split by layer (``load_by_layer``): host memory, the ``"rows"``
        path and a layer-outermost order; else empty."""

    @staticmethod
    def _entries(layout: KVCacheLayout, bases: list[int],
                 group_storages: Sequence[frozenset[int]]) -> list[tuple[int, int]]:
        """``(group, region)`` of each of a slot's regions with several groups, in slot
        order; empty with one group.

        Raises:
            LayoutMismatchError: the order is block-outermost, or a group names a storage
                the layout does not have (LAY-010).
        """
        if len(group_storages) < 2:
            return []
        if layout.order.block_outermost:
            raise LayoutMismatchError(
                "the offload backend moves several KV-cache groups only with a "
                f"layer-outermost order, got {layout.order.dims}", clause="LAY-010")
        storage = storage_of(layout, bases)
        known = set(storage)
        for g, used in enumerate(group_storages):
            if not used or not used <= known:
                raise LayoutMismatchError(
                    f"KV-cache group {g} uses layer storages {sorted(used)}; the layout has "
                    f"{sorted(known)}", clause="LAY-010")
        return [(g, i) for g, used in enumerate(group_storages)
                for i, s in enumerate(storage) if s in used]

    def _layer_chunks(self, layout: KVCacheLayout, bases: list[int]) -> tuple[tuple[int, int], ...]:
        if self.device.type != "cpu" or self.path != "rows" or layout.order.block_outermost:
            return ()
        layer = [b // layout.layer_stride_bytes for b in bases]  # ascending: L is outermost
        if layer != sorted(layer) or layer[-1] - layer[0] + 1 != layout.num_storage_layers:
            return ()
        return tuple((layer.index(n), len(layer) - layer[::-1].index(n))
                     for n in range(layer[0], layer[-1] + 1))

    # -- planning ---------------------------------------------------------------------------

    def plan(
        self, block_ids: Sequence[int], slots: Sequence[int], *, checked: bool = False,
        columns: Sequence[Sequence[int]] = (),
    ) -> CopyPlan:
        """Check and plan moving ``block_ids`` to or from ``slots``, pairwise. ``checked``:
        they are a ``TransferJob``'s columns (ints, block ids >= 0), so only the upper
        bounds are checked. ``columns``: every group's ids (several KV-cache groups; the
        pool must have been built with ``group_storages``), checked the same way.

        Raises:
            InvalidBlockIdError: a block id outside ``[0, num_blocks)`` (LAY-012).
            OffloadCapacityError: a slot outside the pool, or the lengths differ (ERR-002).
        """
        ids, slot_tuple = tuple(block_ids), tuple(slots)
        if len(ids) != len(slot_tuple) or not ids:
            raise OffloadCapacityError(
                f"{len(ids)} block ids and {len(slot_tuple)} slots; expected the same "
                "non-zero number", clause="ERR-002",
            )
        if (not checked and (not set(map(type, ids)) <= {int} or min(ids) < 0)) or (
            max(ids) >= self.num_blocks
        ):
            bad = next(b for b in ids if type(b) is not int or not 0 <= b < self.num_blocks)
            raise InvalidBlockIdError(
                f"block id {bad!r} is outside the engine's block budget; expected ints in "
                f"[0, num_blocks={self.num_blocks})", clause="LAY-012",
            )
        cols = tuple(tuple(c) for c in columns)
        if bool(cols) != bool(self.columns) or (cols and len(cols) != self.columns):
            raise InvalidArgumentError(
                f"a plan of {len(cols)} group columns for a pool of {self.columns} groups",
                clause="KVG-001")
        for col in cols:
            if len(col) != len(ids) or not set(map(type, col)) <= {int} or min(col) < 0 \
                    or max(col) >= self.num_blocks:
                raise InvalidBlockIdError(
                    f"a group column {col!r:.80} is not {len(ids)} block ids in "
                    f"[0, num_blocks={self.num_blocks})", clause="LAY-012")
        runs = _runs(slot_tuple) if checked or set(map(type, slot_tuple)) <= {int} else ()
        if not runs or (runs[0][0] < 0 or runs[0][0] + runs[0][2] > self.slots
                        if len(runs) == 1  # the usual plan: one run, two comparisons
                        else min(s for s, _, _ in runs) < 0
                        or max(s + n for s, _, n in runs) > self.slots):
            bad = next(s for s in slot_tuple if type(s) is not int or not 0 <= s < self.slots)
            raise OffloadCapacityError(
                f"slot {bad!r} is outside the host pool [0, {self.slots}); the scheduler "
                "and the workers must agree on offload_slots", clause="ERR-002",
            )
        return CopyPlan(ids, slot_tuple, runs, cols)

    # -- copies -----------------------------------------------------------------------------

    def _index(self, plan: CopyPlan) -> torch.Tensor:
        """The index into ``path``'s view of the KV caches: ``entries_per_block`` entries
        per block (its regions' rows, or their elements), in job order."""
        if self.path == "rows" and len(plan.block_ids) * len(self._bases_list) <= _SMALL:
            # A few rows: their numbers in Python and one tensor, instead of three tensor
            # ops that each cost more than the arithmetic.
            s, bases = self._stride_entries, self._bases_list
            index = _int64_tensor([b * s + base for b in plan.block_ids for base in bases])
            return index if self.device.type == "cpu" else index.to(self.device)
        index = _int64_tensor(plan.block_ids)
        if self.path != "block":
            index = torch.add(self._bases, index.unsqueeze(1), alpha=self._stride_entries)
            if self.path == "elements":
                index = index.unsqueeze(2) + self._arange
            index = index.view(-1)
        return index.to(self.device)

    def _host_rows(self, slot: int, n: int) -> torch.Tensor:
        k = self.entries_per_block
        return self._host[slot * k:(slot + n) * k]

    def _moves(self, plan: CopyPlan, store: bool) -> bool:
        """Move a host-memory plan of at most ``_FEW`` regions with one ``memmove`` per
        region, in the pool's region order; False (nothing moved) for any other plan. The
        plan's ids and slots were range-checked by ``plan``, so every address is inside
        the KV buffer (checked at construction, LAY-008) or the pool."""
        addrs = self._addrs
        if addrs is None or len(plan.block_ids) * self.regions_per_block > _FEW:
            return False
        _, _, kv, host = addrs
        move, r, stride, per = ctypes.memmove, self.region_nbytes, self._stride_bytes, \
            self.bytes_per_block
        for b, slot in zip(plan.block_ids, plan.slots):
            at, h = kv + b * stride, host + slot * per
            for base in self._byte_bases:
                if store:
                    move(h, at + base, r)
                else:
                    move(at + base, h, r)
                h += r
        return True

    def store(self, plan: CopyPlan) -> None:
        """Copy the plan's blocks of the KV caches into its slots: a few regions with
        ``_moves``; else build the index, then one
        gather per run of consecutive slots, straight into the pool's rows (through a device
        staging buffer when the KV caches are not on the host)."""
        if plan.columns:
            return self._grouped(plan, True)
        if self._moves(plan, True):
            return
        k = self.entries_per_block
        entries = self._index(plan)
        whole = len(plan.runs) == 1  # one run: its index is the whole index
        for slot, pos, n in plan.runs:
            index = entries if whole else entries[pos * k:(pos + n) * k]
            dst = self._host_rows(slot, n)
            if self.device.type == "cpu":
                torch.index_select(self._view, 0, index, out=dst)
            else:
                dst.copy_(self._view.index_select(0, index), non_blocking=True)

    def load(self, plan: CopyPlan) -> None:
        """Copy the plan's slots into its blocks of the KV caches: a few regions with
        ``_moves``; else build the index, then one
        scatter per run of consecutive slots, straight from the pool's rows."""
        if plan.columns:
            return self._grouped(plan, False)
        if self._moves(plan, False):
            return
        k = self.entries_per_block
        entries = self._index(plan)
        whole = len(plan.runs) == 1
        for slot, pos, n in plan.runs:
            index = entries if whole else entries[pos * k:(pos + n) * k]
            src = self._host_rows(slot, n)
            if self.device.type != "cpu":
                src = src.to(self.device, non_blocking=True)
            self._view.index_copy_(0, index, src)

    def _grouped(self, plan: CopyPlan, store: bool) -> None:
        """Move a grouped plan: each slot region at its group's block id, null ids
        skipped (KVG-004); one gather into a temporary, one scatter."""
        e = self.entries_per_block
        ids = torch.tensor(plan.columns, dtype=torch.int64).index_select(0, self._entry_col)
        keep = ids != NULL_BLOCK_ID  # [entries, positions]
        kv = torch.add(self._entry_base, ids, alpha=self._entry_stride)[keep]
        host = (_int64_tensor(plan.slots).unsqueeze(0) * e
                + torch.arange(e, dtype=torch.int64).unsqueeze(1))[keep]
        if store:
            self._host.index_put_((host,), self._view.index_select(0, kv.to(self.device))
                                  .to(self._host.device))
        else:
            self._view.index_put_((kv.to(self.device),),
                                  self._host.index_select(0, host).to(self.device))

    def few(self, plan: CopyPlan) -> bool:
        """True when ``plan`` is moved region by region (``_moves``): a few regions on the
        host, microseconds in all."""
        return self._addrs is not None and len(plan.block_ids) * self.regions_per_block <= _FEW

    def layer_index(self, plan: CopyPlan) -> torch.Tensor:
        """``load_by_layer``'s index of ``plan``: ``[blocks, entries_per_block]`` rows of the
        KV view. Built by whoever holds the GIL anyway (the engine's thread, as it hands
        the load over), so the copying thread starts copying at once."""
        return self._index(plan).view(len(plan.block_ids), self.entries_per_block)

    def load_by_layer(self, plan: CopyPlan, done: Callable[[int], object],
                      stop: Callable[[], bool], index: torch.Tensor | None = None) -> bool:
        """``load``, one layer storage after the other (``layer_chunks``, which must not be
        empty): after copying storage ``n``'s regions of every block, call ``done(n)``;
        before each, stop (returning False) when ``stop()`` is true. One ``index_put_``
        per run and layer, from a strided view of the pool's rows (no temporary); True when
        every layer was copied. ``index``: ``layer_index(plan)``, if built already.

        Between two layers this thread runs only indexing (which keeps the GIL) and the
        callbacks: every other PyTorch call releases the GIL and must win it back from the
        engine's thread, which runs the forward in Python, and each such wait (tens of
        microseconds) is a gap in the copy."""
        entries = self.layer_index(plan) if index is None else index
        host = self._host_blocks
        for n, (lo, hi) in enumerate(self.layer_chunks):
            if stop():
                return False
            for slot, pos, count in plan.runs:
                self._view.index_put_((entries[pos:pos + count, lo:hi],),
                                      host[slot:slot + count, lo:hi])
            done(n)
        return True

    def detach_kv(self) -> torch.Tensor:
        """Drop every reference to the KV caches and return the host memory, kept for a
        pool over the tensors restored at wake (WRK-018). The pool moves nothing after."""
        host = self.host
        self.release()
        return host

    def release(self) -> None:
        """Drop the references to the KV caches and the host memory (WRK-015)."""
        empty = torch.empty(0, dtype=torch.uint8)
        self._addrs = None  # a move running now keeps its own reference
        self._view = self._arange = self._bases = self._host = self._host_blocks = empty
        self.host = empty.view(0, 0)
