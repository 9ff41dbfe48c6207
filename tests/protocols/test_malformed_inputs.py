"""Issue 36: malformed inputs to public entries end in a typed kvspec error naming the
clause, never a bare ValueError and never silent acceptance; and the one wire layer
(``kvspec.protocols.wire``) refuses what it did not write, typed."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from kvspec.protocols import (
    NULL_BLOCK_ID,
    AllocatedBlocks,
    CompatibilityError,
    Envelope,
    ForwardContextView,
    ForwardKind,
    HandshakeMetadata,
    InvalidArgumentError,
    InvalidBlockIdError,
    KVSpecError,
    MalformedMetadataError,
    SchedulerOutputView,
    parse_decimal,
    resolve_type_path,
    type_path,
)

_LAYOUT = {"order": "LBHNC", "packing": "fused", "dtype": "float16", "block_size": 4}


def _names(err: pytest.ExceptionInfo[KVSpecError], clause: str) -> None:
    assert err.value.clause == clause
    assert f"[{clause}]" in str(err.value)


def test_finished_ids_given_as_a_mapping_are_refused() -> None:
    """Input 6: a dict's keys were taken as the finished request ids."""
    with pytest.raises(InvalidArgumentError) as err:
        SchedulerOutputView(step_id=0, finished_req_ids={"a": 1})  # type: ignore[arg-type]
    _names(err, "ERR-002")
    with pytest.raises(InvalidArgumentError) as err:
        SchedulerOutputView(step_id=0, preempted_req_ids={"a": 1})  # type: ignore[arg-type]
    _names(err, "ERR-002")
    assert SchedulerOutputView(step_id=0, finished_req_ids={"a"}).finished_req_ids == {"a"}


def test_a_block_id_twice_in_a_group_is_refused_but_the_null_block_may_repeat() -> None:
    """Input 7: ``AllocatedBlocks(((1, 1),))`` took block 1 twice; hybrid models' window
    groups repeat the null block (KVG-004), which stays allowed."""
    with pytest.raises(InvalidBlockIdError) as err:
        AllocatedBlocks(((1, 1),))
    _names(err, "ERR-003")
    with pytest.raises(InvalidBlockIdError) as err:
        AllocatedBlocks(((0, 1, 2), (NULL_BLOCK_ID, 7, 7)))
    _names(err, "ERR-003")
    null = AllocatedBlocks(((1, 2, 3), (NULL_BLOCK_ID, NULL_BLOCK_ID, 5)))
    assert null.block_ids(1) == (0, 0, 5)
    many = list(range(40))
    with pytest.raises(InvalidBlockIdError):
        AllocatedBlocks.single([*many, 39])  # the bulk (msgspec) path checks it too


def test_empty_layer_names_are_refused_whatever_was_checked_before() -> None:
    """Input 8: the validity cache let ``()`` through until a valid tuple was seen. Run in a
    fresh interpreter, so that nothing was checked before."""
    code = (
        "from kvspec.protocols import ForwardContextView, ForwardKind, InvalidArgumentError\n"
        "try:\n"
        "    ForwardContextView(ForwardKind.REAL, 0, 1, ())\n"
        "except InvalidArgumentError as e:\n"
        "    print(e.clause)\n"
        "else:\n"
        "    print('accepted')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "ERR-002"
    names = ("a", "b")
    ForwardContextView(ForwardKind.REAL, 0, 1, names)  # now one valid tuple is cached
    for bad in ((), ("a", "a"), ["a", ""]):
        with pytest.raises(InvalidArgumentError) as err:
            ForwardContextView(ForwardKind.REAL, 0, 1, bad)  # type: ignore[arg-type]
        _names(err, "ERR-002")
    assert ForwardContextView(ForwardKind.REAL, 1, 1, names).layer_names is names


@pytest.mark.parametrize("major", ["²", "9" * 5000, "", "-1", " 1", "v1"])
def test_a_peers_spec_version_is_parsed_never_int(major: str) -> None:
    """Inputs 1-5 (handshake part): ``'²'.isdigit()`` is True and ``int('²')`` raised a
    bare ValueError in ``check_compatible``; so did a 5,000-digit major version."""
    good = HandshakeMetadata("e", 0, "1.0", _LAYOUT)
    wire = good.encode().replace(b'"1.0"', json.dumps(f"{major}.0").encode())
    assert wire != good.encode()
    with pytest.raises(MalformedMetadataError) as err:
        HandshakeMetadata.decode(wire)
    _names(err, "HSK-005")
    with pytest.raises(InvalidArgumentError) as err:
        HandshakeMetadata("e", 0, f"{major}.0", _LAYOUT)
    _names(err, "HSK-001")
    with pytest.raises(CompatibilityError):
        good.check_compatible(HandshakeMetadata("e", 1, "2.0", _LAYOUT))


@pytest.mark.parametrize("text,ok", [("0", 0), ("42", 42), ("65535", 65535)])
def test_parse_decimal_reads_ascii_digits(text: str, ok: int) -> None:
    assert parse_decimal(text, what="a port", maximum=65535) == ok


@pytest.mark.parametrize("text", ["²", "١", "9" * 5000, "65536", "", "+1", "1 ", "0x1", 7])
def test_parse_decimal_refuses_anything_else_typed(text: Any) -> None:
    with pytest.raises(MalformedMetadataError) as err:
        parse_decimal(text, what="a port", maximum=65535, clause="HSK-005")
    _names(err, "HSK-005")
    assert "a port" in str(err.value)


def test_the_envelope_round_trips_and_refuses_what_it_did_not_write() -> None:
    env = Envelope.of(HandshakeMetadata, b"\x00\x01")
    assert env.type_path == "kvspec.protocols.metadata:HandshakeMetadata"
    assert Envelope.decode(env.encode()) == env
    assert Envelope.from_plain(env.to_plain()) == env
    for bad in (b"", b"\x80\x04garbage", Envelope.of(env, b"").encode()[:-1], "text"):
        with pytest.raises(MalformedMetadataError) as err:
            Envelope.decode(bad)
        _names(err, "ERR-005")
    for plain in ({"type_path": "a:b"}, {"type_path": "a:b", "data": "!!"}, [], None,
                  {"type_path": 1, "data": ""}):
        with pytest.raises(MalformedMetadataError) as err:
            Envelope.from_plain(plain, clause="HSK-005")
        _names(err, "HSK-005")


def test_the_resolver_names_what_was_wrong() -> None:
    assert resolve_type_path(type_path(HandshakeMetadata)) is HandshakeMetadata
    assert resolve_type_path("kvspec.protocols:Envelope.decode") == Envelope.decode
    cases = {
        "no colon": "expected 'package.module:Name'",
        "kvspec_no_such_module_x:X": "module 'kvspec_no_such_module_x' not found",
        "kvspec.protocols:Missing": "'kvspec.protocols' has no attribute 'Missing'",
        "kvspec.protocols:Envelope.missing": "'kvspec.protocols:Envelope' has no attribute",
        "kvspec.protocols:SPEC_VERSION": "expected a subclass of",
    }
    for path, fragment in cases.items():
        with pytest.raises(MalformedMetadataError) as err:
            resolve_type_path(path, base=object)
        _names(err, "ERR-005")
        assert fragment in str(err.value), str(err.value)


def test_the_resolver_takes_dotted_paths_when_told_so() -> None:
    assert resolve_type_path("kvspec.protocols.wire.Envelope", allow_dotted=True) is Envelope
    with pytest.raises(MalformedMetadataError, match="expected 'package.module:Name'"):
        resolve_type_path("kvspec.protocols.wire.Envelope")
    with pytest.raises(MalformedMetadataError, match="cannot be resolved"):
        resolve_type_path("kvspec.protocols.wire.Missing", allow_dotted=True)


def test_the_resolver_imports_nothing_when_told_so() -> None:
    name = "kvspec.demo.pd"
    before = name in sys.modules
    if not before:
        with pytest.raises(MalformedMetadataError, match="is not loaded"):
            resolve_type_path(f"{name}:X", loaded_only=True)
        assert name not in sys.modules
    assert resolve_type_path("kvspec.protocols:Envelope", loaded_only=True) is Envelope
