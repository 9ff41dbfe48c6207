"""Tests of kvspec.protocols.capabilities: defaults, validation, normalisation, describe()."""

from __future__ import annotations

import json

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.protocols.capabilities import Capabilities, FailureReporting, HookGraphMode
from kvspec.protocols.errors import CapabilityError, InvalidArgumentError
from kvspec.protocols.layout import StrideOrder
from kvspec.protocols.views import TransferRole
from typing import Any

BOOL_FIELDS = (
    "async_loads", "delayed_free", "accepts_split_kv", "heterogeneous_tp",
    "custom_aggregator", "handles_preemptions",
)
ORDERS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


def test_defaults() -> None:
    c = Capabilities()
    assert c.async_loads is False
    assert c.delayed_free is False
    assert c.layer_hooks is HookGraphMode.NO_LAYER_HOOKS
    assert c.accepted_layouts == ()
    assert c.accepts_split_kv is True
    assert c.heterogeneous_tp is False
    assert c.failure_reporting is FailureReporting.NEVER_FAILS
    assert c.kv_cache_groups == 1
    assert c.custom_aggregator is False
    assert c.handles_preemptions is False
    assert c.has_layer_hooks is False
    assert Capabilities() == c


def test_frozen() -> None:
    c = Capabilities()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        c.async_loads = True  # type: ignore[misc]


@pytest.mark.parametrize(
    "hooks,expected",
    [(HookGraphMode.NO_LAYER_HOOKS, False), (HookGraphMode.EAGER, True),
     (HookGraphMode.CAPTURABLE, True)],
)
def test_has_layer_hooks(hooks: HookGraphMode, expected: bool) -> None:
    assert Capabilities(layer_hooks=hooks).has_layer_hooks is expected


# ------------------------------------------------------------------ accepted_layouts


def _names(orders: tuple[StrideOrder, ...]) -> tuple[str, ...]:
    assert all(isinstance(o, StrideOrder) for o in orders), orders
    return tuple(o.value for o in orders)


@pytest.mark.parametrize(
    "given_,expected",
    [
        (("NHD",), ("LBNHC",)),
        (("HND",), ("LBHNC",)),
        (["nhd", "hnd"], ("LBNHC", "LBHNC")),
        (("lbhnc", "BLNHC"), ("LBHNC", "BLNHC")),
        (("HND", "LBHNC", "NHD", "LBNHC", "hnd"), ("LBHNC", "LBNHC")),
        (("BHLNC", "LHBNC", "BHLNC"), ("BHLNC", "LHBNC")),
        (ORDERS, ORDERS),
        (tuple(reversed(ORDERS)), tuple(reversed(ORDERS))),
        ((StrideOrder.parse("NHD"), StrideOrder.BLHNC, "NHD"), ("LBNHC", "BLHNC")),
        ((StrideOrder.LBHNC, "hnd"), ("LBHNC",)),
        ((), ()),
        ([], ()),
    ],
)
def test_accepted_layouts_normalised(given_: object, expected: tuple[str, ...]) -> None:
    c = Capabilities(accepted_layouts=given_)  # type: ignore[arg-type]
    assert _names(c.accepted_layouts) == expected
    assert isinstance(c.accepted_layouts, tuple)
    assert c.accepted_layouts == tuple(StrideOrder(n) for n in expected)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(ORDERS + ("NHD", "HND", "nhd", "hnd", "lbnhc"))))
def test_accepted_layouts_dedup_keeps_first_occurrence_order(names: list[str]) -> None:
    aliases = {"NHD": "LBNHC", "HND": "LBHNC"}
    expected: list[str] = []
    for n in names:
        canon = aliases.get(n.upper(), n.upper())
        if canon not in expected:
            expected.append(canon)
    assert _names(Capabilities(accepted_layouts=names).accepted_layouts) == tuple(expected)


@pytest.mark.parametrize("bad", [("XYZ",), ("NHD", "NDH"), ("",), ("LBNHCX",)])
def test_accepted_layouts_bad_names_rejected(bad: tuple[object, ...]) -> None:
    with pytest.raises(InvalidArgumentError, match="unknown stride order") as info:
        Capabilities(accepted_layouts=bad)  # type: ignore[arg-type]
    msg = str(info.value)
    assert "expected one of" in msg
    for name in ORDERS + ("NHD", "HND"):
        assert name in msg
    assert info.value.clause == "LAY-001"


@pytest.mark.parametrize("bad", [(3,), (None,), (b"NHD",), (HookGraphMode.EAGER,)])
def test_accepted_layouts_non_str_entries_rejected(bad: tuple[object, ...]) -> None:
    with pytest.raises(InvalidArgumentError, match="stride order name must be a str") as info:
        Capabilities(accepted_layouts=bad)  # type: ignore[arg-type]
    assert info.value.clause == "LAY-001"


@pytest.mark.parametrize("bad", ["NHD", 3, None, {"NHD": 1}, frozenset({"NHD"}), {"HND"}])
def test_accepted_layouts_must_be_a_sequence(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="accepted_layouts must be a tuple") as info:
        Capabilities(accepted_layouts=bad)  # type: ignore[arg-type]
    assert info.value.clause == "LAY-001"


# -------------------------------------------------------------------- field checks


@pytest.mark.parametrize("field", BOOL_FIELDS)
@pytest.mark.parametrize("bad", [1, 0, "yes", None])
def test_bool_fields_reject_non_bools(field: str, bad: object) -> None:
    kwargs: dict[str, object] = {field: bad}
    with pytest.raises(InvalidArgumentError, match=f"Capabilities.{field} must be a bool"):
        Capabilities(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", BOOL_FIELDS)
def test_bool_fields_accept_bools(field: str) -> None:
    extra: dict[str, object] = {}
    if field == "async_loads":
        extra["failure_reporting"] = FailureReporting.INVALID_BLOCKS
    for v in (True, False):
        assert getattr(Capabilities(**{field: v}, **extra), field) is v  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["eager", None, 1, FailureReporting.NEVER_FAILS])
def test_layer_hooks_must_be_enum(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="layer_hooks must be a HookGraphMode"):
        Capabilities(layer_hooks=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["never_fails", None, HookGraphMode.EAGER])
def test_failure_reporting_must_be_enum(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="failure_reporting must be a FailureReporting"):
        Capabilities(failure_reporting=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, True, False, 1.0, "2", None])
def test_kv_cache_groups_must_be_positive_int(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="kv_cache_groups must be an int >= 1"):
        Capabilities(kv_cache_groups=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [1, 2, 7])
def test_kv_cache_groups_accepted(n: int) -> None:
    assert Capabilities(kv_cache_groups=n).kv_cache_groups == n


def test_async_loads_that_never_fail_is_refused() -> None:
    with pytest.raises(CapabilityError, match="INVALID_BLOCKS") as info:
        Capabilities(async_loads=True)
    assert info.value.clause == "WRK-011"
    assert not isinstance(info.value, InvalidArgumentError)
    with pytest.raises(CapabilityError):
        Capabilities(async_loads=True, failure_reporting=FailureReporting.NEVER_FAILS)


def test_async_loads_with_invalid_blocks_is_fine() -> None:
    c = Capabilities(async_loads=True, failure_reporting=FailureReporting.INVALID_BLOCKS)
    assert c.async_loads is True
    assert c.failure_reporting is FailureReporting.INVALID_BLOCKS
    # Sync-only connectors may declare either reporting mode.
    assert Capabilities(failure_reporting=FailureReporting.INVALID_BLOCKS).async_loads is False


# ------------------------------------------------------------------------ describe


def test_describe_defaults() -> None:
    assert Capabilities().describe() == {
        "async_loads": False,
        "delayed_free": False,
        "layer_hooks": "no_layer_hooks",
        "accepted_layouts": [],
        "accepts_split_kv": True,
        "heterogeneous_tp": False,
        "failure_reporting": "never_fails",
        "kv_cache_groups": 1,
        "group_kinds": ["full"],
        "custom_aggregator": False,
        "handles_preemptions": False,
        "needs_token_rows": False,
        "fault_injection": False,
        "block_sizes": [],
        "sleep_mode": False,
    }


def test_block_sizes_are_ints_in_preference_order() -> None:
    caps = Capabilities(block_sizes=[32, 64, 32])
    assert caps.block_sizes == (32, 64)
    assert caps.describe()["block_sizes"] == [32, 64]
    for bad in ("32", (0,), (True,), (16.0,), 32):
        with pytest.raises(InvalidArgumentError, match="block_sizes"):
            Capabilities(block_sizes=bad)


caps_strategy = st.builds(
    Capabilities,
    async_loads=st.just(False),
    delayed_free=st.booleans(),
    layer_hooks=st.sampled_from(HookGraphMode),
    accepted_layouts=st.lists(st.sampled_from(ORDERS + ("NHD", "HND")), max_size=8),
    accepts_split_kv=st.booleans(),
    heterogeneous_tp=st.booleans(),
    failure_reporting=st.sampled_from(FailureReporting),
    kv_cache_groups=st.integers(1, 16),
    custom_aggregator=st.booleans(),
    handles_preemptions=st.booleans(),
    block_sizes=st.lists(st.integers(1, 64), max_size=3),
) | st.builds(
    Capabilities,
    async_loads=st.just(True),
    failure_reporting=st.just(FailureReporting.INVALID_BLOCKS),
    layer_hooks=st.sampled_from(HookGraphMode),
)


@settings(max_examples=100, deadline=None)
@given(caps_strategy)
def test_describe_is_json_and_round_trips(caps: Capabilities) -> None:
    d = caps.describe()
    assert set(d) == {f.name for f in attrs.fields(Capabilities)}
    text = json.dumps(d)
    back = json.loads(text)
    assert back == d
    assert back["layer_hooks"] == caps.layer_hooks.value
    assert HookGraphMode(back["layer_hooks"]) is caps.layer_hooks
    assert FailureReporting(back["failure_reporting"]) is caps.failure_reporting
    assert back["accepted_layouts"] == list(_names(caps.accepted_layouts))
    rebuilt = Capabilities(
        **{
            **back,
            "layer_hooks": HookGraphMode(back["layer_hooks"]),
            "failure_reporting": FailureReporting(back["failure_reporting"]),
        }
    )
    assert rebuilt == caps


def test_fault_plan_reads_and_checks_the_config() -> None:
    from kvspec.protocols import FAULTS_KEY, EngineConfigView, FaultPlan

    def config(value: object) -> EngineConfigView:
        return EngineConfigView(engine_id="e", role=TransferRole.BOTH, num_layers=1,
                                block_size=4, num_blocks=8, extra={FAULTS_KEY: value})

    plain = EngineConfigView(engine_id="e", role=TransferRole.BOTH, num_layers=1,
                             block_size=4, num_blocks=8)
    assert FaultPlan.from_config(plain) == FaultPlan() and not FaultPlan().active
    plan = FaultPlan.from_config(config({"fail_loads": True, "delay_s": 0.5}))
    assert plan == FaultPlan(fail_loads=True, delay_s=0.5) and plan.active
    assert FaultPlan.from_config(config(plan.to_plain())) == plan
    for bad in ({"fail_loads": 1}, {"delay_s": -1}, {"delay_s": float("nan")},
                {"unknown": True}, [1], "yes", {"delay_s": True}):
        with pytest.raises(InvalidArgumentError):
            FaultPlan.from_config(config(bad))


def test_sleep_mode_is_off_by_default_and_its_refusal_names_connector_and_capability() -> None:
    """WRK-020: a connector that does not declare sleep_mode is refused by name."""
    from kvspec.protocols import CapabilityError, WorkerConnector

    assert Capabilities().sleep_mode is False
    Capabilities(sleep_mode=True).check_sleep_mode("'x'")
    with pytest.raises(CapabilityError, match=r"WRK-020.*'tiny'.*sleep_mode") as e:
        Capabilities().check_sleep_mode("'tiny'")
    assert e.value.clause == "WRK-020"
    with pytest.raises(Exception, match="sleep_mode must be a bool"):
        Capabilities(sleep_mode=1)  # type: ignore[arg-type]

    class _W(WorkerConnector):
        def register_kv_caches(self, kv_caches: Any, layout: Any) -> None: ...
        def bind_connector_metadata(self, metadata: Any) -> None: ...
        def clear_connector_metadata(self) -> None: ...
        def start_load_kv(self, forward_context: Any) -> None: ...
        def wait_for_save(self) -> None: ...

    from kvspec.protocols import UnsupportedOperationError
    with pytest.raises(UnsupportedOperationError, match="WRK-020"):
        _W().unregister_kv_caches()
    with pytest.raises(UnsupportedOperationError, match="WRK-020"):
        _W().restore_kv_caches({}, None)  # type: ignore[arg-type]
