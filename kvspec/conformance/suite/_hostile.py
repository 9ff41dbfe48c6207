"""Hostile inputs for the decoders a connector exposes to peers and clients.

``hostile_bytes`` derives, from real encodings of a connector's metadata, the bytes an
attacker or a broken peer sends: truncations, flipped and inserted bytes, random bytes,
integers past Python's 4300-digit limit, nesting past the recursion limit, and a pickle
payload whose unpickling calls ``trip`` (a canary: it runs no other code).
``hostile_params`` does the same for ``kv_transfer_params``, which come from clients.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["PICKLE_PAYLOAD", "hostile_bytes", "hostile_params", "reset", "trip", "tripped"]

_tripped: list[str] = []


def trip(note: str) -> None:
    """Called only by unpickling ``PICKLE_PAYLOAD``."""
    _tripped.append(note)


def tripped() -> bool:
    """Whether ``PICKLE_PAYLOAD`` was unpickled since ``reset``."""
    return bool(_tripped)


def reset() -> None:
    """Forget earlier trips."""
    _tripped.clear()


class _Payload:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return trip, ("a kvspec pickle payload was unpickled",)


PICKLE_PAYLOAD = pickle.dumps(_Payload(), protocol=2)
"""Bytes whose unpickling calls ``trip``: what a peer could make run instead."""

HUGE = b"9" * 5000
DEEP = b"[" * 100_000 + b"]" * 100_000


def hostile_bytes(samples: Sequence[bytes], *, seed: int = 0, count: int = 60
                  ) -> Iterator[tuple[str, bytes]]:
    """``(description, bytes)`` pairs: fixed attacks, then ``count`` mutations of the
    samples (deterministic for ``seed``)."""
    yield "a pickle payload", PICKLE_PAYLOAD
    yield "the pickle payload after a valid encoding", (samples[0] if samples else b"") + PICKLE_PAYLOAD
    yield "empty bytes", b""
    yield "a 5000-digit integer", HUGE
    yield "100,000-deep nesting", DEEP
    yield "a 50,000-deep object", b'{"a":' * 50_000
    yield "bytes that are not UTF-8", b"\xff\xfe\x00\x80"
    rng = random.Random(seed)
    for sample in samples[:4]:
        yield "a valid encoding with a 5000-digit integer", _replace_number(sample, HUGE)
        yield "a valid encoding cut in half", sample[: len(sample) // 2]
        yield "a valid encoding without its last byte", sample[:-1]
    pieces = [HUGE, b"-" + HUGE, b"1e999", b"NaN", b"[[[[", b"{", b'"\\ud800"', b"\xff",
              b"\x00" * 8, b"null", b"-1", b"[]", b"{}"]
    for i in range(count):
        base = samples[i % len(samples)] if samples else b""
        kind = rng.randrange(4)
        at = rng.randrange(len(base) + 1)
        if kind == 0 and base:
            j = rng.randrange(len(base))
            yield f"a valid encoding with byte {j} changed", (
                base[:j] + bytes([rng.randrange(256)]) + base[j + 1:])
        elif kind == 1:
            yield f"a valid encoding cut at byte {at}", base[:at]
        elif kind == 2:
            piece = rng.choice(pieces)
            yield f"a valid encoding with {piece[:12]!r} inserted at byte {at}", (
                base[:at] + piece + base[at:])
        else:
            yield "random bytes", bytes(rng.randrange(256) for _ in range(rng.randrange(64)))


def _replace_number(sample: bytes, number: bytes) -> bytes:
    for i, byte in enumerate(sample):
        if 0x30 <= byte <= 0x39:
            j = i
            while j < len(sample) and 0x30 <= sample[j] <= 0x39:
                j += 1
            return sample[:i] + number + sample[j:]
    return sample + number


_VALUES: tuple[tuple[str, Any], ...] = (
    ("None", None), ("-1", -1), ("2**70", 2 ** 70), ("a string", "x"), ("True", True),
    ("an empty list", []), ("an empty object", {}), ("a float", 0.5),
    ("a list of strings", ["a", "b"]), ("a list of negative ints", [-5, -1]),
)


def hostile_params(samples: Sequence[Mapping[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(description, params)``: each key of each sample dropped, or its value replaced by
    a value of another type or range; then unrelated params a client could send."""
    for sample in samples[:2]:
        for key in sample:
            rest = {k: v for k, v in sample.items() if k != key}
            yield f"the connector's own params without {key!r}", rest
            for what, value in _VALUES:
                yield f"the connector's own params with {key!r} = {what}", {**rest, key: value}
    yield "an empty object", {}
    yield "unrelated keys", {"do_remote_prefill": True, "remote_block_ids": [-1, 2 ** 70]}
