"""The file store that the shared-storage and layerwise-storage connectors share.

Both connectors keep a block in one directory that every process of every engine sees.
A block is keyed by the engine's chained block hash (``RequestView.block_hashes[i]``,
salted by cache salt and LoRA id: SCH-020), as lowercase hex. Rank ``r`` stores the
block, all its layers, in one file ``<key>.rank<r>`` (``block_path``): a safetensors file
holding one tensor, ``block``, whose metadata entry ``kvspec-block`` names the format version,
the key and the rank. A block counts as stored only once the marker ``<key>.done``
(``marker_path``) exists, which the scheduler role writes when every rank wrote its file.
Every file is written to a temporary name and renamed into place (``atomic_write``), so a
reader never sees half a file.

Also here: the connectors' settings (``StorageSettings``, read from ``config.extra``
through msgspec) and their metadata codec (``decode_metadata``: strict JSON through
msgspec, errors as ``MalformedMetadataError``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, TypeVar

import attrs
import msgspec
import safetensors.torch
import torch
from typing_extensions import Self

from kvspec.protocols import (
    BlockRemoved,
    BlockStored,
    EngineConfigView,
    InvalidArgumentError,
    InvalidBlockIdError,
    KVCacheLayout,
    KVPacking,
    KVSpecError,
    MalformedMetadataError,
    RequestView,
)

__all__ = [
    "MEDIUM",
    "BlockFileError",
    "KVBlocks",
    "StorageSettings",
    "atomic_write",
    "block_path",
    "check_key",
    "check_pairs",
    "decode_metadata",
    "mark_stored",
    "marked_events",
    "marker_path",
    "read_block_file",
    "removed_event",
    "stored_events",
    "unmark",
    "write_block_file",
    "write_marker",
]

MEDIUM = "shared-storage"
"""The ``medium`` of the store's ``BlockStored`` / ``BlockRemoved`` events."""

_log = logging.getLogger(__name__)
_KEY_RE = re.compile(r"(?:[0-9a-f]{2}){1,256}")
_FILE_VERSION = 1
_MAX_HEADER = 1 << 16

_Seconds = Annotated[float, msgspec.Meta(gt=0, le=sys.float_info.max)]  # finite, > 0
_Delay = Annotated[float, msgspec.Meta(ge=0, le=sys.float_info.max)]  # finite, >= 0


class StorageSettings(msgspec.Struct, frozen=True):
    """The shared-storage connector's configuration, read from ``EngineConfigView.extra``.

    Attributes:
        directory: Where blocks and markers live: ``extra["storage_dir"]`` if set and
            non-empty, else ``extra["kvspec.tmpdir"]``.
        io_timeout_s: A transfer not finished this many seconds after it was submitted ends
            as failed (WRK-014); ``extra["io_timeout_s"]``, default 30.
        load_delay_s: Seconds the background thread waits before each load;
            ``extra["load_delay_s"]``, default 0. Lets tests keep a load in flight.
        handoff_timeout_s: The longest a handed-off request's match is deferred while the
            producer's save completes; ``extra["handoff_timeout_s"]``, default 30.
    """

    directory: Annotated[str, msgspec.Meta(min_length=1)]
    io_timeout_s: _Seconds = 30.0
    load_delay_s: _Delay = 0.0
    handoff_timeout_s: _Seconds = 30.0

    @classmethod
    def from_config(cls, config: EngineConfigView) -> Self:
        """Read the settings (every field of ``cls`` but ``directory``, by name) from
        ``config.extra``.

        Raises:
            InvalidArgumentError: no directory is configured, or a value is malformed.
        """
        extra = config.extra
        values = {name: extra[name] for name in cls.__struct_fields__ if name in extra}
        values["directory"] = extra.get("storage_dir") or extra.get("kvspec.tmpdir")
        try:
            return msgspec.convert(values, cls)
        except msgspec.ValidationError as e:
            raise InvalidArgumentError(
                f"config.extra is invalid: {e} (the directory is extra['storage_dir'] or "
                "extra['kvspec.tmpdir']; times are finite seconds)",
                clause="ERR-002",
            ) from None


# ---------------------------------------------------------------------------- keys, paths


def check_key(key: object, what: str = "key") -> str:
    """Return ``key`` if it is a storage key: lowercase hex, 2 to 512 characters, even.

    Raises:
        InvalidArgumentError: it is not (a path made of it could leave the directory).
    """
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise InvalidArgumentError(
            f"{what} is {key!r}; expected a lowercase hex string of 2 to 512 characters, "
            "even length",
            clause="ERR-002",
        )
    return key


def check_pairs(
    value: object, what: str, *, non_empty: bool = False, unique_keys: bool = False
) -> tuple[tuple[int, str], ...]:
    """Return ``value`` if it is a tuple of ``(block_id, key)`` pairs with distinct block
    ids (and distinct keys with ``unique_keys``; at least one with ``non_empty``).

    Raises:
        InvalidBlockIdError: a block id is not an int >= 0 (ERR-003).
        InvalidArgumentError: anything else is malformed.
    """
    if not isinstance(value, tuple) or (non_empty and not value):
        raise InvalidArgumentError(
            f"{what} must be a {'non-empty ' if non_empty else ''}tuple of (block_id, key) "
            f"pairs, got {value!r}"
        )
    blocks: set[int] = set()
    keys: set[str] = set()
    for item in value:
        if not isinstance(item, tuple) or len(item) != 2:
            raise InvalidArgumentError(f"{what} holds {item!r}; expected a (block_id, key) pair")
        block, key = item
        if isinstance(block, bool) or not isinstance(block, int) or block < 0:
            raise InvalidBlockIdError(
                f"{what} holds block id {block!r}; expected an int >= 0", clause="ERR-003"
            )
        if block in blocks or (unique_keys and key in keys):
            raise InvalidArgumentError(
                f"{what} names block {block} or key {key} twice; expected each moved once",
                clause="SCH-013",
            )
        blocks.add(block)
        keys.add(check_key(key, f"{what} key"))
    return value


def block_path(directory: str, key: str, rank: int) -> str:
    """The file holding block ``key`` of rank ``rank``: ``<directory>/<key>.rank<rank>``.

    Raises:
        InvalidArgumentError: ``key`` is not lowercase hex or ``rank`` not an int >= 0.
    """
    check_key(key)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise InvalidArgumentError(f"rank must be an int >= 0, got {rank!r}", clause="ERR-002")
    return os.path.join(directory, f"{key}.rank{rank}")


def marker_path(directory: str, key: str) -> str:
    """The marker that makes block ``key`` count as stored: ``<directory>/<key>.done``.

    Raises:
        InvalidArgumentError: ``key`` is not lowercase hex.
    """
    return os.path.join(directory, f"{check_key(key)}.done")


def atomic_write(path: str, chunks: Iterable[bytes]) -> None:
    """Write ``chunks`` to ``path`` through a temporary file and ``os.replace``."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_marker(directory: str, key: str) -> None:
    """Mark block ``key`` stored (every rank wrote its file)."""
    atomic_write(marker_path(directory, key), (b"stored\n",))


def mark_stored(directory: str, keys: Iterable[str], world_size: int) -> set[str]:
    """Write the markers of the blocks among ``keys`` whose file every rank wrote (a failed
    write leaves its block unmarked, never matched); return the keys marked."""
    marked = set()
    for key in keys:
        if all(os.path.exists(block_path(directory, key, r)) for r in range(world_size)):
            try:
                write_marker(directory, key)
                marked.add(key)
            except OSError as e:
                _log.warning("cannot write marker of block %s: %s", key, e)
    return marked


def unmark(directory: str, keys: Iterable[str]) -> list[str]:
    """Remove the markers of ``keys`` (blocks whose load failed, to be stored again);
    return the keys whose marker was removed."""
    removed = []
    for key in keys:
        try:
            os.unlink(marker_path(directory, key))
            removed.append(key)
        except FileNotFoundError:
            pass
        except OSError as e:
            _log.warning("cannot remove marker of block %s: %s", key, e)
    return removed


# ---------------------------------------------------------------------------------- events


def stored_events(
    request: RequestView, keys: tuple[str, ...], positions: Iterable[int], block_size: int,
) -> tuple[BlockStored, ...]:
    """One ``BlockStored`` per run of consecutive positions among the request's blocks
    (EVT-005); none for a run the event refuses (e.g. negative token ids)."""
    tokens, bs = request.all_token_ids, block_size
    runs: list[list[int]] = []
    for i in positions:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    events = []
    for run in runs:
        first, last = run[0], run[-1] + 1
        try:
            events.append(BlockStored(
                block_hashes=[bytes.fromhex(keys[i]) for i in run],
                parent_block_hash=bytes.fromhex(keys[first - 1]) if first else None,
                token_ids=tokens[first * bs: last * bs], block_size=bs,
                lora_id=request.lora_id, medium=MEDIUM))
        except InvalidArgumentError:  # no event; the blocks are still stored
            _log.debug("no BlockStored event for request %s", request.request_id)
    return tuple(events)


def marked_events(events: Iterable[BlockStored], marked: set[str]) -> list[BlockStored]:
    """``events`` cut down to the blocks in ``marked``: one event per run of them."""
    out, done = [], {bytes.fromhex(key) for key in marked}
    for event in events:
        hashes, bs, start = list(event.block_hashes), event.block_size, 0
        for end in range(len(hashes) + 1):
            if end < len(hashes) and hashes[end] in done:
                continue
            if end > start:
                out.append(attrs.evolve(
                    event, block_hashes=hashes[start:end],
                    parent_block_hash=hashes[start - 1] if start else event.parent_block_hash,
                    token_ids=event.token_ids[start * bs:end * bs]))
            start = end + 1
    return out


def removed_event(keys: list[str]) -> list[BlockRemoved]:
    """A ``BlockRemoved`` of ``keys``, if any."""
    if not keys:
        return []
    return [BlockRemoved(block_hashes=[bytes.fromhex(k) for k in keys], medium=MEDIUM)]


# ------------------------------------------------------------------------------ block files


class BlockFileError(KVSpecError):
    """A stored block file is malformed, truncated or describes another block."""


def _metadata(key: str, rank: int) -> dict[str, str]:
    # one entry: safetensors writes several in any order, and equal blocks make equal files
    return {"kvspec-block": json.dumps({"version": _FILE_VERSION, "key": key, "rank": rank},
                                       sort_keys=True)}


def write_block_file(path: str, key: str, rank: int, block: torch.Tensor) -> None:
    """Store one block (a contiguous CPU tensor holding every layer) at ``path``."""
    if block.device.type != "cpu" or not block.is_contiguous():
        raise InvalidArgumentError(
            "a block is written from a contiguous CPU tensor", clause="ERR-002"
        )
    atomic_write(path, (safetensors.torch.save({"block": block}, _metadata(key, rank)),))


def read_block_file(
    path: str, key: str, rank: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """Read one block as a flat, writable uint8 tensor, after checking what the file says.

    Raises:
        BlockFileError: the file is not a safetensors file of one block (malformed,
            truncated or padded), or names another key, rank, dtype or shape.
        OSError: the file cannot be read.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    with open(path, "rb") as f:
        data = f.read(nbytes + _MAX_HEADER + 1)  # a longer file is not one of ours
    try:
        if len(data) > nbytes + _MAX_HEADER:
            raise ValueError(f"longer than {nbytes + _MAX_HEADER} bytes")
        (size,) = struct.unpack("<Q", data[:8])
        if size > _MAX_HEADER:
            raise ValueError(f"header of {size} bytes exceeds {_MAX_HEADER}")
        metadata = json.loads(data[8:8 + size]).get("__metadata__")
        tensors = safetensors.torch.load(data)
    except Exception as e:  # safetensors, struct, JSON and UTF-8 errors all mean "not ours"
        raise BlockFileError(f"{path}: not a block file: {type(e).__name__}: {e}") from None
    expected = _metadata(key, rank)
    if metadata != expected:
        raise BlockFileError(f"{path}: metadata {metadata!r} do not match {expected!r}")
    block = tensors.get("block")
    if set(tensors) != {"block"} or block is None or block.dtype != dtype or \
            tuple(block.shape) != tuple(shape):
        found = {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}
        raise BlockFileError(f"{path}: holds {found!r}, not one {dtype} block of {shape}")
    return block.reshape(-1).view(torch.uint8)


# ------------------------------------------------------------------------------ KV blocks


class KVBlocks:
    """The registered KV caches seen as the block files hold them: a block is a tensor
    ``shape = (storages, *block)``, one row per distinct layer storage (layers that share
    storage are moved once, LAY-011). The tensors are checked against the layout (LAY-008)
    and indexed along their block dim, never re-strided (LAY-009)."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout) -> None:
        tensors = list(kv_caches.values())
        layout.check_layer_tensors(tensors)
        first: dict[int, torch.Tensor] = {}
        for tensor, slot in zip(tensors, layout.layer_slots):
            first.setdefault(slot, tensor)
        self.tensors = list(first.values())
        self.split = layout.packing is KVPacking.SPLIT
        self.dim = 1 if self.split else 0  # [2, B, H, N, D] or [B, H, N, C] (LAY-002)
        per_layer = layout.storage_shape[1:]
        block = (2, *per_layer[2:]) if self.split else per_layer[1:]
        self.shape: tuple[int, ...] = (len(self.tensors), *block)
        self.dtype, self.num_blocks = layout.dtype, layout.num_blocks
        self._stream: torch.cuda.Stream | None = None  # copy_in's, on CUDA

    def check_budget(self, pairs: Iterable[tuple[int, str]], what: str) -> None:
        """Refuse block ids outside the engine's block budget, which the tensors may exceed
        (InvalidBlockIdError, LAY-012): metadata comes from another process."""
        bad = [b for b, _ in pairs if b >= self.num_blocks]
        if bad:
            raise InvalidBlockIdError(f"{what} names block id {bad[0]}, outside the block "
                                      f"budget [0, {self.num_blocks})", clause="LAY-012")

    def block(self, tensor: torch.Tensor, block: int) -> torch.Tensor:
        """The view of block ``block`` in one layer storage (no copy)."""
        return tensor.select(self.dim, block)

    def snapshot(self, block_ids: tuple[int, ...]) -> torch.Tensor:
        """Copy blocks into one contiguous CPU tensor ``(len(block_ids), *shape)``."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.tensors[0].device)
        parts = [t.index_select(self.dim, index) for t in self.tensors]
        if self.split:
            parts = [p.movedim(1, 0) for p in parts]
        return torch.stack(parts, dim=1).to("cpu").contiguous()

    def copy_in(self, block: int, src: torch.Tensor) -> None:
        """Copy one block, ``src`` of ``shape`` on the host, into the KV caches; on CUDA on
        a stream of its own, complete when this returns."""
        if not self.tensors[0].is_cuda:
            for tensor, part in zip(self.tensors, src):
                self.block(tensor, block).copy_(part)
            return
        if self._stream is None:
            device = self.tensors[0].device
            self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(self._stream):
            for tensor, part in zip(self.tensors, src):
                self.block(tensor, block).copy_(part)
        self._stream.synchronize()

    def read(self, directory: str, key: str, rank: int) -> torch.Tensor:
        """Read block ``key`` of ``rank`` from its file, shaped ``shape`` (see
        ``read_block_file``)."""
        data = read_block_file(block_path(directory, key, rank), key, rank, self.dtype,
                               self.shape)
        return data.view(self.dtype).reshape(self.shape)


# ------------------------------------------------------------------------------- metadata

_W = TypeVar("_W")
_T = TypeVar("_T")


def decode_metadata(data: object, wire: type[_W], what: str, build: Callable[[_W], _T]) -> _T:
    """Decode ``data``, bytes of strict JSON, as ``wire`` (a msgspec type) and return
    ``build(decoded)`` (ERR-005, ERR-006).

    Raises:
        MalformedMetadataError: ``data`` is not bytes, not JSON, or not a ``wire``, or a
            ``__post_init__`` of a Struct in it, or ``build``, refuses a value.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedMetadataError(
            f"{what} must be bytes, got {type(data).__name__}", clause="ERR-005"
        )
    try:
        return build(msgspec.json.decode(data, type=wire))
    except (msgspec.MsgspecError, ValueError) as e:  # ValueError: InvalidArgumentError, UTF-8
        raise MalformedMetadataError(f"{what} is malformed: {e}", clause="ERR-005") from None
