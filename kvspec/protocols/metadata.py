"""Metadata that crosses process boundaries: step metadata, its binding slot, handshakes.

Nothing here is ever unpickled (ERR-006): step metadata encodes itself to bytes and decodes
with validation; handshake metadata is JSON with a spec version.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Generic, NoReturn, Protocol, TypeVar, runtime_checkable

import attrs
import msgspec
from typing_extensions import Self

from .errors import (
    CompatibilityError,
    InvalidArgumentError,
    KVSpecError,
    MalformedMetadataError,
    MetadataNotBoundError,
)
from .views import freeze_params
from .wire import parse_decimal

MAX_SPEC_MAJOR = 999_999
"""The largest spec major version a peer may name (six ASCII digits)."""


def spec_major(
    version: object, *, error: type[KVSpecError] = InvalidArgumentError,
    clause: str | None = "HSK-003",
) -> int:
    """The major part of a spec version such as ``"1.2"``: ASCII digits, at most
    ``MAX_SPEC_MAJOR`` (``parse_decimal``), never a bare ``ValueError``.

    Raises:
        KVSpecError: of class ``error`` naming ``clause``: not such a version string.
    """
    major = version.split(".")[0] if isinstance(version, str) else None
    try:
        return parse_decimal(major, what="spec_version's major part", maximum=MAX_SPEC_MAJOR,
                             error=error, clause=clause)
    except KVSpecError:
        raise error(f"spec_version must look like '1.2' (a major part of at most "
                    f"{len(str(MAX_SPEC_MAJOR))} ASCII digits), got {version!r:.60}",
                    clause=clause) from None

__all__ = [
    "ConnectorMetadata",
    "decode_json_envelope",
    "HandshakeMetadata",
    "MAX_SPEC_MAJOR",
    "MetadataSlot",
    "spec_major",
]

M = TypeVar("M")


@runtime_checkable
class ConnectorMetadata(Protocol):
    """Per-step metadata from the scheduler role to the worker roles.

    Built by ``build_connector_meta`` (or, for dummy runs, ``build_dummy_connector_meta``)
    and bound around a forward. It crosses from the scheduler process to every worker
    process, so it must encode itself to bytes and decode from them without pickle (ERR-006).
    """

    @abstractmethod
    def encode(self) -> bytes:
        """Return the metadata as bytes that ``decode`` turns back into an equal object.

        Must not use pickle or any format that runs code when decoded (ERR-006).
        """

    @classmethod
    @abstractmethod
    def decode(cls, data: bytes) -> Self:
        """Rebuild metadata from ``encode``'s bytes.

        Must validate what it reads and raise MalformedMetadataError on anything it did not
        write (ERR-005).
        """


class MetadataSlot(Generic[M]):
    """Holds the metadata bound to a worker connector, and refuses reads when none is.

    A connector keeps one slot and forwards ``bind_connector_metadata`` and
    ``clear_connector_metadata`` to it; hooks read the metadata with ``get``, which raises
    ``MetadataNotBoundError`` naming the hook instead of failing an assertion (DRY-001).
    """

    __slots__ = ("_value", "_type")

    def __init__(self, metadata_type: type[M]) -> None:
        if not isinstance(metadata_type, type):
            raise InvalidArgumentError(f"metadata_type must be a class, got {metadata_type!r}")
        self._type = metadata_type
        self._value: M | None = None

    def bind(self, metadata: M) -> None:
        """Bind the step's metadata (WRK-003).

        Raises:
            InvalidArgumentError: ``metadata`` is not of the slot's type.
        """
        if not isinstance(metadata, self._type):
            raise InvalidArgumentError(
                f"expected {self._type.__name__} metadata, got {type(metadata).__name__}",
                clause="WRK-003",
            )
        self._value = metadata

    def clear(self) -> None:
        """Clear the bound metadata (WRK-003). Clearing an empty slot is allowed."""
        self._value = None

    @property
    def is_bound(self) -> bool:
        """True while metadata is bound."""
        return self._value is not None

    def get(self, hook: str = "a worker hook") -> M:
        """Return the bound metadata.

        Raises:
            MetadataNotBoundError: nothing is bound; the message names ``hook`` (DRY-001).
        """
        if self._value is None:
            raise MetadataNotBoundError(
                f"{hook} ran with no connector metadata bound; the engine must bind metadata "
                "before any hook that reads it, in real and dummy forwards alike",
                clause="DRY-001",
            )
        return self._value


_W = TypeVar("_W")


def _strict_json(data: bytes | bytearray | memoryview, wire: type[_W]) -> _W:
    """``data`` as ``wire`` through msgspec's strict JSON (no NaN or Infinity, bounded depth
    and integers); raises ``ValueError`` saying what was wrong."""
    try:
        return msgspec.json.decode(bytes(data), type=wire)
    except (ValueError, RecursionError) as e:  # msgspec's errors, UTF-8, depth
        raise ValueError(str(e)) from None



def decode_json_envelope(
    data: object, *, kind: str, version: int, keys: Collection[str],
    lists: Iterable[str] = (), fail: Callable[[str], NoReturn],
) -> dict[str, Any]:
    """Decode the strict JSON object a connector's metadata ``encode`` writes (ERR-005, ERR-006).

    Checks, in order: ``data`` is bytes; it is UTF-8 JSON with no NaN or Infinity and no
    runaway nesting; it is an object with exactly ``keys``; its ``"kind"`` equals ``kind``
    and its ``"version"`` equals ``version``; every field named in ``lists`` is a list.
    Each failure calls ``fail`` with a message saying what was found and what was expected,
    so a connector raises its own ``MalformedMetadataError`` with its own prefix. Nothing is
    unpickled. Field contents beyond these checks are the caller's to validate.

    Returns:
        The decoded object.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        fail(f"expected bytes, got {type(data).__name__}")
    try:
        obj = _strict_json(data, Any)
    except ValueError as e:
        fail(f"not UTF-8 JSON: {e}")
    if not isinstance(obj, dict) or set(obj) != set(keys):
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        fail(f"got {got}; expected an object with keys {sorted(keys)}")
    if obj["kind"] != kind:
        fail(f"kind is {obj['kind']!r}; expected {kind!r}")
    if isinstance(obj["version"], bool) or obj["version"] != version:
        fail(f"version is {obj['version']!r}; expected {version}")
    for name in lists:
        if not isinstance(obj[name], list):
            fail(f"{name} is {type(obj[name]).__name__}; expected a list")
    return obj


def _json_ready(value: Mapping[str, Any]) -> dict[str, Any]:
    def conv(v: Any) -> Any:
        if isinstance(v, Mapping):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, tuple):
            return [conv(x) for x in v]
        return v

    return {k: conv(v) for k, v in value.items()}


def _plain_field(name: str, value: Mapping[str, Any]) -> Mapping[str, Any]:
    frozen = freeze_params(value, name)
    if frozen is None:
        raise InvalidArgumentError(f"{name} must be a mapping, got None", clause="HSK-001")
    return frozen


def _layout_field(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return _plain_field("layout", value)


def _payload_field(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return _plain_field("payload", value)


_HANDSHAKE_KEYS = {"engine_id", "rank", "spec_version", "layout", "payload"}


class _HandshakeWire(msgspec.Struct, forbid_unknown_fields=True):
    # the scalars stay Any: HandshakeMetadata's own checks say what is wrong with them
    engine_id: Any
    rank: Any
    spec_version: Any
    layout: dict[str, Any]
    payload: dict[str, Any]

_LAYOUT_KEYS = ("order", "packing", "dtype", "block_size")


@attrs.frozen
class HandshakeMetadata:
    """What one worker rank tells its peers before the first transfer (HSK clauses).

    Attributes:
        engine_id: The engine the rank belongs to.
        rank: The worker rank.
        spec_version: The kvspec spec version the connector implements; peers must agree
            on its major part (HSK-003).
        layout: Plain-data summary of the KV layout: ``order``, ``packing``, ``dtype`` and
            ``block_size`` at least (HSK-003).
        payload: Connector-specific plain data (for example a transfer agent's metadata,
            hex-encoded).
    """

    engine_id: str
    rank: int
    spec_version: str
    layout: Mapping[str, Any] = attrs.field(converter=_layout_field)
    payload: Mapping[str, Any] = attrs.field(factory=dict, converter=_payload_field)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise InvalidArgumentError(f"engine_id must be a non-empty str, got {self.engine_id!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise InvalidArgumentError(f"rank must be an int >= 0, got {self.rank!r}")
        spec_major(self.spec_version, clause="HSK-001")
        missing = [k for k in _LAYOUT_KEYS if k not in self.layout]
        if missing:
            raise InvalidArgumentError(
                f"handshake layout lacks {missing}; it needs {list(_LAYOUT_KEYS)} (HSK-003)",
                clause="HSK-003",
            )

    def encode(self) -> bytes:
        """Encode as UTF-8 JSON (HSK-001)."""
        return msgspec.json.encode(
            _HandshakeWire(self.engine_id, self.rank, self.spec_version,
                           _json_ready(self.layout), _json_ready(self.payload)),
            order="sorted",
        )

    @classmethod
    def decode(cls, data: bytes) -> HandshakeMetadata:
        """Decode and validate bytes from ``encode`` (HSK-001, HSK-005).

        Raises:
            MalformedMetadataError: the bytes are not the JSON object ``encode`` writes.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MalformedMetadataError(
                f"handshake metadata must be bytes, got {type(data).__name__}", clause="HSK-005"
            )
        try:
            obj = _strict_json(data, Any)
        except ValueError as e:
            raise MalformedMetadataError(
                f"handshake metadata is not UTF-8 JSON: {e}", clause="HSK-005"
            ) from None
        if not isinstance(obj, dict) or set(obj) != _HANDSHAKE_KEYS:
            got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise MalformedMetadataError(
                f"handshake metadata must be an object with keys {sorted(_HANDSHAKE_KEYS)}, "
                f"got {got}",
                clause="HSK-005",
            )
        try:
            wire = msgspec.convert(obj, _HandshakeWire)
        except msgspec.ValidationError as e:
            raise MalformedMetadataError(
                f"handshake 'layout' and 'payload' must be JSON objects: {e}", clause="HSK-005"
            ) from None
        try:
            return cls(engine_id=wire.engine_id, rank=wire.rank, spec_version=wire.spec_version,
                       layout=wire.layout, payload=wire.payload)
        except InvalidArgumentError as e:
            raise MalformedMetadataError(e.message, clause="HSK-005") from None

    def check_compatible(self, peer: HandshakeMetadata) -> None:
        """Raise if ``peer`` cannot exchange KV with this rank (HSK-003).

        Compares the spec major version and the layout's order, packing, dtype and block size.

        Raises:
            CompatibilityError: naming the first field that differs and both values.
        """
        if not isinstance(peer, HandshakeMetadata):
            raise InvalidArgumentError(f"peer must be HandshakeMetadata, got {type(peer).__name__}")
        mine, theirs = spec_major(self.spec_version), spec_major(peer.spec_version)
        if mine != theirs:
            raise CompatibilityError(
                f"spec major version differs: {self.engine_id} rank {self.rank} implements "
                f"{self.spec_version}, {peer.engine_id} rank {peer.rank} implements "
                f"{peer.spec_version}",
                clause="HSK-003",
            )
        for key in _LAYOUT_KEYS:
            if self.layout[key] != peer.layout[key]:
                raise CompatibilityError(
                    f"layout {key} differs: {self.engine_id} rank {self.rank} has "
                    f"{self.layout[key]!r}, {peer.engine_id} rank {peer.rank} has "
                    f"{peer.layout[key]!r}",
                    clause="HSK-003",
                )
