"""Tests of layout negotiation (LAY-010)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.protocols.errors import InvalidArgumentError, LayoutNegotiationError
from kvspec.protocols.layout import KVPacking, StrideOrder
from kvspec.protocols.negotiation import LayoutOffer, ResolvedLayout, negotiate_layout

O = StrideOrder
CONCAT, SPLIT = KVPacking.CONCAT, KVPacking.SPLIT
NHD, HND = StrideOrder.parse("NHD"), StrideOrder.parse("HND")


def connector(*orders: StrideOrder, packings: tuple[KVPacking, ...] = ()) -> LayoutOffer:
    return LayoutOffer("connector", orders, packings)


def backend(*orders: StrideOrder, packings: tuple[KVPacking, ...] = ()) -> LayoutOffer:
    return LayoutOffer("attention backend", orders, packings)


def provider(*orders: StrideOrder, packings: tuple[KVPacking, ...] = (),
             can_restride: bool = True) -> LayoutOffer:
    return LayoutOffer("tensor provider", orders, packings, can_restride)


def test_agreement_follows_connector_preference() -> None:
    offers = (connector(O.BLHNC, O.LBHNC, packings=(SPLIT, CONCAT)),
              backend(O.LBHNC, O.BLHNC, packings=(CONCAT, SPLIT)), provider())
    resolved = negotiate_layout(*offers)
    assert resolved == ResolvedLayout(O.BLHNC, SPLIT, "connector", offers)
    assert resolved.packing_chosen_by == "connector"


def test_first_preference_accepted_by_both_others_wins() -> None:
    resolved = negotiate_layout(connector(O.BLHNC, HND, NHD),
                                backend(NHD, HND), provider(NHD, HND, O.BLHNC))
    assert resolved.order is O.LBHNC and resolved.chosen_by == "connector"


def test_no_preference_defers_to_backend_then_provider() -> None:
    resolved = negotiate_layout(connector(), backend(O.LBNHC, O.LBHNC), provider(O.LBHNC))
    assert (resolved.order, resolved.chosen_by) == (O.LBHNC, "attention backend")
    resolved = negotiate_layout(connector(), backend(), provider(O.BHLNC, packings=(SPLIT,)))
    assert (resolved.order, resolved.chosen_by) == (O.BHLNC, "tensor provider")
    assert (resolved.packing, resolved.packing_chosen_by) == (SPLIT, "tensor provider")


def test_nobody_has_a_preference() -> None:
    resolved = negotiate_layout(connector(), backend(), provider())
    assert (resolved.order, resolved.packing, resolved.chosen_by) == (O.LBHNC, CONCAT, "default")


def test_order_and_packing_decided_independently() -> None:
    resolved = negotiate_layout(connector(NHD), backend(packings=(SPLIT,)), provider())
    assert (resolved.chosen_by, resolved.packing_chosen_by) == ("connector", "attention backend")


def test_refusals_name_each_party_and_candidate() -> None:
    """LAY-010: one line per party that excluded each candidate; no silent fallback."""
    with pytest.raises(LayoutNegotiationError) as info:
        negotiate_layout(connector(O.BLHNC, O.LBHNC), backend(O.LBHNC, O.LBNHC),
                         provider(O.BLHNC, O.LBNHC))
    err = info.value
    assert err.clause == "LAY-010"
    assert err.refusals == (
        "attention backend refused BLHNC: accepts LBHNC, LBNHC",
        "tensor provider refused LBHNC: accepts BLHNC, LBNHC",
    )
    assert "no stride order preferred by connector" in str(err)
    assert "attention backend refused BLHNC" in str(err)


def test_non_restridable_provider_refusal_says_why() -> None:
    """LAY-009: a provider that cannot re-stride offers its native order only."""
    kvcached = provider(NHD, can_restride=False)
    assert negotiate_layout(connector(HND, NHD), backend(), kvcached).order is NHD
    with pytest.raises(LayoutNegotiationError) as info:
        negotiate_layout(connector(HND), backend(), kvcached)
    assert info.value.refusals == (
        "tensor provider refused LBHNC: cannot re-stride its tensors, native order is LBNHC",
    )


def test_packing_refusals() -> None:
    with pytest.raises(LayoutNegotiationError) as info:
        negotiate_layout(connector(packings=(SPLIT,)), backend(packings=(CONCAT,)),
                         provider(packings=(CONCAT,)))
    assert info.value.refusals == (
        "attention backend refused SPLIT packing: accepts CONCAT",
        "tensor provider refused SPLIT packing: accepts CONCAT",
    )
    assert "no K/V packing preferred by connector" in str(info.value)


def test_order_and_packing_failures_reported_together() -> None:
    with pytest.raises(LayoutNegotiationError) as info:
        negotiate_layout(connector(), backend(O.BLHNC, packings=(SPLIT,)),
                         provider(NHD, packings=(CONCAT,)))
    assert info.value.refusals == (
        "tensor provider refused BLHNC: accepts LBNHC",
        "tensor provider refused SPLIT packing: accepts CONCAT",
    )
    assert "preferred by attention backend" in str(info.value)


@settings(max_examples=200, deadline=None)
@given(
    offers=st.lists(
        st.tuples(st.lists(st.sampled_from(list(StrideOrder)), unique=True),
                  st.lists(st.sampled_from(list(KVPacking)), unique=True)),
        min_size=3, max_size=3,
    )
)
def test_result_is_accepted_by_all_or_refused(
    offers: list[tuple[list[StrideOrder], list[KVPacking]]]
) -> None:
    """Negotiation either finds a layout every party accepts or explains a refusal."""
    parties = [LayoutOffer(name, tuple(o), tuple(p)) for name, (o, p) in
               zip(("connector", "attention backend", "tensor provider"), offers)]
    common_orders = [o for o in StrideOrder if all(x.accepts_order(o) for x in parties)]
    common_packings = [p for p in KVPacking if all(x.accepts_packing(p) for x in parties)]
    if common_orders and common_packings:
        resolved = negotiate_layout(*parties)
        assert resolved.order in common_orders and resolved.packing in common_packings
        leader = next((x for x in parties if x.orders), None)
        if leader is not None:
            assert resolved.order is next(o for o in leader.orders if o in common_orders)
    else:
        with pytest.raises(LayoutNegotiationError) as info:
            negotiate_layout(*parties)
        assert info.value.refusals


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(party=""), "party must be a non-empty str"),
        (dict(party=3), "party must be a non-empty str"),
        (dict(orders=[NHD]), "orders must be a tuple of StrideOrder"),
        (dict(orders=("NHD",)), "orders must be a tuple of StrideOrder"),
        (dict(orders=(NHD, O.LBNHC)), "names a value twice"),
        (dict(packings=(CONCAT, CONCAT)), "names a value twice"),
        (dict(packings=(NHD,)), "packings must be a tuple of KVPacking"),
        (dict(can_restride=0), "can_restride must be a bool"),
        (dict(can_restride=False), "cannot re-stride but offers every order"),
        (dict(can_restride=False, orders=(NHD, HND)), "expected exactly its one native"),
    ],
)
def test_offer_rejects(kwargs: dict[str, object], fragment: str) -> None:
    args: dict[str, object] = dict(party="tensor provider")
    args.update(kwargs)
    with pytest.raises(InvalidArgumentError, match=fragment):
        LayoutOffer(**args)  # type: ignore[arg-type]


def test_negotiate_rejects_non_offers() -> None:
    with pytest.raises(InvalidArgumentError, match="backend must be a LayoutOffer, got tuple"):
        negotiate_layout(connector(), (NHD,), provider())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(order="NHD"), "order and packing must be"),
        (dict(chosen_by=""), "chosen_by must be a non-empty str"),
        (dict(packing_chosen_by=None), "packing_chosen_by must be a non-empty str"),
        (dict(offers=[connector()]), "offers must be a tuple of LayoutOffer"),
        (dict(offers=(backend(HND),)), "attention backend does not accept LBNHC"),
    ],
)
def test_resolved_layout_rejects(kwargs: dict[str, object], fragment: str) -> None:
    args: dict[str, object] = dict(order=NHD, packing=CONCAT, chosen_by="connector",
                                   offers=(connector(),))
    args.update(kwargs)
    with pytest.raises(InvalidArgumentError, match=fragment):
        ResolvedLayout(**args)  # type: ignore[arg-type]
