"""Tests of the KV-cache layout descriptor (LAY-001 .. LAY-013)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.protocols.errors import (
    InvalidArgumentError,
    InvalidBlockIdError,
    LayoutMismatchError,
)
from kvspec.protocols.layout import KVCacheLayout, KVPacking, StrideOrder

CONCAT, SPLIT = KVPacking.CONCAT, KVPacking.SPLIT
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int8)


# --------------------------------------------------------------------------- helpers
# The tensors below are built independently of the library: allocated densely in the
# physical order (with padding at a chosen pitch), then permuted to the logical order.


@dataclass(frozen=True)
class Case:
    order: StrideOrder
    packing: KVPacking
    dtype: torch.dtype
    layers: int
    blocks: int
    capacity: int
    heads: int
    tokens: int
    hk: int
    hv: int
    pad: int
    pad_at: int  # the physical dims from pad_at on form the padded unit

    @property
    def physical(self) -> list[str]:
        dims = list(self.order.dims)
        if self.packing is SPLIT:
            dims.insert(dims.index("L") + 1, "S")
        return dims

    @property
    def logical(self) -> str:
        return "LSBHNC" if self.packing is SPLIT else "LBHNC"

    def size(self, dim: str) -> int:
        return {
            "L": self.layers, "S": 2, "B": self.capacity, "H": self.heads, "N": self.tokens,
            "C": self.hk if self.packing is SPLIT else self.hk + self.hv,
        }[dim]

    def build(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(raw uint8 buffer, logical view of it in self.dtype)."""
        outer = [self.size(d) for d in self.physical[: self.pad_at]]
        inner = [self.size(d) for d in self.physical[self.pad_at :]]
        unit = math.prod(inner)
        raw = torch.zeros(math.prod(outer) * (unit + self.pad) * self.dtype.itemsize,
                          dtype=torch.uint8)
        typed = raw.view(self.dtype).view(*outer, unit + self.pad)[..., :unit]
        physical = typed.view(*outer, *inner)
        perm = [self.physical.index(d) for d in self.logical]
        return raw, physical.permute(perm)

    def describe(self, tensor: torch.Tensor, **kwargs: object) -> KVCacheLayout:
        return KVCacheLayout.from_tensor(
            tensor, packing=self.packing, num_blocks=self.blocks, num_heads=self.heads,
            head_size_k=self.hk, head_size_v=self.hv, **kwargs,  # type: ignore[arg-type]
        )


@st.composite
def cases(draw: st.DrawFn) -> Case:
    order = draw(st.sampled_from(list(StrideOrder)))
    packing = draw(st.sampled_from(list(KVPacking)))
    blocks = draw(st.integers(1, 6))
    hk = draw(st.integers(1, 4))
    ndims = 6 if packing is SPLIT else 5
    return Case(
        order=order, packing=packing, dtype=draw(st.sampled_from(DTYPES)),
        layers=draw(st.integers(1, 4)), blocks=blocks,
        capacity=draw(st.integers(blocks, blocks + 3)), heads=draw(st.integers(1, 3)),
        tokens=draw(st.integers(1, 4)), hk=hk,
        hv=hk if packing is SPLIT else draw(st.integers(1, 4)),
        pad=draw(st.integers(0, 3)), pad_at=draw(st.integers(1, ndims - 1)),
    )


def tensor_index(case: Case, layer: int, block: int, token: int, head: int, kv: int,
                 elem: int) -> tuple[int, ...]:
    if case.packing is SPLIT:
        return (layer, kv, block, head, token, elem)
    return (layer, block, head, token, elem + (case.hk if kv else 0))


def contiguous(order: StrideOrder | str = "LBHNC", packing: KVPacking = CONCAT,
               **kwargs: object) -> KVCacheLayout:
    args: dict[str, object] = dict(dtype=torch.float16, num_layers=3, num_blocks=4,
                                   block_size=2, num_heads=2, head_size_k=4)
    args.update(kwargs)
    return KVCacheLayout.contiguous(order, packing, **args)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- properties


@settings(max_examples=500, deadline=None)
@given(case=cases(), data=st.data())
def test_byte_offset_equals_tensor_offset(case: Case, data: st.DataObject) -> None:
    """LAY-006: the descriptor's byte offset is the tensor's, for every order and packing."""
    raw, view = case.build()
    desc = case.describe(view)
    if all(case.size(d) > 1 for d in "LBHNC"):
        assert desc.order is case.order
    assert case.describe(view, order=case.order).byte_offset(0, 0, 0, 0) == 0
    assert desc.logical_shape == tuple(view.shape)
    assert desc.block_capacity == case.capacity and desc.num_blocks == case.blocks
    assert desc.page_size_bytes == (case.heads * case.tokens * (case.hk + case.hv)
                                    * case.dtype.itemsize)
    assert desc.span_bytes <= raw.numel()
    for _ in range(6):
        layer = data.draw(st.integers(0, case.layers - 1))
        block = data.draw(st.integers(0, case.capacity - 1))
        token = data.draw(st.integers(0, case.tokens - 1))
        head = data.draw(st.integers(0, case.heads - 1))
        kv = data.draw(st.integers(0, 1))
        elem = data.draw(st.integers(0, (case.hv if kv else case.hk) - 1))
        element = view[tensor_index(case, layer, block, token, head, kv, elem)]
        assert desc.byte_offset(layer, block, token, head, kv=kv, elem=elem) == (
            element.data_ptr() - raw.data_ptr()
        )


@settings(max_examples=250, deadline=None)
@given(case=cases(), data=st.data())
def test_block_regions_cover_exactly_the_block(case: Case, data: st.DataObject) -> None:
    """Regions of a block hold exactly its bytes, padding excluded (LAY-004, LAY-013)."""
    raw, view = case.build()
    desc = case.describe(view)
    itemsize = case.dtype.itemsize
    as_bytes = torch.as_strided(raw, (*view.shape, itemsize),
                                (*(s * itemsize for s in view.stride()), 1))
    block_dim = case.logical.index("B")
    for block in range(case.capacity):
        as_bytes.select(block_dim, block).fill_(block + 1)
    ids = data.draw(st.lists(st.integers(0, case.blocks - 1), max_size=4))
    regions = desc.block_regions(ids)
    offsets = desc.block_region_offsets(ids)
    assert offsets.dtype == torch.int64
    assert tuple(offsets.shape) == (len(ids), desc.regions_per_block)
    for block, block_regions, row in zip(ids, regions, offsets.tolist()):
        assert [off for off, _ in block_regions] == row == sorted(row)
        covered = torch.zeros(raw.numel(), dtype=torch.bool)
        for offset, nbytes in block_regions:
            assert nbytes == desc.region_nbytes
            assert not covered[offset : offset + nbytes].any()  # no overlap
            covered[offset : offset + nbytes] = True
        assert torch.equal(covered, raw == block + 1)
        assert int(covered.sum()) == case.layers * desc.page_size_bytes
        # Regions are maximal: no two of them touch.
        ends = {off + n for off, n in block_regions}
        assert not ends & {off for off, _ in block_regions}


# --------------------------------------------------------------------------- StrideOrder


def test_six_orders_and_aliases() -> None:
    """LAY-001."""
    assert [o.name for o in StrideOrder] == ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]
    assert StrideOrder.parse("nhd") is StrideOrder.LBNHC
    assert StrideOrder.parse(" HnD ") is StrideOrder.LBHNC
    assert len(StrideOrder) == 6 and not hasattr(StrideOrder, "NHD")
    for order in StrideOrder:
        assert StrideOrder.parse(order.name.lower()) is order
        assert order.dims == order.name
        assert order.block_outermost == order.name.startswith("B")


@pytest.mark.parametrize("bad", ["LBHCN", "", "NDH"])
def test_parse_rejects_unknown_names(bad: str) -> None:
    with pytest.raises(InvalidArgumentError, match="unknown stride order"):
        StrideOrder.parse(bad)


def test_parse_rejects_non_str() -> None:
    with pytest.raises(InvalidArgumentError, match="must be a str"):
        StrideOrder.parse(3)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- constructors


@pytest.mark.parametrize("order", list(StrideOrder))
@pytest.mark.parametrize("packing", list(KVPacking))
@pytest.mark.parametrize("pad", [0, 3])
def test_contiguous_round_trips_through_from_tensor(
    order: StrideOrder, packing: KVPacking, pad: int
) -> None:
    desc = contiguous(order, packing, page_padding_elems=pad, block_capacity=6)
    view = desc.view(torch.zeros(desc.span_elems, dtype=desc.dtype))
    assert view.is_contiguous() == (pad == 0 and order is StrideOrder.LBHNC)
    again = KVCacheLayout.from_tensor(
        view, packing=packing, num_blocks=4, num_heads=2, head_size_k=4, restridable=True
    )
    assert again == desc
    desc.check_tensor(view)
    if pad:  # LAY-004: padding shows in the pitch, not in the page size
        unpadded = contiguous(order, packing, block_capacity=6)
        assert desc.padded_page_size_bytes > unpadded.padded_page_size_bytes
        assert desc.page_size_bytes == unpadded.page_size_bytes
    else:
        assert desc.span_bytes == 3 * 6 * desc.page_size_bytes


@pytest.mark.parametrize("order", list(StrideOrder))
@pytest.mark.parametrize("packing", list(KVPacking))
def test_from_layer_tensors_matches_from_tensor(order: StrideOrder, packing: KVPacking) -> None:
    desc = contiguous(order, packing, page_padding_elems=1, restridable=False)
    view = desc.view(torch.zeros(desc.span_elems, dtype=desc.dtype))
    layers = list(view.unbind(0))
    again = KVCacheLayout.from_layer_tensors(
        layers, packing=packing, num_blocks=4, num_heads=2, head_size_k=4
    )
    assert again == desc
    desc.check_layer_tensors(layers)


def test_restridable_defaults() -> None:
    """LAY-009: a tensor someone else allocated is not re-stridable unless declared."""
    desc = contiguous()
    assert desc.restridable
    view = desc.view(torch.zeros(desc.span_elems, dtype=desc.dtype))
    assert not KVCacheLayout.from_tensor(
        view, packing=CONCAT, num_blocks=4, num_heads=2, head_size_k=4
    ).restridable


def test_order_hint_resolves_ambiguity() -> None:
    """With one layer, layer-outermost and block-outermost orders address alike."""
    desc = contiguous("BLHNC", num_layers=1)
    view = desc.view(torch.zeros(desc.span_elems, dtype=desc.dtype))
    kwargs = dict(packing=CONCAT, num_blocks=4, num_heads=2, head_size_k=4)
    assert KVCacheLayout.from_tensor(view, **kwargs).order is StrideOrder.LBHNC  # type: ignore[arg-type]
    hinted = KVCacheLayout.from_tensor(view, order="blhnc", restridable=True, **kwargs)  # type: ignore[arg-type]
    assert hinted == desc
    with pytest.raises(LayoutMismatchError, match="expected LBNHC"):
        KVCacheLayout.from_tensor(view, order=StrideOrder.LBNHC, **kwargs)  # type: ignore[arg-type]


def test_unequal_k_and_v_heads() -> None:
    """LAY-002: CONCAT carries unequal K and V head sizes; V starts at channel head_size_k."""
    desc = contiguous("LBNHC", head_size_k=3, head_size_v=2)
    assert desc.storage_shape == (3, 4, 2, 2, 5)
    assert desc.byte_offset(0, 0, 0, 0, kv=1, elem=0) == 3 * 2
    with pytest.raises(InvalidArgumentError, match="elem 2 is out of range"):
        desc.byte_offset(0, 0, 0, 0, kv=1, elem=2)
    desc.byte_offset(0, 0, 0, 0, kv=0, elem=2)


# --------------------------------------------------------------------------- regions


@pytest.mark.parametrize("order", ["BLHNC", "BLNHC", "BHLNC"])
@pytest.mark.parametrize("packing", list(KVPacking))
def test_block_outermost_unpadded_is_one_region_per_block(order: str, packing: KVPacking) -> None:
    """LAY-013."""
    desc = contiguous(order, packing)
    assert desc.regions_per_block == 1
    assert desc.region_nbytes == 3 * desc.page_size_bytes
    assert desc.block_regions([2]) == (((2 * desc.block_stride_bytes, desc.region_nbytes),),)


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_layer_outermost_is_one_region_per_layer(order: str) -> None:
    desc = contiguous(order)
    assert desc.regions_per_block == 3
    assert desc.region_nbytes == desc.page_size_bytes
    assert desc.block_regions([1]) == tuple(
        [tuple((layer * desc.layer_stride_bytes + desc.block_stride_bytes,
                desc.page_size_bytes) for layer in range(3))]
    )
    assert contiguous(order, SPLIT).regions_per_block == 6  # K and V pages apart


def test_padded_block_outermost_is_one_region_per_layer() -> None:
    """LAY-004: padding between the pages of a block splits the block's region."""
    desc = contiguous("BLHNC", page_padding_elems=2)
    assert desc.padded_page_size_bytes == desc.page_size_bytes + 4
    assert desc.regions_per_block == 3 and desc.region_nbytes == desc.page_size_bytes


def test_block_region_offsets_vectorised() -> None:
    desc = contiguous("HND")
    ids = torch.tensor([3, 0, 3], dtype=torch.int32)
    offsets = desc.block_region_offsets(ids)
    assert offsets.tolist() == [[off for off, _ in row] for row in desc.block_regions([3, 0, 3])]
    assert tuple(desc.block_region_offsets([]).shape) == (0, 3)
    assert desc.block_regions([]) == ()


def test_over_allocated_capacity() -> None:
    """LAY-003: the tensor holds more blocks than the budget; only the budget is moved."""
    desc = contiguous("NHD", block_capacity=10, restridable=False)
    assert desc.is_over_allocated and not contiguous().is_over_allocated
    assert desc.storage_shape[1] == 10 and desc.num_blocks == 4
    desc.byte_offset(0, 9, 0, 0)  # addressable: inside the tensor
    with pytest.raises(InvalidBlockIdError, match=r"num_blocks=4\).*block_capacity 10"):
        desc.block_regions([4])
    view = desc.view(torch.zeros(desc.span_elems, dtype=desc.dtype))
    again = KVCacheLayout.from_tensor(view, packing=CONCAT, num_blocks=4, num_heads=2,
                                      head_size_k=4)
    assert again == desc


def test_shared_layers_are_declared_and_moved_once() -> None:
    """LAY-011: layers viewing one storage get one slot and are moved once."""
    base = contiguous("BLHNC")
    view = base.view(torch.zeros(base.span_elems, dtype=base.dtype))
    layers = [view[0], view[1], view[0], view[2], view[1]]
    desc = KVCacheLayout.from_layer_tensors(
        layers, packing=CONCAT, num_blocks=4, num_heads=2, head_size_k=4
    )
    assert desc.num_layers == 5 and desc.num_storage_layers == 3
    assert desc.shared_layers == ((0, 2), (1, 4))
    assert desc.layer_slots == (0, 1, 0, 2, 1)
    assert desc.logical_shape[0] == 5 and desc.storage_shape == base.storage_shape
    assert desc.byte_offset(2, 1, 1, 1, elem=3) == desc.byte_offset(0, 1, 1, 1, elem=3)
    assert desc.byte_offset(3, 1, 0, 0) == base.byte_offset(2, 1, 0, 0)
    assert desc.block_regions([1]) == base.block_regions([1])
    desc.check_layer_tensors(layers)
    swapped = [view[0], view[1], view[1], view[2], view[1]]
    with pytest.raises(LayoutMismatchError, match="layer 2: starts"):
        desc.check_layer_tensors(swapped)
    direct = KVCacheLayout.from_tensor(view, packing=CONCAT, num_blocks=4, num_heads=2,
                                       head_size_k=4, shared_layers=((4, 1), (2, 0)))
    assert direct == desc


def test_view_addresses_like_byte_offset() -> None:
    desc = contiguous("BHLNC", SPLIT, dtype=torch.float32, page_padding_elems=1)
    flat = torch.arange(desc.span_elems + 5, dtype=desc.dtype)[5:]  # offset storage
    view = desc.view(flat)
    assert view.shape == desc.storage_shape and view.stride() == desc.strides
    assert view.data_ptr() == flat.data_ptr()
    assert int(view[2, 1, 3, 1, 0, 2].item()) - 5 == desc.byte_offset(
        2, 3, 0, 1, kv=1, elem=2
    ) // desc.element_size


def test_descriptor_is_immutable_and_hashable() -> None:
    """LAY-005."""
    desc = contiguous()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        desc.num_blocks = 5  # type: ignore[misc]
    assert hash(desc) == hash(contiguous()) and desc == contiguous()


# --------------------------------------------------------------------------- rejections


def _fields(**changes: object) -> dict[str, object]:
    fields: dict[str, object] = dict(
        order=StrideOrder.LBHNC, packing=CONCAT, dtype=torch.float16, num_layers=2,
        num_blocks=3, block_capacity=3, block_size=2, num_heads=2, head_size_k=2,
        head_size_v=2, strides=(48, 16, 8, 4, 1),
    )
    fields.update(changes)
    return fields


def test_fields_fixture_is_valid() -> None:
    KVCacheLayout(**_fields())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        (dict(order="LBHNC"), "order must be a StrideOrder"),
        (dict(packing="CONCAT"), "packing must be a KVPacking"),
        (dict(dtype="float16"), "dtype must be a torch.dtype"),
        (dict(num_layers=0), "num_layers must be an int >= 1"),
        (dict(num_heads=True), "num_heads must be an int >= 1"),
        (dict(block_size=2.0), "block_size must be an int >= 1"),
        (dict(num_blocks=4), "num_blocks 4 exceeds block_capacity 3"),
        (dict(packing=SPLIT, head_size_v=1, strides=(96, 48, 16, 8, 4, 1)),
         "SPLIT packing needs head_size_k == head_size_v"),
        (dict(strides=(16, 8, 4, 1)), "strides must be a tuple of 5 ints"),
        (dict(strides=[48, 16, 8, 4, 1]), "strides must be a tuple of 5 ints"),
        (dict(packing=SPLIT, strides=(48, 16, 8, 4, 1)), "tuple of 6 ints"),
        (dict(strides=(48, 16, 8, 4, -1)), "stride of dim C must be an int >= 0"),
        (dict(strides=(48, 16, 4, 4, 1)), "dim N (size 2, stride 4) overlaps"),
        (dict(strides=(48, 16, 8, 4, 1), num_layers=3, block_capacity=4, num_blocks=3),
         "overlaps"),
        (dict(order=StrideOrder.BLHNC), "do not follow order BLHNC"),
        (dict(restridable=1), "restridable must be a bool"),
        (dict(shared_layers=((0, 2),)), "layer 2; expected an int in [0, 2)"),
        (dict(shared_layers=((0,),)), "group must be a tuple of >= 2"),
        (dict(shared_layers=((0, 1), (1, 0))), "names layer 1 twice"),
        (dict(shared_layers={0: 1}), "shared_layers must be a tuple of tuples"),
    ],
)
def test_constructor_rejects(changes: dict[str, object], fragment: str) -> None:
    """LAY-005: every validation raises InvalidArgumentError saying what was wrong."""
    with pytest.raises(InvalidArgumentError) as info:
        KVCacheLayout(**_fields(**changes))  # type: ignore[arg-type]
    assert fragment in str(info.value)


def test_shared_layers_shrink_the_storage() -> None:
    desc = KVCacheLayout(**_fields(num_layers=3, shared_layers=[[2, 0]]))  # type: ignore[arg-type]
    assert desc.shared_layers == ((0, 2),) and desc.storage_shape[0] == 2


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(order="XYZ"), "unknown stride order"),
        (dict(order=3), "order must be a StrideOrder or its name"),
        (dict(packing="SPLIT"), "packing must be a KVPacking"),
        (dict(page_padding_elems=-1), "page_padding_elems must be an int >= 0"),
        (dict(num_blocks=0), "num_blocks must be an int >= 1"),
        (dict(block_capacity=2), "num_blocks 4 exceeds block_capacity 2"),
        (dict(head_size_k="4"), "head_size_k must be an int >= 1"),
        (dict(packing=SPLIT, head_size_v=2), "SPLIT packing needs head_size_k == head_size_v"),
    ],
)
def test_contiguous_rejects(kwargs: dict[str, object], fragment: str) -> None:
    args: dict[str, object] = dict(order="LBHNC", packing=CONCAT)
    args.update(kwargs)
    order, packing = args.pop("order"), args.pop("packing")
    with pytest.raises(InvalidArgumentError, match=fragment):
        contiguous(order, packing, **args)  # type: ignore[arg-type]


def _from(tensor: object, **kwargs: object) -> KVCacheLayout:
    args: dict[str, object] = dict(packing=CONCAT, num_blocks=3, num_heads=2, head_size_k=2)
    args.update(kwargs)
    return KVCacheLayout.from_tensor(tensor, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tensor", "kwargs", "fragment"),
    [
        (torch.zeros(2, 3, 2, 2), {}, "has 4 dims; expected 5"),
        (torch.zeros(2, 3, 3, 2, 4), {}, "dim H is 3, expected 2"),
        (torch.zeros(2, 3, 2, 2, 5), {}, "dim C is 5, expected 4"),
        (torch.zeros(2, 3, 3, 2, 2, 2), dict(packing=SPLIT), "dim S is 3, expected 2"),
        (torch.zeros(2, 2, 2, 2, 4), {}, "dim B holds 2 blocks; expected at least num_blocks=3"),
        (torch.zeros(2, 1, 2, 2, 4).expand(2, 3, 2, 2, 4), {}, r"dim B \(size 3, stride 0\) overlaps"),
        (torch.zeros(2, 2, 3, 2, 4).permute(1, 2, 3, 0, 4), {}, "follow no stride order"),
        (torch.zeros(2, 3, 2, 2, 4), dict(order="BLHNC"), "follow LBHNC; expected BLHNC"),
    ],
)
def test_from_tensor_rejects_mismatching_tensors(
    tensor: torch.Tensor, kwargs: dict[str, object], fragment: str
) -> None:
    """LAY-008."""
    with pytest.raises(LayoutMismatchError, match=fragment):
        _from(tensor, **kwargs)


@pytest.mark.parametrize(
    ("tensor", "kwargs", "fragment"),
    [
        ([0.0], {}, "needs a torch.Tensor"),
        (torch.zeros(2, 3, 2, 2, 4), dict(num_heads=0), "num_heads must be an int >= 1"),
        (torch.zeros(2, 3, 2, 2, 4), dict(num_blocks=None), "num_blocks must be an int >= 1"),
        (torch.zeros(2, 3, 2, 2, 4), dict(packing="CONCAT"), "packing must be a KVPacking"),
        (torch.zeros(2, 3, 2, 2, 4), dict(order=5), "order must be a StrideOrder, its name"),
        (torch.zeros(2, 3, 2, 2, 4), dict(shared_layers=((0, 5),)), r"layer 5; expected an int in \[0, 3\)"),
        (torch.zeros(2, 3, 2, 2, 4), dict(head_size_v=0), "head_size_v must be an int >= 1"),
    ],
)
def test_from_tensor_rejects_bad_arguments(
    tensor: object, kwargs: dict[str, object], fragment: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=fragment):
        _from(tensor, **kwargs)


def test_from_tensor_split_rejects_unequal_heads() -> None:
    with pytest.raises(InvalidArgumentError, match="SPLIT packing needs"):
        _from(torch.zeros(2, 2, 3, 2, 2, 2), packing=SPLIT, head_size_k=2, head_size_v=3)


def _layers(tensors: object) -> KVCacheLayout:
    return KVCacheLayout.from_layer_tensors(
        tensors, packing=CONCAT, num_blocks=3, num_heads=2, head_size_k=2  # type: ignore[arg-type]
    )


def test_from_layer_tensors_rejections() -> None:
    """LAY-008: the offending layer is named."""
    buf = torch.zeros(4, 3, 2, 2, 4)
    with pytest.raises(InvalidArgumentError, match="non-empty sequence"):
        _layers([])
    with pytest.raises(InvalidArgumentError, match="use from_tensor"):
        _layers(buf)
    with pytest.raises(InvalidArgumentError, match="per-layer torch.Tensors"):
        _layers([buf[0], "x"])
    with pytest.raises(LayoutMismatchError, match="layer 1: dtype torch.float16"):
        _layers([buf[0], buf[1].half()])
    with pytest.raises(LayoutMismatchError, match=r"layer 2: shape \(2, 2, 2, 4\)"):
        _layers([buf[0], buf[1], buf[2, :2]])
    with pytest.raises(LayoutMismatchError, match="layer 1: strides"):
        _layers([buf[0], buf[1].transpose(1, 2).contiguous().transpose(1, 2)])
    with pytest.raises(LayoutMismatchError, match="layer 1 is not a view of layer 0's buffer"):
        _layers([buf[0], buf[1].clone()])
    with pytest.raises(LayoutMismatchError, match=r"layer 3 starts 576 bytes .* = 384 bytes"):
        _layers([buf[0], buf[1], buf[1], buf[3]])
    with pytest.raises(LayoutMismatchError, match="layer 1 starts -192 bytes"):
        _layers([buf[1], buf[0]])
    flat = torch.zeros(200)
    overlapping = [flat[i * 10 : i * 10 + 48].view(3, 2, 2, 4) for i in range(3)]
    with pytest.raises(LayoutMismatchError, match="dim L .* overlaps"):
        _layers(overlapping)


def test_byte_offset_rejects_out_of_range_indices() -> None:
    desc = contiguous(block_capacity=5)
    desc.byte_offset(2, 4, 1, 1, kv=1, elem=3)
    for args, kwargs, fragment in [
        ((3, 0, 0, 0), {}, "layer 3 is out of range; expected an int in [0, 3)"),
        ((0, 5, 0, 0), {}, "block 5 is out of range; expected an int in [0, 5)"),
        ((0, -1, 0, 0), {}, "block -1"),
        ((0, 0, 2, 0), {}, "token 2"),
        ((0, 0, 0, 2), {}, "head 2"),
        ((0, 0, 0, 0), dict(kv=2), "kv 2"),
        ((0, 0, 0, 0), dict(elem=4), "elem 4"),
        ((True, 0, 0, 0), {}, "layer True"),
        ((0, 1.0, 0, 0), {}, "block 1.0"),
    ]:
        with pytest.raises(InvalidArgumentError) as info:
            desc.byte_offset(*args, **kwargs)  # type: ignore[arg-type]
        assert fragment in str(info.value)


def test_check_tensor_names_the_differing_field() -> None:
    """LAY-008."""
    desc = contiguous("HND")
    good = desc.view(torch.zeros(desc.span_elems, dtype=desc.dtype))
    desc.check_tensor(good)
    one = contiguous("HND", num_layers=1)
    odd = torch.as_strided(torch.zeros(one.span_elems, dtype=one.dtype), one.storage_shape,
                           (999, *one.strides[1:]))
    one.check_tensor(odd)  # the stride of a size-1 dim is not compared
    with pytest.raises(LayoutMismatchError, match="dtype is torch.float32"):
        desc.check_tensor(good.float())
    with pytest.raises(LayoutMismatchError, match=r"shape is \(3, 4, 2, 2, 4\)"):
        desc.check_tensor(good[..., :4])
    with pytest.raises(LayoutMismatchError, match="stride of dim H is 8"):
        desc.check_tensor(contiguous("NHD").view(torch.zeros(desc.span_elems,
                                                             dtype=desc.dtype)))
    with pytest.raises(InvalidArgumentError, match="needs a torch.Tensor"):
        desc.check_tensor("tensor")  # type: ignore[arg-type]


def test_check_layer_tensors_rejections() -> None:
    desc = contiguous()
    view = desc.view(torch.zeros(desc.span_elems, dtype=desc.dtype))
    with pytest.raises(LayoutMismatchError, match="got 2 layer tensors; expected num_layers=3"):
        desc.check_layer_tensors([view[0], view[1]])
    with pytest.raises(LayoutMismatchError, match="layer 1: dtype"):
        desc.check_layer_tensors([view[0], view[1].float(), view[2]])
    with pytest.raises(InvalidArgumentError, match="sequence of per-layer"):
        desc.check_layer_tensors(view)  # type: ignore[arg-type]


def test_view_rejections() -> None:
    desc = contiguous()
    with pytest.raises(LayoutMismatchError, match="storage dtype is torch.float32"):
        desc.view(torch.zeros(desc.span_elems))
    with pytest.raises(LayoutMismatchError, match="flat contiguous 1-D"):
        desc.view(torch.zeros(2, desc.span_elems, dtype=desc.dtype))
    with pytest.raises(LayoutMismatchError, match="flat contiguous 1-D"):
        desc.view(torch.zeros(2 * desc.span_elems, dtype=desc.dtype)[::2])
    with pytest.raises(LayoutMismatchError, match=f"expected at least span_elems={desc.span_elems}"):
        desc.view(torch.zeros(desc.span_elems - 1, dtype=desc.dtype))
    with pytest.raises(InvalidArgumentError, match="view needs a torch.Tensor"):
        desc.view(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ids", "fragment"),
    [
        ([4], "block id 4 is outside the engine's block budget"),
        ([0, -1], "block id -1"),
        ([1.0], "block id 1.0 is not an int"),
        ([True], "block id True is not an int"),
        ("12", "must be a sequence of ints"),
        (torch.tensor([0.0]), "expected a 1-D integer tensor"),
        (torch.tensor([[0]]), "expected a 1-D integer tensor"),
        (torch.tensor([0, 7]), "block id 7"),
    ],
)
def test_block_ids_are_validated(ids: object, fragment: str) -> None:
    """LAY-012: block ids are ints in [0, num_blocks)."""
    desc = contiguous()
    for method in (desc.block_regions, desc.block_region_offsets):
        with pytest.raises(InvalidBlockIdError, match=fragment):
            method(ids)  # type: ignore[arg-type]


def test_block_ids_past_int64_are_rejected_typed() -> None:
    """Issue 14, defect 9: block_regions([2**63]) raised RuntimeError from torch."""
    layout = KVCacheLayout.contiguous("LBHNC", KVPacking.CONCAT, torch.float16, 2, 8, 4, 2, 8)
    for bad in ([2 ** 63], [-(2 ** 70)], [8]):
        with pytest.raises(InvalidBlockIdError, match="LAY-012|budget"):
            layout.block_regions(bad)
