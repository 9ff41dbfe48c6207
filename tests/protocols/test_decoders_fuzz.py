"""Every decoder of bytes or plain data from a peer, a file or a client ends every input in a
value or a typed kvspec error (ERR-005, SCH-018, HSK-005): random bytes, mutations of valid
encodings, integers past Python's 4300-digit limit and nesting past the recursion limit
(issue 14, defect 6). Before the fix, a huge integer leaked ValueError from every JSON
decoder and deep nesting leaked RecursionError from freeze_params."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvspec.backends.nixl import NixlLoad, NixlMetadata, PeerInfo
from kvspec.backends.offload import FailedStores, OffloadMetadata, TransferJob
from kvspec.conformance.connectors.layerwise import LayerwiseMetadata
from kvspec.conformance.connectors.null import NullMetadata
from kvspec.conformance.connectors.shared_storage import SharedStorageMetadata
from kvspec.conformance.connectors.tiny import TinyCacheMetadata
from kvspec.protocols import Envelope, HandshakeMetadata, KVSpecError, RequestView, freeze_params

DECODERS: dict[str, tuple[Callable[[bytes], Any], bytes]] = {
    "offload": (OffloadMetadata.decode, OffloadMetadata(
        loads=(TransferJob.of("r", ((1, 0, 1), (2, -1, 2)), True),),
        stores=(TransferJob.of("s", ((3, 4, 5),), False),), aborted_loads=("a",)).encode()),
    "offload-failed-stores": (FailedStores.decode, FailedStores(frozenset({"a", "b"})).encode()),
    "nixl": (NixlMetadata.decode, NixlMetadata(
        loads=(NixlLoad("r", "e", (3, 0), (9, 1), "p", "0f" * 16),), sends={"q": "a1" * 16},
        peers={"e": {0: {"agent_name": "a"}}}).encode()),
    "null": (NullMetadata.decode, NullMetadata().encode()),
    "shared-storage": (SharedStorageMetadata.decode, SharedStorageMetadata().encode()),
    "layerwise": (LayerwiseMetadata.decode, LayerwiseMetadata().encode()),
    "handshake": (HandshakeMetadata.decode,
                  b'{"engine_id":"e","rank":0,"spec_version":"0.2","layout":{},"payload":{}}'),
    "envelope": (Envelope.decode, Envelope("kvspec.protocols:Envelope", b"\x00").encode()),
    "tiny": (TinyCacheMetadata.decode, TinyCacheMetadata().encode()),
    "peer-info": (PeerInfo.decode, b'{"agent":"a","metadata":"00","layout":{}}'),
}

HUGE = b"9" * 5000
DEEP = b"[" * 100_000 + b"]" * 100_000


def _check(decode: Callable[[bytes], Any], data: bytes) -> None:
    """A value or a typed kvspec error; anything else propagates and fails the test."""
    with contextlib.suppress(KVSpecError):
        decode(data)


def _mutations(seed: bytes) -> st.SearchStrategy[bytes]:
    def flip(data: bytes, i: int, b: int) -> bytes:
        if not data:
            return bytes([b])
        i %= len(data)
        return data[:i] + bytes([b]) + data[i + 1:]

    def cut(data: bytes, i: int) -> bytes:
        return data[: i % (len(data) + 1)]

    def insert(data: bytes, i: int, extra: bytes) -> bytes:
        i %= len(data) + 1
        return data[:i] + extra + data[i:]

    pieces = st.sampled_from([HUGE, b"-" + HUGE, b"1e999", b"NaN", b"[[[[", b"{", b'"\\ud800"',
                              b"\xff", b"\x00" * 8, b'"kind"'])
    return st.one_of(
        st.builds(flip, st.just(seed), st.integers(0, 10_000), st.integers(0, 255)),
        st.builds(cut, st.just(seed), st.integers(0, 10_000)),
        st.builds(insert, st.just(seed), st.integers(0, 10_000), pieces),
    )


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_huge_ints_and_deep_nesting_fail_typed(name: str) -> None:
    decode, seed = DECODERS[name]
    for data in (HUGE, b'{"kind":' + HUGE + b"}", DEEP, b'{"a":' * 50_000,
                 seed.replace(b"[]", b"[" + HUGE + b"]", 1),
                 seed.replace(b":0", b":" + HUGE, 1)):
        _check(decode, data)


@pytest.mark.parametrize("name", sorted(DECODERS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_and_mutated_bytes_fail_typed(name: str, data: st.DataObject) -> None:
    decode, seed = DECODERS[name]
    blob = data.draw(st.one_of(st.binary(max_size=256), _mutations(seed)))
    _check(decode, blob)


def _deep_lists(n: int) -> Any:
    value: Any = 1
    for _ in range(n):
        value = [value]
    return value


def _deep(n: int) -> Any:
    value: Any = 1
    for _ in range(n):
        value = {"x": value}
    return value


@pytest.mark.parametrize("params", [
    {"x": 10 ** 5000},
    {"x": [-(10 ** 400)]},
    _deep(100_000),
    {"x": _deep_lists(70)},
], ids=["huge-int", "huge-negative-int", "deep-dicts", "deep-lists"])
def test_client_transfer_params_fail_typed(params: Any) -> None:
    """A client's kv_transfer_params (SCH-018) end in InvalidArgumentError, in the view the
    vLLM adapter builds of every request, never in ValueError or RecursionError."""
    with pytest.raises(KVSpecError, match="SCH-018"):
        freeze_params(params)
    with pytest.raises(KVSpecError):
        RequestView("r", (1, 2), kv_transfer_params=params)


def test_ordinary_params_still_freeze() -> None:
    frozen = freeze_params({"a": [1, {"b": 2 ** 63}], "c": None})
    assert frozen is not None and frozen["a"][1]["b"] == 2 ** 63
