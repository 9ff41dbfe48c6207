"""One wire layer: the envelope, the type-path resolver and the checked decimal parser.

Everything kvspec moves between processes without pickle (ERR-006) that is not of one known
type travels as an ``Envelope``: the ``"module:qualname"`` path of the value's class and the
bytes of the value's own encoding. The receiving side turns the path back into the class
with ``resolve_type_path`` (the one lookup of such paths in kvspec, built on the standard
library's ``pkgutil.resolve_name``) and hands the bytes to the class's ``decode``.

Numbers a peer or a client sends as text (a rank as a JSON object key, a count in a
notification, a spec version's major part) are read by ``parse_decimal``: ASCII digits of
bounded length only. ``int()`` alone is not a check: it accepts ``'²'``-like digits to
``str.isdigit`` but refuses them itself with a bare ``ValueError``, and refuses numbers past
Python's int-string conversion limit the same way.

This module imports nothing else of kvspec but the error hierarchy.
"""

from __future__ import annotations

import base64
import binascii
import importlib
import pkgutil
import re
import sys
from typing import Any

import msgspec

from .errors import KVSpecError, MalformedMetadataError

__all__ = [
    "Envelope",
    "parse_decimal",
    "resolve_type_path",
    "type_path",
]

_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_TYPE_PATH = re.compile(rf"({_DOTTED}):({_DOTTED})", re.ASCII)
_DOTTED_PATH = re.compile(_DOTTED, re.ASCII)
_DIGITS = re.compile(r"[0-9]+", re.ASCII)


def type_path(obj: object) -> str:
    """The ``"module:qualname"`` path of ``obj`` if it is a class, else of its class."""
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}:{cls.__qualname__}"


def _fail(error: type[KVSpecError], clause: str | None, what: str, path: object,
          detail: str) -> KVSpecError:
    return error(f"bad {what} {path!r}: {detail}", clause=clause)


def resolve_type_path(
    path: object,
    *,
    what: str = "type path",
    base: type | None = None,
    loaded_only: bool = False,
    allow_dotted: bool = False,
    error: type[KVSpecError] = MalformedMetadataError,
    clause: str | None = "ERR-005",
) -> Any:
    """The object ``"package.module:Name"`` names (``Name`` may be a dotted attribute path).

    Args:
        path: The type path, one colon between the module and the attribute path.
        what: What the path is, for the error message (``"connector spec"``).
        base: When given, the object must be a class and a subclass of ``base``.
        loaded_only: Import nothing: the module must already be loaded (a decoder that
            must not import what a peer names, ERR-006).
        allow_dotted: Also accept ``"package.module.Name"`` without a colon (the longest
            importable module prefix is the module), as ``pkgutil.resolve_name`` does.
        error: The kvspec error class raised.
        clause: The clause the error names (``None`` for none).

    Raises:
        KVSpecError: of class ``error``, naming ``what`` and ``path``, what was wrong (the
            path's form, a module not found or failing to import, a missing attribute, an
            object that is not a ``base``) and what was expected.
    """
    dotted = allow_dotted and isinstance(path, str) and _DOTTED_PATH.fullmatch(path)
    if not dotted and (not isinstance(path, str) or not _TYPE_PATH.fullmatch(path)):
        raise _fail(error, clause, what, path,
                    "expected 'package.module:Name' (an importable module, one colon, then "
                    "an attribute name or dotted attribute path)")
    assert isinstance(path, str)
    if dotted:
        if loaded_only and path.partition(".")[0] not in sys.modules:
            raise _fail(error, clause, what, path, "its package is not loaded")
        try:
            return pkgutil.resolve_name(path)
        except Exception as e:
            raise _fail(error, clause, what, path, f"cannot be resolved: {type(e).__name__}: "
                        f"{e}") from e
    module_name, _, attr_path = path.partition(":")
    if loaded_only and module_name not in sys.modules:
        raise _fail(error, clause, what, path,
                    f"module {module_name!r} is not loaded; expected a class the receiving "
                    "process has already imported (nothing is imported on a peer's word)")
    try:
        obj: Any = pkgutil.resolve_name(path)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise _fail(error, clause, what, path, f"module {module_name!r} not found (is it "
                        "installed, or on sys.path?)") from e
        raise _fail(error, clause, what, path,
                    f"importing module {module_name!r} failed: {e}") from e
    except AttributeError:
        raise _fail(error, clause, what, path, _missing(module_name, attr_path)) from None
    except Exception as e:
        raise _fail(error, clause, what, path, f"importing module {module_name!r} raised "
                    f"{type(e).__name__}: {e}") from e
    if base is not None and not (isinstance(obj, type) and issubclass(obj, base)):
        raise _fail(error, clause, what, path,
                    f"names a {type(obj).__name__}; expected a subclass of {base.__qualname__}")
    return obj


def _missing(module_name: str, attr_path: str) -> str:
    """Which attribute of ``module:attr_path`` is missing, as ``'where' has no attribute``."""
    obj: Any = importlib.import_module(module_name)  # loaded: resolve_name imported it
    walked = module_name
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            return f"{walked!r} has no attribute {part!r}"
        obj = getattr(obj, part)
        walked = f"{walked}.{part}" if walked != module_name else f"{module_name}:{part}"
    return f"{module_name!r} has no attribute path {attr_path!r}"  # pragma: no cover


def parse_decimal(
    text: object,
    *,
    what: str,
    maximum: int,
    minimum: int = 0,
    error: type[KVSpecError] = MalformedMetadataError,
    clause: str | None = "ERR-005",
) -> int:
    """``text`` as an int, if it is ASCII digits (no sign, no space, no other script's
    digits) of at most ``len(str(maximum))`` characters, in ``[minimum, maximum]``.

    Raises:
        KVSpecError: of class ``error`` naming ``what``, the text and what was expected.
    """
    limit = len(str(maximum))
    if not isinstance(text, str) or len(text) > limit or not _DIGITS.fullmatch(text) or not (
            minimum <= int(text) <= maximum):
        shown = text[:40] + "..." if isinstance(text, str) and len(text) > 40 else text
        raise error(f"{what} is {shown!r}; expected a decimal number in [{minimum}, {maximum}] "
                    f"written in at most {limit} ASCII digits", clause=clause)
    return int(text)


_MSGPACK = msgspec.msgpack.Encoder()


class Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A value as the path of its class and the bytes of its own encoding (ERR-006).

    The one shape in which kvspec moves a value of a class the receiver learns only from
    the message: step metadata between the harness's processes and inside the vLLM
    adapter, custom stats and worker metadata from worker processes, a vLLM connector's
    handshake. The receiver resolves ``type_path`` with ``resolve_type_path`` and decodes
    ``data`` with that class's own decoder, which validates it (ERR-005).

    Attributes:
        type_path: ``"module:qualname"`` of the value's class.
        data: The value's encoding.
    """

    type_path: str
    data: bytes

    @classmethod
    def of(cls, value: object, data: bytes) -> Envelope:
        """The envelope of ``value``'s class with ``data`` (its encoding)."""
        return cls(type_path(value), bytes(data))

    def encode(self) -> bytes:
        """MessagePack ``[type_path, data]`` (a map with those keys)."""
        return _MSGPACK.encode(self)

    @classmethod
    def decode(cls, data: object, *, clause: str = "ERR-005") -> Envelope:
        """Decode ``encode``'s bytes.

        Raises:
            MalformedMetadataError: ``data`` is not bytes, or not an envelope (names
                ``clause``).
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MalformedMetadataError(
                f"an envelope must be bytes, got {type(data).__name__}", clause=clause)
        try:
            return _ENVELOPE.decode(data)
        except (msgspec.MsgspecError, ValueError, RecursionError) as e:  # ValueError: UTF-8
            raise MalformedMetadataError(
                f"not an envelope ({e}); expected a map of type_path (str) and data (bytes)",
                clause=clause) from None

    def to_plain(self) -> dict[str, str]:
        """JSON-ready ``{"type_path": ..., "data": base64 text}``."""
        return {"type_path": self.type_path, "data": base64.b64encode(self.data).decode()}

    @classmethod
    def from_plain(cls, obj: object, *, clause: str = "ERR-005") -> Envelope:
        """Rebuild ``to_plain``'s dict.

        Raises:
            MalformedMetadataError: ``obj`` is not exactly that (names ``clause``).
        """
        if not (isinstance(obj, dict) and set(obj) == {"type_path", "data"}
                and isinstance(obj["type_path"], str) and isinstance(obj["data"], str)):
            got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise MalformedMetadataError(
                f"envelope is {got}; expected an object of a type_path string and base64 "
                "data", clause=clause)
        try:
            data = base64.b64decode(obj["data"], validate=True)
        except (binascii.Error, ValueError) as e:
            raise MalformedMetadataError(f"envelope data is not base64: {e}",
                                         clause=clause) from None
        return cls(obj["type_path"], data)


_ENVELOPE = msgspec.msgpack.Decoder(Envelope)
