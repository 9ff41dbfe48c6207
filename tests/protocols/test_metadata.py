"""Tests of kvspec.protocols.metadata: the binding slot (DRY-001) and handshake metadata
(HSK-001, HSK-003, HSK-005, ERR-006)."""

from __future__ import annotations

import json
import pickle
import re
from typing import NoReturn
from collections.abc import Mapping
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.protocols.errors import (
    CompatibilityError,
    InvalidArgumentError,
    KVSpecError,
    MalformedMetadataError,
    MetadataNotBoundError,
)
from kvspec.protocols.metadata import ConnectorMetadata, HandshakeMetadata, MetadataSlot


@attrs.frozen
class StepMeta:
    loads: tuple[int, ...] = ()

    def encode(self) -> bytes:
        return json.dumps(list(self.loads)).encode()

    @classmethod
    def decode(cls, data: bytes) -> StepMeta:
        return cls(tuple(json.loads(data)))


@attrs.frozen
class OtherMeta:
    pass


LAYOUT = {"order": "LBNHC", "packing": "concat", "dtype": "bfloat16", "block_size": 16}


def _hs(**kw: Any) -> HandshakeMetadata:
    args: dict[str, Any] = {
        "engine_id": "prefill-0", "rank": 0, "spec_version": "0.1", "layout": dict(LAYOUT),
        "payload": {"agent": "abcd", "ports": [5000, 5001]},
    }
    args.update(kw)
    return HandshakeMetadata(**args)


def _wire(**kw: Any) -> bytes:
    obj: dict[str, Any] = {
        "engine_id": "e", "rank": 1, "spec_version": "0.1", "layout": dict(LAYOUT), "payload": {},
    }
    obj.update(kw)
    return json.dumps(obj).encode()


def _thaw(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {k: _thaw(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_thaw(x) for x in v]
    return v


# -------------------------------------------------------------------- MetadataSlot


def test_step_meta_satisfies_protocol() -> None:
    assert isinstance(StepMeta(), ConnectorMetadata)
    assert not isinstance(OtherMeta(), ConnectorMetadata)


def test_slot_get_before_bind_raises_naming_the_hook() -> None:
    slot: MetadataSlot[StepMeta] = MetadataSlot(StepMeta)
    assert slot.is_bound is False
    with pytest.raises(MetadataNotBoundError) as info:
        slot.get("wait_for_layer_load")
    assert info.value.clause == "DRY-001"
    assert str(info.value).startswith("[DRY-001] wait_for_layer_load ran with no connector metadata")
    with pytest.raises(MetadataNotBoundError, match="a worker hook ran"):
        slot.get()


def test_slot_bind_get_clear() -> None:
    slot: MetadataSlot[StepMeta] = MetadataSlot(StepMeta)
    meta = StepMeta((1, 2))
    slot.bind(meta)
    assert slot.is_bound is True
    assert slot.get("start_load_kv") is meta
    other = StepMeta((3,))
    slot.bind(other)  # rebinding replaces
    assert slot.get() is other
    slot.clear()
    assert slot.is_bound is False
    with pytest.raises(MetadataNotBoundError, match="save_kv_layer"):
        slot.get("save_kv_layer")
    slot.clear()  # clearing an empty slot is allowed
    assert slot.is_bound is False


def test_slot_accepts_subclass_instances() -> None:
    class Sub(StepMeta):
        pass

    slot: MetadataSlot[StepMeta] = MetadataSlot(StepMeta)
    s = Sub((1,))
    slot.bind(s)
    assert slot.get() is s


@pytest.mark.parametrize("bad", [OtherMeta(), None, {"loads": []}, b"\x00"])
def test_slot_bind_wrong_type(bad: object) -> None:
    slot: MetadataSlot[StepMeta] = MetadataSlot(StepMeta)
    with pytest.raises(InvalidArgumentError) as info:
        slot.bind(bad)  # type: ignore[arg-type]
    assert f"expected StepMeta metadata, got {type(bad).__name__}" in str(info.value)
    assert info.value.clause == "WRK-003"
    assert slot.is_bound is False


def test_slot_wrong_bind_keeps_previous_binding() -> None:
    slot: MetadataSlot[StepMeta] = MetadataSlot(StepMeta)
    meta = StepMeta()
    slot.bind(meta)
    with pytest.raises(InvalidArgumentError):
        slot.bind(OtherMeta())  # type: ignore[arg-type]
    assert slot.get() is meta


@pytest.mark.parametrize("bad", [StepMeta(), "StepMeta", None])
def test_slot_needs_a_class(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="metadata_type must be a class"):
        MetadataSlot(bad)  # type: ignore[arg-type]


def test_slot_has_no_dict() -> None:
    slot: MetadataSlot[StepMeta] = MetadataSlot(StepMeta)
    with pytest.raises(AttributeError):
        slot.extra = 1  # type: ignore[attr-defined]


# --------------------------------------------------------------- HandshakeMetadata


def test_handshake_constructs_and_freezes() -> None:
    layout = dict(LAYOUT, extra=[1, 2])
    hs = _hs(layout=layout)
    assert hs.layout["order"] == "LBNHC"
    assert hs.layout["extra"] == (1, 2)
    layout["order"] = "LBHNC"
    assert hs.layout["order"] == "LBNHC"
    with pytest.raises(TypeError):
        hs.layout["order"] = "X"  # type: ignore[index]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        hs.rank = 3  # type: ignore[misc]
    assert _hs(payload={}).payload == {}
    assert HandshakeMetadata("e", 0, "1", LAYOUT).payload == {}


def test_encode_is_sorted_utf8_json() -> None:
    data = _hs().encode()
    assert isinstance(data, bytes)
    obj = json.loads(data.decode("utf-8"))
    assert obj == {
        "engine_id": "prefill-0", "rank": 0, "spec_version": "0.1", "layout": LAYOUT,
        "payload": {"agent": "abcd", "ports": [5000, 5001]},
    }
    assert list(obj) == sorted(obj)


def test_round_trip_simple() -> None:
    hs = _hs()
    back = HandshakeMetadata.decode(hs.encode())
    assert back == hs
    assert back.payload["ports"] == (5000, 5001)
    assert HandshakeMetadata.decode(bytearray(hs.encode())) == hs
    assert HandshakeMetadata.decode(memoryview(hs.encode())) == hs


json_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.text(max_size=8) \
    | st.floats(allow_nan=False, allow_infinity=False)
plain = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=15,
)


@settings(max_examples=150, deadline=None)
@given(
    engine_id=st.text(min_size=1, max_size=20),
    rank=st.integers(0, 2**40),
    major=st.integers(0, 99),
    minor=st.integers(0, 99),
    layout=st.fixed_dictionaries(
        {
            "order": st.sampled_from(["LBNHC", "LBHNC", "BLHNC"]),
            "packing": st.sampled_from(["concat", "split"]),
            "dtype": st.sampled_from(["bfloat16", "float16", "float8_e4m3fn"]),
            "block_size": st.integers(1, 1024),
        },
        optional={"shared": plain, "num_layers": st.integers(1, 128)},
    ),
    payload=st.dictionaries(st.text(max_size=8), plain, max_size=5),
)
def test_round_trip_property(
    engine_id: str, rank: int, major: int, minor: int, layout: dict[str, Any],
    payload: dict[str, Any],
) -> None:
    hs = HandshakeMetadata(engine_id, rank, f"{major}.{minor}", layout, payload)
    data = hs.encode()
    back = HandshakeMetadata.decode(data)
    assert back == hs
    assert back.encode() == data
    assert _thaw(back.payload) == _thaw(payload)
    assert _thaw(back.layout) == _thaw(layout)
    back.check_compatible(hs)
    hs.check_compatible(back)


def test_decode_never_unpickles(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a: object, **_k: object) -> object:
        raise AssertionError("pickle must not be used (ERR-006, HSK-001)")

    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "Unpickler", boom)
    hs = _hs()
    assert HandshakeMetadata.decode(hs.encode()) == hs
    # A pickle of the object is not accepted either.
    with pytest.raises(MalformedMetadataError):
        HandshakeMetadata.decode(pickle.dumps({"engine_id": "e"}))


# ----------------------------------------------------------------------- decoding


@pytest.mark.parametrize("bad", ["{}", None, 3, [b"x"], {"engine_id": "e"}])
def test_decode_rejects_non_bytes(bad: object) -> None:
    with pytest.raises(MalformedMetadataError, match="must be bytes") as info:
        HandshakeMetadata.decode(bad)  # type: ignore[arg-type]
    assert info.value.clause == "HSK-005"


BAD_WIRE = {
    "non_utf8": b"\xff\xfe{",
    "latin1": '{"engine_id": "é"}'.encode("latin-1"),
    "not_json": b"engine_id=e",
    "truncated": _wire()[:-3],
    "empty": b"",
    "array": b'["engine_id", "rank"]',
    "string": b'"hello"',
    "number": b"42",
    "null": b"null",
    "missing_payload": json.dumps(
        {"engine_id": "e", "rank": 0, "spec_version": "0.1", "layout": LAYOUT}).encode(),
    "missing_rank": json.dumps(
        {"engine_id": "e", "spec_version": "0.1", "layout": LAYOUT, "payload": {}}).encode(),
    "extra_key": json.dumps(
        {"engine_id": "e", "rank": 0, "spec_version": "0.1", "layout": LAYOUT, "payload": {},
         "evil": 1}).encode(),
    "rank_negative": _wire(rank=-1),
    "rank_str": _wire(rank="0"),
    "rank_bool": _wire(rank=True),
    "rank_float": _wire(rank=1.0),
    "rank_null": _wire(rank=None),
    "version_word": _wire(spec_version="one.two"),
    "version_empty": _wire(spec_version=""),
    "version_int": _wire(spec_version=1),
    "engine_empty": _wire(engine_id=""),
    "engine_int": _wire(engine_id=7),
    "layout_list": _wire(layout=["LBNHC"]),
    "layout_str": _wire(layout="LBNHC"),
    "layout_null": _wire(layout=None),
    "payload_list": _wire(payload=[1]),
    "layout_missing_dtype": _wire(layout={k: v for k, v in LAYOUT.items() if k != "dtype"}),
}


@pytest.mark.parametrize("data", list(BAD_WIRE.values()), ids=list(BAD_WIRE))
def test_decode_rejects_malformed(data: bytes) -> None:
    with pytest.raises(MalformedMetadataError) as info:
        HandshakeMetadata.decode(data)
    assert info.value.clause == "HSK-005"
    assert isinstance(info.value, InvalidArgumentError)


def test_decode_messages_say_what_was_wrong() -> None:
    with pytest.raises(MalformedMetadataError, match="not UTF-8 JSON"):
        HandshakeMetadata.decode(b"\xff")
    with pytest.raises(MalformedMetadataError, match="got list"):
        HandshakeMetadata.decode(b"[]")
    with pytest.raises(MalformedMetadataError, match=r"'evil'"):
        HandshakeMetadata.decode(BAD_WIRE["extra_key"])
    with pytest.raises(MalformedMetadataError, match="rank must be an int >= 0, got -1"):
        HandshakeMetadata.decode(_wire(rank=-1))
    with pytest.raises(MalformedMetadataError, match="spec_version must look like"):
        HandshakeMetadata.decode(_wire(spec_version="x"))
    with pytest.raises(MalformedMetadataError, match="must be JSON objects"):
        HandshakeMetadata.decode(_wire(layout=[]))
    with pytest.raises(MalformedMetadataError, match=r"lacks \['dtype'\]"):
        HandshakeMetadata.decode(BAD_WIRE["layout_missing_dtype"])


def test_decode_rejects_deeply_nested_json() -> None:
    with pytest.raises(MalformedMetadataError):
        HandshakeMetadata.decode(b"[" * 100_000)


# ------------------------------------------------------------------- construction


@pytest.mark.parametrize("missing", ["order", "packing", "dtype", "block_size"])
def test_layout_missing_key_raises_hsk_003(missing: str) -> None:
    layout = {k: v for k, v in LAYOUT.items() if k != missing}
    with pytest.raises(InvalidArgumentError) as info:
        _hs(layout=layout)
    assert info.value.clause == "HSK-003"
    assert f"lacks ['{missing}']" in str(info.value)
    assert "HSK-003" in info.value.message
    assert not isinstance(info.value, MalformedMetadataError)


def test_layout_missing_all_keys() -> None:
    with pytest.raises(InvalidArgumentError, match=r"lacks \['order', 'packing', 'dtype', 'block_size'\]"):
        _hs(layout={})


@pytest.mark.parametrize(
    "kw,fragment",
    [
        ({"engine_id": ""}, "engine_id must be a non-empty str"),
        ({"engine_id": 3}, "engine_id must be a non-empty str"),
        ({"rank": -1}, "rank must be an int >= 0"),
        ({"rank": True}, "rank must be an int >= 0"),
        ({"rank": 1.5}, "rank must be an int >= 0"),
        ({"spec_version": "v1"}, "spec_version must look like '1.2'"),
        ({"spec_version": 1}, "spec_version must look like '1.2'"),
        ({"layout": dict(LAYOUT, bad={1, 2})}, "is a set"),
        ({"payload": {"blob": b"\x00"}}, "is a bytes"),
        ({"payload": {1: "x"}}, "non-str key"),
    ],
)
def test_constructor_validates(kw: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        _hs(**kw)
    assert fragment in str(info.value)


def test_constructor_rejects_none_layout() -> None:
    with pytest.raises(InvalidArgumentError):
        _hs(layout=None)


def test_constructor_rejects_none_payload() -> None:
    with pytest.raises(InvalidArgumentError):
        _hs(payload=None)


def test_constructor_error_names_the_field() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        _hs(layout=dict(LAYOUT, bad={1}))
    assert "layout" in str(info.value)
    assert "kv_transfer_params" not in str(info.value)


# -------------------------------------------------------------- check_compatible


@pytest.mark.parametrize(
    "field,mine,theirs",
    [
        ("order", "LBNHC", "LBHNC"),
        ("packing", "concat", "split"),
        ("dtype", "bfloat16", "float16"),
        ("block_size", 16, 32),
    ],
)
def test_check_compatible_names_the_layout_field(field: str, mine: object, theirs: object) -> None:
    a = _hs(engine_id="prefill", rank=0, layout=dict(LAYOUT, **{field: mine}))
    b = _hs(engine_id="decode", rank=3, layout=dict(LAYOUT, **{field: theirs}))
    for x, y in ((a, b), (b, a)):
        with pytest.raises(CompatibilityError) as info:
            x.check_compatible(y)
        err = info.value
        assert err.clause == "HSK-003"
        assert f"layout {field} differs" in str(err)
        assert repr(x.layout[field]) in str(err) and repr(y.layout[field]) in str(err)
        assert f"{x.engine_id} rank {x.rank}" in str(err)
        assert f"{y.engine_id} rank {y.rank}" in str(err)


def test_check_compatible_major_version() -> None:
    a = _hs(spec_version="0.1")
    b = _hs(engine_id="decode", rank=2, spec_version="1.0")
    with pytest.raises(CompatibilityError) as info:
        a.check_compatible(b)
    assert info.value.clause == "HSK-003"
    assert "spec major version differs" in str(info.value)
    assert "0.1" in str(info.value) and "1.0" in str(info.value)


def test_check_compatible_version_checked_before_layout() -> None:
    a = _hs(spec_version="1.0")
    b = _hs(spec_version="2.0", layout=dict(LAYOUT, dtype="float16"))
    with pytest.raises(CompatibilityError, match="spec major version"):
        a.check_compatible(b)


@pytest.mark.parametrize("mine,theirs", [("0.1", "0.9"), ("1.0", "1.12"), ("3", "3.1"), ("2.5", "2.5")])
def test_check_compatible_accepts_different_minor(mine: str, theirs: str) -> None:
    a = _hs(spec_version=mine)
    b = _hs(engine_id="decode", rank=1, spec_version=theirs,
            payload={"different": True}, layout=dict(LAYOUT, extra="ignored"))
    assert a.check_compatible(b) is None
    assert b.check_compatible(a) is None


@pytest.mark.parametrize("bad", [None, {"engine_id": "x"}, LAYOUT])
def test_check_compatible_rejects_non_handshake(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="peer must be HandshakeMetadata"):
        _hs().check_compatible(bad)  # type: ignore[arg-type]


def test_all_errors_are_kvspec_errors() -> None:
    for data in BAD_WIRE.values():
        try:
            HandshakeMetadata.decode(data)
        except KVSpecError:
            continue
        raise AssertionError(f"{data!r} decoded")


class _Bad(Exception):
    pass


def _fail(msg: str) -> NoReturn:
    raise _Bad(msg)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ("text", "expected bytes, got str"),
        (b"\xff", "not UTF-8 JSON"),
        (b'{"kind": "m", "version": 1, "jobs": [], "x": NaN}', "not UTF-8 JSON"),
        (b"[" * 100_000, "not UTF-8 JSON"),
        (b"[]", "got list; expected an object with keys ['jobs', 'kind', 'version']"),
        (b'{"kind": "m", "version": 1}', "got ['kind', 'version']; expected an object"),
        (b'{"kind": "other", "version": 1, "jobs": []}', "kind is 'other'; expected 'm'"),
        (b'{"kind": "m", "version": true, "jobs": []}', "version is True; expected 1"),
        (b'{"kind": "m", "version": 2, "jobs": []}', "version is 2; expected 1"),
        (b'{"kind": "m", "version": 1, "jobs": {}}', "jobs is dict; expected a list"),
    ],
)
def test_decode_json_envelope_rejects(data: object, fragment: str) -> None:
    from kvspec.protocols import decode_json_envelope

    with pytest.raises(_Bad, match=re.escape(fragment)):
        decode_json_envelope(data, kind="m", version=1, keys={"kind", "version", "jobs"},
                             lists=("jobs",), fail=_fail)


def test_decode_json_envelope_accepts_and_never_unpickles(monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    from kvspec.protocols import decode_json_envelope

    monkeypatch.setattr(pickle, "loads", lambda *_: (_ for _ in ()).throw(AssertionError))
    obj = decode_json_envelope(b'{"kind": "m", "version": 1, "jobs": [[1, "ab"]]}', kind="m",
                               version=1, keys=("kind", "version", "jobs"), lists=("jobs",),
                               fail=_fail)
    assert obj == {"kind": "m", "version": 1, "jobs": [[1, "ab"]]}
