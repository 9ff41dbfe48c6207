"""The KV-cache layout descriptor: what a connector needs to know to move KV bytes.

The logical KV space of one engine is ``[L layers, B blocks, H heads, N tokens per block,
C]``. With ``KVPacking.CONCAT`` the last dim holds K then V
(``C = head_size_k + head_size_v``); with ``KVPacking.SPLIT`` a K/V selector dim ``S``
of size 2 follows ``L`` and the last dim is the head size ``D``. How these dims sit in
memory is a ``StrideOrder`` (LAY-001) plus the exact element strides, which
``KVCacheLayout`` records, validates and turns into byte offsets and transfer regions.

Clauses enforced or documented here:

* LAY-001 six stride orders, plus the aliases NHD (= LBNHC) and HND (= LBHNC).
* LAY-002 K and V are either concatenated in the last dim or split by a selector dim.
* LAY-003 the block budget (``num_blocks``) and the tensor's block capacity
  (``block_capacity``) differ when the cache is over-allocated: connectors size transfers by
  ``num_blocks``, index tensors by ``block_capacity``, and never assert the two are equal.
* LAY-004 pages may be padded: the page pitch comes from the strides, never from the sizes.
* LAY-005 the descriptor is immutable and validated on construction.
* LAY-006 ``KVCacheLayout.byte_offset`` equals the byte offset of the tensor's element.
* LAY-007 ``register_kv_caches`` receives this descriptor with the tensors; a connector
  must not assume anything about the memory beyond what the descriptor states.
* LAY-008 a tensor that does not match its descriptor is rejected with
  ``LayoutMismatchError``.
* LAY-009 a connector never re-strides or re-allocates a tensor whose descriptor says
  ``restridable=False``.
* LAY-011 layers that share storage are declared in ``shared_layers`` and moved once.
* LAY-012 the engine hands out block ids in ``[0, num_blocks)`` only.
* LAY-013 (SHOULD) block-outermost layouts move one contiguous region per block.

A state group's layers (``GroupKind.STATE``) are described apart, by ``StateLayout`` (STG-001):
each state layer's tensor is a byte view ``(block_capacity, ..., content_bytes)`` whose block
pitch is ``page_pitch_bytes`` (the page padded to the attention page); the content bytes of one
block are its ``components`` (conv state, then ssm state, ...) at consecutive byte offsets,
each viewed as its own dtype and shape.
"""

from __future__ import annotations

import enum
import math
import operator
from collections.abc import Sequence
from typing import SupportsIndex

import attrs
import torch

from kvspec.protocols.errors import (
    InvalidArgumentError,
    InvalidBlockIdError,
    LayoutMismatchError,
)

__all__ = ["ConvLayout", "KVCacheLayout", "KVPacking", "StateComponent", "StateLayout",
           "StrideOrder"]


_ORDER_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}


class StrideOrder(enum.Enum):
    """The order of the logical dims in memory, outermost first (LAY-001).

    The six members spell the dims ``L`` (layer), ``B`` (block), ``H`` (head), ``N`` (token
    in block) and ``C`` (K/V channels). The names ``NHD`` (= ``LBNHC``) and ``HND``
    (= ``LBHNC``) are accepted by ``parse`` only, so static checkers see six members.
    Orders starting with ``B`` are cross-layer block layouts: all layers of one block are
    contiguous (LAY-013).
    """

    LBHNC = "LBHNC"
    LBNHC = "LBNHC"
    LHBNC = "LHBNC"
    BLHNC = "BLHNC"
    BLNHC = "BLNHC"
    BHLNC = "BHLNC"

    @classmethod
    def parse(cls, name: str) -> StrideOrder:
        """Return the order named ``name``: one of the six orders, ``NHD`` or ``HND``,
        case-insensitive (LAY-001).

        Raises:
            InvalidArgumentError: ``name`` is not a string naming an order.
        """
        if not isinstance(name, str):
            raise InvalidArgumentError(
                f"a stride order name must be a str, got {type(name).__name__}",
                clause="LAY-001",
            )
        key = name.strip().upper()
        member = cls.__members__.get(_ORDER_ALIASES.get(key, key))
        if member is None:
            raise InvalidArgumentError(
                f"unknown stride order {name!r}; expected one of "
                f"{', '.join([*cls.__members__, *_ORDER_ALIASES])} (case-insensitive)",
                clause="LAY-001",
            )
        return member

    @property
    def dims(self) -> str:
        """The dim letters, outermost first, e.g. ``"LBHNC"``."""
        return self.value

    @property
    def block_outermost(self) -> bool:
        """True for cross-layer block orders (starting with ``B``, LAY-013)."""
        return self.value[0] == "B"


class KVPacking(enum.Enum):
    """How K and V share the cache (LAY-002).

    ``CONCAT``: K then V in the last dim, ``C = head_size_k + head_size_v``.
    ``SPLIT``: a K/V selector dim ``S`` of size 2 (0 = K, 1 = V) and a last dim ``D`` with
    ``head_size_k == head_size_v == D``.
    """

    CONCAT = "CONCAT"
    SPLIT = "SPLIT"


_ORDERS: tuple[StrideOrder, ...] = tuple(StrideOrder)
_NAMES = {  # storage dims in logical order; for SPLIT, D plays the role of C in an order
    KVPacking.CONCAT: ("L", "B", "H", "N", "C"),
    KVPacking.SPLIT: ("L", "S", "B", "H", "N", "D"),
}


def _int(value: object) -> int | None:
    """``value`` as an int, or None if it is not an integer (bools are not integers)."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _is_tensor_sequence(value: object) -> bool:
    """True for a list/tuple-like sequence of tensors (a tensor itself is not one)."""
    return (
        isinstance(value, Sequence)
        and not isinstance(value, (str, bytes, torch.Tensor))
        and all(isinstance(item, torch.Tensor) for item in value)
    )


def _check_size(name: str, value: object, *, minimum: int = 1, clause: str = "LAY-005") -> int:
    number = _int(value)
    if number is None or number < minimum:
        raise InvalidArgumentError(
            f"{name} must be an int >= {minimum}, got {value!r}", clause=clause
        )
    return number


def _check_index(name: str, value: object, bound: int, what: str) -> int:
    number = _int(value)
    if number is None or not 0 <= number < bound:
        raise InvalidArgumentError(
            f"{name} {value!r} is out of range; expected an int in [0, {bound}) ({what})",
            clause="LAY-006",
        )
    return number


def _aliasing_problem(
    names: Sequence[str], sizes: Sequence[int], strides: Sequence[int]
) -> str | None:
    """Why the strides may alias two elements, or None when the dims nest (sufficient
    non-overlap check: sorted by stride, each stride exceeds the reach of the dims inside)."""
    dims = sorted((st, sz, nm) for nm, sz, st in zip(names, sizes, strides) if sz > 1)
    reach = 0
    for stride, size, name in dims:
        if stride <= reach:
            return (
                f"dim {name} (size {size}, stride {stride}) overlaps the dims inside it, "
                f"which reach element offset {reach}; expected a stride > {reach} so that "
                f"no two elements alias"
            )
        reach += (size - 1) * stride
    return None


def _matching_orders(
    names: Sequence[str], sizes: Sequence[int], strides: Sequence[int]
) -> tuple[StrideOrder, ...]:
    """The orders whose dim sequence agrees with the strides, size-1 dims and S ignored."""
    present = sorted(
        ((st, "C" if nm == "D" else nm) for nm, sz, st in zip(names, sizes, strides)
         if sz > 1 and nm != "S"),
        key=lambda item: -item[0],
    )
    letters = [letter for _, letter in present]
    return tuple(o for o in _ORDERS if [c for c in o.dims if c in letters] == letters)


def _canonical_groups(groups: object, num_layers: int) -> tuple[tuple[int, ...], ...]:
    """Validate ``shared_layers`` and return it sorted (LAY-011)."""
    if not isinstance(groups, (tuple, list)):
        raise InvalidArgumentError(
            f"shared_layers must be a tuple of tuples of layer indices, got "
            f"{type(groups).__name__}",
            clause="LAY-011",
        )
    seen: set[int] = set()
    result = []
    for group in groups:
        if not isinstance(group, (tuple, list)) or len(group) < 2:
            raise InvalidArgumentError(
                f"each shared_layers group must be a tuple of >= 2 layer indices, got "
                f"{group!r}",
                clause="LAY-011",
            )
        members = []
        for layer in group:
            index = _int(layer)
            if index is None or not 0 <= index < num_layers:
                raise InvalidArgumentError(
                    f"shared_layers names layer {layer!r}; expected an int in "
                    f"[0, {num_layers})",
                    clause="LAY-011",
                )
            if index in seen:
                raise InvalidArgumentError(
                    f"shared_layers names layer {index} twice; expected disjoint groups",
                    clause="LAY-011",
                )
            seen.add(index)
            members.append(index)
        result.append(tuple(sorted(members)))
    return tuple(sorted(result))


@attrs.frozen
class KVCacheLayout:
    """Immutable, validated description of one engine's KV-cache memory (LAY-005, LAY-007).

    A connector receives this with the tensors in ``register_kv_caches`` and must not
    assume anything beyond it (LAY-007); a tensor that does not match it is rejected
    with ``LayoutMismatchError`` (LAY-008, ``check_tensor``).

    Attributes:
        order: Memory order of the logical dims, outermost first (LAY-001).
        packing: How K and V share the cache (LAY-002).
        dtype: Element dtype.
        num_layers: Number of attention layers ``L``.
        num_blocks: The engine's block budget: it only ever hands out block ids
            ``0 .. num_blocks-1`` (LAY-012). Size transfers and metadata by this (LAY-003).
        block_capacity: The tensor's block dim size, ``>= num_blocks``; larger when the
            cache is over-allocated (kvcached). Index tensors by this; never assert
            ``block_capacity == num_blocks`` (LAY-003).
        block_size: Tokens per block ``N``.
        num_heads: KV heads ``H`` (of this rank).
        head_size_k: Channels of K per head.
        head_size_v: Channels of V per head (equal to ``head_size_k`` for SPLIT).
        strides: Element strides of the storage dims in logical order: ``(L, B, H, N, C)``
            for CONCAT, ``(L, S, B, H, N, D)`` for SPLIT. The ``L`` stride is the pitch
            between distinct layer storages. Strides of size-1 dims carry no meaning.
        restridable: False when the tensors must not be re-strided or re-allocated, e.g.
            GPU-virtual-memory backed caches (LAY-009).
        shared_layers: Groups of layer indices whose KV lives in the same storage (sorted
            on construction). A group occupies one layer slot of the storage, assigned at
            its smallest member, and is moved once (LAY-011).
        opaque_pages: True when the bytes of one (layer, block, head) page, its ``N`` x
            ``C`` elements, are packed for the engine's kernels and are not token rows and
            channels (vLLM-CPU stores K transposed, then V). Shapes and strides still say
            where each page starts and how long it is; what lies inside has no address, so
            only whole pages may be copied (LAY-014), and ``byte_offset`` refuses any
            element but a page's first.
    """

    order: StrideOrder
    packing: KVPacking
    dtype: torch.dtype
    num_layers: int
    num_blocks: int
    block_capacity: int
    block_size: int
    num_heads: int
    head_size_k: int
    head_size_v: int
    strides: tuple[int, ...]
    restridable: bool = True
    shared_layers: tuple[tuple[int, ...], ...] = ()
    opaque_pages: bool = False

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.opaque_pages, bool):
            raise InvalidArgumentError(
                f"opaque_pages must be a bool, got {self.opaque_pages!r}", clause="LAY-014"
            )
        if not isinstance(self.order, StrideOrder):
            raise InvalidArgumentError(
                f"order must be a StrideOrder, got {self.order!r}", clause="LAY-001"
            )
        if not isinstance(self.packing, KVPacking):
            raise InvalidArgumentError(
                f"packing must be a KVPacking, got {self.packing!r}", clause="LAY-002"
            )
        if not isinstance(self.dtype, torch.dtype):
            raise InvalidArgumentError(
                f"dtype must be a torch.dtype, got {self.dtype!r}", clause="LAY-005"
            )
        for name in ("num_layers", "num_blocks", "block_capacity", "block_size",
                     "num_heads", "head_size_k", "head_size_v"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InvalidArgumentError(
                    f"{name} must be an int >= 1, got {value!r}", clause="LAY-005"
                )
        if self.num_blocks > self.block_capacity:
            raise InvalidArgumentError(
                f"num_blocks {self.num_blocks} exceeds block_capacity {self.block_capacity}; "
                f"expected the tensor to hold at least the engine's block budget",
                clause="LAY-003",
            )
        if self.packing is KVPacking.SPLIT and self.head_size_k != self.head_size_v:
            raise InvalidArgumentError(
                f"SPLIT packing needs head_size_k == head_size_v, got {self.head_size_k} "
                f"and {self.head_size_v}; use CONCAT for unequal K and V head sizes",
                clause="LAY-002",
            )
        if not isinstance(self.restridable, bool):
            raise InvalidArgumentError(
                f"restridable must be a bool, got {self.restridable!r}", clause="LAY-009"
            )
        object.__setattr__(
            self, "shared_layers", _canonical_groups(self.shared_layers, self.num_layers)
        )
        names = _NAMES[self.packing]
        if not isinstance(self.strides, tuple) or len(self.strides) != len(names):
            raise InvalidArgumentError(
                f"strides must be a tuple of {len(names)} ints ({', '.join(names)}) for "
                f"{self.packing.name} packing, got {self.strides!r}",
                clause="LAY-005",
            )
        for name, stride in zip(names, self.strides):
            if type(stride) is not int or stride < 0:
                raise InvalidArgumentError(
                    f"stride of dim {name} must be an int >= 0, got {stride!r}",
                    clause="LAY-005",
                )
        problem = _aliasing_problem(names, self.storage_shape, self.strides)
        if problem is not None:
            raise InvalidArgumentError(f"strides {self.strides}: {problem}", clause="LAY-005")
        if self.order not in _matching_orders(names, self.storage_shape, self.strides):
            raise InvalidArgumentError(
                f"strides {self.strides} ({', '.join(names)}) do not follow order "
                f"{self.order.name}; expected strides decreasing in the order's dim sequence",
                clause="LAY-001",
            )

    # ---------------------------------------------------------------- constructors

    @classmethod
    def contiguous(
        cls,
        order: StrideOrder | str,
        packing: KVPacking,
        dtype: torch.dtype,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_heads: int,
        head_size_k: int,
        head_size_v: int | None = None,
        *,
        block_capacity: int | None = None,
        page_padding_elems: int = 0,
        restridable: bool = True,
        opaque_pages: bool = False,
    ) -> KVCacheLayout:
        """The layout of a tensor allocated densely in the physical order ``order``.

        For SPLIT the selector ``S`` sits right after ``L`` in the physical order.
        ``page_padding_elems`` is added to the stride of the innermost of the ``L``/``S``/``B``
        dims, i.e. to the page pitch (LAY-004). ``head_size_v`` defaults to ``head_size_k``
        and ``block_capacity`` to ``num_blocks`` (LAY-003).

        Raises:
            InvalidArgumentError: a size is not a positive int, or the result is invalid.
        """
        order = StrideOrder.parse(order) if isinstance(order, str) else order
        if not isinstance(order, StrideOrder):
            raise InvalidArgumentError(
                f"order must be a StrideOrder or its name, got {order!r}", clause="LAY-001"
            )
        if not isinstance(packing, KVPacking):
            raise InvalidArgumentError(
                f"packing must be a KVPacking, got {packing!r}", clause="LAY-002"
            )
        hk = _check_size("head_size_k", head_size_k)
        hv = hk if head_size_v is None else _check_size("head_size_v", head_size_v)
        blocks = _check_size("num_blocks", num_blocks, clause="LAY-003")
        capacity = blocks if block_capacity is None else block_capacity
        pad = _check_size("page_padding_elems", page_padding_elems, minimum=0, clause="LAY-004")
        sizes = {
            "L": _check_size("num_layers", num_layers),
            "S": 2,
            "B": _check_size("block_capacity", capacity, clause="LAY-003"),
            "H": _check_size("num_heads", num_heads),
            "N": _check_size("block_size", block_size),
            "C": hk + hv,
            "D": hk,
        }
        physical = list(order.dims)
        if packing is KVPacking.SPLIT:
            physical.insert(physical.index("L") + 1, "S")
            physical[physical.index("C")] = "D"
        stride: dict[str, int] = {}
        pitch, padded = 1, False
        for dim in reversed(physical):
            if dim in "LSB" and not padded:
                pitch, padded = pitch + pad, True
            stride[dim] = pitch
            pitch *= sizes[dim]
        return cls(
            order=order,
            packing=packing,
            dtype=dtype,
            num_layers=sizes["L"],
            num_blocks=blocks,
            block_capacity=sizes["B"],
            block_size=sizes["N"],
            num_heads=sizes["H"],
            head_size_k=hk,
            head_size_v=hv,
            strides=tuple(stride[name] for name in _NAMES[packing]),
            restridable=restridable,
            opaque_pages=opaque_pages,
        )

    @classmethod
    def from_tensor(
        cls,
        tensor: torch.Tensor,
        *,
        packing: KVPacking,
        num_blocks: int,
        num_heads: int,
        head_size_k: int,
        head_size_v: int | None = None,
        restridable: bool = False,
        shared_layers: tuple[tuple[int, ...], ...] = (),
        order: StrideOrder | str | None = None,
        opaque_pages: bool = False,
    ) -> KVCacheLayout:
        """Describe ``tensor``, given in storage shape ``(L, B, H, N, C)`` (CONCAT) or
        ``(L, 2, B, H, N, D)`` (SPLIT) with any strides.

        Shape, strides and dtype are read from the tensor; ``block_capacity`` is its block
        dim (LAY-003). The order is inferred from the strides; when size-1 dims make several
        orders fit, ``order`` picks one (default: the first in ``StrideOrder``).
        With ``shared_layers`` the tensor's first dim holds one entry per distinct storage
        (a group counts once), and ``num_layers`` counts every layer (LAY-011).
        ``restridable`` defaults to False: a tensor someone else allocated is not re-strided
        unless its provider says so (LAY-009). ``head_size_v`` defaults to ``head_size_k``.

        Raises:
            LayoutMismatchError: the tensor's shape disagrees with the given sizes, or its
                strides alias elements or follow no order (or not ``order``) (LAY-008).
            InvalidArgumentError: a parameter is invalid.
        """
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(
                f"from_tensor needs a torch.Tensor, got {type(tensor).__name__}",
                clause="LAY-008",
            )
        return cls._from_geometry(
            tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, "tensor",
            packing=packing, num_blocks=num_blocks, num_heads=num_heads,
            head_size_k=head_size_k, head_size_v=head_size_v, restridable=restridable,
            shared_layers=shared_layers, order=order, opaque_pages=opaque_pages,
        )

    @classmethod
    def from_layer_tensors(
        cls,
        tensors: Sequence[torch.Tensor],
        *,
        packing: KVPacking,
        num_blocks: int,
        num_heads: int,
        head_size_k: int,
        head_size_v: int | None = None,
        restridable: bool = False,
        order: StrideOrder | str | None = None,
        opaque_pages: bool = False,
    ) -> KVCacheLayout:
        """Describe per-layer tensors, each of shape ``(B, H, N, C)`` (CONCAT) or
        ``(2, B, H, N, D)`` (SPLIT), that are views into one buffer.

        All must share dtype, shape, strides, device and storage. Layers with the same
        ``data_ptr`` share storage and are recorded in ``shared_layers`` (LAY-011); the
        distinct storages, in order of first appearance, must be equally spaced and
        non-overlapping, and that spacing becomes the ``L`` stride. Byte offsets are from
        ``tensors[0].data_ptr()``. Other parameters are as for ``from_tensor``.

        Raises:
            LayoutMismatchError: naming the first layer that breaks one of the above (LAY-008).
            InvalidArgumentError: ``tensors`` is empty or not a sequence of tensors.
        """
        if not _is_tensor_sequence(tensors) or not tensors:
            raise InvalidArgumentError(
                "from_layer_tensors needs a non-empty sequence of per-layer torch.Tensors; "
                "use from_tensor for one tensor holding every layer",
                clause="LAY-007",
            )
        first = tensors[0]
        itemsize = first.dtype.itemsize
        storage = first.untyped_storage().data_ptr()
        slot_ptrs: list[int] = []
        slot_of_ptr: dict[int, int] = {}
        layers_of_slot: list[list[int]] = []
        for index, tensor in enumerate(tensors):
            for what, got, want in (
                ("dtype", tensor.dtype, first.dtype),
                ("shape", tuple(tensor.shape), tuple(first.shape)),
                ("strides", tensor.stride(), first.stride()),
                ("device", tensor.device, first.device),
            ):
                if got != want:
                    raise LayoutMismatchError(
                        f"layer {index}: {what} {got} differs from layer 0's {want}; "
                        f"expected every layer tensor to share dtype, shape, strides and device",
                        clause="LAY-008",
                    )
            if tensor.untyped_storage().data_ptr() != storage:
                raise LayoutMismatchError(
                    f"layer {index} is not a view of layer 0's buffer; expected every layer "
                    f"tensor to view one shared storage",
                    clause="LAY-008",
                )
            ptr = tensor.data_ptr()
            if ptr not in slot_of_ptr:
                slot = len(slot_ptrs)
                gap = ptr - first.data_ptr()
                pitch = slot_ptrs[1] - slot_ptrs[0] if slot >= 2 else gap
                if slot >= 1 and (pitch <= 0 or pitch % itemsize or gap != slot * pitch):
                    raise LayoutMismatchError(
                        f"layer {index} starts {gap} bytes from layer 0; expected the "
                        f"distinct layer storages to be equally spaced at a positive multiple "
                        f"of the element size ({slot} x {pitch} = {slot * pitch} bytes)",
                        clause="LAY-008",
                    )
                slot_of_ptr[ptr] = slot
                slot_ptrs.append(ptr)
                layers_of_slot.append([])
            layers_of_slot[slot_of_ptr[ptr]].append(index)
        shape, strides = tuple(first.shape), tuple(first.stride())
        if len(slot_ptrs) > 1:
            layer_stride = (slot_ptrs[1] - slot_ptrs[0]) // itemsize
        else:  # one storage: the L stride is meaningless; use the layer's extent
            layer_stride = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
        return cls._from_geometry(
            (len(slot_ptrs), *shape), (layer_stride, *strides), first.dtype, "layer tensors",
            packing=packing, num_blocks=num_blocks, num_heads=num_heads,
            head_size_k=head_size_k, head_size_v=head_size_v, restridable=restridable,
            shared_layers=tuple(tuple(g) for g in layers_of_slot if len(g) > 1), order=order,
            opaque_pages=opaque_pages,
        )

    @classmethod
    def _from_geometry(
        cls,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        dtype: torch.dtype,
        source: str,
        *,
        packing: KVPacking,
        num_blocks: int,
        num_heads: int,
        head_size_k: int,
        head_size_v: int | None,
        restridable: bool,
        shared_layers: tuple[tuple[int, ...], ...],
        order: StrideOrder | str | None,
        opaque_pages: bool = False,
    ) -> KVCacheLayout:
        if not isinstance(packing, KVPacking):
            raise InvalidArgumentError(
                f"packing must be a KVPacking, got {packing!r}", clause="LAY-002"
            )
        heads = _check_size("num_heads", num_heads)
        hk = _check_size("head_size_k", head_size_k)
        hv = hk if head_size_v is None else _check_size("head_size_v", head_size_v)
        wanted = None if order is None else (
            StrideOrder.parse(order) if isinstance(order, str) else order
        )
        if wanted is not None and not isinstance(wanted, StrideOrder):
            raise InvalidArgumentError(
                f"order must be a StrideOrder, its name or None, got {order!r}",
                clause="LAY-001",
            )
        names = _NAMES[packing]
        if len(shape) != len(names):
            raise LayoutMismatchError(
                f"{source} shape {shape} has {len(shape)} dims; expected {len(names)} "
                f"({', '.join(names)}) for {packing.name} packing",
                clause="LAY-008",
            )
        dims = dict(zip(names, shape))
        expected = {"H": heads, "S": 2, "C": hk + hv, "D": hk}
        for name, size in expected.items():
            if name in dims and dims[name] != size:
                raise LayoutMismatchError(
                    f"{source} shape {shape}: dim {name} is {dims[name]}, expected {size} "
                    f"(from num_heads={heads}, head_size_k={hk}, head_size_v={hv})",
                    clause="LAY-008",
                )
        if packing is KVPacking.SPLIT and hk != hv:
            raise InvalidArgumentError(
                f"SPLIT packing needs head_size_k == head_size_v, got {hk} and {hv}",
                clause="LAY-002",
            )
        blocks = _check_size("num_blocks", num_blocks, clause="LAY-003")
        if dims["B"] < blocks:
            raise LayoutMismatchError(
                f"{source} shape {shape}: dim B holds {dims['B']} blocks; expected at least "
                f"num_blocks={blocks} (the block capacity may exceed the budget, not fall "
                f"short of it)",
                clause="LAY-003",
            )
        problem = _aliasing_problem(names, shape, strides)
        if problem is not None:
            raise LayoutMismatchError(f"{source} strides {strides}: {problem}", clause="LAY-008")
        matches = _matching_orders(names, shape, strides)
        if not matches or (wanted is not None and wanted not in matches):
            raise LayoutMismatchError(
                f"{source} strides {strides} ({', '.join(names)}) follow "
                f"{' or '.join(o.name for o in matches) or 'no stride order'}; expected "
                f"{wanted.name if wanted else 'one of ' + ', '.join(o.name for o in _ORDERS)}",
                clause="LAY-008",
            )
        # Range-checked by the constructor, once num_layers is known.
        groups = _canonical_groups(shared_layers, 1 << 62)
        return cls(
            order=wanted or matches[0],
            packing=packing,
            dtype=dtype,
            num_layers=shape[0] + sum(len(g) - 1 for g in groups),
            num_blocks=blocks,
            block_capacity=dims["B"],
            block_size=dims["N"],
            num_heads=heads,
            head_size_k=hk,
            head_size_v=hv,
            strides=strides,
            restridable=restridable,
            shared_layers=groups,
            opaque_pages=opaque_pages,
        )

    # ---------------------------------------------------------------- derived sizes

    @property
    def element_size(self) -> int:
        """Bytes per element of ``dtype``."""
        return self.dtype.itemsize

    @property
    def num_storage_layers(self) -> int:
        """Distinct layer storages: ``num_layers`` minus the layers that reuse a shared
        group's storage (LAY-011). The size of the storage's ``L`` dim."""
        return self.num_layers - sum(len(g) - 1 for g in self.shared_layers)

    @property
    def layer_slots(self) -> tuple[int, ...]:
        """For each layer, the index of its storage along the storage's ``L`` dim
        (LAY-011): slots are numbered in layer order, a shared group taking one slot at
        its smallest member."""
        group_of = {layer: g[0] for g in self.shared_layers for layer in g}
        slots: dict[int, int] = {}
        result = []
        for layer in range(self.num_layers):
            leader = group_of.get(layer, layer)
            result.append(slots.setdefault(leader, len(slots)))
        return tuple(result)

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """``(num_layers, block_capacity, H, N, C)`` for CONCAT, ``(num_layers, 2,
        block_capacity, H, N, D)`` for SPLIT: the logical KV space, every layer counted."""
        return (self.num_layers, *self.storage_shape[1:])

    @property
    def storage_shape(self) -> tuple[int, ...]:
        """The shape whose strides are ``strides``: ``logical_shape`` with
        ``num_storage_layers`` in place of ``num_layers``. Equal to it unless layers share
        storage (LAY-011). This is what ``check_tensor`` and ``view`` use."""
        tail = (self.block_capacity, self.num_heads, self.block_size)
        if self.packing is KVPacking.SPLIT:
            return (self.num_storage_layers, 2, *tail, self.head_size_k)
        return (self.num_storage_layers, *tail, self.head_size_k + self.head_size_v)

    @property
    def is_over_allocated(self) -> bool:
        """True when the tensor holds more blocks than the engine will use (LAY-003)."""
        return self.block_capacity > self.num_blocks

    @property
    def page_elems(self) -> int:
        """Elements of one layer's one block, K and V, without padding (LAY-004)."""
        return self.num_heads * self.block_size * (self.head_size_k + self.head_size_v)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one layer's one block, K and V, without padding (LAY-004)."""
        return self.page_elems * self.element_size

    @property
    def padded_page_size_bytes(self) -> int:
        """The page pitch in bytes, padding included (LAY-004): the block stride for
        layer-outermost orders, the layer stride for block-outermost orders. It exceeds
        ``page_size_bytes`` exactly when pages are padded, for orders whose page is
        contiguous (H inside B and L); for LHBNC/BHLNC, and for SPLIT with the K and V
        halves of a page apart, it is the pitch of the contiguous part. Meaningless when the
        dim it comes from has size 1."""
        return self.layer_stride_bytes if self.order.block_outermost else self.block_stride_bytes

    @property
    def block_stride_bytes(self) -> int:
        """Bytes between block ``b`` and ``b + 1`` of one layer (LAY-004)."""
        return self.strides[2 if self.packing is KVPacking.SPLIT else 1] * self.element_size

    @property
    def layer_stride_bytes(self) -> int:
        """Bytes between consecutive layer storages (slots, LAY-011) at one block."""
        return self.strides[0] * self.element_size

    @property
    def span_elems(self) -> int:
        """Elements from the first to the last element of the storage, inclusive: the
        minimum size of a flat buffer behind it (LAY-003: capacity, not budget)."""
        return 1 + sum((n - 1) * s for n, s in zip(self.storage_shape, self.strides))

    @property
    def span_bytes(self) -> int:
        """``span_elems`` in bytes: the memory region to register for transfers."""
        return self.span_elems * self.element_size

    # ---------------------------------------------------------------- addressing

    def byte_offset(
        self, layer: int, block: int, token: int, head: int, *, kv: int = 0, elem: int = 0
    ) -> int:
        """Byte offset of one element from the start of layer 0's storage; it equals the
        offset the described tensor gives that element (LAY-006).

        ``kv`` selects K (0) or V (1); ``elem`` indexes the channels of that head (for
        CONCAT, V starts at channel ``head_size_k``). ``block`` may be any index below
        ``block_capacity`` (LAY-003). Layers in a shared group give the same offset (LAY-011).
        With ``opaque_pages`` only a page's first element (token 0, element 0, and K
        unless K and V are split) has a meaningful address (LAY-014).

        Raises:
            InvalidArgumentError: an index is not an int or out of range, or it addresses
                the inside of an opaque page (LAY-014).
        """
        layer = _check_index("layer", layer, self.num_layers, "num_layers")
        block = _check_index("block", block, self.block_capacity, "block_capacity")
        token = _check_index("token", token, self.block_size, "block_size")
        head = _check_index("head", head, self.num_heads, "num_heads")
        kv = _check_index("kv", kv, 2, "0 selects K, 1 selects V")
        width = self.head_size_v if kv else self.head_size_k
        elem = _check_index("elem", elem, width, "head_size_v" if kv else "head_size_k")
        if self.opaque_pages and (token or elem or (kv and self.packing is KVPacking.CONCAT)):
            raise InvalidArgumentError(
                f"token {token}, kv {kv}, elem {elem} address the inside of an opaque page: "
                "the engine packs each page for its kernels, so only a page's start (token 0, "
                "elem 0, and kv 0 unless K and V are split) has an address; move whole pages",
                clause="LAY-014",
            )
        slot = self.layer_slots[layer] if self.shared_layers else layer
        if self.packing is KVPacking.SPLIT:
            index: tuple[int, ...] = (slot, kv, block, head, token, elem)
        else:
            index = (slot, block, head, token, elem + (self.head_size_k if kv else 0))
        return sum(i * s for i, s in zip(index, self.strides)) * self.element_size

    def check_tensor(self, tensor: torch.Tensor) -> None:
        """Check that ``tensor`` is the tensor this descriptor describes: dtype,
        ``storage_shape`` and strides (strides of size-1 dims are not compared).

        Raises:
            LayoutMismatchError: naming the field that differs (LAY-008).
            InvalidArgumentError: ``tensor`` is not a torch.Tensor.
        """
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(
                f"check_tensor needs a torch.Tensor, got {type(tensor).__name__}",
                clause="LAY-008",
            )
        self._check_geometry("tensor", tensor, self.storage_shape, self.strides)

    def check_layer_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Check per-layer tensors (one per layer, shape ``storage_shape`` without the
        first dim) against this descriptor: dtype, shape, strides, one shared storage, and
        each layer starting at its slot's offset from ``tensors[0]`` (LAY-008, LAY-011).

        Raises:
            LayoutMismatchError: naming the first layer and field that differ.
            InvalidArgumentError: ``tensors`` is not a sequence of tensors.
        """
        if not _is_tensor_sequence(tensors):
            raise InvalidArgumentError(
                "check_layer_tensors needs a sequence of per-layer torch.Tensors",
                clause="LAY-008",
            )
        if len(tensors) != self.num_layers:
            raise LayoutMismatchError(
                f"got {len(tensors)} layer tensors; expected num_layers={self.num_layers}",
                clause="LAY-008",
            )
        base, storage = tensors[0].data_ptr(), tensors[0].untyped_storage().data_ptr()
        for layer, (tensor, slot) in enumerate(zip(tensors, self.layer_slots)):
            self._check_geometry(f"layer {layer}", tensor, self.storage_shape[1:],
                                 self.strides[1:])
            offset = tensor.data_ptr() - base
            if tensor.untyped_storage().data_ptr() != storage or (
                offset != slot * self.layer_stride_bytes
            ):
                raise LayoutMismatchError(
                    f"layer {layer}: starts {offset} bytes from layer 0 (or in another "
                    f"buffer); expected {slot * self.layer_stride_bytes} bytes (slot {slot}) "
                    f"in layer 0's buffer",
                    clause="LAY-008",
                )

    def _check_geometry(
        self, what: str, tensor: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...]
    ) -> None:
        if tensor.dtype != self.dtype:
            raise LayoutMismatchError(
                f"{what}: dtype is {tensor.dtype}, the descriptor says {self.dtype}",
                clause="LAY-008",
            )
        if tuple(tensor.shape) != shape:
            raise LayoutMismatchError(
                f"{what}: shape is {tuple(tensor.shape)}, the descriptor says {shape}",
                clause="LAY-008",
            )
        names = _NAMES[self.packing][len(_NAMES[self.packing]) - len(shape):]
        for name, size, got, want in zip(names, shape, tensor.stride(), strides):
            if size > 1 and got != want:
                raise LayoutMismatchError(
                    f"{what}: stride of dim {name} is {got}, the descriptor says {want} "
                    f"(strides {tuple(tensor.stride())} vs {strides})",
                    clause="LAY-008",
                )

    def view(self, storage: torch.Tensor) -> torch.Tensor:
        """The ``storage_shape`` view of a flat, contiguous 1-D ``storage`` of
        ``dtype`` holding at least ``span_elems`` elements. Never copies; the
        result's element offsets are those of ``byte_offset`` (LAY-006).

        Raises:
            LayoutMismatchError: wrong dtype, not flat and contiguous, or too small (LAY-008).
            InvalidArgumentError: ``storage`` is not a torch.Tensor.
        """
        if not isinstance(storage, torch.Tensor):
            raise InvalidArgumentError(
                f"view needs a torch.Tensor, got {type(storage).__name__}", clause="LAY-008"
            )
        if storage.dtype != self.dtype:
            raise LayoutMismatchError(
                f"storage dtype is {storage.dtype}, the descriptor says {self.dtype}",
                clause="LAY-008",
            )
        if storage.dim() != 1 or (storage.numel() > 1 and storage.stride(0) != 1):
            raise LayoutMismatchError(
                f"storage has shape {tuple(storage.shape)} and strides {storage.stride()}; "
                f"expected a flat contiguous 1-D tensor",
                clause="LAY-008",
            )
        if storage.numel() < self.span_elems:
            raise LayoutMismatchError(
                f"storage holds {storage.numel()} elements; expected at least "
                f"span_elems={self.span_elems}",
                clause="LAY-008",
            )
        return torch.as_strided(
            storage, self.storage_shape, self.strides, storage.storage_offset()
        )

    # ---------------------------------------------------------------- transfer regions

    def _region_geometry(self) -> tuple[int, list[tuple[int, int]]]:
        """(elements per contiguous region, [(stride, size)] of the dims enumerating the
        regions of one block), from the strides alone (LAY-004)."""
        names = _NAMES[self.packing]
        dims = sorted(
            (st, sz) for nm, sz, st in zip(names, self.storage_shape, self.strides)
            if nm != "B" and sz > 1
        )
        run, inner = 1, 0
        while inner < len(dims) and dims[inner][0] == run:
            run *= dims[inner][1]
            inner += 1
        return run, dims[inner:]

    @property
    def region_nbytes(self) -> int:
        """Bytes of each contiguous region of a block (see ``block_regions``)."""
        return self._region_geometry()[0] * self.element_size

    @property
    def regions_per_block(self) -> int:
        """Contiguous regions that hold one block across all layer storages: 1 for an
        unpadded block-outermost layout (LAY-013), ``num_storage_layers`` for NHD/HND."""
        return math.prod(size for _, size in self._region_geometry()[1])

    def _region_bases(self) -> torch.Tensor:
        bases = torch.zeros(1, dtype=torch.int64)
        for stride, size in self._region_geometry()[1]:
            bases = (bases[:, None] + torch.arange(size, dtype=torch.int64) * stride).reshape(-1)
        return torch.sort(bases).values * self.element_size

    def _block_id_tensor(self, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        if isinstance(block_ids, torch.Tensor):
            if block_ids.dim() != 1 or block_ids.dtype.is_floating_point or (
                block_ids.dtype.is_complex or block_ids.dtype == torch.bool
            ):
                raise InvalidBlockIdError(
                    f"block_ids tensor has dtype {block_ids.dtype} and shape "
                    f"{tuple(block_ids.shape)}; expected a 1-D integer tensor",
                    clause="LAY-012",
                )
            ids = block_ids.to(torch.int64)
        else:
            if isinstance(block_ids, (str, bytes)) or not hasattr(block_ids, "__iter__"):
                raise InvalidBlockIdError(
                    f"block_ids must be a sequence of ints, got {type(block_ids).__name__}",
                    clause="LAY-012",
                )
            values = []
            for value in block_ids:
                number = _int(value)
                if number is None:
                    raise InvalidBlockIdError(
                        f"block id {value!r} is not an int; expected ints in "
                        f"[0, {self.num_blocks})",
                        clause="LAY-012",
                    )
                if not 0 <= number < self.num_blocks:  # before int64 could overflow
                    raise InvalidBlockIdError(
                        f"block id {number} is outside the engine's block budget; expected "
                        f"ids in [0, num_blocks={self.num_blocks})"
                        + (f" (block_capacity {self.block_capacity} is not the budget)"
                           if self.is_over_allocated else ""),
                        clause="LAY-012",
                    )
                values.append(number)
            ids = torch.tensor(values, dtype=torch.int64)
        bad = ids[(ids < 0) | (ids >= self.num_blocks)]
        if bad.numel():
            raise InvalidBlockIdError(
                f"block id {int(bad[0])} is outside the engine's block budget; expected ids "
                f"in [0, num_blocks={self.num_blocks})"
                + (f" (block_capacity {self.block_capacity} is not the budget)"
                   if self.is_over_allocated else ""),
                clause="LAY-012",
            )
        return ids

    def block_region_offsets(self, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Vectorised ``block_regions``: an int64 tensor ``[len(block_ids),
        regions_per_block]`` of byte offsets, each region ``region_nbytes`` long, on the
        device of ``block_ids`` when it is a tensor (LAY-011, LAY-013).

        Raises:
            InvalidBlockIdError: a block id is not an int in ``[0, num_blocks)`` (LAY-012).
        """
        ids = self._block_id_tensor(block_ids)
        bases = self._region_bases().to(ids.device)
        return ids[:, None] * self.block_stride_bytes + bases[None, :]

    def block_regions(
        self, block_ids: Sequence[int] | torch.Tensor
    ) -> tuple[tuple[tuple[int, int], ...], ...]:
        """For each block id, the ``(byte_offset, nbytes)`` contiguous regions, ascending,
        that hold exactly that block across all layers.

        Adjacent regions are merged, so an unpadded block-outermost layout gives one region
        per block (LAY-013) and NHD/HND give one per layer; a shared storage appears once
        (LAY-011). Pitches come from the strides, so padding is skipped (LAY-004).

        Raises:
            InvalidBlockIdError: a block id is not an int in ``[0, num_blocks)`` (LAY-012).
        """
        nbytes = self.region_nbytes
        offsets = self.block_region_offsets(block_ids).tolist()
        return tuple(tuple((offset, nbytes) for offset in row) for row in offsets)


# ------------------------------------------------------------------------ state layouts


class ConvLayout(enum.Enum):
    """The order of a convolution state's two dims (vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT``):
    the layout is baked into the component's shape, and peers that exchange state must agree
    on it or convert (STG-010)."""

    SD = "SD"
    """``(state_len, dim)``: vLLM's default."""
    DS = "DS"
    """``(dim, state_len)``: what vLLM's NIXL connectors require."""


def _shape(value: object) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not value:
        raise InvalidArgumentError(
            f"StateComponent.shape must be a non-empty tuple of ints >= 1, got {value!r}",
            clause="STG-001")
    return tuple(_check_size("StateComponent.shape dim", d, clause="STG-001") for d in value)


@attrs.frozen
class StateComponent:
    """One component of a state page (STG-001): a conv state, an ssm state, an extra.

    Attributes:
        name: Its name, unique within the layout (``"conv"``, ``"ssm"``).
        shape: Its shape, of this rank (a conv state's shape follows ``conv_layout``).
        dtype: Its element dtype.
        byte_offset: Where it starts within the block's content bytes.
    """

    name: str
    shape: tuple[int, ...] = attrs.field(converter=_shape)
    dtype: torch.dtype
    byte_offset: int

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgumentError(
                f"StateComponent.name must be a non-empty str, got {self.name!r}",
                clause="STG-001")
        if not isinstance(self.dtype, torch.dtype):
            raise InvalidArgumentError(
                f"StateComponent.dtype must be a torch.dtype, got {self.dtype!r}",
                clause="STG-001")
        offset = _check_size("StateComponent.byte_offset", self.byte_offset, minimum=0,
                             clause="STG-001")
        if offset % self.dtype.itemsize:
            raise InvalidArgumentError(
                f"component {self.name!r} starts at byte {offset}, not a multiple of its "
                f"{self.dtype} item size {self.dtype.itemsize}", clause="STG-001")

    @property
    def nbytes(self) -> int:
        """Bytes of the component."""
        return math.prod(self.shape) * self.dtype.itemsize


def _components(value: object) -> tuple[StateComponent, ...]:
    if not isinstance(value, (tuple, list)) or not value \
            or not all(isinstance(c, StateComponent) for c in value):
        raise InvalidArgumentError(
            f"StateLayout.components must be a non-empty tuple of StateComponent, got "
            f"{value!r}", clause="STG-001")
    return tuple(value)


@attrs.frozen
class StateLayout:
    """Immutable, validated description of one state group's tensors on one rank (STG-001).

    Every layer of the group has one tensor, registered by ``register_state_caches``: a byte
    view (``int8`` or ``uint8``) of shape ``(block_capacity, ..., content_bytes)`` (vLLM:
    ``(blocks, 1, 1, content_bytes)``) whose block stride is ``page_pitch_bytes``. Block
    ``b``'s content bytes hold the components at their byte offsets; the bytes from
    ``content_bytes`` to the pitch are padding that nobody moves. A connector copies whole
    content bytes of a block between equal layouts (``same_state_as``), and never assumes
    anything this descriptor does not state (LAY-007).

    Attributes:
        components: The components in page order, at ascending, non-overlapping offsets.
        content_bytes: Bytes of state per block: the end of the last component.
        page_pitch_bytes: Bytes from one block's page to the next, ``>= content_bytes``
            (vLLM pads a state page to the attention page, LAY-004).
        num_blocks: The engine's block budget (LAY-003, LAY-012).
        block_capacity: The tensor's block dim size, ``>= num_blocks`` (LAY-003).
        conv_layout: The conv state's dim order, or None for a state without one (STG-010).
        tp_size: Tensor-parallel ranks the state is sharded over.
        tp_rank: This rank.
        tp_replicated: True when every rank holds the whole state (no sharding).

    Raises:
        InvalidArgumentError: a field out of range, components overlapping or out of
            order, or ``content_bytes`` not the end of the last component.
    """

    components: tuple[StateComponent, ...] = attrs.field(converter=_components)
    content_bytes: int
    page_pitch_bytes: int
    num_blocks: int
    block_capacity: int
    conv_layout: ConvLayout | None = None
    tp_size: int = 1
    tp_rank: int = 0
    tp_replicated: bool = False

    def __attrs_post_init__(self) -> None:
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"StateLayout components repeat a name: {names}",
                                       clause="STG-001")
        end = 0
        for c in self.components:
            if c.byte_offset < end:
                raise InvalidArgumentError(
                    f"component {c.name!r} starts at byte {c.byte_offset}, inside the one "
                    f"before it (ends at {end}); expected ascending, non-overlapping "
                    "components", clause="STG-001")
            end = c.byte_offset + c.nbytes
        content = _check_size("content_bytes", self.content_bytes, clause="STG-001")
        if content != end:
            raise InvalidArgumentError(
                f"content_bytes {content} is not the end of the last component ({end})",
                clause="STG-001")
        pitch = _check_size("page_pitch_bytes", self.page_pitch_bytes, clause="LAY-004")
        if pitch < content:
            raise InvalidArgumentError(
                f"page_pitch_bytes {pitch} is below content_bytes {content}",
                clause="LAY-004")
        blocks = _check_size("num_blocks", self.num_blocks, clause="LAY-003")
        if _check_size("block_capacity", self.block_capacity, clause="LAY-003") < blocks:
            raise InvalidArgumentError(
                f"num_blocks {blocks} exceeds block_capacity {self.block_capacity}",
                clause="LAY-003")
        if self.conv_layout is not None and not isinstance(self.conv_layout, ConvLayout):
            raise InvalidArgumentError(
                f"conv_layout must be a ConvLayout or None, got {self.conv_layout!r}",
                clause="STG-010")
        size = _check_size("tp_size", self.tp_size, clause="STG-001")
        _check_index("tp_rank", self.tp_rank, size, "a rank of tp_size")
        if not isinstance(self.tp_replicated, bool):
            raise InvalidArgumentError(
                f"tp_replicated must be a bool, got {self.tp_replicated!r}", clause="STG-001")

    @classmethod
    def contiguous(
        cls,
        components: Sequence[tuple[str, Sequence[int], torch.dtype]],
        num_blocks: int,
        *,
        page_pitch_bytes: int | None = None,
        block_capacity: int | None = None,
        conv_layout: ConvLayout | None = None,
        tp_size: int = 1,
        tp_rank: int = 0,
        tp_replicated: bool = False,
    ) -> StateLayout:
        """The layout of components packed at consecutive byte offsets, in the order given
        (vLLM's ``bind_kv_cache`` for state layers); the pitch defaults to the content
        bytes, and ``block_capacity`` to ``num_blocks``.

        Raises:
            InvalidArgumentError: a component is not ``(name, shape, dtype)``, or the result
                is invalid.
        """
        parts: list[StateComponent] = []
        offset = 0
        for item in components:
            if not isinstance(item, tuple) or len(item) != 3:
                raise InvalidArgumentError(
                    f"a component must be (name, shape, dtype), got {item!r}",
                    clause="STG-001")
            name, shape, dtype = item
            if isinstance(dtype, torch.dtype) and offset % dtype.itemsize:
                offset += dtype.itemsize - offset % dtype.itemsize
            part = StateComponent(name, tuple(shape), dtype, offset)
            parts.append(part)
            offset += part.nbytes
        return cls(components=tuple(parts), content_bytes=offset,
                   page_pitch_bytes=offset if page_pitch_bytes is None else page_pitch_bytes,
                   num_blocks=num_blocks,
                   block_capacity=num_blocks if block_capacity is None else block_capacity,
                   conv_layout=conv_layout, tp_size=tp_size, tp_rank=tp_rank,
                   tp_replicated=tp_replicated)

    def component(self, name: str) -> StateComponent:
        """The component called ``name``.

        Raises:
            InvalidArgumentError: no such component.
        """
        for c in self.components:
            if c.name == name:
                return c
        raise InvalidArgumentError(
            f"no state component {name!r}; the layout has "
            f"{', '.join(c.name for c in self.components)}", clause="STG-001")

    def same_state_as(self, other: StateLayout) -> bool:
        """True when a block's content bytes mean the same under both layouts: the same
        components (names, shapes, dtypes, offsets), conv layout and sharding (``tp_size``,
        ``tp_replicated``), so whole content bytes may be copied between them (STG-010,
        STG-011). Pitch, block counts and rank may differ."""
        return (self.components == other.components and self.conv_layout == other.conv_layout
                and self.tp_size == other.tp_size and self.tp_replicated == other.tp_replicated)

    def check_tensor(self, tensor: torch.Tensor) -> None:
        """Check that ``tensor`` is one state layer's tensor of this layout: a byte dtype,
        ``block_capacity`` blocks at a pitch of ``page_pitch_bytes``, each block's
        ``content_bytes`` contiguous.

        Raises:
            LayoutMismatchError: naming what differs (LAY-008).
            InvalidArgumentError: ``tensor`` is not a torch.Tensor.
        """
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(
                f"check_tensor needs a torch.Tensor, got {type(tensor).__name__}",
                clause="LAY-008")
        problem = None
        if tensor.dtype not in (torch.int8, torch.uint8):
            problem = f"dtype {tensor.dtype}; expected int8 or uint8 (a byte view)"
        elif tensor.dim() < 2 or tensor.shape[0] != self.block_capacity:
            problem = (f"shape {tuple(tensor.shape)}; expected (block_capacity="
                       f"{self.block_capacity}, ..., content bytes)")
        elif math.prod(tensor.shape[1:]) != self.content_bytes:
            problem = (f"{math.prod(tensor.shape[1:])} bytes per block; expected "
                       f"content_bytes={self.content_bytes}")
        elif tensor.stride(0) != self.page_pitch_bytes:
            problem = (f"block stride {tensor.stride(0)} bytes; expected page_pitch_bytes="
                       f"{self.page_pitch_bytes}")
        elif not tensor[0].is_contiguous():
            problem = "a block's content bytes are not contiguous"
        if problem is not None:
            raise LayoutMismatchError(f"state tensor: {problem}", clause="LAY-008")

    def block_bytes(self, tensor: torch.Tensor, block: int) -> torch.Tensor:
        """The content bytes of ``block`` in one state layer's ``tensor``, as a 1-D uint8
        view (no copy).

        Raises:
            InvalidBlockIdError: ``block`` is not in ``[0, num_blocks)`` (LAY-012).
        """
        number = _int(block)
        if number is None or not 0 <= number < self.num_blocks:
            raise InvalidBlockIdError(
                f"block {block!r} is out of range; expected an int in [0, {self.num_blocks})",
                clause="LAY-012")
        return tensor[number].reshape(-1).view(torch.uint8)

    def component_view(self, tensor: torch.Tensor, block: int, name: str) -> torch.Tensor:
        """Component ``name`` of ``block`` in one state layer's ``tensor``, viewed as its
        dtype and shape (no copy).

        Raises:
            InvalidBlockIdError: ``block`` out of range (LAY-012).
            InvalidArgumentError: no such component.
        """
        c = self.component(name)
        raw = self.block_bytes(tensor, block)[c.byte_offset:c.byte_offset + c.nbytes]
        return raw.view(c.dtype).view(c.shape)
