"""The shared-storage connector: saves finished requests' blocks to files, loads them later.

A reference connector with asynchronous loads and delayed frees, small enough to read in one
sitting. Every process of an engine (and every engine of a prefill/decode pair) shares one
directory: ``config.extra["storage_dir"]``, else ``config.extra["kvspec.tmpdir"]``.

Storage
    A block is keyed by the engine's chained block hash (``RequestView.block_hashes[i]``,
    salted by cache salt and LoRA id: SCH-020), as lowercase hex. Rank ``r`` stores the
    block, all its layers, in one file ``<key>.rank<r>`` (``block_path``): an 8-byte
    magic, a little-endian u32 header length, a JSON header (format version, key, rank,
    dtype, shape) and the raw bytes. A block counts as stored only once the marker
    ``<key>.done`` (``marker_path``) exists, which the scheduler role writes when every
    rank reported the save. Every file is written to a temporary name and renamed into place.

Scheduler role (``SharedStorageScheduler``)
    Matches consecutive stored blocks after the computed tokens, block aligned, leaving at
    least one prompt token to compute (SCH-005, SCH-007), asynchronously; plans a load when
    ``update_state_after_alloc`` carries external tokens; at ``request_finished`` plans a save
    of the request's fully computed blocks that are not stored yet and delays the free until
    the workers report the save. Writes the ``.done`` markers (and emits ``BlockStored``
    events) when the aggregated output reports the save; removes the markers of blocks whose
    load failed, so that they are stored again after the recomputation.

Worker role (``SharedStorageWorker``)
    At ``start_load_kv`` (or, if the engine did not call it for a zero-token step, at
    ``clear_connector_metadata``) it submits loads to one background thread, and snapshots
    the blocks of saves on the calling thread (a copy in host memory) before writing the
    files in the background. Reports each request once per direction from ``get_finished``;
    a failed or timed-out load is reported in ``finished_recving`` and ``failed_recving``
    with its failing block ids invalid (WRK-011, WRK-014).

Prefill/decode hand-off
    An engine whose role is ``TransferRole.PRODUCER`` returns, from ``request_finished``,
    ``kv_transfer_params = {"kvspec.shared_storage": {"blocks": n}}``: the request's first
    ``n`` blocks are stored or being stored. A request that arrives with these parameters
    (on any engine) has its match deferred (``None``, SCH-002) while those blocks are not
    all marked stored yet, for at most ``handoff_timeout_s`` after ``on_new_request``; then
    it matches whatever is stored.

Configuration (``config.extra``): ``storage_dir`` (str), ``io_timeout_s`` (float > 0,
default 30: a transfer not done by then ends as failed), ``load_delay_s`` (float >= 0,
default 0: the background thread waits this long before each load, for tests that need a
load in flight), ``handoff_timeout_s`` (float > 0, default 30: the longest a handed-off
request's match is deferred).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import json
import logging
import math
import os
import queue
import re
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, NoReturn

import attrs
import torch
from typing_extensions import Self

from kvspec.protocols.metadata import decode_json_envelope
from kvspec.protocols import (
    AllocatedBlocks,
    FaultPlan,
    BlockRemoved,
    BlockStored,
    Capabilities,
    ConnectorFactory,
    ConnectorMetadata,
    ConnectorStats,
    EngineConfigView,
    FailureReporting,
    ForwardContextView,
    HookGraphMode,
    InvalidArgumentError,
    InvalidBlockIdError,
    KVCacheEvent,
    KVCacheLayout,
    KVConnectorOutput,
    KVPacking,
    KVSpecError,
    MalformedMetadataError,
    MetadataSlot,
    RequestView,
    SchedulerConnector,
    SchedulerOutputView,
    SupportsAggregate,
    TransferRole,
    UnknownRequestError,
    WorkerConnector,
)

from ._checks import check_count, check_request

__all__ = [
    "LoadJob",
    "SaveJob",
    "SharedStorageConnector",
    "SharedStorageMetadata",
    "SharedStorageScheduler",
    "SharedStorageWorker",
    "StorageSettings",
    "HANDOFF_PARAM",
    "block_path",
    "marker_path",
]

HANDOFF_PARAM = "kvspec.shared_storage"
"""The ``kv_transfer_params`` key of a producer's hand-off: ``{"blocks": n}``."""

_log = logging.getLogger(__name__)

_KEY_RE = re.compile(r"(?:[0-9a-f]{2}){1,256}")
_MAGIC = b"KVSPECSS"
_FILE_VERSION = 1
_MAX_HEADER = 1 << 16
_META_KIND = "kvspec.shared_storage"
_META_VERSION = 1
_MEDIUM = "shared-storage"


# ----------------------------------------------------------------------------- settings


def _number(extra: Mapping[str, Any], name: str, default: float, *, positive: bool) -> float:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
        value
    ) or value < 0 or (positive and value == 0):
        raise InvalidArgumentError(
            f"config.extra[{name!r}] is {value!r}; expected a finite number "
            f"{'> 0' if positive else '>= 0'} (seconds)",
            clause="ERR-002",
        )
    return float(value)


@attrs.frozen
class StorageSettings:
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

    directory: str
    io_timeout_s: float = 30.0
    load_delay_s: float = 0.0
    handoff_timeout_s: float = 30.0

    @classmethod
    def from_config(cls, config: EngineConfigView) -> StorageSettings:
        """Read the settings from ``config.extra``.

        Raises:
            InvalidArgumentError: no directory is configured, or a value is malformed.
        """
        if not isinstance(config, EngineConfigView):
            raise InvalidArgumentError(
                f"config must be an EngineConfigView, got {type(config).__name__}",
                clause="ERR-002",
            )
        extra = config.extra
        directory = extra.get("storage_dir") or extra.get("kvspec.tmpdir")
        if not isinstance(directory, str) or not directory:
            raise InvalidArgumentError(
                "the shared-storage connector needs a directory: set config.extra"
                "['storage_dir'] or config.extra['kvspec.tmpdir'] to a path, got "
                f"{directory!r}",
                clause="ERR-002",
            )
        return cls(
            directory=directory,
            io_timeout_s=_number(extra, "io_timeout_s", 30.0, positive=True),
            load_delay_s=_number(extra, "load_delay_s", 0.0, positive=False),
            handoff_timeout_s=_number(extra, "handoff_timeout_s", 30.0, positive=True),
        )


def _check_key(key: object, what: str = "key") -> str:
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise InvalidArgumentError(
            f"{what} is {key!r}; expected a lowercase hex string of 2 to 512 characters, "
            "even length",
            clause="ERR-002",
        )
    return key


def block_path(directory: str, key: str, rank: int) -> str:
    """The file holding block ``key`` of rank ``rank``: ``<directory>/<key>.rank<rank>``.

    Raises:
        InvalidArgumentError: ``key`` is not lowercase hex or ``rank`` not an int >= 0.
    """
    _check_key(key)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise InvalidArgumentError(f"rank must be an int >= 0, got {rank!r}", clause="ERR-002")
    return os.path.join(directory, f"{key}.rank{rank}")


def marker_path(directory: str, key: str) -> str:
    """The marker that makes block ``key`` count as stored: ``<directory>/<key>.done``.

    Raises:
        InvalidArgumentError: ``key`` is not lowercase hex.
    """
    return os.path.join(directory, f"{_check_key(key)}.done")


def _atomic_write(path: str, chunks: Iterable[bytes]) -> None:
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


# --------------------------------------------------------------------------- block files


class _BadBlockFile(KVSpecError):
    """A stored block file is missing, truncated or describes another block."""


def _write_block_file(path: str, key: str, rank: int, block: torch.Tensor) -> None:
    """Store one block (a contiguous CPU tensor holding every layer) at ``path``."""
    if block.device.type != "cpu" or not block.is_contiguous():
        raise InvalidArgumentError(
            "a block is written from a contiguous CPU tensor", clause="ERR-002"
        )
    header = json.dumps(
        {
            "version": _FILE_VERSION,
            "key": key,
            "rank": rank,
            "dtype": str(block.dtype),
            "shape": list(block.shape),
        },
        sort_keys=True,
    ).encode()
    payload = ctypes.string_at(block.data_ptr(), block.numel() * block.element_size())
    _atomic_write(path, (_MAGIC, struct.pack("<I", len(header)), header, payload))


def _read_block_file(
    path: str, key: str, rank: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """Read one block as a flat, writable uint8 tensor, after checking its header.

    Raises:
        _BadBlockFile: the header is malformed or names another key, rank, dtype or shape,
            or the payload has the wrong length.
        OSError: the file cannot be read.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    with open(path, "rb") as f:
        head = f.read(len(_MAGIC) + 4)
        if len(head) != len(_MAGIC) + 4 or head[: len(_MAGIC)] != _MAGIC:
            raise _BadBlockFile(f"{path}: not a shared-storage block file (bad magic)")
        (size,) = struct.unpack("<I", head[len(_MAGIC):])
        if size > _MAX_HEADER:
            raise _BadBlockFile(f"{path}: header of {size} bytes exceeds {_MAX_HEADER}")
        try:
            header = json.loads(f.read(size).decode("utf-8"))
        except (ValueError, RecursionError) as e:  # JSON, UTF-8, int-size and depth errors
            raise _BadBlockFile(f"{path}: header is not UTF-8 JSON: {e}") from None
        expected = {
            "version": _FILE_VERSION,
            "key": key,
            "rank": rank,
            "dtype": str(dtype),
            "shape": list(shape),
        }
        if header != expected:
            raise _BadBlockFile(f"{path}: header {header!r} does not match {expected!r}")
        buf = bytearray(nbytes)
        got = f.readinto(buf)
        if got != nbytes or f.read(1):
            raise _BadBlockFile(
                f"{path}: payload is {'shorter' if got != nbytes else 'longer'} than "
                f"{nbytes} bytes"
            )
    return torch.frombuffer(buf, dtype=torch.uint8)


# ------------------------------------------------------------------------------ metadata


def _check_request_id(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"{what} must be a non-empty str, got {value!r}")
    return value


def _check_blocks(value: object, what: str) -> tuple[tuple[int, str], ...]:
    if not isinstance(value, tuple) or not value:
        raise InvalidArgumentError(
            f"{what} must be a non-empty tuple of (block_id, key) pairs, got {value!r}"
        )
    seen: set[int] = set()
    for item in value:
        if not isinstance(item, tuple) or len(item) != 2:
            raise InvalidArgumentError(f"{what} holds {item!r}; expected a (block_id, key) pair")
        block, key = item
        if isinstance(block, bool) or not isinstance(block, int) or block < 0:
            raise InvalidBlockIdError(
                f"{what} holds block id {block!r}; expected an int >= 0", clause="ERR-003"
            )
        if block in seen:
            raise InvalidArgumentError(f"{what} names block {block} twice")
        seen.add(block)
        _check_key(key, f"{what} key")
    return value


def _check_unique(jobs: Sequence[LoadJob] | Sequence[SaveJob], what: str) -> None:
    ids = [j.request_id for j in jobs]
    if len(set(ids)) != len(ids):
        raise InvalidArgumentError(f"{what} names a request twice: {sorted(ids)}", clause="SCH-013")


@attrs.frozen
class LoadJob:
    """Load these stored blocks into these engine blocks, for one request.

    Attributes:
        request_id: The request whose external tokens the blocks hold.
        blocks: ``(block_id, key)`` pairs: engine block id and storage key, in token order.

    Raises:
        InvalidArgumentError: a field is malformed (InvalidBlockIdError for a block id).
    """

    request_id: str
    blocks: tuple[tuple[int, str], ...]

    def __attrs_post_init__(self) -> None:
        _check_request_id(self.request_id, "LoadJob.request_id")
        _check_blocks(self.blocks, "LoadJob.blocks")


@attrs.frozen
class SaveJob:
    """Store these engine blocks under these keys, for one finished request.

    Attributes:
        request_id: The finished request.
        blocks: ``(block_id, key)`` pairs, in token order.
        report: Whether the workers report the request in ``finished_sending`` when the
            files are written; True exactly when ``request_finished`` delayed the free.

    Raises:
        InvalidArgumentError: a field is malformed (InvalidBlockIdError for a block id).
    """

    request_id: str
    blocks: tuple[tuple[int, str], ...]
    report: bool = True

    def __attrs_post_init__(self) -> None:
        _check_request_id(self.request_id, "SaveJob.request_id")
        _check_blocks(self.blocks, "SaveJob.blocks")
        if not isinstance(self.report, bool):
            raise InvalidArgumentError(f"SaveJob.report must be a bool, got {self.report!r}")


_META_KEYS = frozenset({"kind", "version", "loads", "saves", "aborted_loads"})


def _malformed(detail: str) -> NoReturn:
    raise MalformedMetadataError(
        f"shared-storage metadata is malformed: {detail}", clause="ERR-005"
    )


def _wire_blocks(value: object, what: str) -> tuple[tuple[int, str], ...]:
    if not isinstance(value, list):
        _malformed(f"{what} is {type(value).__name__}; expected a list of [block_id, key]")
    out: list[tuple[int, str]] = []
    for item in value:
        if not isinstance(item, list) or len(item) != 2:
            _malformed(f"{what} holds {item!r}; expected [block_id, key]")
        out.append((item[0], item[1]))
    return tuple(out)


def _wire_job(value: object, what: str, keys: frozenset[str]) -> dict[str, Any]:
    if not isinstance(value, dict) or set(value) != keys:
        got = sorted(value) if isinstance(value, dict) else type(value).__name__
        _malformed(f"{what} is {got}; expected an object with keys {sorted(keys)}")
    return value


_LOAD_KEYS = frozenset({"request_id", "blocks"})
_SAVE_KEYS = frozenset({"request_id", "blocks", "report"})


@attrs.frozen
class SharedStorageMetadata:
    """One step's transfers, from the scheduler role to every worker (SCH-011, SCH-013).

    Attributes:
        loads: Loads to start; each request appears once.
        saves: Saves to start; each request appears once.
        aborted_loads: Requests aborted while their load was in flight (SCH-021): the
            workers still report each of them in ``finished_recving`` exactly once.

    Encodes to a JSON object ``{"kind", "version", "loads", "saves", "aborted_loads"}``;
    ``decode`` accepts exactly that and validates every field (ERR-005, ERR-006).

    Raises:
        InvalidArgumentError: a field is malformed.
    """

    loads: tuple[LoadJob, ...] = ()
    saves: tuple[SaveJob, ...] = ()
    aborted_loads: tuple[str, ...] = ()

    def __attrs_post_init__(self) -> None:
        for name, kind in (("loads", LoadJob), ("saves", SaveJob)):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(j, kind) for j in value):
                raise InvalidArgumentError(
                    f"{name} must be a tuple of {kind.__name__}, got {value!r}"
                )
        _check_unique(self.loads, "loads")
        _check_unique(self.saves, "saves")
        if not isinstance(self.aborted_loads, tuple):
            raise InvalidArgumentError(
                f"aborted_loads must be a tuple of request ids, got {self.aborted_loads!r}"
            )
        for rid in self.aborted_loads:
            _check_request_id(rid, "aborted_loads entry")
        if len(set(self.aborted_loads)) != len(self.aborted_loads):
            raise InvalidArgumentError(f"aborted_loads names a request twice: {self.aborted_loads}")

    @property
    def is_empty(self) -> bool:
        """True when the metadata describes nothing."""
        return not (self.loads or self.saves or self.aborted_loads)

    def encode(self) -> bytes:
        """Encode as UTF-8 JSON (ERR-006)."""
        return json.dumps(
            {
                "kind": _META_KIND,
                "version": _META_VERSION,
                "loads": [
                    {"request_id": j.request_id, "blocks": [list(b) for b in j.blocks]}
                    for j in self.loads
                ],
                "saves": [
                    {
                        "request_id": j.request_id,
                        "blocks": [list(b) for b in j.blocks],
                        "report": j.report,
                    }
                    for j in self.saves
                ],
                "aborted_loads": list(self.aborted_loads),
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        """Decode and validate bytes from ``encode``.

        Raises:
            MalformedMetadataError: ``data`` is not exactly what ``encode`` writes, or
                a field is out of range (ERR-005).
        """
        obj = decode_json_envelope(
            data, kind=_META_KIND, version=_META_VERSION, keys=_META_KEYS,
            lists=("loads", "saves", "aborted_loads"), fail=_malformed,
        )
        try:
            loads = []
            for i, v in enumerate(obj["loads"]):
                j = _wire_job(v, f"loads[{i}]", _LOAD_KEYS)
                loads.append(
                    LoadJob(
                        request_id=j["request_id"],
                        blocks=_wire_blocks(j["blocks"], f"loads[{i}].blocks"),
                    )
                )
            saves = []
            for i, v in enumerate(obj["saves"]):
                j = _wire_job(v, f"saves[{i}]", _SAVE_KEYS)
                saves.append(
                    SaveJob(
                        request_id=j["request_id"],
                        blocks=_wire_blocks(j["blocks"], f"saves[{i}].blocks"),
                        report=j["report"],
                    )
                )
            return cls(
                loads=tuple(loads), saves=tuple(saves),
                aborted_loads=tuple(obj["aborted_loads"]),
            )
        except MalformedMetadataError:
            raise
        except InvalidArgumentError as e:
            _malformed(e.message)



# ----------------------------------------------------------------------------- scheduler




@attrs.frozen
class _SaveRecord:
    """A save the scheduler waits for: its keys and the events to emit when it is done."""

    keys: tuple[str, ...]
    events: tuple[BlockStored, ...]


class SharedStorageScheduler(SchedulerConnector):
    """Scheduler role of the shared-storage connector. See the module docstring.

    The seams ``_block_keys``, ``_match_limit``, ``_is_async`` and
    ``_delay_free`` exist so that the deliberately broken variants of
    ``kvspec.conformance.connectors.broken`` each change one behaviour.
    """

    def __init__(self, config: EngineConfigView) -> None:
        self._settings = StorageSettings.from_config(config)
        self._config = config
        self._block_size = config.block_size
        self._dir = self._settings.directory
        os.makedirs(self._dir, exist_ok=True)
        self._known: set[str] = set()
        # num_computed_tokens of the latest match of each request not yet allocated: where
        # its external tokens start when update_state_after_alloc comes.
        self._asked: dict[str, int] = {}
        self._loading: dict[str, LoadJob] = {}  # awaiting the aggregated finished_recving
        self._saving: dict[str, _SaveRecord] = {}  # awaiting the aggregated finished_sending
        self._unreported: dict[str, _SaveRecord] = {}  # saves whose free was not delayed
        self._saving_keys: set[str] = set()
        self._pending_loads: list[LoadJob] = []
        self._pending_saves: list[SaveJob] = []
        self._pending_aborts: list[str] = []
        self._events: list[KVCacheEvent] = []
        # Deadlines of handed-off requests' deferral, and the time of the current scheduling
        # phase (sampled once per step, so that repeated matches in a step agree, SCH-001).
        self._handoff_until: dict[str, float] = {}
        self._clock = time.monotonic()

    # -- seams ------------------------------------------------------------------------------

    def _block_keys(self, request: RequestView) -> tuple[str, ...]:
        """Storage keys of the request's full blocks: its salted block hashes (SCH-020)."""
        return tuple(h.hex() for h in request.block_hashes)

    def _match_limit(self, request: RequestView) -> int:
        """How many leading blocks a match may reach: one prompt token stays (SCH-005)."""
        return (request.num_prompt_tokens - 1) // self._block_size

    def _is_async(self, count: int) -> bool:
        """The load flag for a match of ``count`` tokens (SCH-004)."""
        return count > 0

    def _delay_free(self) -> bool:
        """Whether a planned save holds the blocks until it is reported (SCH-016)."""
        return True

    def _is_stored(self, key: str) -> bool:
        """True when block ``key`` is stored by every rank (its marker exists)."""
        return os.path.exists(marker_path(self._dir, key))

    # -- matching ---------------------------------------------------------------------------

    def _match(self, request: RequestView, num_computed_tokens: int) -> int:
        """Tokens of consecutive stored blocks from ``num_computed_tokens``, block aligned."""
        bs = self._block_size
        if num_computed_tokens % bs:
            return 0
        keys = self._block_keys(request)
        start = num_computed_tokens // bs
        end = min(len(keys), self._match_limit(request))
        stop = start
        while stop < end and self._is_stored(keys[stop]):
            stop += 1
        return (stop - start) * bs

    @staticmethod
    def _announced_blocks(request: RequestView) -> int | None:
        """The block count of a producer's hand-off in the request's params, if any."""
        params = request.kv_transfer_params
        entry = params.get(HANDOFF_PARAM) if params is not None else None
        blocks = entry.get("blocks") if isinstance(entry, Mapping) else None
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
            return None
        return blocks

    def _awaits_handoff(self, request: RequestView, num_computed_tokens: int, count: int) -> bool:
        """True while a handed-off request's announced blocks are not all stored yet."""
        announced = self._announced_blocks(request)
        until = self._handoff_until.get(request.request_id)
        if announced is None or until is None or self._clock >= until:
            return False
        if num_computed_tokens % self._block_size:
            return False
        want = min(announced, self._match_limit(request), len(self._block_keys(request)))
        return num_computed_tokens + count < want * self._block_size

    def on_new_request(self, request: RequestView) -> None:
        """Remember the request's id (SCH-028), and when a hand-off's deferral ends."""
        self._known.add(check_request(request).request_id)
        if self._announced_blocks(request) is not None:
            self._handoff_until[request.request_id] = (
                time.monotonic() + self._settings.handoff_timeout_s
            )

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Return ``(n, n > 0)``: ``n`` tokens of stored blocks after the computed ones.

        Reads only the markers; the answer depends only on the request, the count, the
        markers and, for a handed-off request, the step's time (SCH-001). A handed-off
        request whose announced blocks are not all stored yet gets ``(None, False)``
        (SCH-002) until its deferral ends, and so does a request whose match reaches a
        block this engine is still saving, until that save is reported (SCH-031). It remembers ``num_computed_tokens`` as where a
        following allocation's external tokens start.
        """
        check_request(request)
        check_count("num_computed_tokens", num_computed_tokens)
        count = self._match(request, num_computed_tokens)
        self._known.add(request.request_id)
        self._asked[request.request_id] = num_computed_tokens
        if self._awaits_handoff(request, num_computed_tokens, count) or self._awaits_save(
                request, num_computed_tokens, count):
            return None, False
        return count, self._is_async(count)

    def _awaits_save(self, request: RequestView, num_computed_tokens: int, count: int) -> bool:
        """True when the block after the match is in a save whose report is awaited (a
        finished request's, SCH-016): the match waits for that report (SCH-002, SCH-031)
        instead of missing the block after an idle gap."""
        if not self._saving or num_computed_tokens % self._block_size:
            return False
        keys = self._block_keys(request)
        i = (num_computed_tokens + count) // self._block_size
        return i < min(len(keys), self._match_limit(request)) and any(
            keys[i] in record.keys for record in self._saving.values())

    def update_state_after_alloc(
        self, request: RequestView, blocks: AllocatedBlocks, num_external_tokens: int
    ) -> None:
        """Plan a load of the external tokens' blocks, if there are any (SCH-008..010).

        The external tokens start at the ``num_computed_tokens`` of the latest
        ``get_num_new_matched_tokens`` for the request (else ``request.num_computed_tokens``);
        their blocks are ``blocks.block_ids()[start // block_size : end // block_size]``.
        With ``num_external_tokens == 0`` nothing happens (SCH-009).

        Raises:
            UnknownRequestError: the request was never seen (SCH-028).
            InvalidBlockIdError: a block id is outside the budget (LAY-012).
            InvalidArgumentError: the external tokens are not whole blocks, do not fit
                ``blocks``, or a load for the request is already in flight.
        """
        check_request(request)
        rid = request.request_id
        if rid not in self._known:
            raise UnknownRequestError(
                f"update_state_after_alloc for request {rid!r}, which this connector never "
                "saw; expected a request asked with get_num_new_matched_tokens",
                request_id=rid,
                clause="SCH-028",
            )
        if not isinstance(blocks, AllocatedBlocks):
            raise InvalidArgumentError(
                f"blocks must be AllocatedBlocks, got {type(blocks).__name__}", clause="ERR-002"
            )
        if check_count("num_external_tokens", num_external_tokens) == 0:
            return
        blocks.check_budget(self._config.num_blocks)
        bs = self._block_size
        start = self._asked.get(rid, request.num_computed_tokens)
        if start % bs or num_external_tokens % bs:
            raise InvalidArgumentError(
                f"request {rid!r}: external tokens [{start}, {start + num_external_tokens}) "
                f"are not whole blocks of {bs}; this connector matches whole blocks only",
                clause="SCH-007",
            )
        if rid in self._loading:
            raise InvalidArgumentError(
                f"request {rid!r} already has a load in flight; expected no second load "
                "before finished_recving",
                clause="SCH-009",
            )
        first, last = start // bs, (start + num_external_tokens) // bs
        keys = self._block_keys(request)
        ids = blocks.block_ids(0)
        if last > len(keys) or last > len(ids):
            raise InvalidArgumentError(
                f"request {rid!r}: external blocks [{first}, {last}) exceed its "
                f"{len(keys)} full blocks or its {len(ids)} allocated blocks",
                clause="SCH-010",
            )
        job = LoadJob(rid, tuple((ids[i], keys[i]) for i in range(first, last)))
        self._pending_loads.append(job)
        self._loading[rid] = job
        self._asked.pop(rid, None)

    # -- finishing --------------------------------------------------------------------------

    def _unsaved_blocks(self, request: RequestView, block_ids: tuple[int, ...]) -> list[int]:
        """Positions of the request's fully computed blocks that are neither stored nor
        being stored by another request."""
        keys = self._block_keys(request)
        full = min(len(keys), request.num_computed_tokens // self._block_size, len(block_ids))
        return [
            i for i in range(full)
            if keys[i] not in self._saving_keys and not self._is_stored(keys[i])
        ]

    def _stored_events(
        self, request: RequestView, keys: tuple[str, ...], positions: list[int]
    ) -> tuple[BlockStored, ...]:
        """One BlockStored per run of consecutive saved blocks (EVT-005)."""
        bs = self._block_size
        tokens = request.all_token_ids
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
                events.append(
                    BlockStored(
                        block_hashes=[bytes.fromhex(keys[i]) for i in run],
                        parent_block_hash=bytes.fromhex(keys[first - 1]) if first else None,
                        token_ids=tokens[first * bs: last * bs],
                        block_size=bs,
                        lora_id=request.lora_id,
                        medium=_MEDIUM,
                    )
                )
            except InvalidArgumentError:  # e.g. negative token ids: no event, still stored
                _log.debug("no BlockStored event for request %s", request.request_id)
        return tuple(events)

    def request_finished(
        self, request: RequestView, block_ids: tuple[int, ...]
    ) -> tuple[bool, Mapping[str, Any] | None]:
        """Plan a save of the request's computed blocks not stored yet; delay the free then.

        A request whose load is still in flight (aborted while waiting for remote KV) is not
        saved: the call returns ``(False, None)`` (the engine holds the blocks until
        ``finished_recving`` anyway, SCH-021) and the next metadata names it in
        ``aborted_loads``. Otherwise, when some of the first
        ``min(len(block_hashes), num_computed_tokens // block_size)`` blocks have no marker
        and no other request is saving them, a save job goes into the next metadata and the
        call returns ``(True, params)`` (SCH-016); else ``(False, params)``. ``params`` is
        None, except on a ``TransferRole.PRODUCER`` engine: the hand-off parameters (see the
        module docstring).

        Raises:
            UnknownRequestError: the request was never seen or already finished (SCH-028).
            InvalidBlockIdError: a block id is outside the budget (LAY-012).
        """
        check_request(request)
        rid = request.request_id
        if rid not in self._known:
            raise UnknownRequestError(
                f"request_finished for request {rid!r}, which this connector never saw or "
                "already finished; expected exactly one call per request (SCH-015)",
                request_id=rid,
                clause="SCH-028",
            )
        AllocatedBlocks.single(block_ids).check_budget(self._config.num_blocks)
        self._known.discard(rid)
        self._asked.pop(rid, None)
        self._handoff_until.pop(rid, None)
        if rid in self._loading:
            self._pending_aborts.append(rid)
            return False, None
        block_ids = tuple(block_ids)
        params = self._handoff_params(request, block_ids)
        positions = self._unsaved_blocks(request, block_ids)
        if not positions:
            return False, params
        delay = self._delay_free()
        keys = self._block_keys(request)
        job = SaveJob(rid, tuple((block_ids[i], keys[i]) for i in positions), report=delay)
        record = _SaveRecord(
            tuple(keys[i] for i in positions), self._stored_events(request, keys, positions)
        )
        self._pending_saves.append(job)
        self._saving_keys.update(record.keys)
        (self._saving if delay else self._unreported)[rid] = record
        return delay, params

    def _handoff_params(
        self, request: RequestView, block_ids: tuple[int, ...]
    ) -> Mapping[str, Any] | None:
        """A producer's hand-off parameters: how many leading blocks are (being) stored."""
        if self._config.role is not TransferRole.PRODUCER:
            return None
        full = min(
            len(self._block_keys(request)),
            request.num_computed_tokens // self._block_size,
            len(block_ids),
        )
        return {HANDOFF_PARAM: {"blocks": full}} if full else None

    # -- per step ---------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ConnectorMetadata:
        """Describe the loads, saves and aborted loads planned since the last call, once each
        (SCH-011, SCH-013). Never waits (SCH-014)."""
        if not isinstance(scheduler_output, SchedulerOutputView):
            raise InvalidArgumentError(
                f"scheduler_output must be a SchedulerOutputView, got "
                f"{type(scheduler_output).__name__}",
                clause="ERR-002",
            )
        self._clock = time.monotonic()
        meta = SharedStorageMetadata(
            loads=tuple(self._pending_loads),
            saves=tuple(self._pending_saves),
            aborted_loads=tuple(self._pending_aborts),
        )
        self._pending_loads.clear()
        self._pending_saves.clear()
        self._pending_aborts.clear()
        return meta

    def _mark_done(self, record: _SaveRecord) -> None:
        """Write the markers of a reported save's blocks whose files every rank wrote (a
        failed write leaves its block unmarked, to be saved again), and queue their events."""
        marked: set[bytes] = set()
        ranks = range(self._config.world_size)
        for key in record.keys:
            self._saving_keys.discard(key)
            if not all(os.path.exists(block_path(self._dir, key, r)) for r in ranks):
                continue  # some rank could not write it: never matched
            try:
                _atomic_write(marker_path(self._dir, key), (b"stored\n",))
                marked.add(bytes.fromhex(key))
            except OSError as e:
                _log.warning("cannot write marker of block %s: %s", key, e)
        for event in record.events:  # only the blocks marked: one event per run of them
            hashes = list(event.block_hashes)
            start = 0
            for end in range(len(hashes) + 1):
                if end < len(hashes) and hashes[end] in marked:
                    continue
                if end > start:
                    bs = event.block_size
                    self._events.append(attrs.evolve(
                        event, block_hashes=hashes[start:end],
                        parent_block_hash=hashes[start - 1] if start else event.parent_block_hash,
                        token_ids=event.token_ids[start * bs:end * bs]))
                start = end + 1

    def _unmark(self, keys: Sequence[str]) -> None:
        """Remove the markers of blocks whose load failed, so they are stored again."""
        removed = []
        for key in keys:
            try:
                os.unlink(marker_path(self._dir, key))
                removed.append(bytes.fromhex(key))
            except FileNotFoundError:
                pass
            except OSError as e:
                _log.warning("cannot remove marker of block %s: %s", key, e)
        if removed:
            self._events.append(BlockRemoved(block_hashes=removed, medium=_MEDIUM))

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Write the markers of the saves reported in ``finished_sending``; forget the loads
        reported in ``finished_recving``, removing the markers of the blocks of failed loads
        named in ``invalid_block_ids`` (all the load's blocks if none is named).

        Raises:
            UnknownRequestError: the output reports a transfer this role is not waiting for;
                nothing changes then (SCH-028).
        """
        if not isinstance(output, KVConnectorOutput):
            raise InvalidArgumentError(
                f"output must be a KVConnectorOutput, got {type(output).__name__}",
                clause="ERR-002",
            )
        stray = sorted(
            {f"{r} (sending)" for r in output.finished_sending if r not in self._saving}
            | {f"{r} (recving)" for r in output.finished_recving if r not in self._loading}
        )
        if stray:
            raise UnknownRequestError(
                f"the output reports {stray}, which this connector is not waiting for",
                request_id=stray[0].rsplit(" ", 1)[0],
                clause="SCH-028",
            )
        for rid in sorted(output.finished_recving):
            job = self._loading.pop(rid)
            if rid in output.failed_recving:
                bad = [k for b, k in job.blocks if b in output.invalid_block_ids]
                self._unmark(bad or [k for _, k in job.blocks])
        for rid in sorted(output.finished_sending):
            self._mark_done(self._saving.pop(rid))

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Return the ``BlockStored`` / ``BlockRemoved`` events since the last call, once
        each (EVT-004)."""
        events, self._events = tuple(self._events), []
        return events

    def shutdown(self) -> None:
        """Forget every request and pending job; idempotent (SCH-027)."""
        for state in (
            self._known, self._asked, self._loading, self._saving, self._unreported,
            self._saving_keys, self._pending_loads, self._pending_saves, self._pending_aborts,
            self._events, self._handoff_until,
        ):
            state.clear()


# -------------------------------------------------------------------------------- worker


class _Job:
    """One request's load or save on one rank, as the worker tracks it."""

    __slots__ = ("request_id", "block_ids", "report", "deadline", "cancelled", "lock", "future")

    def __init__(
        self, request_id: str, block_ids: tuple[int, ...], timeout_s: float, report: bool
    ) -> None:
        self.request_id = request_id
        self.block_ids = block_ids
        self.report = report
        self.deadline = time.monotonic() + timeout_s
        self.cancelled = threading.Event()
        self.lock = threading.Lock()
        self.future: concurrent.futures.Future[tuple[int, ...]] | None = None


_LOCK_TIMEOUT_S = 5.0
_JOIN_WAIT_S = 0.5
"""After the running job's own timeout, the longest ``shutdown`` waits for the thread."""
_CANCEL_WAIT_S = 0.05
"""The longest an output hook waits, cancelling a timed-out job, for its block copy in
progress (a copy into memory takes microseconds; one that takes longer is stuck)."""


class SharedStorageWorker(WorkerConnector):
    """Worker role of the shared-storage connector. See the module docstring.

    Rank ``r`` reads and writes only ``<key>.rank<r>`` files. One background thread per
    worker does the file I/O and the copies of loads; saves are snapshotted on the calling
    thread. The seams ``_sync_saves``, ``_load_delay_s``, ``_after_load`` and
    ``_report`` exist for the broken variants.
    """

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        self._settings = StorageSettings.from_config(config)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < config.world_size:
            raise InvalidArgumentError(
                f"rank must be an int in [0, {config.world_size}), got {rank!r}",
                clause="ERR-002",
            )
        self._rank = rank
        self._faults = FaultPlan.from_config(config)  # the conformance suite's fault seam
        self._dir = self._settings.directory
        self._slot: MetadataSlot[SharedStorageMetadata] = MetadataSlot(SharedStorageMetadata)
        self._started = False
        self._layout: KVCacheLayout | None = None
        self._tensors: list[torch.Tensor] = []  # one per distinct layer storage (LAY-011)
        self._block_shape: tuple[int, ...] = ()
        self._split = False
        self._stream: torch.cuda.Stream | None = None
        self._pool: _Runner | None = None
        self._closing = threading.Event()
        self._closed = False
        self._loads: dict[str, _Job] = {}
        self._saves: dict[str, _Job] = {}
        self._aborted: set[str] = set()
        self._failed: frozenset[str] = frozenset()
        self._invalid: frozenset[int] = frozenset()
        self._stats_lock = threading.Lock()
        self._counters: dict[str, int] = {}

    # -- seams ------------------------------------------------------------------------------

    _sync_saves: ClassVar[bool] = False
    """Write saves' files on the calling thread, in ``start_load_kv``; default: background."""

    def _load_delay_s(self) -> float:
        """Seconds the background thread waits before each load (``load_delay_s``, or
        the fault plan's ``delay_s`` if longer)."""
        return max(self._settings.load_delay_s, self._faults.delay_s)

    def _after_load(self, data: torch.Tensor) -> torch.Tensor:
        """Hook on a block's bytes (flat uint8) read from storage, before they are copied
        into the KV cache. Runs on the background thread. Default: unchanged."""
        return data

    def _report(self, sending: set[str], recving: set[str]) -> tuple[set[str], set[str]]:
        """Hook on what one ``get_finished`` reports. Default: unchanged."""
        return sending, recving

    # -- registration -----------------------------------------------------------------------

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout
    ) -> None:
        """Check the tensors against ``layout`` and start the background thread.

        Only the first layer of each distinct storage is moved (LAY-011); tensors are
        indexed, never re-strided (LAY-009).

        Raises:
            InvalidArgumentError: called twice (WRK-001), or arguments of the wrong type.
            LayoutMismatchError: a tensor does not match ``layout`` (LAY-008).
        """
        if self._layout is not None or self._closed:
            raise InvalidArgumentError(
                "register_kv_caches called twice (or after shutdown); expected exactly one "
                "registration per worker",
                clause="WRK-001",
            )
        if not isinstance(layout, KVCacheLayout):
            raise InvalidArgumentError(
                f"layout must be a KVCacheLayout, got {type(layout).__name__}", clause="LAY-007"
            )
        if not isinstance(kv_caches, Mapping):
            raise InvalidArgumentError(
                f"kv_caches must map layer names to tensors, got {type(kv_caches).__name__}",
                clause="WRK-001",
            )
        tensors = list(kv_caches.values())
        layout.check_layer_tensors(tensors)
        seen: set[int] = set()
        for tensor, slot in zip(tensors, layout.layer_slots):
            if slot not in seen:
                seen.add(slot)
                self._tensors.append(tensor)
        self._split = layout.packing is KVPacking.SPLIT
        per_layer = layout.storage_shape[1:]
        block = (2, *per_layer[2:]) if self._split else per_layer[1:]
        self._block_shape = (len(self._tensors), *block)
        if tensors[0].is_cuda:
            stream = torch.cuda.Stream(device=tensors[0].device)  # type: ignore[no-untyped-call]
            self._stream = stream
        self._layout = layout
        os.makedirs(self._dir, exist_ok=True)
        self._pool = _Runner(f"kvspec-shared-storage-rank{self._rank}")

    # -- metadata ---------------------------------------------------------------------------

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        """Bind the step's metadata (WRK-003).

        Raises:
            InvalidArgumentError: ``metadata`` is not ``SharedStorageMetadata``.
        """
        self._slot.bind(metadata)  # type: ignore[arg-type]  # the slot checks the type
        self._started = False

    def clear_connector_metadata(self) -> None:
        """Start the bound metadata's transfers if ``start_load_kv`` did not (a step without
        a forward), then forget the metadata (WRK-003)."""
        if self._slot.is_bound and not self._started:
            self._start(self._slot.get("clear_connector_metadata"))
        self._slot.clear()

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        """Submit the bound metadata's loads and saves (WRK-004).

        Loads run on the background thread. Saves are snapshotted here, on the calling
        thread (the engine holds their blocks until ``finished_sending``), and written in the
        background. Dummy forwards move nothing (DRY-006).

        Raises:
            MetadataNotBoundError: no metadata is bound (DRY-001).
            InvalidBlockIdError: the metadata names a block outside the budget (LAY-012).
        """
        meta = self._slot.get("start_load_kv")
        if isinstance(forward_context, ForwardContextView) and forward_context.kind.is_dummy:
            return
        self._start(meta)

    def _start(self, meta: SharedStorageMetadata) -> None:
        self._started = True
        if meta.is_empty:
            return
        layout, pool = self._layout, self._pool
        if layout is None or pool is None or self._closed:
            raise InvalidArgumentError(
                "the metadata names transfers but no KV caches are registered (or the worker "
                "is shut down); expected register_kv_caches before the first transfer",
                clause="WRK-001",
            )
        jobs: list[LoadJob | SaveJob] = [*meta.loads, *meta.saves]
        for job in jobs:
            for block, _ in job.blocks:
                if block >= layout.num_blocks:
                    raise InvalidBlockIdError(
                        f"request {job.request_id!r}: block id {block} is outside the block "
                        f"budget [0, {layout.num_blocks})",
                        clause="LAY-012",
                    )
            if job.request_id in (self._loads if isinstance(job, LoadJob) else self._saves):
                raise InvalidArgumentError(
                    f"request {job.request_id!r} already has a transfer of this direction in "
                    "flight; expected each transfer described once",
                    clause="SCH-013",
                )
        timeout = self._settings.io_timeout_s
        for load in meta.loads:
            j = _Job(load.request_id, tuple(b for b, _ in load.blocks), timeout, True)
            j.future = pool.submit(self._load_blocks, j, load.blocks)
            self._loads[load.request_id] = j
        self._aborted.update(r for r in meta.aborted_loads if r in self._loads)
        for save in meta.saves:
            ids = tuple(b for b, _ in save.blocks)
            snapshot = self._snapshot(ids)
            j = _Job(save.request_id, ids, timeout, save.report)
            keys = tuple(k for _, k in save.blocks)
            if self._sync_saves:
                j.future = concurrent.futures.Future()
                j.future.set_result(self._write_blocks(j, keys, snapshot))
            else:
                j.future = pool.submit(self._write_blocks, j, keys, snapshot)
            self._saves[save.request_id] = j

    # -- transfers --------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self._counters[name] = self._counters.get(name, 0) + n

    def _snapshot(self, block_ids: tuple[int, ...]) -> torch.Tensor:
        """Copy blocks into one contiguous CPU tensor ``(len(block_ids), *block_shape)``."""
        dim = 1 if self._split else 0
        index = torch.tensor(block_ids, dtype=torch.long, device=self._tensors[0].device)
        parts = [t.index_select(dim, index) for t in self._tensors]
        if self._split:
            parts = [p.movedim(1, 0) for p in parts]
        return torch.stack(parts, dim=1).to("cpu").contiguous()

    def _block(self, tensor: torch.Tensor, block: int) -> torch.Tensor:
        return tensor[:, block] if self._split else tensor[block]

    def _copy_in(self, block: int, src: torch.Tensor) -> None:
        """Copy one block, ``(num_storages, *block)`` on the host, into the KV caches."""
        if self._stream is None:
            for tensor, part in zip(self._tensors, src):
                self._block(tensor, block).copy_(part)
            return
        with torch.cuda.stream(self._stream):
            for tensor, part in zip(self._tensors, src):
                self._block(tensor, block).copy_(part)
        self._stream.synchronize()  # the block is complete before the load is reported

    def _load_blocks(self, job: _Job, blocks: tuple[tuple[int, str], ...]) -> tuple[int, ...]:
        """Background thread: read and copy in each block; return the ids that failed."""
        layout = self._layout
        assert layout is not None
        delay = self._load_delay_s()
        if delay:
            self._closing.wait(delay)  # returns early at shutdown
        failed: list[int] = []
        for block, key in blocks:
            if self._closing.is_set() or job.cancelled.is_set() or self._faults.fail_loads:
                failed.append(block)
                continue
            try:
                data = _read_block_file(
                    block_path(self._dir, key, self._rank), key, self._rank,
                    layout.dtype, self._block_shape,
                )
                src = self._after_load(data).view(layout.dtype).reshape(self._block_shape)
                if not job.lock.acquire(timeout=_LOCK_TIMEOUT_S):  # every wait is bounded
                    failed.append(block)
                    continue
                try:
                    if job.cancelled.is_set():  # timed out meanwhile: write nothing more
                        failed.append(block)
                        continue
                    self._copy_in(block, src)
                finally:
                    job.lock.release()
            except (OSError, KVSpecError, RuntimeError, ValueError) as e:
                _log.info("rank %d: load of block %s into %d failed: %s", self._rank, key, block, e)
                failed.append(block)
        self._count("blocks_loaded", len(blocks) - len(failed))
        self._count("blocks_load_failed", len(failed))
        return tuple(failed)

    def _write_blocks(
        self, job: _Job, keys: tuple[str, ...], snapshot: torch.Tensor
    ) -> tuple[int, ...]:
        """Background thread: write each snapshotted block; return the ids not written."""
        if self._faults.delay_s and not self._sync_saves:
            self._closing.wait(self._faults.delay_s)  # returns early at shutdown
        failed: list[int] = []
        for i, (block, key) in enumerate(zip(job.block_ids, keys)):
            if self._closing.is_set() or job.cancelled.is_set() or self._faults.fail_stores:
                failed.append(block)
                continue
            try:
                _write_block_file(block_path(self._dir, key, self._rank), key, self._rank,
                                  snapshot[i])
            except (OSError, KVSpecError, RuntimeError, ValueError) as e:
                _log.warning("rank %d: save of block %s failed: %s", self._rank, key, e)
                failed.append(block)
        self._count("blocks_saved", len(keys) - len(failed))
        return tuple(failed)

    def _cancel(self, job: _Job) -> None:
        """Stop a job: dequeue it, or keep it from copying any further block. Runs in the
        output hooks, so it waits only ``_CANCEL_WAIT_S`` for a block copy in progress;
        if that one is stuck, the flag still stops every later block (WRK-014)."""
        if job.future is not None:
            job.future.cancel()
        locked = job.lock.acquire(timeout=_CANCEL_WAIT_S)
        job.cancelled.set()
        if locked:
            job.lock.release()

    def _outcome(self, job: _Job, now: float) -> tuple[int, ...] | None:
        """None while ``job`` runs; else the block ids that failed (all on a timeout)."""
        future = job.future
        if future is not None and future.done():
            if future.cancelled() or future.exception() is not None:
                return job.block_ids
            return future.result()
        if now >= job.deadline:
            _log.warning("rank %d: transfer of request %s timed out", self._rank, job.request_id)
            self._cancel(job)
            return job.block_ids
        return None

    # -- completion -------------------------------------------------------------------------

    def get_finished(
        self, finished_req_ids: frozenset[str]
    ) -> tuple[frozenset[str], frozenset[str]]:
        """Return the saves (sending) and loads (recving) that completed since the last call,
        each once (WRK-009, WRK-010); loads that failed or timed out count as completed
        (WRK-011, WRK-014). ``finished_req_ids`` is not needed."""
        now = time.monotonic()
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        invalid: set[int] = set()
        for rid, job in list(self._loads.items()):
            bad = self._outcome(job, now)
            if bad is None:
                continue
            del self._loads[rid]
            recving.add(rid)
            if bad:
                failed.add(rid)
                invalid.update(bad)
        for rid, job in list(self._saves.items()):
            if self._outcome(job, now) is None:
                continue
            del self._saves[rid]
            if job.report:
                sending.add(rid)
        sending, recving = self._report(sending, recving)
        self._aborted &= set(self._loads)
        self._failed = frozenset(failed & recving)
        self._invalid = frozenset(invalid)
        return frozenset(sending), frozenset(recving)

    def get_failed_recving(self) -> frozenset[str]:
        """The loads of the last ``get_finished`` that failed (WRK-011)."""
        failed, self._failed = self._failed, frozenset()
        return failed

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        """The blocks of the last ``get_finished``'s failed loads (WRK-011, EVT-003)."""
        invalid, self._invalid = self._invalid, frozenset()
        return invalid

    def get_kv_connector_stats(self) -> SupportsAggregate | None:
        """Blocks loaded, failed and saved since the last call, or None if none."""
        with self._stats_lock:
            counters, self._counters = self._counters, {}
        return ConnectorStats(counters) if any(counters.values()) else None

    def wait_for_save(self) -> None:
        """Return at once: saves were snapshotted in ``start_load_kv``, so no block the next
        step may overwrite is still read (WRK-007)."""
        return None

    def handle_preemptions(self, preempted_req_ids: frozenset[str]) -> None:
        """Wait, bounded by each transfer's deadline, for transfers of preempted requests;
        cancel those still running (WRK-012, WRK-014). They are reported as usual."""
        for rid in preempted_req_ids:
            for job in (self._loads.get(rid), self._saves.get(rid)):
                if job is None or job.future is None:
                    continue
                try:
                    job.future.result(timeout=max(0.0, job.deadline - time.monotonic()))
                except concurrent.futures.TimeoutError:
                    self._cancel(job)
                except Exception:  # reported as failed by get_finished
                    pass

    def shutdown(self) -> None:
        """Cancel queued work, wait a bounded time for the running job and the thread, and
        drop every reference to the KV caches; idempotent (WRK-015, ERR-009)."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        pool, self._pool = self._pool, None
        if pool is not None:
            jobs = (*self._loads.values(), *self._saves.values())
            for j in jobs:
                if j.future is not None:
                    j.future.cancel()  # those not started
            pool.close()
            # A future cancelled before it started stays CANCELLED, which wait() never
            # counts as done: waiting on it would always run into the timeout.
            futures = [j.future for j in jobs if j.future is not None and not j.future.cancelled()]
            concurrent.futures.wait(futures, timeout=self._settings.io_timeout_s)
            pool.thread.join(timeout=_JOIN_WAIT_S)  # its calls had io_timeout_s to end
            if pool.thread.is_alive():  # a daemon: it does not keep the process alive
                _log.error("rank %d: thread %s is stuck in a transfer; left behind",
                           self._rank, pool.thread.name)
        self._loads.clear()
        self._saves.clear()
        self._aborted.clear()
        self._tensors = []
        self._stream = None
        self._slot.clear()


class _Runner:
    """One daemon thread running submitted calls in order. A ``ThreadPoolExecutor``'s
    threads are joined when the interpreter exits, so one stuck write kept the engine's
    process from ever exiting (issue 34)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Queue ``fn(*args)``; its future can be cancelled until the call starts."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return future

    def close(self) -> None:
        """End the thread after the call it runs, if any; calls queued are dropped."""
        self._queue.put(None)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 (the future carries it)
                    future.set_exception(e)


# ------------------------------------------------------------------------------- factory


class SharedStorageConnector(ConnectorFactory):
    """Factory of the shared-storage connector
    (``kvspec.conformance.connectors:SharedStorageConnector``).

    Declares async loads, delayed free, no per-layer hooks, failed loads reported as invalid
    blocks, every stride order and both K/V packings. Holds no state: the roles share only
    the storage directory.
    """

    scheduler_class: ClassVar[type[SharedStorageScheduler]] = SharedStorageScheduler
    worker_class: ClassVar[type[SharedStorageWorker]] = SharedStorageWorker

    @property
    def name(self) -> str:
        """``"shared-storage"``."""
        return "shared-storage"

    @property
    def capabilities(self) -> Capabilities:
        """Async loads, delayed free, ``NO_LAYER_HOOKS``, ``INVALID_BLOCKS``, all layouts."""
        return Capabilities(
            async_loads=True,
            delayed_free=True,
            layer_hooks=HookGraphMode.NO_LAYER_HOOKS,
            accepted_layouts=(),
            accepts_split_kv=True,
            failure_reporting=FailureReporting.INVALID_BLOCKS,
            fault_injection=True,
        )

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        """Build the scheduler role (``scheduler_class``)."""
        return self.scheduler_class(config)

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        """Build the worker role of ``rank`` (``worker_class``)."""
        return self.worker_class(config, rank)
