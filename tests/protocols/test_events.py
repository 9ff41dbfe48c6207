"""Tests of kvspec.protocols.events: value types, validation and the wire codec."""

from __future__ import annotations

import json
import math
import pickle
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.protocols.errors import (
    InvalidArgumentError,
    InvalidBlockIdError,
    MalformedMetadataError,
)
from kvspec.protocols import RequestView
from kvspec.protocols.events import (
    EMPTY_OUTPUT,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ConnectorStats,
    Direction,
    KVConnectorOutput,
    SupportsAggregate,
)

# ------------------------------------------------------------------------- fixtures


@attrs.frozen
class MaxMeta:
    """A custom worker metadata: keeps the maximum of a value (associative)."""

    value: int

    def aggregate(self, other: MaxMeta) -> MaxMeta:
        return MaxMeta(max(self.value, other.value))


def stored(**kw: Any) -> BlockStored:
    args: dict[str, Any] = dict(
        block_hashes=(1, b"\x01\x02"),
        parent_block_hash=None,
        token_ids=range(8),
        block_size=4,
    )
    args.update(kw)
    return BlockStored(**args)


# ------------------------------------------------------------------------ Direction


def test_direction_members() -> None:
    assert {d.value for d in Direction} == {"send", "recv"}
    assert Direction("send") is Direction.SEND


# ------------------------------------------------------------------------- events


def test_block_stored_converts_and_keeps_fields() -> None:
    ev = stored(block_hashes=[5, b"ab"], parent_block_hash=b"p", lora_id=3, medium="GPU")
    assert ev.block_hashes == (5, b"ab")
    assert ev.token_ids == tuple(range(8))
    assert ev.parent_block_hash == b"p"
    assert (ev.block_size, ev.lora_id, ev.medium) == (4, 3, "GPU")
    assert ev == stored(block_hashes=(5, b"ab"), parent_block_hash=b"p", lora_id=3, medium="GPU")
    assert hash(ev) == hash(
        stored(block_hashes=(5, b"ab"), parent_block_hash=b"p", lora_id=3, medium="GPU")
    )


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"block_hashes": ()}, "block_hashes is empty"),
        ({"block_hashes": "ab"}, "bare str"),
        ({"block_hashes": 7}, "expected an iterable"),
        ({"block_hashes": (1, "x")}, "block_hashes[1]"),
        ({"block_hashes": (True, 2)}, "block_hashes[0]"),
        ({"block_hashes": (1.5, 2)}, "expected an int or a non-empty bytes"),
        ({"block_hashes": (b"", 2)}, "empty bytes"),
        ({"parent_block_hash": "p"}, "parent_block_hash"),
        ({"token_ids": range(7)}, "expected len(block_hashes) * block_size"),
        ({"token_ids": [0] * 7 + [-1]}, "token_ids[7]"),
        ({"token_ids": [0] * 7 + [True]}, "token_ids[7]"),
        ({"block_size": 0, "token_ids": ()}, "block_size is 0"),
        ({"block_size": True}, "block_size is True"),
        ({"lora_id": -1}, "lora_id is -1"),
        ({"lora_id": "a"}, "lora_id is 'a'"),
        ({"medium": ""}, "medium is ''"),
        ({"medium": 3}, "medium is 3"),
    ],
)
def test_block_stored_rejects(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidArgumentError, match="EVT-005") as info:
        stored(**kwargs)
    assert fragment in str(info.value)


@settings(max_examples=60, deadline=None)
@given(
    blocks=st.integers(1, 40), block_size=st.integers(1, 5), outputs=st.integers(0, 12),
    data=st.data(),
)
def test_block_stored_from_request_equals_the_checked_event(
    blocks: int, block_size: int, outputs: int, data: st.DataObject
) -> None:
    """``from_request`` builds exactly the event the checking constructor builds from the
    same fields, for any block range, whether the tokens come from the prompt or reach
    into the output (the bulk token path starts at 16 tokens)."""
    total = blocks * block_size
    prompt_len = max(1, total - outputs)
    tokens = data.draw(st.lists(st.integers(0, 2**40), min_size=total, max_size=total))
    hashes = data.draw(st.lists(st.binary(min_size=1, max_size=4), min_size=blocks,
                                max_size=blocks))
    lora = data.draw(st.none() | st.integers(0, 9))
    request = RequestView("r", tokens[:prompt_len], output_token_ids=tokens[prompt_len:],
                          block_hashes=hashes, lora_id=lora)
    first = data.draw(st.integers(0, blocks - 1))
    last = data.draw(st.integers(first + 1, blocks))
    event = BlockStored.from_request(request, first, last, block_size, medium="CPU")
    assert event == BlockStored(
        block_hashes=hashes[first:last], parent_block_hash=hashes[first - 1] if first else None,
        token_ids=tokens[first * block_size:last * block_size], block_size=block_size,
        lora_id=lora, medium="CPU",
    )


_REQ = RequestView("r", tuple(range(12)), block_hashes=(b"a", b"b", b"c"))


@pytest.mark.parametrize(
    ("args", "kwargs", "fragment"),
    [
        (("r", 0, 1, 4), {}, "expected a RequestView"),
        ((_REQ, 0, 0, 4), {}, "blocks [0, 0)"),
        ((_REQ, 2, 1, 4), {}, "blocks [2, 1)"),
        ((_REQ, -1, 1, 4), {}, "blocks [-1, 1)"),
        ((_REQ, 0, 4, 4), {}, "<= 3 (its block hashes)"),
        ((_REQ, 0, 3, 5), {}, "<= 12 (its tokens)"),
        ((_REQ, False, 1, 4), {}, "blocks [False, 1)"),
        ((_REQ, 0, 1.0, 4), {}, "blocks [0, 1.0)"),
        ((_REQ, 0, 1, 0), {}, "block_size is 0"),
        ((_REQ, 0, 1, True), {}, "block_size is True"),
        ((_REQ, 0, 1, 4), {"medium": ""}, "medium is ''"),
    ],
)
def test_block_stored_from_request_rejects(
    args: tuple[Any, ...], kwargs: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(InvalidArgumentError, match="EVT-005") as info:
        BlockStored.from_request(*args, **kwargs)
    assert fragment in str(info.value)


def test_block_removed_and_cleared() -> None:
    ev = BlockRemoved([1, b"z"], medium="CPU")
    assert ev.block_hashes == (1, b"z") and ev.medium == "CPU"
    assert BlockRemoved((3,)).medium is None
    assert AllBlocksCleared() == AllBlocksCleared()
    with pytest.raises(InvalidArgumentError, match="block_hashes is empty"):
        BlockRemoved([])
    with pytest.raises(InvalidArgumentError, match=r"block_hashes\[0\]"):
        BlockRemoved([None])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match="medium"):
        BlockRemoved([1], medium=b"GPU")  # type: ignore[arg-type]


def test_events_are_frozen() -> None:
    ev = stored()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        ev.block_size = 8  # type: ignore[misc]
    rm = BlockRemoved([1])
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        rm.medium = "GPU"  # type: ignore[misc]


# -------------------------------------------------------------------------- stats


def test_stats_basic() -> None:
    src = {"b": 2, "a": 1.5}
    stats = ConnectorStats(src)
    src["c"] = 9
    assert dict(stats.counters) == {"a": 1.5, "b": 2}
    assert list(stats.counters) == ["a", "b"]
    with pytest.raises(TypeError):
        stats.counters["a"] = 3  # type: ignore[index]
    assert stats == ConnectorStats({"a": 1.5, "b": 2})
    assert hash(stats) == hash(ConnectorStats({"b": 2, "a": 1.5}))
    assert repr(stats) == "ConnectorStats(counters={'a': 1.5, 'b': 2})"
    assert isinstance(stats, SupportsAggregate)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        stats._items = ()  # type: ignore[misc]


def test_stats_aggregate_and_empty() -> None:
    merged = ConnectorStats({"a": 1, "b": 2}).aggregate(ConnectorStats({"b": 3, "c": 4}))
    assert dict(merged.counters) == {"a": 1, "b": 5, "c": 4}
    assert ConnectorStats().is_empty()
    assert ConnectorStats({"a": 0}).is_empty()
    assert not ConnectorStats({"a": 0.5}).is_empty()
    with pytest.raises(InvalidArgumentError, match="cannot aggregate ConnectorStats with MaxMeta"):
        ConnectorStats().aggregate(MaxMeta(1))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("counters", "fragment"),
    [
        ([("a", 1)], "expected a mapping"),
        ({"": 1}, "counter name ''"),
        ({3: 1}, "counter name 3"),
        ({"a": True}, "counter 'a' is True"),
        ({"a": "1"}, "counter 'a' is '1'"),
        ({"a": math.nan}, "finite"),
        ({"a": math.inf}, "finite"),
    ],
)
def test_stats_rejects(counters: Any, fragment: str) -> None:
    with pytest.raises(InvalidArgumentError, match="EVT-006") as info:
        ConnectorStats(counters)
    assert fragment in str(info.value)


int_counters = st.dictionaries(
    st.sampled_from(["a", "b", "c", "d"]), st.integers(-(10**12), 10**12), max_size=4
)


@settings(max_examples=100, deadline=None)
@given(int_counters)
def test_stats_of_a_backends_int_counters_equal_the_checked_constructors(
    counters: dict[str, int],
) -> None:
    """The unchecked constructor a worker uses for its own counters builds the same value
    (equal, same hash, same counters in the same order) as the checking one."""
    fast, checked = ConnectorStats._of_ints(dict(counters)), ConnectorStats(counters)
    assert fast == checked and hash(fast) == hash(checked)
    assert list(fast.counters.items()) == list(checked.counters.items())
    assert type(fast) is ConnectorStats


@settings(max_examples=200, deadline=None)
@given(int_counters, int_counters, int_counters)
def test_stats_reduce_associative_and_commutative(
    a: dict[str, int], b: dict[str, int], c: dict[str, int]
) -> None:
    x, y, z = ConnectorStats(a), ConnectorStats(b), ConnectorStats(c)
    assert x.aggregate(y).aggregate(z) == x.aggregate(y.aggregate(z))
    assert x.aggregate(y) == y.aggregate(x)
    assert x.aggregate(ConnectorStats()) == x


float_counters = st.dictionaries(
    st.sampled_from(["a", "b", "c"]),
    st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False),
    max_size=3,
)


@settings(max_examples=100, deadline=None)
@given(float_counters, float_counters, float_counters)
def test_stats_float_reduce_associative_up_to_rounding(
    a: dict[str, float], b: dict[str, float], c: dict[str, float]
) -> None:
    x, y, z = ConnectorStats(a), ConnectorStats(b), ConnectorStats(c)
    left = x.aggregate(y).aggregate(z).counters
    right = x.aggregate(y.aggregate(z)).counters
    assert left.keys() == right.keys()
    for key in left:
        assert math.isclose(left[key], right[key], rel_tol=1e-9, abs_tol=1e-6)


# ------------------------------------------------------------------------- output


def test_output_defaults_and_empty() -> None:
    out = KVConnectorOutput()
    assert out == EMPTY_OUTPUT
    assert out.is_empty()
    assert out.finished_sending == frozenset() and out.events == ()
    assert out.stats is None and out.worker_metadata is None
    assert out.expected_finished_count is None
    assert KVConnectorOutput(stats=ConnectorStats({"a": 0}), expected_finished_count=2).is_empty()
    assert not KVConnectorOutput(stats=ConnectorStats({"a": 1})).is_empty()
    assert not KVConnectorOutput(stats=MaxMeta(0)).is_empty()
    assert not KVConnectorOutput(worker_metadata=MaxMeta(0)).is_empty()
    assert not KVConnectorOutput(finished_sending=["r"]).is_empty()
    assert not KVConnectorOutput(invalid_block_ids=[0]).is_empty()
    assert not KVConnectorOutput(events=[AllBlocksCleared()]).is_empty()


def test_output_converts_iterables() -> None:
    out = KVConnectorOutput(
        finished_sending=["a", "b", "a"],
        finished_recving=("c", "d"),
        failed_recving={"d"},
        invalid_block_ids=iter([3, 0, 3]),
        events=[AllBlocksCleared(), BlockRemoved([1])],
        stats=ConnectorStats({"x": 1}),
        worker_metadata=MaxMeta(2),
        expected_finished_count=2,
    )
    assert out.finished_sending == frozenset({"a", "b"})
    assert isinstance(out.finished_recving, frozenset)
    assert out.failed_recving == frozenset({"d"})
    assert out.invalid_block_ids == frozenset({0, 3})
    assert out.events == (AllBlocksCleared(), BlockRemoved([1]))
    assert out.worker_metadata == MaxMeta(2)


def test_output_is_frozen() -> None:
    out = KVConnectorOutput(finished_sending=["a"])
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        out.finished_sending = frozenset()  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        out.stats = None  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "error", "clause", "fragment"),
    [
        ({"finished_sending": "req-1"}, InvalidArgumentError, "EVT-001", "bare str"),
        ({"finished_sending": 3}, InvalidArgumentError, "EVT-001", "expected an iterable"),
        ({"finished_sending": {"a": 1}}, InvalidArgumentError, "EVT-001", "mapping"),
        ({"finished_recving": [""]}, InvalidArgumentError, "EVT-001", "contains ''"),
        ({"finished_sending": [1]}, InvalidArgumentError, "EVT-001", "finished_sending contains 1"),
        (
            {"finished_recving": ["a"], "failed_recving": ["a", "b"]},
            InvalidArgumentError,
            "EVT-002",
            "failed_recving names ['b']",
        ),
        ({"failed_recving": [None]}, InvalidArgumentError, "EVT-001", "failed_recving contains"),
        ({"invalid_block_ids": [-1]}, InvalidBlockIdError, "EVT-003", "contains -1"),
        ({"invalid_block_ids": [True]}, InvalidBlockIdError, "EVT-003", "contains True"),
        ({"invalid_block_ids": [1.0]}, InvalidBlockIdError, "EVT-003", "contains 1.0"),
        ({"invalid_block_ids": 5}, InvalidArgumentError, "EVT-003", "expected an iterable"),
        ({"expected_finished_count": 0}, InvalidArgumentError, "EVT-008", "is 0"),
        ({"expected_finished_count": True}, InvalidArgumentError, "EVT-008", "is True"),
        ({"expected_finished_count": 1.0}, InvalidArgumentError, "EVT-008", "is 1.0"),
        ({"events": [object()]}, InvalidArgumentError, "EVT-005", "events[0] is object"),
        ({"stats": {"a": 1}}, InvalidArgumentError, "EVT-006", "stats is dict"),
        ({"worker_metadata": 5}, InvalidArgumentError, "EVT-007", "worker_metadata is int"),
        ({"stats": ConnectorStats}, InvalidArgumentError, "EVT-006", "stats is type"),
    ],
)
def test_output_rejects(
    kwargs: dict[str, Any], error: type[Exception], clause: str, fragment: str
) -> None:
    with pytest.raises(error) as info:
        KVConnectorOutput(**kwargs)
    assert getattr(info.value, "clause", None) == clause
    assert fragment in str(info.value)


# ---------------------------------------------------------------------- wire codec

ids = st.frozensets(st.text(min_size=1, max_size=6), max_size=4)
hashes = st.one_of(st.integers(-(2**70), 2**70), st.binary(min_size=1, max_size=8))


@st.composite
def block_stored(draw: st.DrawFn) -> BlockStored:
    hs = draw(st.lists(hashes, min_size=1, max_size=3))
    size = draw(st.integers(1, 3))
    return BlockStored(
        block_hashes=hs,
        parent_block_hash=draw(st.none() | hashes),
        token_ids=draw(
            st.lists(st.integers(0, 50_000), min_size=len(hs) * size, max_size=len(hs) * size)
        ),
        block_size=size,
        lora_id=draw(st.none() | st.integers(0, 10)),
        medium=draw(st.none() | st.sampled_from(["GPU", "CPU", "disk"])),
    )


events_st = st.lists(
    st.one_of(
        block_stored(),
        st.builds(
            BlockRemoved,
            st.lists(hashes, min_size=1, max_size=3),
            st.none() | st.sampled_from(["GPU", "CPU"]),
        ),
        st.just(AllBlocksCleared()),
    ),
    max_size=4,
)
stats_st = st.none() | st.builds(
    ConnectorStats,
    st.dictionaries(
        st.text(min_size=1, max_size=5),
        st.integers(-100, 100) | st.floats(allow_nan=False, allow_infinity=False),
        max_size=3,
    ),
)


@st.composite
def outputs(draw: st.DrawFn) -> KVConnectorOutput:
    recving = draw(ids)
    return KVConnectorOutput(
        finished_sending=draw(ids),
        finished_recving=recving,
        failed_recving=draw(st.sets(st.sampled_from(sorted(recving)))) if recving else (),
        invalid_block_ids=draw(st.frozensets(st.integers(0, 2**40), max_size=5)),
        stats=draw(stats_st),
        events=draw(events_st),
        worker_metadata=draw(stats_st),
        expected_finished_count=draw(st.none() | st.integers(1, 8)),
    )


@settings(max_examples=200, deadline=None)
@given(outputs())
def test_wire_round_trip(out: KVConnectorOutput) -> None:
    wire = out.to_wire()
    text = json.dumps(wire, allow_nan=False)
    back = KVConnectorOutput.from_wire(json.loads(text))
    assert back == out
    assert back.to_wire() == wire


def test_wire_is_plain_sorted_data() -> None:
    out = KVConnectorOutput(
        finished_sending=["b", "a"],
        invalid_block_ids=[9, 2],
        events=[BlockRemoved([b"\xff", 3])],
    )
    wire = out.to_wire()
    assert wire["finished_sending"] == ["a", "b"]
    assert wire["invalid_block_ids"] == [2, 9]
    assert wire["events"] == [
        {"type": "BlockRemoved", "block_hashes": [{"bytes": "ff"}, 3], "medium": None}
    ]


def test_wire_custom_values_not_dropped_silently() -> None:
    out = KVConnectorOutput(stats=MaxMeta(3), worker_metadata=MaxMeta(4), finished_sending=["a"])
    with pytest.raises(InvalidArgumentError, match="EVT-009") as info:
        out.to_wire()
    assert "MaxMeta" in str(info.value) and "omit_custom" in str(info.value)
    wire = out.to_wire(omit_custom=True)
    assert wire["stats"] is None and wire["worker_metadata"] is None
    assert KVConnectorOutput.from_wire(wire) == KVConnectorOutput(finished_sending=["a"])


def _good_wire() -> dict[str, Any]:
    return KVConnectorOutput(
        finished_recving=["r"],
        failed_recving=["r"],
        stats=ConnectorStats({"a": 1}),
        events=[stored(), BlockRemoved([1]), AllBlocksCleared()],
    ).to_wire()


def _mutated(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    wire = _good_wire()
    target: Any = wire
    for step in path[:-1]:
        target = target[step]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return wire


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "fragment"),
    [
        (("kind",), "other", "kind is 'other'"),
        (("version",), 2, "version is 2"),
        (("version",), True, "version is True"),
        (("finished_sending",), _DELETE, "missing keys ['finished_sending']"),
        (("extra",), 1, "unknown keys"),
        (("finished_sending",), "a", "finished_sending is str"),
        (("finished_sending",), [1], "finished_sending contains 1"),
        (("finished_sending",), [""], "finished_sending contains ''"),
        (("failed_recving",), ["x"], "failed_recving names"),
        (("invalid_block_ids",), [True], "invalid_block_ids contains True"),
        (("invalid_block_ids",), [-3], "contains -3"),
        (("invalid_block_ids",), ["3"], "invalid_block_ids contains '3'"),
        (("expected_finished_count",), 0, "expected_finished_count is 0"),
        (("expected_finished_count",), "2", "expected_finished_count is '2'"),
        (("stats",), {"counters": [1]}, "stats.counters is list"),
        (("stats",), {"counters": {"a": "x"}}, "counter 'a'"),
        (("stats",), {"py/object": "os.system"}, "expected null or"),
        (("worker_metadata",), [], "worker_metadata is []"),
        (("events",), {}, "events is dict"),
        (("events", 0), "BlockStored", "events[0] is str"),
        (("events", 0, "type"), "Evil", "has type 'Evil'"),
        (("events", 0, "extra"), 1, "has keys"),
        (("events", 0, "block_hashes", 0), 1.5, "block_hashes[0] is 1.5"),
        (("events", 0, "block_hashes", 1), {"bytes": "zz"}, "not a hex string"),
        (("events", 0, "block_hashes", 1), {"hex": "00"}, "expected an int or"),
        (("events", 0, "parent_block_hash"), "p", "parent is 'p'"),
        (("events", 0, "token_ids"), [1], "token_ids has 1 tokens"),
        (("events", 0, "block_size"), "4", "block_size is '4'"),
        (("events", 1, "block_hashes"), [], "block_hashes is empty"),
    ],
)
def test_from_wire_rejects(path: tuple[Any, ...], value: Any, fragment: str) -> None:
    wire = _mutated(path, value)
    with pytest.raises(MalformedMetadataError, match="ERR-005") as info:
        KVConnectorOutput.from_wire(wire)
    assert fragment in str(info.value)


@pytest.mark.parametrize("data", [None, [], "text", pickle.dumps(EMPTY_OUTPUT), 3])
def test_from_wire_rejects_non_dict(data: object) -> None:
    with pytest.raises(MalformedMetadataError, match="expected a dict"):
        KVConnectorOutput.from_wire(data)


def test_good_wire_decodes() -> None:
    assert KVConnectorOutput.from_wire(_good_wire()).failed_recving == frozenset({"r"})
