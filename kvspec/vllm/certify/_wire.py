"""vLLM connector metadata on kvspec's wire: MessagePack through msgspec, never pickle.

vLLM hands a connector's ``KVConnectorMetadata`` from the scheduler to the workers by
pickling it. kvspec's harness requires metadata that encodes to bytes and decodes with
validation (ERR-005, ERR-006), so the wrapper carries vLLM's object in ``VllmMetadata``:
the bytes are the metadata class's ``module:qualname`` and its fields in MessagePack
(msgspec), decoded back into that class against the class's own type annotations (strict:
a wrong type is an error, not a coercion). Tensors travel as dtype, shape and raw bytes.
The bytes are decoded untyped first (MessagePack runs no code), then built into the
annotated types field by field (``_build``), so unions msgspec's typed decoder refuses
(vLLM's ``tuple[list[int], ...] | list[list[int]]``) work too.

Every object travels as a map tagged with its class (``"@class": "module:qualname"``), so a
field declared as a base class decodes into the subclass it held (MultiConnector's tuple of
its connectors' metadata). Decoding imports nothing and runs no ``__init__``: each tagged
class must already be loaded in the decoding process (the connector's module loaded it),
must be the declared type or a subclass of it (a ``KVConnectorMetadata`` at the top), and
must be a dataclass of plain values, tensors and nested objects, or a plain class whose
``__init__`` gives every attribute it sets a type: an annotation
(``self.reqs: dict[str, ReqMeta] = {}``, as vLLM's ``NixlConnectorMetadata`` does) or an
annotated parameter it stores (``self.ids = ids`` for ``ids: set[str]``, as
``MooncakeStoreConnectorMetadata`` does; ``Any`` is no type: such a class is not carried).
Its fields are decoded against those types.
"""

from __future__ import annotations

import ast
import collections.abc
import dataclasses
import enum
import functools
import inspect
import sys
import textwrap
import types
import typing
from typing import Any

import msgspec
import torch
from typing_extensions import Self

from kvspec.protocols import HarnessError, InvalidArgumentError, MalformedMetadataError

__all__ = ["VllmMetadata", "VllmWorkerMetadata", "carry_gap", "decode_value", "encode_value"]

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
              torch.float16, torch.bfloat16, torch.float32, torch.float64)
}


class _Envelope(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    kind: str
    cls: str
    body: msgspec.Raw


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise InvalidArgumentError(f"a {t.dtype} tensor cannot be encoded; "
                                       f"supported dtypes: {sorted(_DTYPES)}")
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return [name, list(t.shape), raw]
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


_ATOMS: dict[Any, tuple[type, ...]] = {int: (int,), float: (float, int), str: (str,),
                                       bool: (bool,), bytes: (bytes,)}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(value: Any, typ: Any, where: str) -> Any:
    """Plain decoded data as ``typ``, checked all the way down (no coercion, no code run)."""
    if typ is Any or typ is object:
        if isinstance(value, dict) and isinstance(value.get(_TAG), str):
            return _build_object(value, object, where)
        return value
    if isinstance(typ, typing.NewType):  # vLLM's BlockHash = NewType("BlockHash", bytes)
        return _build(value, typ.__supertype__, where)
    if typ is type(None) or typ is None:
        if value is not None:
            raise ValueError(f"{where}: expected None, got {type(value).__name__}")
        return None
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for member in args:
            try:
                return _build(value, member, where)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(f"{where}: matches no member of {typ}: {'; '.join(errors)}")
    if typ in _ATOMS:
        if not isinstance(value, _ATOMS[typ]) or (typ is int and isinstance(value, bool)):
            raise ValueError(f"{where}: expected {typ.__name__}, got {type(value).__name__}")
        return float(value) if isinstance(value, (int, float)) and typ is float else value
    if typ is torch.Tensor:
        return _tensor(value)
    if origin in (list, set, frozenset, tuple, collections.abc.Sequence,
                  collections.abc.Set) or typ in (list, set, tuple):
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected an array, got {type(value).__name__}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ValueError(f"{where}: expected {len(args)} items, got {len(value)}")
            return tuple(_build(v, t, f"{where}[{i}]") for i, (v, t) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [_build(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        kind = origin or typ
        return {tuple: tuple, set: set, frozenset: frozenset,
                collections.abc.Set: frozenset}.get(kind, list)(items)
    if origin in (dict, collections.abc.Mapping) or typ is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a map, got {type(value).__name__}")
        kt, vt = args or (Any, Any)
        return {_build(k, kt, f"{where} key"): _build(v, vt, f"{where}[{k!r}]")
                for k, v in value.items()}
    if isinstance(typ, type) and issubclass(typ, enum.Enum):
        try:
            return typ(value)
        except ValueError:
            raise ValueError(f"{where}: {value!r} is not a {typ.__qualname__}") from None
    if typing.get_origin(typ) is typing.Literal:
        if value not in args:
            raise ValueError(f"{where}: {value!r} is not one of {args}")
        return value
    if isinstance(typ, type):
        return _build_object(value, typ, where)
    raise ValueError(f"{where}: the wrapper cannot decode a {typ!r}")


def _build_object(value: Any, typ: type, where: str) -> Any:
    """A map ``_plain`` tagged with its class, as an instance of that class, which must be
    loaded already and be ``typ`` or a subclass of it; its fields are built against the
    class's own field types, and no ``__init__`` runs."""
    if not isinstance(value, dict) or not isinstance(value.get(_TAG), str):
        raise ValueError(f"{where}: expected a {typ.__qualname__} object, got "
                         f"{type(value).__name__}")
    try:
        cls = loaded_class(value[_TAG], typ)
        fields = _fields(cls)
    except (MalformedMetadataError, InvalidArgumentError) as e:
        raise ValueError(f"{where}: {e.message}") from None
    body = {k: v for k, v in value.items() if k != _TAG}
    if set(body) != set(fields):
        raise ValueError(f"{where}: {cls.__qualname__} fields {sorted(body)}; expected "
                         f"{sorted(fields)}")
    obj: Any = object.__new__(cls)
    for k, t in fields.items():
        object.__setattr__(obj, k, _build(body[k], t, f"{where}.{k}"))
    return obj


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


_TAG = "@class"  # not an identifier: no field can be named so


def _fields(cls: type, value: object | None = None) -> dict[str, Any]:
    """``{field: type}`` of a dataclass or of a plain class (``_init_annotations``); with
    ``value``, checked to be exactly the attributes it holds.

    Raises:
        InvalidArgumentError: the class has no field types kvspec can read."""
    if dataclasses.is_dataclass(cls):
        hints = _hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    fields = _init_annotations(cls)
    if fields is None or (value is not None and set(fields) != set(vars(value))):
        raise InvalidArgumentError(
            f"{cls.__qualname__} cannot be encoded without pickle: it is neither a dataclass, "
            "nor a class whose __init__ gives every attribute it sets a type (an annotation, "
            "or an annotated parameter it stores)", clause="ERR-006")
    return fields


def _plain(value: Any) -> Any:
    """``value`` as MessagePack-ready data: every object a map tagged with its class (so a
    field declared as a base class, like MultiConnector's tuple of its connectors'
    metadata, decodes into the subclass it held), containers as arrays or maps."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.Tensor)):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    cls = type(value)
    if cls.__module__ == "builtins":
        raise TypeError(f"a {cls.__qualname__} is neither plain data nor a tensor")
    out = {_TAG: f"{cls.__module__}:{cls.__qualname__}"}
    out.update({k: _plain(getattr(value, k)) for k in _fields(cls, value)})
    return out


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


def decode_value(data: bytes, typ: Any) -> Any:
    """Decode ``encode_value``'s bytes as ``typ``, strictly.

    Raises:
        MalformedMetadataError: the bytes are not a ``typ`` (ERR-005).
    """
    try:
        if isinstance(typ, type) and issubclass(typ, msgspec.Struct):
            return msgspec.msgpack.decode(data, type=typ)
        return _build(msgspec.msgpack.decode(data), typ, "metadata")
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError,
            RecursionError) as e:
        raise MalformedMetadataError(f"not a {getattr(typ, '__qualname__', typ)}: {e}",
                                     clause="ERR-005") from None


def loaded_class(path: str, base: type) -> type:
    """The already-loaded subclass of ``base`` named ``module:qualname``; imports nothing.

    Raises:
        MalformedMetadataError: no such class is loaded, or it is not a ``base``.
    """
    module, _, qualname = path.partition(":")
    obj: Any = sys.modules.get(module)
    for part in qualname.split(".") if obj is not None and qualname else ():
        obj = getattr(obj, part, None)
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise MalformedMetadataError(
            f"{path!r} is not a loaded {base.__qualname__} subclass; the decoding process "
            "decodes only classes its connector module already loaded", clause="ERR-005")
    return obj


@functools.cache
def _init_annotations(cls: type) -> dict[str, Any] | None:
    """``{attribute: type}`` of a plain class, from its ``__init__``: ``self.x: T = ...``,
    and ``self.x = p`` for a parameter ``p: T``; None when an attribute ``__init__`` sets
    has no type that way or its source is unreadable."""
    init = cls.__dict__.get("__init__")
    if init is None or "__slots__" in cls.__dict__:
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        params = typing.get_type_hints(init)
    except Exception:  # unreadable source, or annotations that do not resolve
        return None
    scope = vars(sys.modules[cls.__module__])
    out: dict[str, Any] = {}
    for node in ast.walk(tree):
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                and target.value.id == "self"):
            continue
        if isinstance(node, ast.AnnAssign):
            try:
                out[target.attr] = eval(  # noqa: S307 - the class's own source text
                    compile(ast.Expression(node.annotation), "<annotation>", "eval"), scope)
            except Exception:
                return None
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) \
                and params.get(node.value.id, Any) is not Any and target.attr not in out:
            out[target.attr] = params[node.value.id]  # ``Any`` says nothing to check against
        elif target.attr not in out:
            return None
    return out


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
    _KIND = "vllm-metadata"

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
        return _ENCODER.encode(_Envelope(self._KIND, f"{cls.__module__}:{cls.__qualname__}",
                                         msgspec.Raw(payload)))

    @classmethod
    def decode(cls, data: bytes) -> Self:
        """Rebuild the metadata; see the module docstring for what is accepted.

        Raises:
            MalformedMetadataError: anything ``encode`` did not write (ERR-005).
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MalformedMetadataError(f"vLLM metadata must be bytes, got {type(data).__name__}",
                                         clause="ERR-005")
        env = decode_value(bytes(data), _Envelope)
        if env.kind != cls._KIND:
            raise MalformedMetadataError(f"kind is {env.kind!r}; expected {cls._KIND!r}",
                                         clause="ERR-005")
        typ = loaded_class(env.cls, cls._base())
        return cls(_metadata_value(typ, bytes(env.body)))


class VllmWorkerMetadata(VllmMetadata):
    """A vLLM worker's ``build_connector_worker_meta()`` as kvspec ``worker_metadata``
    (EVT-007), crossing from worker processes with the same codec as step metadata and
    reduced with the connector's own ``aggregate``, in rank order, as vLLM's executor does.

    Attributes:
        value: The vLLM ``KVConnectorWorkerMetadata`` a worker role built.
    """

    __slots__ = ()
    _KIND = "vllm-worker-metadata"

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
