"""Tests of the head-sliced runs of heterogeneous TP (kvspec.backends.nixl._heads), without
NIXL: the runs are applied as plain byte copies between rank buffers and the result is
compared with the model's heads, for every stride order, both packings, padded pages,
over-allocated tensors and any pair of TP sizes that split the heads."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.backends.nixl import BlockGeometry, LayoutSummary, head_runs
from kvspec.backends.nixl._heads import overlap
from kvspec.protocols import (
    CompatibilityError,
    InvalidArgumentError,
    KVCacheLayout,
    KVPacking,
    StrideOrder,
)


@attrs.frozen
class Engine:
    """One engine's ranks: a layout per rank (all alike) and a buffer per rank."""

    tp: int
    layout: KVCacheLayout
    buffers: tuple[torch.Tensor, ...]

    def heads(self, rank: int) -> range:
        per = self.layout.num_heads
        return range(rank * per, (rank + 1) * per)

    def block(self, rank: int, block: int) -> torch.Tensor:
        """``(layers, [K/V,] heads, tokens, channels)`` of one block of one rank."""
        view = self.layout.view(self.buffers[rank].view(self.layout.dtype))
        return view[:, :, block] if self.layout.packing is KVPacking.SPLIT else view[:, block]


def _engine(tp: int, heads: int, order: StrideOrder, packing: KVPacking, *, padding: int,
            extra: int, block_size: int, layers: int, head_size_v: int, fill: bool) -> Engine:
    layout = KVCacheLayout.contiguous(
        order, packing, torch.int16, layers, 6, block_size, heads // tp, 2,
        2 if packing is KVPacking.SPLIT else head_size_v,
        block_capacity=6 + extra, page_padding_elems=padding,
    )
    buffers = []
    for rank in range(tp):
        if fill:  # every byte distinct enough: position-derived values
            buf = (torch.arange(layout.span_elems, dtype=torch.int32) * 7 + rank * 30011)
            buf = (buf % 32749).to(torch.int16)
        else:
            buf = torch.full((layout.span_elems,), -1, dtype=torch.int16)
        buffers.append(buf.view(torch.uint8))
    return Engine(tp, layout, tuple(buffers))


def _copy(runs: tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]],
          src: Engine, src_rank: int, src_block: int,
          dst: Engine, dst_rank: int, dst_block: int) -> None:
    """What NIXL does with the descriptors: copy each remote run into the local run."""
    local_base = dst_block * dst.layout.block_stride_bytes
    remote_base = src_block * src.layout.block_stride_bytes
    for (lo, ln), (ro, rn) in zip(*runs):
        assert ln == rn
        dst.buffers[dst_rank][local_base + lo:local_base + lo + ln] = (
            src.buffers[src_rank][remote_base + ro:remote_base + ro + rn]
        )


@settings(max_examples=150, deadline=None)
@given(
    order=st.sampled_from(list(StrideOrder)),
    packing=st.sampled_from(list(KVPacking)),
    tps=st.sampled_from([(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (2, 2), (2, 3),
                         (3, 2), (1, 1)]),
    paddings=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    extras=st.tuples(st.integers(0, 2), st.integers(0, 2)),
    block_size=st.integers(1, 3),
    layers=st.integers(1, 3),
    head_size_v=st.integers(1, 3),
    pairs=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=3,
                   unique_by=lambda p: p[0]),
)
def test_runs_move_exactly_the_shared_heads(
    order: StrideOrder, packing: KVPacking, tps: tuple[int, int],
    paddings: tuple[int, int], extras: tuple[int, int], block_size: int, layers: int,
    head_size_v: int, pairs: list[tuple[int, int]],
) -> None:
    p_tp, c_tp = tps
    heads = 12
    common = dict(block_size=block_size, layers=layers, head_size_v=head_size_v)
    prod = _engine(p_tp, heads, order, packing, padding=paddings[0], extra=extras[0],
                   fill=True, **common)  # type: ignore[arg-type]
    cons = _engine(c_tp, heads, order, packing, padding=paddings[1], extra=extras[1],
                   fill=False, **common)  # type: ignore[arg-type]
    p_sum, c_sum = LayoutSummary.from_layout(prod.layout), LayoutSummary.from_layout(cons.layout)
    p_geo, c_geo = BlockGeometry.from_layout(prod.layout), BlockGeometry.from_layout(cons.layout)
    for c in range(c_tp):
        readers = 0
        for p in range(p_tp):
            if not overlap(cons.heads(c), prod.heads(p)):
                with pytest.raises(InvalidArgumentError, match="do not overlap"):
                    head_runs(c_sum, cons.heads(c), p_sum, prod.heads(p), 2)
                continue
            readers += 1
            runs = head_runs(c_sum, cons.heads(c), p_sum, prod.heads(p), 2)
            # The transport accepts them: each run inside one region, no overlap.
            assert c_geo.check_runs(runs[0]) == runs[0]
            assert p_geo.check_runs(runs[1]) == runs[1]
            assert [o for o, _ in runs[0]] == sorted(o for o, _ in runs[0])
            for local, remote in pairs:
                _copy(runs, prod, p, remote, cons, c, local)
        assert readers == (p_tp // c_tp if p_tp % c_tp == 0 else 1 if c_tp % p_tp == 0 else
                           readers)  # uneven splits: checked by the bytes below
        dim = 1 if packing is KVPacking.SPLIT else 0
        for local, remote in pairs:
            want = torch.cat([prod.block(p, remote) for p in range(p_tp)], dim=dim + 1)
            got = cons.block(c, local)
            start = c * cons.layout.num_heads
            mine = want.narrow(dim + 1, start, cons.layout.num_heads)
            assert torch.equal(got, mine)
        # Nothing outside the loaded blocks' KV was written (padding, other blocks).
        written = sum(cons.block(c, b).numel() for b, _ in pairs) * 2
        untouched = cons.buffers[c].view(torch.int16).eq(-1).sum().item() * 2
        assert untouched == cons.layout.span_bytes - written


def test_head_split_layouts_take_one_run_per_layer_storage() -> None:
    prod = _engine(1, 4, StrideOrder.LBHNC, KVPacking.CONCAT, padding=0, extra=0, block_size=4,
                   layers=3, head_size_v=2, fill=True)
    cons = _engine(2, 4, StrideOrder.LBHNC, KVPacking.CONCAT, padding=0, extra=0, block_size=4,
                   layers=3, head_size_v=2, fill=False)
    p_sum, c_sum = LayoutSummary.from_layout(prod.layout), LayoutSummary.from_layout(cons.layout)
    local, remote = head_runs(c_sum, range(2, 4), p_sum, range(0, 4), 2)
    page = cons.layout.page_size_bytes
    assert local == tuple((layer * cons.layout.layer_stride_bytes, page) for layer in range(3))
    assert remote == tuple((layer * prod.layout.layer_stride_bytes + page, page)
                           for layer in range(3))
    # Token-major (NHD) pages interleave heads: one run per layer and token.
    nhd = [_engine(tp, 4, StrideOrder.LBNHC, KVPacking.CONCAT, padding=0, extra=0,
                   block_size=4, layers=3, head_size_v=2, fill=False) for tp in (1, 2)]
    runs = head_runs(LayoutSummary.from_layout(nhd[1].layout), range(0, 2),
                     LayoutSummary.from_layout(nhd[0].layout), range(0, 4), 2)
    assert len(runs[0]) == 3 * 4


def test_mismatched_layouts_and_ranges_are_refused() -> None:
    a = LayoutSummary.from_layout(_engine(2, 4, StrideOrder.LBHNC, KVPacking.CONCAT, padding=0,
                                          extra=0, block_size=4, layers=2, head_size_v=2,
                                          fill=False).layout)
    with pytest.raises(CompatibilityError, match="block_size"):
        head_runs(a, range(0, 2), attrs.evolve(a, block_size=8), range(0, 2), 2)
    with pytest.raises(CompatibilityError, match="storage_layers"):
        head_runs(a, range(0, 2), attrs.evolve(a, storage_layers=1), range(0, 2), 2)
    with pytest.raises(CompatibilityError, match="channels are not contiguous"):
        head_runs(a, range(0, 2), attrs.evolve(a, strides=(*a.strides[:4], 2)), range(0, 2), 2)
    with pytest.raises(InvalidArgumentError, match="consecutive heads"):
        head_runs(a, range(0, 3), a, range(0, 2), 2)
    with pytest.raises(InvalidArgumentError, match="do not overlap"):
        head_runs(a, range(0, 2), a, range(2, 4), 2)
