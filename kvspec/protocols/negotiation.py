"""Layout negotiation between a connector, the attention backend and the tensor provider.

Each party states the stride orders (LAY-001) and K/V packings (LAY-002) it accepts;
``negotiate_layout`` picks the one layout all three accept, led by the connector's
preference, or fails with ``LayoutNegotiationError`` naming
who refused what. It never falls back silently to a layout someone refused (LAY-010).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import attrs

from kvspec.protocols.errors import InvalidArgumentError, LayoutNegotiationError
from kvspec.protocols.layout import KVPacking, StrideOrder

__all__ = ["LayoutOffer", "ResolvedLayout", "negotiate_layout"]

_Choice = TypeVar("_Choice", StrideOrder, KVPacking)


def _check_choices(party: str, field: str, values: object, kind: type) -> None:
    if not isinstance(values, tuple) or not all(isinstance(v, kind) for v in values):
        raise InvalidArgumentError(
            f"{party}: {field} must be a tuple of {kind.__name__} (empty = accepts all), "
            f"got {values!r}",
            clause="LAY-010",
        )
    if len(set(values)) != len(values):
        raise InvalidArgumentError(
            f"{party}: {field} {tuple(v.name for v in values)} names a value twice; expected "
            f"each at most once",
            clause="LAY-010",
        )


@attrs.frozen
class LayoutOffer:
    """What one party accepts, in preference order (LAY-010).

    Attributes:
        party: Who offers, e.g. ``"connector"``, ``"attention backend"``,
            ``"tensor provider"``; refusal messages name it.
        orders: Accepted stride orders, most preferred first; empty means no preference
            (all six accepted). No order may appear twice.
        packings: Accepted K/V packings, same convention.
        can_restride: False for a party that cannot re-stride or re-allocate its tensors
            (LAY-009); it must then offer exactly its one native order.
        opaque_pages: The party packs each page for its kernels (vLLM-CPU's attention
            backend): tokens and channels inside a page have no address (LAY-014).
        needs_token_rows: The party (a connector) addresses tokens or channels inside a
            page; it cannot agree with a party whose pages are opaque (LAY-014).

    Raises:
        InvalidArgumentError: on construction, if any of the above does not hold.
    """

    party: str
    orders: tuple[StrideOrder, ...] = ()
    packings: tuple[KVPacking, ...] = ()
    can_restride: bool = True
    opaque_pages: bool = False
    needs_token_rows: bool = False

    def __attrs_post_init__(self) -> None:
        for flag in ("opaque_pages", "needs_token_rows"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidArgumentError(
                    f"{flag} must be a bool, got {getattr(self, flag)!r}", clause="LAY-014"
                )
        if not isinstance(self.party, str) or not self.party.strip():
            raise InvalidArgumentError(
                f"party must be a non-empty str naming who offers, got {self.party!r}",
                clause="LAY-010",
            )
        _check_choices(self.party, "orders", self.orders, StrideOrder)
        _check_choices(self.party, "packings", self.packings, KVPacking)
        if not isinstance(self.can_restride, bool):
            raise InvalidArgumentError(
                f"{self.party}: can_restride must be a bool, got {self.can_restride!r}",
                clause="LAY-009",
            )
        if not self.can_restride and len(self.orders) != 1:
            raise InvalidArgumentError(
                f"{self.party} cannot re-stride but offers "
                f"{', '.join(o.name for o in self.orders) or 'every order'}; expected exactly "
                f"its one native order",
                clause="LAY-009",
            )

    def accepts_order(self, order: StrideOrder) -> bool:
        """True if this party accepts ``order`` (an empty ``orders`` accepts all)."""
        return not self.orders or order in self.orders

    def accepts_packing(self, packing: KVPacking) -> bool:
        """True if this party accepts ``packing`` (an empty ``packings`` accepts all)."""
        return not self.packings or packing in self.packings


@attrs.frozen
class ResolvedLayout:
    """The outcome of ``negotiate_layout``: an order and packing every offer accepts.

    Attributes:
        order: The agreed stride order.
        packing: The agreed K/V packing.
        chosen_by: The party whose preference decided the order, or ``"default"`` when
            no party stated one (then the first order of ``StrideOrder``).
        offers: The offers it was resolved from: connector, attention backend, provider.
        packing_chosen_by: The same for the packing; defaults to ``chosen_by``.
        opaque_pages: True when any offer's pages are opaque: the descriptor built for the
            resolved layout must say so (LAY-014).

    Raises:
        InvalidArgumentError: on construction, if a field has the wrong type or an offer
            does not accept the order or packing (LAY-010).
    """

    order: StrideOrder
    packing: KVPacking
    chosen_by: str
    offers: tuple[LayoutOffer, ...]
    packing_chosen_by: str = attrs.field(
        default=attrs.Factory(lambda self: self.chosen_by, takes_self=True)
    )
    opaque_pages: bool = attrs.field(
        default=attrs.Factory(lambda self: any(o.opaque_pages for o in self.offers),
                              takes_self=True)
    )

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.order, StrideOrder) or not isinstance(self.packing, KVPacking):
            raise InvalidArgumentError(
                f"order and packing must be a StrideOrder and a KVPacking, got "
                f"{self.order!r} and {self.packing!r}",
                clause="LAY-010",
            )
        for name in ("chosen_by", "packing_chosen_by"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise InvalidArgumentError(
                    f"{name} must be a non-empty str, got {value!r}", clause="LAY-010"
                )
        if not isinstance(self.offers, tuple) or not all(
            isinstance(o, LayoutOffer) for o in self.offers
        ):
            raise InvalidArgumentError(
                f"offers must be a tuple of LayoutOffer, got {self.offers!r}", clause="LAY-010"
            )
        for offer in self.offers:
            if not (offer.accepts_order(self.order) and offer.accepts_packing(self.packing)):
                raise InvalidArgumentError(
                    f"{offer.party} does not accept {self.order.name} with "
                    f"{self.packing.name} packing; a resolved layout must satisfy every offer",
                    clause="LAY-010",
                )


def _choose(
    offers: tuple[LayoutOffer, ...],
    preferences: Callable[[LayoutOffer], tuple[_Choice, ...]],
    universe: tuple[_Choice, ...],
    refusal: Callable[[LayoutOffer, _Choice], str],
) -> tuple[_Choice | None, str, list[str]]:
    """(choice or None, who decided, refusal lines). The first offer with a preference
    leads; its first candidate every offer accepts wins."""
    leader = next((o for o in offers if preferences(o)), None)
    candidates = preferences(leader) if leader else universe
    chosen_by = leader.party if leader else "default"
    for candidate in candidates:
        if all(not preferences(o) or candidate in preferences(o) for o in offers):
            return candidate, chosen_by, []
    refusals = [
        refusal(offer, candidate)
        for candidate in candidates
        for offer in offers
        if offer is not leader and preferences(offer) and candidate not in preferences(offer)
    ]
    return None, chosen_by, refusals


def _order_refusal(offer: LayoutOffer, order: StrideOrder) -> str:
    if not offer.can_restride:
        return (
            f"{offer.party} refused {order.name}: cannot re-stride its tensors, native order "
            f"is {offer.orders[0].name}"
        )
    return f"{offer.party} refused {order.name}: accepts {', '.join(o.name for o in offer.orders)}"


def _packing_refusal(offer: LayoutOffer, packing: KVPacking) -> str:
    return (
        f"{offer.party} refused {packing.name} packing: accepts "
        f"{', '.join(p.name for p in offer.packings)}"
    )


def negotiate_layout(
    connector: LayoutOffer, backend: LayoutOffer, provider: LayoutOffer
) -> ResolvedLayout:
    """Agree on a stride order and K/V packing that all three parties accept (LAY-010).

    The order is the first of the connector's preferences that the attention backend and
    the tensor provider accept; if the connector has no preference, the backend's
    preference leads, then the provider's; if nobody has one, the first
    ``StrideOrder``. The packing is chosen the same way, independently. A party that
    needs token rows never agrees with a party whose pages are opaque (LAY-014).

    Raises:
        LayoutNegotiationError: no order or no packing satisfies all three; ``refusals``
            holds one line per party that excluded a candidate of the leading party,
            e.g. ``"attention backend refused BLHNC: accepts LBHNC, LBNHC"``. There is
            no silent fallback (LAY-010).
        InvalidArgumentError: an argument is not a ``LayoutOffer``.
    """
    offers = (connector, backend, provider)
    for role, offer in zip(("connector", "backend", "provider"), offers):
        if not isinstance(offer, LayoutOffer):
            raise InvalidArgumentError(
                f"{role} must be a LayoutOffer, got {type(offer).__name__}", clause="LAY-010"
            )
    order, order_by, order_refusals = _choose(
        offers, lambda o: o.orders, tuple(StrideOrder), _order_refusal
    )
    packing, packing_by, packing_refusals = _choose(
        offers, lambda o: o.packings, tuple(KVPacking), _packing_refusal
    )
    rows = [o for o in offers if o.needs_token_rows]
    opaque = [o for o in offers if o.opaque_pages]
    if rows and opaque:
        raise LayoutNegotiationError(
            f"{', '.join(o.party for o in rows)} needs token rows inside pages, but the pages "
            f"of {', '.join(o.party for o in opaque)} are opaque (packed for its kernels); "
            "expected a connector that moves whole pages (LAY-014)",
            refusals=tuple(
                f"{o.party} refused token-row access: its pages are opaque, whole-page copies "
                "only" for o in opaque
            ),
            clause="LAY-014",
        )
    if order is None or packing is None:
        parties = ", ".join(o.party for o in offers)
        failed = [
            f"no {what} preferred by {leader} is accepted by every party ({parties})"
            for what, leader, choice in (
                ("stride order", order_by, order), ("K/V packing", packing_by, packing)
            )
            if choice is None
        ]
        raise LayoutNegotiationError(
            "; ".join(failed) + "; expected at least one layout all parties accept",
            refusals=tuple(order_refusals + packing_refusals),
        )
    return ResolvedLayout(
        order=order, packing=packing, chosen_by=order_by, offers=offers,
        packing_chosen_by=packing_by,
    )
