"""vLLM connector metadata on kvspec's wire: MessagePack through msgspec, never pickle.

vLLM hands a connector's ``KVConnectorMetadata`` from the scheduler to the workers by
pickling it. kvspec's harness requires metadata that encodes to bytes and decodes with
validation (ERR-005, ERR-006), so the wrapper carries vLLM's object in ``VllmMetadata``: an
``Envelope`` of the metadata class's ``module:qualname`` and its fields in MessagePack
(msgspec). The bytes are decoded untyped first (MessagePack runs no code), then converted
with ``msgspec.convert`` against the types the class declares (strict: a wrong type is an
error, not a coercion). Tensors travel as dtype, shape and raw bytes.

Every object travels as a map tagged with its class (``"@class": "module:qualname"``), so a
field declared as a base class decodes into the subclass it held (MultiConnector's tuple of
its connectors' metadata). Decoding imports nothing and runs no ``__init__``: each tagged
class must already be loaded in the decoding process (the connector's module loaded it),
must be the declared type or a subclass of it (a ``KVConnectorMetadata`` at the top), and
must be a dataclass (its fields decode against their annotations) or a plain class with an
``__init__`` of its own. A plain class's attributes decode against the types the class
declares: class-level annotations, or the annotation of the ``__init__`` parameter of the
same name (``self.ids = ids`` for ``ids: set[str]``, as ``MooncakeStoreConnectorMetadata``
does). An attribute declared ``Any`` says nothing to check against: such a class is not
carried. An attribute without a declared type (``self.reqs: dict[str, ReqMeta] = {}`` in
``__init__``, as vLLM's ``NixlConnectorMetadata`` does: an annotation Python does not keep)
travels *described*: every container tagged with its kind, objects only as loaded
dataclasses, so it decodes into exactly the value it was, without reading any source.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import functools
import types
import typing
from typing import Any

import msgspec
import torch
from typing_extensions import Self

from kvspec.protocols import (
    Envelope,
    HarnessError,
    InvalidArgumentError,
    MalformedMetadataError,
    resolve_type_path,
    type_path,
)

__all__ = ["VllmMetadata", "VllmWorkerMetadata", "carry_gap", "decode_value", "encode_value"]

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
              torch.float16, torch.bfloat16, torch.float32, torch.float64)
}

_TAG = "@class"  # not an identifier: no field can be named so
_DESCRIBED = "@described"  # a plain object's attributes without a declared type


def _tensor_plain(obj: torch.Tensor) -> list[Any]:
    t = obj.detach().cpu().contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise InvalidArgumentError(f"a {t.dtype} tensor cannot be encoded; "
                                   f"supported dtypes: {sorted(_DTYPES)}")
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return [name, list(t.shape), raw]


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _tensor_plain(obj)
    raise TypeError(f"a {type(obj).__qualname__} is neither plain data nor a tensor")


def _tensor(obj: Any) -> torch.Tensor:
    if not (isinstance(obj, list) and len(obj) == 3 and isinstance(obj[0], str)
            and isinstance(obj[1], list) and isinstance(obj[2], bytes)
            and all(type(n) is int and n >= 0 for n in obj[1])):
        raise ValueError(f"expected a tensor [dtype, shape, bytes], got {obj!r:.80}")
    name, shape, data = obj
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"unknown tensor dtype {name!r}")
    count = 1
    for n in shape:
        count *= n
    if len(data) != count * dtype.itemsize:
        raise ValueError(f"a {name} tensor of shape {shape} needs {count * dtype.itemsize} "
                         f"bytes, got {len(data)}")
    if not count:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


# ------------------------------------------------------------------ declared field types


def loaded_class(path: str, base: type) -> type:
    """The already-loaded subclass of ``base`` named ``module:qualname``; imports nothing.

    Raises:
        MalformedMetadataError: no such class is loaded, or it is not a ``base`` (ERR-005).
    """
    cls: type = resolve_type_path(path, what=f"{base.__qualname__} class", base=base,
                                  loaded_only=True)
    return cls


def _refuse(cls: type) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{cls.__qualname__} cannot be encoded without pickle: it is neither a dataclass, "
        "nor a class whose __init__ gives every attribute it sets a type (an annotation, "
        "or an annotated parameter it stores)", clause="ERR-006")


@functools.cache
def _declared(cls: type) -> tuple[bool, dict[str, Any]]:
    """``(is a dataclass, {field: declared type})``: a dataclass's fields, or what a plain
    class declares (class-level annotations, annotated ``__init__`` parameters).

    Raises:
        InvalidArgumentError: the class cannot be carried (ERR-006)."""
    if dataclasses.is_dataclass(cls):
        hints = typing.get_type_hints(cls)
        return True, {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    init = cls.__dict__.get("__init__")
    if init is None or "__slots__" in cls.__dict__:
        raise _refuse(cls)
    try:
        declared = {k: t for k, t in typing.get_type_hints(cls).items()
                    if typing.get_origin(t) is not typing.ClassVar}
        declared.update((k, t) for k, t in typing.get_type_hints(init).items() if k != "return")
    except Exception:  # annotations that do not resolve: nothing to check against
        raise _refuse(cls) from None
    return False, declared


def _conforms(value: object, typ: Any) -> bool:
    """Whether ``value`` is, at its outermost level, what ``typ`` declares."""
    if isinstance(typ, typing.NewType):
        typ = typ.__supertype__
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, t) for t in typing.get_args(typ))
    if typ is type(None) or typ is None:
        return value is None
    if typ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is typing.Literal:
        return value in typing.get_args(typ)
    outer = origin or typ
    return isinstance(outer, type) and isinstance(value, outer)


# ----------------------------------------------------------------------------- encoding


def _plain(value: Any) -> Any:
    """``value`` as MessagePack-ready data, for a position whose type is declared: every
    object a map tagged with its class, containers as arrays or maps."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.Tensor)):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    return _object(value)


def _object(value: Any) -> dict[Any, Any]:
    cls: type = type(value)
    if cls.__module__ == "builtins":
        raise TypeError(f"a {cls.__qualname__} is neither plain data nor a tensor")
    is_dataclass, declared = _declared(cls)
    out: dict[Any, Any] = {_TAG: type_path(cls)}
    if is_dataclass:
        out.update({k: _plain(getattr(value, k)) for k in declared})
        return out
    described: dict[str, Any] = {}
    for k, v in vars(value).items():
        typ = declared.get(k)
        if typ is Any or typ is object:
            raise _refuse(cls)
        if typ is not None and _conforms(v, typ):
            out[k] = _plain(v)
        else:
            described[k] = _describe(v)
    if described:
        out[_DESCRIBED] = described
    return out


def _describe(value: Any) -> Any:
    """``value`` as data that says what it is (no declared type to decode it against):
    tuples, sets, maps, tensors, enums and objects tagged; objects only dataclasses."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, torch.Tensor):
        return {"@tensor": _tensor_plain(value)}
    if isinstance(value, enum.Enum):
        return {"@enum": [type_path(value), value.value]}
    if isinstance(value, list):
        return [_describe(v) for v in value]
    for kind in (tuple, set, frozenset):
        if isinstance(value, kind):
            return {f"@{kind.__name__}": [_describe(v) for v in value]}
    if isinstance(value, dict):
        return {"@dict": [[_describe(k), _describe(v)] for k, v in value.items()]}
    if not dataclasses.is_dataclass(value):
        raise TypeError(f"a {type(value).__qualname__} in an attribute without a declared "
                        "type is neither plain data, a tensor nor a dataclass")
    return _object(value)


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode_value(value: object) -> bytes:
    """Encode ``value`` (dataclasses, plain classes with typed fields, sets, dicts,
    tensors ...) as MessagePack."""
    try:
        return _ENCODER.encode(_plain(value))
    except (TypeError, InvalidArgumentError) as e:
        raise InvalidArgumentError(
            f"{type(value).__qualname__} cannot be encoded without pickle: {e}; the wrapper "
            "carries dataclasses of plain values, tensors and nested dataclasses",
            clause="ERR-006",
        ) from e


# ----------------------------------------------------------------------------- decoding


class _MarkerType(type):
    """Instances of a marker are what ``_dec_hook`` builds for it: msgspec checks so."""

    def __instancecheck__(cls, obj: object) -> bool:
        target = getattr(cls, "target", None)
        return not isinstance(target, type) or isinstance(obj, target)


class _Marker(metaclass=_MarkerType):
    """A type msgspec does not know, standing for what ``_dec_hook`` builds itself."""

    target: Any = None


class _ObjectOf(_Marker):
    """An object tagged with its class, which must be ``target`` or a subclass of it."""


class _UnionOf(_Marker):
    """A union msgspec cannot convert in one pass: each member is tried in turn."""


class _AnyValue(_Marker):
    """``Any``: the value as it is, or the object its tag names."""


@functools.cache
def _marker(kind: type[_Marker], target: Any) -> type[_Marker]:
    return type(f"{kind.__name__}[{target!r}]", (kind,), {"target": target})


_ABSTRACT = {collections.abc.Sequence: list, collections.abc.MutableSequence: list,
             collections.abc.Set: frozenset, collections.abc.MutableSet: set,
             collections.abc.Mapping: dict, collections.abc.MutableMapping: dict}
_NATIVE = (int, float, str, bool, bytes, type(None))


@functools.cache
def _schema(typ: Any) -> Any:
    """``typ`` as msgspec converts it: classes (other than tensors, enums and plain data)
    and unions msgspec refuses replaced by markers that ``_dec_hook`` builds."""
    if typ is Any or typ is object:
        return _marker(_AnyValue, None)
    if isinstance(typ, typing.NewType):
        return _schema(typ.__supertype__)
    if typ is None or typ in _NATIVE or typ is torch.Tensor:
        return typ
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        members = tuple(_schema(a) for a in args)
        union = functools.reduce(lambda a, b: typing.Union[a, b], members)
        try:
            msgspec.convert(None, union)
        except msgspec.ValidationError:
            pass
        except TypeError:  # a union msgspec does not convert: try the members in turn
            return _marker(_UnionOf, members)
        return union
    if origin is typing.Literal:
        return typ
    if origin is not None:
        outer = _ABSTRACT.get(origin, origin)
        if outer is tuple and args and args[-1] is Ellipsis:
            return tuple[_schema(args[0]), ...]  # type: ignore[misc]
        if outer in (list, set, frozenset, tuple, dict):
            return outer[tuple(_schema(a) for a in args)]
        raise ValueError(f"the wrapper cannot decode a {typ!r}")
    if typ in _ABSTRACT or typ in (list, set, frozenset, tuple, dict):
        return _ABSTRACT.get(typ, typ)
    if isinstance(typ, type) and issubclass(typ, enum.Enum):
        return typ
    if isinstance(typ, type):
        return _marker(_ObjectOf, typ)
    raise ValueError(f"the wrapper cannot decode a {typ!r}")


def _dec_hook(typ: type, obj: Any) -> Any:
    if typ is torch.Tensor:
        return _tensor(obj)
    if issubclass(typ, _ObjectOf):
        return _build_object(obj, typ.target)
    if issubclass(typ, _UnionOf):
        errors = []
        for member in typ.target:
            try:
                return _convert(obj, member)
            except (msgspec.ValidationError, ValueError) as e:
                errors.append(str(e))
        raise ValueError(f"matches no member of the union: {'; '.join(errors)}")
    if issubclass(typ, _AnyValue):
        if isinstance(obj, dict) and isinstance(obj.get(_TAG), str):
            return _build_object(obj, object)
        return obj
    raise ValueError(f"the wrapper cannot decode a {typ.__qualname__}")  # pragma: no cover


def _convert(value: Any, schema: Any) -> Any:
    return msgspec.convert(value, schema, strict=True, dec_hook=_dec_hook,
                           builtin_types=(bytes, bytearray))


def _build_object(value: Any, base: type) -> Any:
    """A map ``_object`` wrote, as an instance of the class it names, which must be loaded
    already and be ``base`` or a subclass of it; no ``__init__`` runs."""
    if not isinstance(value, dict) or not isinstance(value.get(_TAG), str):
        raise ValueError(f"expected a {base.__qualname__} object, got {type(value).__name__}")
    cls = loaded_class(value[_TAG], base)
    try:
        is_dataclass, declared = _declared(cls)
    except InvalidArgumentError as e:
        raise ValueError(e.message) from None
    body = {k: v for k, v in value.items() if k != _TAG}
    described = body.pop(_DESCRIBED, {}) if not is_dataclass else {}
    if (set(body) != set(declared)) if is_dataclass else not set(body) <= set(declared):
        raise ValueError(f"{cls.__qualname__} fields {sorted(map(str, body))}; expected "
                         f"{sorted(declared)}")
    if not isinstance(described, dict) or not all(
            isinstance(k, str) and k.isidentifier() and not k.startswith("__")
            and k not in body for k in described):
        raise ValueError(f"{cls.__qualname__}: malformed attributes without a declared type")
    obj: Any = object.__new__(cls)
    for k, v in body.items():
        object.__setattr__(obj, k, _convert(v, _schema(declared[k])))
    for k, v in described.items():
        object.__setattr__(obj, k, _undescribe(v))
    return obj


_KINDS: dict[str, Any] = {"@tuple": tuple, "@set": set, "@frozenset": frozenset}


def _undescribe(value: Any) -> Any:
    """What ``_describe`` wrote, as the value it was."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, list):
        return [_undescribe(v) for v in value]
    if not isinstance(value, dict):
        raise ValueError(f"not a described value: {type(value).__name__}")
    if _TAG in value:
        cls = loaded_class(value[_TAG], object) if isinstance(value[_TAG], str) else None
        if cls is None or not dataclasses.is_dataclass(cls):
            raise ValueError(f"{value[_TAG]!r:.80} is not a dataclass")
        return _build_object(value, cls)
    if len(value) != 1:
        raise ValueError(f"not a described value: a map of {len(value)} keys")
    ((kind, items),) = value.items()
    if kind in _KINDS and isinstance(items, list):
        return _KINDS[kind](_undescribe(v) for v in items)
    if kind == "@dict" and isinstance(items, list) and all(
            isinstance(p, list) and len(p) == 2 for p in items):
        return {_undescribe(k): _undescribe(v) for k, v in items}
    if kind == "@tensor":
        return _tensor(items)
    if kind == "@enum" and isinstance(items, list) and len(items) == 2:
        return loaded_class(items[0], enum.Enum)(items[1])
    raise ValueError(f"not a described value: {kind!r:.40}")


def decode_value(data: bytes, typ: Any) -> Any:
    """Decode ``encode_value``'s bytes as ``typ``, strictly.

    Raises:
        MalformedMetadataError: the bytes are not a ``typ`` (ERR-005).
    """
    try:
        if isinstance(typ, type) and issubclass(typ, msgspec.Struct):
            return msgspec.msgpack.decode(data, type=typ)
        return _convert(msgspec.msgpack.decode(data), _schema(typ))
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError,
            RecursionError) as e:
        raise MalformedMetadataError(f"not a {getattr(typ, '__qualname__', typ)}: {e}",
                                     clause="ERR-005") from None


def _metadata_payload(value: object) -> bytes:
    return encode_value(value)


def _metadata_value(cls: type, body: bytes) -> object:
    return decode_value(body, cls)


def carry_gap(error: InvalidArgumentError) -> HarnessError:
    """``error`` (a value ``encode_value`` refused) as kvspec's own gap: vLLM moves such
    values between its processes with pickle, which kvspec's wrapper never uses (ERR-006)."""
    return HarnessError(f"{error.message}. vLLM itself pickles this value between its "
                        "processes; kvspec's wrapper refuses pickle and cannot carry it yet")


class VllmMetadata:
    """A vLLM connector's step metadata, as kvspec ``ConnectorMetadata`` (ERR-006).

    Attributes:
        value: The vLLM ``KVConnectorMetadata`` the scheduler role built.
    """

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.encode() == other.encode()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"

    @staticmethod
    def _base() -> type:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

        base: type = KVConnectorMetadata
        return base

    def encode(self) -> bytes:
        """The class path and the fields, in MessagePack.

        Raises:
            HarnessError: kvspec's codec cannot carry this metadata class without pickle, or
                cannot decode what it encoded (vLLM pickles it, so either is kvspec's gap,
                not the connector's fault).
        """
        cls = type(self.value)
        try:
            payload = _metadata_payload(self.value)
        except InvalidArgumentError as e:
            raise carry_gap(e) from e
        try:  # what kvspec writes, kvspec must read back: else the gap is kvspec's
            _metadata_value(cls, payload)
        except MalformedMetadataError as e:
            raise HarnessError(f"kvspec's codec encoded a {cls.__qualname__} it cannot decode "
                               f"({e.message}); vLLM pickles it") from e
        return Envelope.of(cls, payload).encode()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        """Rebuild the metadata; see the module docstring for what is accepted.

        Raises:
            MalformedMetadataError: anything ``encode`` did not write (ERR-005).
        """
        envelope = Envelope.decode(data)
        typ = loaded_class(envelope.type_path, cls._base())
        return cls(_metadata_value(typ, envelope.data))


class VllmWorkerMetadata(VllmMetadata):
    """A vLLM worker's ``build_connector_worker_meta()`` as kvspec ``worker_metadata``
    (EVT-007), crossing from worker processes with the same codec as step metadata and
    reduced with the connector's own ``aggregate``, in rank order, as vLLM's executor does.

    Attributes:
        value: The vLLM ``KVConnectorWorkerMetadata`` a worker role built.
    """

    __slots__ = ()

    @staticmethod
    def _base() -> type:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

        base: type = KVConnectorWorkerMetadata
        return base

    def aggregate(self, other: VllmWorkerMetadata) -> VllmWorkerMetadata:
        """The connector's own reduction of this rank's value and ``other``'s, on a copy:
        vLLM's executor lets ``aggregate`` change its accumulator in place, which kvspec's
        aggregator (EXE-006) must not see as the connector's fault."""
        mine = type(self).decode(self.encode()).value
        return VllmWorkerMetadata(mine.aggregate(other.value))  # type: ignore[attr-defined]
