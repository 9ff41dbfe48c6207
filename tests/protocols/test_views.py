"""Tests of kvspec.protocols.views: construction, immutability and validation (ERR-002,
ERR-003, LAY-012, SCH-012, SCH-018)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.protocols.errors import InvalidArgumentError, InvalidBlockIdError, KVSpecError
from kvspec.protocols.views import (
    AllocatedBlocks,
    CachedRequestView,
    EngineConfigView,
    ForwardContextView,
    ForwardKind,
    NewRequestView,
    RequestStatus,
    RequestView,
    SchedulerOutputView,
    TransferRole,
    freeze_params,
)

FIE = attrs.exceptions.FrozenInstanceError


def _req(rid: str = "r1", n: int = 4, **kw: Any) -> RequestView:
    return RequestView(rid, list(range(n)), **kw)


def _new(rid: str = "r1", blocks: tuple[int, ...] = (0, 1)) -> NewRequestView:
    return NewRequestView(_req(rid), AllocatedBlocks.single(blocks), 0)


# ------------------------------------------------------------------ AllocatedBlocks


def test_allocated_blocks_valid() -> None:
    b = AllocatedBlocks([[0, 1, 2], (7,)])
    assert b.groups == ((0, 1, 2), (7,))
    assert isinstance(b.groups, tuple) and all(isinstance(g, tuple) for g in b.groups)
    assert b.num_groups == 2
    assert b.block_ids() == (0, 1, 2)
    assert b.block_ids(1) == (7,)
    s = AllocatedBlocks.single(iter([3, 4]))
    assert s.groups == ((3, 4),)
    assert s.num_groups == 1
    assert AllocatedBlocks.single([]).groups == ((),)


def test_allocated_blocks_frozen() -> None:
    b = AllocatedBlocks.single([1])
    with pytest.raises(FIE):
        b.groups = ((2,),)  # type: ignore[misc]


def test_allocated_blocks_copies_input() -> None:
    ids = [1, 2]
    b = AllocatedBlocks.single(ids)
    ids.append(3)
    assert b.block_ids() == (1, 2)


@pytest.mark.parametrize(
    "groups,fragment",
    [
        ([[0, -1]], "negative block id -1"),
        ([[-5]], "block ids are >= 0"),
        ([[1.0]], "must hold ints, got 1.0 (float)"),
        ([["3"]], "must hold ints, got '3' (str)"),
        ([[True]], "must hold ints, got True (bool)"),
        ([[False, 1]], "got False (bool)"),
        ([[None]], "got None (NoneType)"),
        ([[0], [2, -3]], "negative block id -3"),
        ([5], "must be an iterable of ints, got int"),
    ],
)
def test_allocated_blocks_rejects_bad_ids(groups: Any, fragment: str) -> None:
    with pytest.raises(InvalidBlockIdError) as info:
        AllocatedBlocks(groups)
    assert fragment in str(info.value)
    assert info.value.clause == "ERR-003"
    assert isinstance(info.value, InvalidArgumentError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("bad", [-1, 1.0, "3", True, False, None])
@pytest.mark.parametrize("container", [list, tuple])
def test_long_ids_and_tokens_are_checked_like_short_ones(bad: Any, container: Any) -> None:
    """From 16 values on, ids and tokens are checked in one msgspec pass; a bad value
    anywhere still raises the typed error that names it, and huge ints stay accepted."""
    values = container([*range(39), bad])
    with pytest.raises(InvalidBlockIdError, match=repr(bad) if bad != -1 else "-1"):
        AllocatedBlocks.single(values)
    with pytest.raises(InvalidArgumentError, match="token ids"):
        RequestView("r", values)
    huge = container([*range(39), 2**70])
    assert AllocatedBlocks.single(huge).block_ids() == tuple(huge)
    assert RequestView("r", huge).prompt_token_ids == tuple(huge)
    assert type(AllocatedBlocks.single(container(range(40))).block_ids()) is tuple


@pytest.mark.parametrize("bad", [[-1], [0, "1"], [True]])
def test_single_rejects_bad_ids(bad: list[Any]) -> None:
    with pytest.raises(InvalidBlockIdError):
        AllocatedBlocks.single(bad)


@pytest.mark.parametrize("group", [2, -1, True, "0", None])
def test_block_ids_bad_group(group: Any) -> None:
    b = AllocatedBlocks([[0], [1]])
    with pytest.raises(InvalidArgumentError, match=r"group must be in \[0, 2\)") as info:
        b.block_ids(group)
    assert not isinstance(info.value, InvalidBlockIdError)


def test_check_budget() -> None:
    b = AllocatedBlocks([[0, 3], [9]])
    assert b.check_budget(10) is None
    with pytest.raises(InvalidBlockIdError) as info:
        b.check_budget(9)
    assert info.value.clause == "LAY-012"
    assert "group 1 holds block id 9" in str(info.value)
    assert "[0, 9)" in str(info.value)
    with pytest.raises(InvalidBlockIdError, match="group 0 holds block id 3"):
        b.check_budget(3)
    AllocatedBlocks.single([]).check_budget(1)
    with pytest.raises(InvalidArgumentError, match="num_blocks must be an int >= 1"):
        AllocatedBlocks.single([]).check_budget(0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 200), max_size=6, unique=True), min_size=1, max_size=3),
       st.integers(1, 200))
def test_check_budget_property(groups: list[list[int]], budget: int) -> None:
    b = AllocatedBlocks(groups)
    if all(x < budget for g in groups for x in g):
        b.check_budget(budget)
    else:
        with pytest.raises(InvalidBlockIdError) as info:
            b.check_budget(budget)
        assert info.value.clause == "LAY-012"


@pytest.mark.parametrize("bad", ["10", -5, True, None])
def test_check_budget_validates_budget(bad: Any) -> None:
    b = AllocatedBlocks.single([1])
    with pytest.raises(InvalidArgumentError, match="num_blocks") as info:
        b.check_budget(bad)
    assert info.value.clause != "LAY-012"


# ---------------------------------------------------------------------- RequestView


def test_request_view_valid() -> None:
    r = RequestView(
        "req-1", [1, 2, 3], output_token_ids=(9,), block_hashes=[b"h1"], cache_salt="s",
        lora_id=2, kv_transfer_params={"remote": {"host": "a", "ports": [1, 2]}},
        status=RequestStatus.RUNNING, num_computed_tokens=4,
    )
    assert r.prompt_token_ids == (1, 2, 3)
    assert r.output_token_ids == (9,)
    assert r.block_hashes == (b"h1",)
    assert r.num_prompt_tokens == 3
    assert r.num_tokens == 4
    assert r.all_token_ids == (1, 2, 3, 9)
    assert r.kv_transfer_params is not None
    assert r.kv_transfer_params["remote"]["ports"] == (1, 2)
    assert isinstance(r.kv_transfer_params, MappingProxyType)
    d = _req()
    assert (d.status, d.num_computed_tokens, d.kv_transfer_params, d.cache_salt, d.lora_id) == (
        RequestStatus.WAITING, 0, None, None, None)


def test_request_view_frozen_and_copies() -> None:
    prompt = [1, 2]
    params = {"a": [1]}
    r = RequestView("r", prompt, kv_transfer_params=params)
    prompt.append(3)
    params["a"].append(2)
    params["b"] = 1
    assert r.prompt_token_ids == (1, 2)
    assert r.kv_transfer_params == {"a": (1,)}
    with pytest.raises(FIE):
        r.num_computed_tokens = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        r.kv_transfer_params["a"] = 2  # type: ignore[index]


@pytest.mark.parametrize(
    "kw,fragment",
    [
        ({"request_id": ""}, "request_id must be a non-empty str"),
        ({"request_id": 5}, "request_id must be a non-empty str"),
        ({"prompt_token_ids": []}, "has an empty prompt; a request has >= 1 prompt token"),
        ({"prompt_token_ids": [1, "2"]}, "token ids must hold ints"),
        ({"prompt_token_ids": [True]}, "token ids must hold ints"),
        ({"prompt_token_ids": 5}, "must be an iterable of ints"),
        ({"output_token_ids": [1.5]}, "token ids must hold ints"),
        ({"block_hashes": ["abc"]}, "block_hashes must hold non-empty bytes"),
        ({"block_hashes": [b""]}, "block_hashes must hold non-empty bytes"),
        ({"cache_salt": 3}, "cache_salt must be a str or None"),
        ({"lora_id": -1}, "lora_id must be an int >= 0"),
        ({"lora_id": True}, "lora_id must be an int >= 0"),
        ({"status": "running"}, "status must be a RequestStatus"),
        ({"num_computed_tokens": -1}, "num_computed_tokens must be an int >= 0"),
        ({"num_computed_tokens": 1.0}, "num_computed_tokens must be an int >= 0"),
        ({"num_computed_tokens": 5}, "num_computed_tokens 5 exceeds its 4 tokens"),
        ({"kv_transfer_params": {"a": {1, 2}}}, "kv_transfer_params.a is a set"),
        ({"kv_transfer_params": [1]}, "kv_transfer_params must be a mapping or None"),
    ],
)
def test_request_view_rejects(kw: dict[str, Any], fragment: str) -> None:
    args: dict[str, Any] = {"request_id": "r", "prompt_token_ids": [1, 2, 3],
                            "output_token_ids": [4]}
    args.update(kw)
    with pytest.raises(InvalidArgumentError) as info:
        RequestView(**args)
    assert fragment in str(info.value)


def test_num_computed_tokens_may_cover_output_tokens() -> None:
    r = RequestView("r", [1, 2], output_token_ids=[3], num_computed_tokens=3)
    assert r.num_computed_tokens == r.num_tokens == 3


# ------------------------------------------------------------- New/Cached request views


def test_new_request_view() -> None:
    n = NewRequestView(_req("x"), AllocatedBlocks.single([0]), 2)
    assert n.request_id == "x"
    assert n.num_computed_tokens == 2
    with pytest.raises(FIE):
        n.num_computed_tokens = 0  # type: ignore[misc]
    for bad in (-1, True, "1"):
        with pytest.raises(InvalidArgumentError, match="num_computed_tokens must be an int >= 0"):
            NewRequestView(_req(), AllocatedBlocks.single([0]), bad)  # type: ignore[arg-type]


def test_cached_request_view() -> None:
    c = CachedRequestView("c1")
    assert c.new_blocks == AllocatedBlocks(((),))
    assert (c.num_computed_tokens, c.new_token_ids, c.resumed_from_preemption) == (0, (), False)
    c2 = CachedRequestView("c2", AllocatedBlocks.single([5]), 7, [11], True)
    assert c2.new_token_ids == (11,)
    assert c2.new_blocks.block_ids() == (5,)
    with pytest.raises(FIE):
        c2.request_id = "z"  # type: ignore[misc]


@pytest.mark.parametrize(
    "kw,fragment",
    [
        ({"request_id": ""}, "request_id must be a non-empty str"),
        ({"request_id": None}, "request_id must be a non-empty str"),
        ({"num_computed_tokens": -2}, "num_computed_tokens must be an int >= 0"),
        ({"new_token_ids": ["a"]}, "token ids must hold ints"),
    ],
)
def test_cached_request_view_rejects(kw: dict[str, Any], fragment: str) -> None:
    args: dict[str, Any] = {"request_id": "c"}
    args.update(kw)
    with pytest.raises(InvalidArgumentError, match=fragment):
        CachedRequestView(**args)


@pytest.mark.parametrize(
    "make",
    [
        lambda: NewRequestView("r", AllocatedBlocks.single([0]), 0),  # type: ignore[arg-type]
        lambda: NewRequestView(_req(), [0, 1], 0),  # type: ignore[arg-type]
        lambda: CachedRequestView("c", new_blocks=[1, 2]),  # type: ignore[arg-type]
        lambda: CachedRequestView("c", resumed_from_preemption="yes"),  # type: ignore[arg-type]
    ],
    ids=["new_request_str", "new_blocks_list", "cached_blocks_list", "cached_resumed_str"],
)
def test_request_views_type_check_fields(make: Any) -> None:
    with pytest.raises(InvalidArgumentError):
        make()


# -------------------------------------------------------------- SchedulerOutputView


def test_scheduler_output_valid() -> None:
    out = SchedulerOutputView(
        step_id=3,
        scheduled_new_reqs=[_new("a")],
        scheduled_cached_reqs=[CachedRequestView("b")],
        num_scheduled_tokens={"a": 4, "b": 1},
        finished_req_ids=["f1", "f2"],
        preempted_req_ids={"p"},
    )
    assert out.total_num_scheduled_tokens == 5
    assert out.is_empty is False
    assert isinstance(out.scheduled_new_reqs, tuple)
    assert isinstance(out.scheduled_cached_reqs, tuple)
    assert out.finished_req_ids == frozenset({"f1", "f2"})
    assert out.preempted_req_ids == frozenset({"p"})
    assert isinstance(out.num_scheduled_tokens, MappingProxyType)
    with pytest.raises(TypeError):
        out.num_scheduled_tokens["a"] = 9  # type: ignore[index]
    with pytest.raises(FIE):
        out.step_id = 4  # type: ignore[misc]


def test_scheduler_output_empty_step() -> None:
    out = SchedulerOutputView(0)
    assert out.is_empty is True
    assert out.total_num_scheduled_tokens == 0
    assert out.num_scheduled_tokens == {}
    assert out.finished_req_ids == frozenset()
    # An empty step may still carry finished requests (SCH-011).
    out2 = SchedulerOutputView(1, finished_req_ids=["done"])
    assert out2.is_empty is True and out2.finished_req_ids == {"done"}


def test_scheduler_output_copies_token_counts() -> None:
    counts = {"a": 2}
    out = SchedulerOutputView(0, scheduled_new_reqs=[_new("a")], num_scheduled_tokens=counts)
    counts["a"] = 99
    assert out.num_scheduled_tokens["a"] == 2


@pytest.mark.parametrize(
    "kw,fragment",
    [
        ({"step_id": -1}, "step_id must be an int >= 0"),
        ({"step_id": True}, "step_id must be an int >= 0"),
        ({"step_id": None}, "step_id must be an int >= 0"),
        ({"scheduled_new_reqs": [_new("a"), _new("a")], "num_scheduled_tokens": {"a": 1}},
         "schedules a request twice"),
        ({"scheduled_new_reqs": [_new("a")], "scheduled_cached_reqs": [CachedRequestView("a")],
          "num_scheduled_tokens": {"a": 1}}, "schedules a request twice"),
        ({"scheduled_new_reqs": [_new("a"), _new("a")],  # as many counts as requests
          "num_scheduled_tokens": {"a": 1, "b": 1}}, "schedules a request twice"),
        ({"scheduled_new_reqs": [_new("a")], "num_scheduled_tokens": {}},
         "num_scheduled_tokens names [] but the step schedules ['a']"),
        ({"num_scheduled_tokens": {"ghost": 1}},
         "num_scheduled_tokens names ['ghost'] but the step schedules []"),
        ({"scheduled_new_reqs": [_new("a")], "num_scheduled_tokens": {"a": 1, "b": 1}},
         "but the step schedules ['a']"),
        ({"scheduled_new_reqs": [_new("a")], "num_scheduled_tokens": {"a": 0}},
         "num_scheduled_tokens['a'] must be an int >= 1, got 0"),
        ({"scheduled_new_reqs": [_new("a")], "num_scheduled_tokens": {"a": -3}},
         "must be an int >= 1, got -3"),
        ({"scheduled_new_reqs": [_new("a")], "num_scheduled_tokens": {"a": True}},
         "must be an int >= 1, got True"),
        ({"scheduled_new_reqs": [_new("a")], "num_scheduled_tokens": {"a": 2.0}},
         "must be an int >= 1, got 2.0"),
        ({"finished_req_ids": "abc"}, "expected an iterable of request ids, got one str"),
        ({"preempted_req_ids": ["ok", ""]}, "request id must be a non-empty str"),
        ({"finished_req_ids": [3]}, "request id must be a non-empty str"),
        ({"scheduled_new_reqs": [CachedRequestView("a")], "num_scheduled_tokens": {"a": 1}},
         "scheduled_new_reqs must hold NewRequestView, got CachedRequestView"),
        ({"scheduled_cached_reqs": [_new("a")], "num_scheduled_tokens": {"a": 1}},
         "scheduled_cached_reqs must hold CachedRequestView, got NewRequestView"),
    ],
)
def test_scheduler_output_rejects(kw: dict[str, Any], fragment: str) -> None:
    args: dict[str, Any] = {"step_id": 0}
    args.update(kw)
    with pytest.raises(InvalidArgumentError) as info:
        SchedulerOutputView(**args)
    assert fragment in str(info.value)


def test_scheduler_output_rejects_non_view_elements() -> None:
    with pytest.raises(InvalidArgumentError, match="must hold NewRequestView"):
        SchedulerOutputView(0, scheduled_new_reqs=["a"], num_scheduled_tokens={"a": 1})


request_ids = st.lists(st.from_regex(r"[a-z]{1,6}", fullmatch=True), unique=True, max_size=8)


@settings(max_examples=100, deadline=None)
@given(st.data(), request_ids)
def test_scheduler_output_totals_property(data: st.DataObject, ids: list[str]) -> None:
    split = data.draw(st.integers(0, len(ids)), label="split")
    new_ids, cached_ids = ids[:split], ids[split:]
    counts = {rid: data.draw(st.integers(1, 4096), label=f"n[{rid}]") for rid in ids}
    finished = data.draw(st.lists(st.from_regex(r"f[0-9]{1,3}", fullmatch=True), max_size=4))
    out = SchedulerOutputView(
        step_id=data.draw(st.integers(0, 10**6)),
        scheduled_new_reqs=[_new(r) for r in new_ids],
        scheduled_cached_reqs=[CachedRequestView(r) for r in cached_ids],
        num_scheduled_tokens=counts,
        finished_req_ids=finished,
    )
    assert out.total_num_scheduled_tokens == sum(counts.values())
    assert out.is_empty is (len(ids) == 0)
    assert set(out.num_scheduled_tokens) == set(ids)
    assert [r.request_id for r in out.scheduled_new_reqs] == new_ids
    assert [r.request_id for r in out.scheduled_cached_reqs] == cached_ids
    assert out.finished_req_ids == frozenset(finished)


# -------------------------------------------------------------- ForwardContextView


@pytest.mark.parametrize("kind", [ForwardKind.REAL, ForwardKind.REPLAY])
def test_forward_context_real(kind: ForwardKind) -> None:
    names = ["l0", "l1"]
    f = ForwardContextView(kind, 5, 128, names)
    names.append("l2")
    assert f.layer_names == ("l0", "l1")
    assert f.step_id == 5 and f.num_tokens == 128
    with pytest.raises(FIE):
        f.step_id = 6  # type: ignore[misc]


@pytest.mark.parametrize("kind", [ForwardKind.PROFILE, ForwardKind.WARMUP, ForwardKind.CAPTURE])
def test_forward_context_dummy(kind: ForwardKind) -> None:
    f = ForwardContextView(kind, None, 0, ("l0",))
    assert f.step_id is None
    assert f.kind.is_dummy


def test_forward_kind_is_dummy() -> None:
    assert {k for k in ForwardKind if k.is_dummy} == {
        ForwardKind.PROFILE, ForwardKind.WARMUP, ForwardKind.CAPTURE}


@pytest.mark.parametrize(
    "args,fragment",
    [
        ((ForwardKind.WARMUP, 3, 8, ["l"]), "a warmup forward has no step id, got step_id=3"),
        ((ForwardKind.CAPTURE, 0, 8, ["l"]), "a capture forward has no step id"),
        ((ForwardKind.PROFILE, 1, 8, ["l"]), "a profile forward has no step id"),
        ((ForwardKind.REAL, None, 8, ["l"]), "a real forward needs the step id it executes"),
        ((ForwardKind.REPLAY, None, 8, ["l"]), "a replay forward needs the step id"),
        ((ForwardKind.REAL, -1, 8, ["l"]), "step_id must be an int >= 0"),
        ((ForwardKind.REAL, True, 8, ["l"]), "step_id must be an int >= 0"),
        ((ForwardKind.REAL, "1", 8, ["l"]), "step_id must be an int >= 0"),
        ((ForwardKind.REAL, 0, -1, ["l"]), "num_tokens must be an int >= 0"),
        ((ForwardKind.REAL, 0, 1.5, ["l"]), "num_tokens must be an int >= 0"),
        ((ForwardKind.REAL, 0, 8, []), "layer_names must be unique and non-empty"),
        ((ForwardKind.REAL, 0, 8, ["a", "b", "a"]), "layer_names must be unique and non-empty"),
        (("real", 0, 8, ["l"]), "kind must be a ForwardKind"),
    ],
)
def test_forward_context_rejects(args: tuple[Any, ...], fragment: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        ForwardContextView(*args)
    assert fragment in str(info.value)


@pytest.mark.parametrize("names", ["abc", [1, 2]], ids=["str", "ints"])
def test_forward_context_layer_names_are_strs(names: Any) -> None:
    with pytest.raises(InvalidArgumentError):
        ForwardContextView(ForwardKind.REAL, 0, 8, names)


def test_forward_context_checks_every_other_tuple_of_names_after_a_valid_one() -> None:
    """The last valid tuple of layer names is not checked again (the engine passes the same
    one every step); any other tuple still is."""
    names = ("l0", "l1")
    assert ForwardContextView(ForwardKind.REAL, 0, 8, names).layer_names is names
    assert ForwardContextView(ForwardKind.REAL, 1, 8, names).layer_names is names
    for bad in (("l0", "l0"), ("l0", ""), (), ("l0", 3)):
        with pytest.raises(InvalidArgumentError):
            ForwardContextView(ForwardKind.REAL, 2, 8, bad)
    assert ForwardContextView(ForwardKind.REAL, 3, 8, names).layer_names is names


# ---------------------------------------------------------------- EngineConfigView


def test_engine_config_valid() -> None:
    extra = {"backend": "nixl", "buffers": [1, 2], "nested": {"k": None}}
    c = EngineConfigView("eng-0", TransferRole.PRODUCER, 32, 16, 1000, tp_size=4, pp_size=2,
                         extra=extra)
    assert c.world_size == 8
    assert c.extra["buffers"] == (1, 2)
    extra["backend"] = "other"
    extra["nested"]["k"] = 1  # type: ignore[index]
    assert c.extra["backend"] == "nixl"
    assert c.extra["nested"]["k"] is None
    with pytest.raises(TypeError):
        c.extra["x"] = 1  # type: ignore[index]
    with pytest.raises(FIE):
        c.num_blocks = 1  # type: ignore[misc]
    d = EngineConfigView("e", TransferRole.BOTH, 1, 1, 1)
    assert (d.tp_size, d.pp_size, d.world_size) == (1, 1, 1)
    assert d.extra == {} and isinstance(d.extra, MappingProxyType)
    with pytest.raises(InvalidArgumentError, match="extra must be a mapping"):
        EngineConfigView("e", TransferRole.BOTH, 1, 1, 1, extra=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kw,fragment",
    [
        ({"engine_id": ""}, "engine_id must be a non-empty str"),
        ({"engine_id": 0}, "engine_id must be a non-empty str"),
        ({"num_layers": 0}, "num_layers must be an int >= 1"),
        ({"block_size": 0}, "block_size must be an int >= 1"),
        ({"block_size": True}, "block_size must be an int >= 1"),
        ({"num_blocks": -4}, "num_blocks must be an int >= 1"),
        ({"num_blocks": 10.0}, "num_blocks must be an int >= 1"),
        ({"tp_size": 0}, "tp_size must be an int >= 1"),
        ({"pp_size": "2"}, "pp_size must be an int >= 1"),
        ({"extra": {"x": object()}}, "is a object"),
        ({"extra": {1: 2}}, "non-str key 1"),
        ({"extra": [("a", 1)]}, "must be a mapping or None"),
    ],
)
def test_engine_config_rejects(kw: dict[str, Any], fragment: str) -> None:
    args: dict[str, Any] = {"engine_id": "e", "role": TransferRole.CONSUMER, "num_layers": 2,
                            "block_size": 16, "num_blocks": 8}
    args.update(kw)
    with pytest.raises(InvalidArgumentError) as info:
        EngineConfigView(**args)
    assert fragment in str(info.value)


def test_engine_config_rejects_non_enum_role() -> None:
    with pytest.raises(InvalidArgumentError, match="role"):
        EngineConfigView("e", "producer", 1, 16, 8)  # type: ignore[arg-type]


# -------------------------------------------------------------------- freeze_params


def test_freeze_params_none() -> None:
    assert freeze_params(None) is None


def test_freeze_params_deep_copy_and_immutable() -> None:
    original: dict[str, Any] = {
        "host": "10.0.0.1", "port": 5000, "ratio": 0.5, "ok": True, "none": None,
        "ids": [1, [2, 3], {"deep": ["x"]}], "tuple": (1, 2),
        "nested": {"a": {"b": [1, 2]}},
    }
    frozen = freeze_params(original)
    assert frozen is not None
    assert isinstance(frozen, MappingProxyType)
    assert frozen["ids"] == (1, (2, 3), {"deep": ("x",)})
    assert frozen["nested"]["a"]["b"] == (1, 2)
    assert frozen["tuple"] == (1, 2)
    # Mutating the original afterwards changes nothing in the copy.
    original["host"] = "evil"
    original["ids"][1].append(4)
    original["ids"][2]["deep"].append("y")
    original["nested"]["a"]["b"].append(3)
    original["new"] = 1
    assert frozen["host"] == "10.0.0.1"
    assert frozen["ids"] == (1, (2, 3), {"deep": ("x",)})
    assert frozen["nested"]["a"]["b"] == (1, 2)
    assert "new" not in frozen
    # The copy cannot be mutated at any depth.
    with pytest.raises(TypeError):
        frozen["host"] = "x"  # type: ignore[index]
    with pytest.raises(TypeError):
        frozen["nested"]["a"]["c"] = 1
    with pytest.raises(TypeError):
        del frozen["nested"]["a"]
    assert not hasattr(frozen["ids"], "append")
    assert isinstance(frozen["ids"][2], MappingProxyType)


def test_freeze_params_accepts_mapping_proxy_and_is_idempotent() -> None:
    first = freeze_params({"a": [1, {"b": 2}]})
    second = freeze_params(first)
    assert second == first == {"a": (1, {"b": 2})}


@pytest.mark.parametrize(
    "params,path,what",
    [
        ({1: "x"}, "kv_transfer_params", "non-str key 1"),
        ({"a": {2: "x"}}, "kv_transfer_params.a", "non-str key 2"),
        ({"a": {1, 2}}, "kv_transfer_params.a", "is a set"),
        ({"a": frozenset()}, "kv_transfer_params.a", "is a frozenset"),
        ({"a": b"bytes"}, "kv_transfer_params.a", "is a bytes"),
        ({"a": bytearray(b"x")}, "kv_transfer_params.a", "is a bytearray"),
        ({"a": object()}, "kv_transfer_params.a", "is a object"),
        ({"a": [0, {1, 2}]}, "kv_transfer_params.a[1]", "is a set"),
        ({"a": [0, b"x"]}, "kv_transfer_params.a[1]", "is a bytes"),
        ({"a": [{"b": [None, object()]}]}, "kv_transfer_params.a[0].b[1]", "is a object"),
        ({"a": {"b": {"c": 1j}}}, "kv_transfer_params.a.b.c", "is a complex"),
        ({"f": len}, "kv_transfer_params.f", "is a builtin_function_or_method"),
    ],
)
def test_freeze_params_rejects_non_plain(params: Any, path: str, what: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        freeze_params(params)
    assert info.value.clause == "SCH-018"
    msg = str(info.value)
    assert f"{path} " in msg, msg
    assert what in msg, msg
    if "non-str key" not in what:
        assert "JSON-representable" in msg


@pytest.mark.parametrize("bad", [[("a", 1)], "abc", 5, {"a"}])
def test_freeze_params_top_level_must_be_mapping(bad: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="kv_transfer_params must be a mapping or None") as info:
        freeze_params(bad)
    assert info.value.clause == "SCH-018"


json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
)


def _thaw(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {k: _thaw(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_thaw(x) for x in v]
    return v


def _is_frozen(v: Any) -> bool:
    if isinstance(v, Mapping):
        return isinstance(v, MappingProxyType) and all(_is_frozen(x) for x in v.values())
    if isinstance(v, (list, dict, set)):
        return False
    if isinstance(v, tuple):
        return all(_is_frozen(x) for x in v)
    return True


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(max_size=5), json_like, max_size=5))
def test_freeze_params_property(params: dict[str, Any]) -> None:
    frozen = freeze_params(params)
    assert frozen is not None
    assert _thaw(frozen) == _thaw(params)
    assert _is_frozen(frozen)


def test_views_raise_kvspec_errors_only_for_validated_fields() -> None:
    """Every rejection above is a KVSpecError and a ValueError (ERR-001, ERR-002)."""
    for make in (
        lambda: RequestView("r", []),
        lambda: AllocatedBlocks.single([-1]),
        lambda: SchedulerOutputView(-1),
        lambda: ForwardContextView(ForwardKind.REAL, None, 1, ["l"]),
        lambda: EngineConfigView("", TransferRole.BOTH, 1, 1, 1),
        lambda: freeze_params({"a": set()}),
    ):
        with pytest.raises(KVSpecError) as info:
            make()
        assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "make",
    [
        lambda: AllocatedBlocks(5),  # type: ignore[arg-type]
        lambda: RequestView("r", [1], block_hashes=5),  # type: ignore[arg-type]
        lambda: SchedulerOutputView(0, num_scheduled_tokens=5),  # type: ignore[arg-type]
    ],
    ids=["allocated_blocks_int", "block_hashes_int", "num_scheduled_tokens_int"],
)
def test_non_iterable_arguments_raise_typed_errors(make: Any) -> None:
    with pytest.raises(InvalidArgumentError):
        make()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_freeze_params_rejects_non_json_floats(value: float) -> None:
    with pytest.raises(InvalidArgumentError, match=r"kv_transfer_params\.x is .*JSON has no NaN"):
        freeze_params({"x": value})


def test_thaw_params_inverts_freeze_params_into_json_ready_data() -> None:
    import json

    from kvspec.protocols import thaw_params

    params = {"a": [1, {"b": (2, 3)}], "c": {"d": None, "e": "x"}}
    frozen = freeze_params(params)
    thawed = thaw_params(frozen)
    assert thawed == {"a": [1, {"b": [2, 3]}], "c": {"d": None, "e": "x"}}
    assert json.loads(json.dumps(thawed)) == thawed  # json.dumps refuses mappingproxy
    thawed["c"]["e"] = "y"  # a mutable copy: the frozen params are untouched
    assert frozen is not None and frozen["c"]["e"] == "x"
    assert freeze_params(thawed) is not None


@pytest.mark.parametrize("make,error", [
    (lambda: AllocatedBlocks.single(5), InvalidBlockIdError),  # type: ignore[arg-type]
    (lambda: AllocatedBlocks.single({3, 1}), InvalidBlockIdError),
    (lambda: AllocatedBlocks(({3, 1},)), InvalidBlockIdError),
    (lambda: SchedulerOutputView(0, finished_req_ids=None), InvalidArgumentError),  # type: ignore[arg-type]
    (lambda: SchedulerOutputView(0, preempted_req_ids=7), InvalidArgumentError),  # type: ignore[arg-type]
    (lambda: RequestView("r", (1, -2)), InvalidArgumentError),
    (lambda: CachedRequestView("c", new_token_ids=[-1]), InvalidArgumentError),
], ids=["single-int", "single-set", "group-set", "finished-none", "preempted-int",
        "negative-prompt-token", "negative-new-token"])
def test_public_entries_fail_typed_on_malformed_input(make: Any, error: type) -> None:
    """Issue 14, defect 9: these raised TypeError or were silently accepted."""
    with pytest.raises(error):
        make()
