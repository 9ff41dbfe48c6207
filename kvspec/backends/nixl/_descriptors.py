"""Block descriptor geometry and the plain-data peer description of the NIXL backend.

Nothing here imports NIXL: the geometry turns a ``KVCacheLayout``
into the rows of a NIXL descriptor array (``address, length, device id``), and
``PeerInfo`` is what one rank tells its peers at handshake, encoded as JSON of ints and
strings (HSK-001) and decoded defensively (HSK-005). NIXL's own ``get_serialized_descs`` /
``deserialize_descs`` pickle, so descriptors never travel that way: a peer rebuilds the
remote descriptor rows from the geometry it received.

Descriptor granularity (LAY-013): a block that is one contiguous region (an unpadded
block-outermost layout) gets one descriptor; otherwise one descriptor per (region, block),
e.g. one per layer and block for NHD/HND. A caller may instead give the byte runs of a block
to move (``BlockRuns``), e.g. a decode rank that reads half of the heads of a
producer's HND page under heterogeneous TP (``head_runs``):
each run ``(offset, nbytes)`` of block 0, inside one region, is one descriptor per block.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal, SupportsIndex

import attrs
import msgspec
import numpy as np
import numpy.typing as npt

from kvspec.protocols.errors import (
    CompatibilityError,
    InvalidArgumentError,
    InvalidBlockIdError,
    MalformedMetadataError,
)
from kvspec.protocols.layout import KVCacheLayout
from kvspec.protocols.metadata import spec_major

__all__ = [
    "BlockGeometry",
    "LayoutSummary",
    "MemKind",
    "BlockRuns",
    "PeerInfo",
    "check_compatible",
]

MemKind = Literal["DRAM", "VRAM"]
"""NIXL memory segment of a registration: host memory or GPU memory."""

BlockRuns = tuple[tuple[int, int], ...]
"""The ``(byte offset, nbytes)`` runs of block 0 that a transfer moves, in descriptor (pair)
order; block ``b``'s runs lie ``b * block_stride`` further. Each run lies inside one region;
runs do not overlap."""

_MAX_REGIONS: Final = 1 << 16
_MAX_RUNS: Final = 1 << 16
_MAX_U64: Final = (1 << 64) - 1
_WIRE_KIND: Final = "kvspec.nixl/1"


def _int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _checked(name: str, value: object, *, minimum: int, maximum: int = _MAX_U64,
             error: type[InvalidArgumentError] = InvalidArgumentError,
             clause: str | None = None) -> int:
    number = _int(value)
    if number is None or not minimum <= number <= maximum:
        raise error(
            f"{name} must be an int in [{minimum}, {maximum}], got {value!r}", clause=clause
        )
    return number


@attrs.frozen
class BlockGeometry:
    """Where the bytes of each block lie in one registered region, relative to its base.

    Block ``b``'s regions start at ``b * block_stride + region_offsets[r]`` and are
    ``region_nbytes`` long. Only blocks ``0 .. num_blocks-1`` (the engine's budget, LAY-003,
    LAY-012) get descriptors.

    Attributes:
        num_blocks: Blocks that may be transferred.
        block_stride: Bytes between block ``b`` and ``b + 1`` of one region.
        region_offsets: Byte offsets of block 0's regions, ascending.
        region_nbytes: Bytes of each region.
    """

    num_blocks: int
    block_stride: int
    region_offsets: tuple[int, ...]
    region_nbytes: int

    def __attrs_post_init__(self) -> None:
        _checked("num_blocks", self.num_blocks, minimum=1)
        _checked("block_stride", self.block_stride, minimum=0)
        _checked("region_nbytes", self.region_nbytes, minimum=1)
        offsets = self.region_offsets
        if not isinstance(offsets, tuple) or not 1 <= len(offsets) <= _MAX_REGIONS:
            raise InvalidArgumentError(
                f"region_offsets must be a tuple of 1 to {_MAX_REGIONS} ints, got "
                f"{type(offsets).__name__} of {len(offsets) if isinstance(offsets, tuple) else '?'}"
            )
        for offset in offsets:
            _checked("a region offset", offset, minimum=0)
        if any(b - a < self.region_nbytes for a, b in zip(offsets, offsets[1:])):
            raise InvalidArgumentError(
                f"region_offsets {offsets[:8]}... must ascend by at least region_nbytes="
                f"{self.region_nbytes} so that no two regions of a block overlap"
            )
        if self.num_blocks > 1 and self.block_stride < self.region_nbytes:
            raise InvalidArgumentError(
                f"block_stride {self.block_stride} is smaller than region_nbytes "
                f"{self.region_nbytes}: regions of consecutive blocks would overlap"
            )

    @classmethod
    def from_layout(cls, layout: KVCacheLayout) -> BlockGeometry:
        """The geometry of ``layout``: one region per block for an unpadded block-outermost
        layout (LAY-013), one per layer storage and block otherwise (shared layers once,
        LAY-011; padding skipped, LAY-004)."""
        if not isinstance(layout, KVCacheLayout):
            raise InvalidArgumentError(
                f"layout must be a KVCacheLayout, got {type(layout).__name__}", clause="LAY-007"
            )
        offsets = layout.block_region_offsets([0])[0].tolist()
        return cls(
            num_blocks=layout.num_blocks,
            block_stride=layout.block_stride_bytes,
            region_offsets=tuple(int(o) for o in offsets),
            region_nbytes=layout.region_nbytes,
        )

    @property
    def regions_per_block(self) -> int:
        """Regions of one block."""
        return len(self.region_offsets)

    @property
    def extent(self) -> int:
        """Bytes from the base to the end of the last region of the last block."""
        return (self.num_blocks - 1) * self.block_stride + self.region_offsets[-1] + (
            self.region_nbytes
        )

    @property
    def region_runs(self) -> BlockRuns:
        """Block 0's whole regions as runs: the default of ``check_runs``."""
        return tuple((offset, self.region_nbytes) for offset in self.region_offsets)

    def check_runs(self, runs: BlockRuns | None) -> BlockRuns:
        """Validate ``runs`` of block 0 against the regions; None means whole regions.

        Raises:
            InvalidArgumentError: a run is not ``(offset, nbytes)`` with ``nbytes >= 1``
                inside one region, runs overlap, or there are none or too many.
        """
        if runs is None:
            return self.region_runs
        if not isinstance(runs, (tuple, list)) or not 1 <= len(runs) <= _MAX_RUNS:
            raise InvalidArgumentError(
                f"runs must be a non-empty tuple of at most {_MAX_RUNS} (offset, nbytes) "
                f"pairs, got {type(runs).__name__} of "
                f"{len(runs) if isinstance(runs, (tuple, list)) else '?'}"
            )
        result = []
        for item in runs:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise InvalidArgumentError(
                    f"each run must be an (offset, nbytes) pair, got {item!r}"
                )
            result.append((_checked("run offset", item[0], minimum=0),
                           _checked("run nbytes", item[1], minimum=1)))
        spans = np.asarray(result, dtype=np.int64)
        starts, ends = spans[:, 0], spans[:, 0] + spans[:, 1]
        regions = np.asarray(self.region_offsets, dtype=np.int64)
        which = np.searchsorted(regions, starts, side="right") - 1
        outside = (which < 0) | (ends > regions[np.maximum(which, 0)] + self.region_nbytes)
        if outside.any():
            offset, nbytes = result[int(np.argmax(outside))]
            raise InvalidArgumentError(
                f"run ({offset}, {nbytes}) is not inside one region of block 0; regions are "
                f"{self.region_nbytes} bytes at {list(self.region_offsets[:4])}..."
            )
        order = np.argsort(starts, kind="stable")
        if (starts[order][1:] < ends[order][:-1]).any():
            raise InvalidArgumentError("runs overlap; each byte of a block is moved at most once")
        return tuple(result)

    def descriptor_rows(
        self, base: int, device_id: int, runs: BlockRuns
    ) -> npt.NDArray[np.uint64]:
        """The NIXL ``Nx3`` descriptor array ``(address, nbytes, device id)`` of every
        block, run-major: run ``d`` of block ``b`` is row ``d * num_blocks + b``.

        Run-major matters: NIXL merges two descriptors of a transfer only when their
        *indices* are consecutive in the prepared list and their memory is contiguous on
        both sides, so with this order a run of consecutive block ids of one layer becomes
        one descriptor (as with vLLM's layer-major lists)."""
        starts = np.asarray([o for o, _ in runs], dtype=np.uint64)
        lengths = np.asarray([n for _, n in runs], dtype=np.uint64)
        blocks = np.arange(self.num_blocks, dtype=np.uint64) * np.uint64(self.block_stride)
        addresses = np.uint64(base) + starts[:, None] + blocks[None, :]
        rows = np.empty((addresses.size, 3), dtype=np.uint64)
        rows[:, 0] = addresses.reshape(-1)
        rows[:, 1] = np.repeat(lengths, self.num_blocks)
        rows[:, 2] = np.uint64(device_id)
        return rows

    def block_ids(self, block_ids: object, what: str) -> npt.NDArray[np.int64]:
        """``block_ids`` as a 1-D int64 array, each in ``[0, num_blocks)``.

        Raises:
            InvalidBlockIdError: not a sequence of ints in range (LAY-012).
        """
        if isinstance(block_ids, np.ndarray):
            if block_ids.ndim != 1 or block_ids.dtype.kind not in "iu":
                raise InvalidBlockIdError(
                    f"{what} block ids must be a 1-D integer array, got dtype "
                    f"{block_ids.dtype} and shape {block_ids.shape}",
                    clause="LAY-012",
                )
            ids = block_ids.astype(np.int64)
        elif isinstance(block_ids, (list, tuple)) and set(map(type, block_ids)) <= {int}:
            # The common case, at C speed: a per-element SupportsIndex check costs about
            # 1.4 us per id, 0.7 ms for a 256-block READ (measured by kvspec bench nixl).
            try:
                ids = np.fromiter(block_ids, dtype=np.int64, count=len(block_ids))
            except OverflowError:
                raise InvalidBlockIdError(
                    f"{what} block ids must fit in 64 bits; expected ints in "
                    f"[0, {self.num_blocks})", clause="LAY-012",
                ) from None
        elif isinstance(block_ids, Sequence) and not isinstance(block_ids, (str, bytes)):
            values = []
            for value in block_ids:
                number = _int(value)
                if number is None:
                    raise InvalidBlockIdError(
                        f"{what} block id {value!r} is not an int; expected ints in "
                        f"[0, {self.num_blocks})",
                        clause="LAY-012",
                    )
                values.append(number)
            ids = np.asarray(values, dtype=np.int64)
        else:
            raise InvalidBlockIdError(
                f"{what} block ids must be a sequence of ints, got {type(block_ids).__name__}",
                clause="LAY-012",
            )
        bad = ids[(ids < 0) | (ids >= self.num_blocks)]
        if bad.size:
            raise InvalidBlockIdError(
                f"{what} block id {int(bad[0])} is outside [0, num_blocks={self.num_blocks})",
                clause="LAY-012",
            )
        return ids

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of the geometry (ints and a list of ints)."""
        return {
            "num_blocks": self.num_blocks,
            "block_stride": self.block_stride,
            "region_offsets": list(self.region_offsets),
            "region_nbytes": self.region_nbytes,
        }


def descriptor_indices(
    block_ids: npt.NDArray[np.int64], per_block: int, num_blocks: int,
    runs: npt.NDArray[np.int64] | None = None,
) -> npt.NDArray[np.int32]:
    """Indices into a run-major prepared list (``BlockGeometry.descriptor_rows``) of
    the descriptors of ``block_ids``, run outer and block inner, so that runs of
    consecutive block ids on both sides are consecutive indices NIXL can merge. ``runs``:
    only these run indices (of ``per_block``) of each block, e.g. the regions of one
    KV-cache group's layers."""
    slots = (np.arange(per_block, dtype=np.int64) if runs is None else runs) * num_blocks
    return (slots[:, None] + block_ids[None, :]).reshape(-1).astype(np.int32)


@attrs.frozen
class LayoutSummary:
    """The layout fields peers compare at handshake (HSK-003), as plain data, and the
    element strides a peer needs to find each head's bytes (heterogeneous TP).

    Attributes:
        order: Stride order name (LAY-001).
        packing: K/V packing name (LAY-002).
        dtype: Element dtype name, e.g. ``"bfloat16"``.
        block_size: Tokens per block.
        num_layers: Attention layers.
        storage_layers: Distinct layer storages (LAY-011).
        num_heads: KV heads of the rank.
        head_size_k: Channels of K per head.
        head_size_v: Channels of V per head.
        strides: Element strides of the storage dims in logical order, as in
            ``strides``. Not compared: peers with
            different padding or capacity exchange KV alike.
    """

    order: str
    packing: str
    dtype: str
    block_size: int
    num_layers: int
    storage_layers: int
    num_heads: int
    head_size_k: int
    head_size_v: int
    strides: tuple[int, ...]

    @classmethod
    def from_layout(cls, layout: KVCacheLayout) -> LayoutSummary:
        """The summary of ``layout``."""
        return cls(
            order=layout.order.name,
            packing=layout.packing.name,
            dtype=str(layout.dtype).removeprefix("torch."),
            block_size=layout.block_size,
            num_layers=layout.num_layers,
            storage_layers=layout.num_storage_layers,
            num_heads=layout.num_heads,
            head_size_k=layout.head_size_k,
            head_size_v=layout.head_size_v,
            strides=layout.strides,
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields (strides as a list)."""
        return {**attrs.asdict(self), "strides": list(self.strides)}


_SUMMARY_FIELDS: Final = tuple(f.name for f in attrs.fields(LayoutSummary))
_SUMMARY_INTS: Final = ("block_size", "num_layers", "storage_layers", "num_heads",
                        "head_size_k", "head_size_v")
_INFO_KEYS: Final = frozenset({
    "kind", "spec_version", "agent_name", "agent_metadata", "mem_type", "device_id",
    "base_address", "nbytes", "layout", "geometry",
})


@attrs.frozen
class PeerInfo:
    """What a rank tells its peers so they can read its blocks: plain data only (HSK-001).

    Attributes:
        spec_version: The kvspec spec version (HSK-003 compares its major part).
        agent_name: The NIXL agent's name, unique among peers.
        agent_metadata: NIXL's own agent metadata blob (``get_agent_metadata``), loaded with
            ``add_remote_agent``; NIXL parses it with its own serializer, not pickle.
        mem_type: ``"DRAM"`` or ``"VRAM"``.
        device_id: The device of the registration (0 for host memory).
        base_address: Address of byte 0 of the registered region.
        nbytes: Bytes registered.
        layout: The layout fields compared at handshake.
        geometry: Where each block lies in the registered region.
    """

    spec_version: str
    agent_name: str
    agent_metadata: bytes
    mem_type: MemKind
    device_id: int
    base_address: int
    nbytes: int
    layout: LayoutSummary
    geometry: BlockGeometry

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (ints, strings, lists; the agent metadata hex-encoded)."""
        return {
            "kind": _WIRE_KIND,
            "spec_version": self.spec_version,
            "agent_name": self.agent_name,
            "agent_metadata": self.agent_metadata.hex(),
            "mem_type": self.mem_type,
            "device_id": self.device_id,
            "base_address": self.base_address,
            "nbytes": self.nbytes,
            "layout": self.layout.to_json(),
            "geometry": self.geometry.to_json(),
        }

    def encode(self) -> bytes:
        """UTF-8 JSON of ``to_json`` (HSK-001)."""
        return msgspec.json.encode(self.to_json(), order="sorted")

    @classmethod
    def decode(cls, data: bytes) -> PeerInfo:
        """Decode ``encode`` output (HSK-001, HSK-005).

        Raises:
            MalformedMetadataError: not UTF-8 JSON of the expected shape.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MalformedMetadataError(
                f"peer info must be bytes, got {type(data).__name__}", clause="HSK-005"
            )
        try:
            obj = msgspec.json.decode(bytes(data))
        except (ValueError, RecursionError) as e:  # msgspec's errors, UTF-8, depth
            raise MalformedMetadataError(
                f"peer info is not UTF-8 JSON: {e}", clause="HSK-005"
            ) from None
        return cls.from_json(obj)

    @classmethod
    def from_json(cls, obj: object) -> PeerInfo:
        """Validate a ``to_json`` dict from a peer (HSK-005).

        Raises:
            MalformedMetadataError: a key is missing, extra, of the wrong type or out of range.
        """
        def bad(why: str) -> MalformedMetadataError:
            return MalformedMetadataError(f"peer info: {why}", clause="HSK-005")

        if not isinstance(obj, Mapping) or set(obj) != _INFO_KEYS:
            got = sorted(obj) if isinstance(obj, Mapping) else type(obj).__name__
            raise bad(f"expected an object with keys {sorted(_INFO_KEYS)}, got {got}")
        if obj["kind"] != _WIRE_KIND:
            raise bad(f"kind is {obj['kind']!r}, expected {_WIRE_KIND!r}")
        for key in ("spec_version", "agent_name", "agent_metadata", "mem_type"):
            if not isinstance(obj[key], str) or not obj[key]:
                raise bad(f"{key} must be a non-empty string, got {obj[key]!r}")
        try:
            spec_major(obj["spec_version"], error=MalformedMetadataError, clause="HSK-005")
        except MalformedMetadataError as e:
            raise bad(e.message) from None
        if obj["mem_type"] not in ("DRAM", "VRAM"):
            raise bad(f"mem_type must be 'DRAM' or 'VRAM', got {obj['mem_type']!r}")
        try:
            metadata = bytes.fromhex(obj["agent_metadata"])
        except ValueError:
            raise bad("agent_metadata is not a hex string") from None
        try:
            device_id = _checked("device_id", obj["device_id"], minimum=0, maximum=1 << 20,
                                 error=MalformedMetadataError, clause="HSK-005")
            base = _checked("base_address", obj["base_address"], minimum=1,
                            error=MalformedMetadataError, clause="HSK-005")
            nbytes = _checked("nbytes", obj["nbytes"], minimum=1,
                              error=MalformedMetadataError, clause="HSK-005")
        except MalformedMetadataError as e:
            raise bad(e.message) from None
        layout = obj["layout"]
        if not isinstance(layout, Mapping) or set(layout) != set(_SUMMARY_FIELDS):
            raise bad(f"layout must be an object with keys {sorted(_SUMMARY_FIELDS)}")
        for key in ("order", "packing", "dtype"):
            if not isinstance(layout[key], str) or not layout[key]:
                raise bad(f"layout {key} must be a non-empty string, got {layout[key]!r}")
        for key in _SUMMARY_INTS:
            if _int(layout[key]) is None or not 1 <= layout[key] <= 1 << 31:
                raise bad(f"layout {key} must be an int >= 1, got {layout[key]!r}")
        strides = layout["strides"]
        if not isinstance(strides, (list, tuple)) or len(strides) not in (5, 6) or not all(
            _int(v) is not None and 0 <= v <= 1 << 62 for v in strides
        ):
            raise bad(f"layout strides must be a list of 5 or 6 ints >= 0, got {strides!r}")
        geometry = obj["geometry"]
        if not isinstance(geometry, Mapping) or set(geometry) != {
            "num_blocks", "block_stride", "region_offsets", "region_nbytes"
        }:
            raise bad("geometry must be an object with keys block_stride, num_blocks, "
                      "region_nbytes, region_offsets")
        offsets = geometry["region_offsets"]
        if not isinstance(offsets, (list, tuple)) or not all(
            _int(o) is not None for o in offsets
        ):
            raise bad("geometry region_offsets must be a list of ints")
        try:
            geom = BlockGeometry(
                num_blocks=geometry["num_blocks"],
                block_stride=geometry["block_stride"],
                region_offsets=tuple(offsets),
                region_nbytes=geometry["region_nbytes"],
            )
        except InvalidArgumentError as e:
            raise bad(f"geometry: {e.message}") from None
        if geom.extent > nbytes or base + nbytes > _MAX_U64:
            raise bad(
                f"geometry reaches byte {geom.extent} of a region of nbytes={nbytes}; every "
                f"block must lie inside the registered region"
            )
        return cls(
            spec_version=obj["spec_version"],
            agent_name=obj["agent_name"],
            agent_metadata=metadata,
            mem_type=obj["mem_type"],
            device_id=device_id,
            base_address=base,
            nbytes=nbytes,
            layout=LayoutSummary(**{k: layout[k] for k in _SUMMARY_FIELDS if k != "strides"},
                                 strides=tuple(strides)),
            geometry=geom,
        )


def check_compatible(
    mine: PeerInfo, theirs: PeerInfo, *, heterogeneous_heads: bool = False
) -> None:
    """Raise unless ``theirs`` can exchange KV with ``mine`` (HSK-003).

    Compares the spec major version, then the layout's order, packing, dtype, block size,
    layer and layer-storage counts, head sizes and (unless ``heterogeneous_heads``, for
    heterogeneous TP with head-sliced descriptors) the head count. Strides are not compared.

    Raises:
        CompatibilityError: naming the first field that differs and both values (HSK-003).
    """
    major_mine = mine.spec_version.split(".")[0]
    major_theirs = theirs.spec_version.split(".")[0]
    if major_mine != major_theirs:
        raise CompatibilityError(
            f"spec major version differs: agent {mine.agent_name!r} implements "
            f"{mine.spec_version}, peer {theirs.agent_name!r} implements {theirs.spec_version}",
            clause="HSK-003",
        )
    for key in _SUMMARY_FIELDS:
        if key == "strides" or (key == "num_heads" and heterogeneous_heads):
            continue
        a, b = getattr(mine.layout, key), getattr(theirs.layout, key)
        if a != b:
            raise CompatibilityError(
                f"layout {key} differs: agent {mine.agent_name!r} has {a!r}, peer "
                f"{theirs.agent_name!r} has {b!r}",
                clause="HSK-003",
            )
