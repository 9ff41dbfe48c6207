"""What a connector declares about itself, in one object.

The engine reads the declaration to decide graph modes and dummy-run behaviour (GRA-001), and
the conformance suite gates its tests on it: a test that needs a capability the connector does
not declare is skipped, and the skip names the capability.
"""

from __future__ import annotations

import enum

import attrs

from collections.abc import Sequence

from .errors import CapabilityError, InvalidArgumentError
from .groups import GroupKind, KVCacheGroup, check_groups
from .layout import KVPacking, StrideOrder
from .negotiation import LayoutOffer

__all__ = ["Capabilities", "FailureReporting", "HookGraphMode"]


class HookGraphMode(enum.Enum):
    """How a connector's per-layer hooks behave under graphs (GRA-001)."""

    NO_LAYER_HOOKS = "no_layer_hooks"
    """The connector implements no per-layer hook. Safe under FULL graphs (DRY-003)."""
    EAGER = "eager"
    """Per-layer hooks run Python per step. The engine keeps them out of captured regions:
    PIECEWISE graphs only (GRA-002, GRA-003); they sit out dummy runs (DRY-004)."""
    CAPTURABLE = "capturable"
    """Per-layer hooks do pure device work on persistent buffers and may be captured, with
    metadata the connector builds itself for dummy runs (DRY-005, GRA-004, GRA-005)."""


class FailureReporting(enum.Enum):
    """How a connector reports failed loads."""

    NEVER_FAILS = "never_fails"
    """Loads cannot fail (for example a connector that moves nothing)."""
    INVALID_BLOCKS = "invalid_blocks"
    """Failed loads end as finished and failed receives plus invalid block ids (WRK-011)."""


def _orders(value: object) -> tuple[StrideOrder, ...]:
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
        raise InvalidArgumentError(
            f"accepted_layouts must be a tuple of StrideOrder or order names, got {value!r}",
            clause="LAY-001",
        )
    out: list[StrideOrder] = []
    for v in value:
        order = v if isinstance(v, StrideOrder) else StrideOrder.parse(v)
        if order not in out:
            out.append(order)
    return tuple(out)


def _group_kinds(value: object) -> frozenset[GroupKind]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (set, frozenset, tuple, list)):
        raise InvalidArgumentError(
            f"group_kinds must be a set of GroupKind or kind names, got {value!r}",
            clause="KVG-002")
    try:
        kinds = frozenset(v if isinstance(v, GroupKind) else GroupKind(v) for v in value)
    except (ValueError, TypeError):
        raise InvalidArgumentError(
            f"group_kinds must hold GroupKind values or names among "
            f"{[k.value for k in GroupKind]}, got {value!r}", clause="KVG-002") from None
    if not kinds:
        raise InvalidArgumentError("group_kinds must name at least one kind", clause="KVG-002")
    return kinds


def _block_sizes(value: object) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)) or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value):
        raise InvalidArgumentError(
            f"block_sizes must be a tuple of ints >= 1 (tokens per block), got {value!r}")
    return tuple(dict.fromkeys(value))


@attrs.frozen
class Capabilities:
    """Everything a connector declares about what it does.

    Attributes:
        async_loads: ``get_num_new_matched_tokens`` may return ``load_async=True``; the
            engine then waits for ``finished_recving`` before scheduling the request.
        delayed_free: ``request_finished`` may return True, holding blocks until
            ``finished_sending`` (SCH-016).
        layer_hooks: Per-layer hook behaviour under graphs (GRA-001).
        accepted_layouts: Stride orders the connector can move, in preference order (names
            such as ``"HND"`` are parsed); empty means every order (LAY-010).
        accepts_split_kv: The connector can move layouts with a K/V selector dim (LAY-002).
        heterogeneous_tp: Producer and consumer may run different TP sizes.
        failure_reporting: How failed loads are reported.
        kv_cache_groups: Most KV-cache groups (hybrid models) the connector supports.
        group_kinds: The kinds of KV-cache group it handles (KVG-002); full attention only
            by default. An engine with a group of another kind, or with more groups than
            ``kv_cache_groups``, must refuse the connector or run with one group
            (``check_groups``).
        custom_aggregator: The connector supplies its own executor aggregator (EXE-012).
        handles_preemptions: The connector implements ``handle_preemptions`` (WRK-012).
        needs_token_rows: The connector addresses single tokens or channels inside a page
            (partial-block copies, per-token reads). It cannot run on engines whose pages
            are opaque (vLLM-CPU); layout negotiation refuses it there (LAY-014).
        block_sizes: Tokens per block the connector works with, in preference order; empty
            (the default) means any. Engines and the suite run it at one of them (the suite
            at the first, with its workloads scaled so that every prompt keeps its full
            blocks). vLLM's connectors on vLLM-CPU, for one, run at multiples of 32, what
            the CPU attention backend pages.
        fault_injection: The connector honours ``EngineConfigView.extra["kvspec.faults"]``
            (``FaultPlan``): it can be told to fail its loads or
            stores, or to keep every transfer in flight for a while, so the conformance
            suite checks what it does when transfers fail or are slow.
        sleep_mode: The connector follows an engine's sleep and wake (WRK-018, WRK-019):
            ``unregister_kv_caches`` drops every registration of the KV tensors before they
            are freed, ``restore_kv_caches`` registers the tensors it is given at wake, which
            may lie at new addresses, and the handshake metadata it publishes after wake is
            the one peers must use (HSK-006). False by default: an engine refuses to sleep
            with a connector that does not declare it, naming the connector and this
            capability (WRK-020, ``check_sleep_mode``).
    """

    async_loads: bool = False
    delayed_free: bool = False
    layer_hooks: HookGraphMode = HookGraphMode.NO_LAYER_HOOKS
    accepted_layouts: tuple[StrideOrder, ...] = attrs.field(default=(), converter=_orders)
    accepts_split_kv: bool = True
    heterogeneous_tp: bool = False
    failure_reporting: FailureReporting = FailureReporting.NEVER_FAILS
    kv_cache_groups: int = 1
    group_kinds: frozenset[GroupKind] = attrs.field(
        default=frozenset({GroupKind.FULL}), converter=_group_kinds)
    custom_aggregator: bool = False
    handles_preemptions: bool = False
    needs_token_rows: bool = False
    fault_injection: bool = False
    block_sizes: tuple[int, ...] = attrs.field(default=(), converter=_block_sizes)
    sleep_mode: bool = False

    def __attrs_post_init__(self) -> None:
        for name in (
            "async_loads", "delayed_free", "accepts_split_kv", "heterogeneous_tp",
            "custom_aggregator", "handles_preemptions", "needs_token_rows", "fault_injection",
            "sleep_mode",
        ):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(
                    f"Capabilities.{name} must be a bool, got {getattr(self, name)!r}"
                )
        if not isinstance(self.layer_hooks, HookGraphMode):
            raise InvalidArgumentError(
                f"Capabilities.layer_hooks must be a HookGraphMode, got {self.layer_hooks!r}"
            )
        if not isinstance(self.failure_reporting, FailureReporting):
            raise InvalidArgumentError(
                "Capabilities.failure_reporting must be a FailureReporting, got "
                f"{self.failure_reporting!r}"
            )
        if isinstance(self.kv_cache_groups, bool) or not isinstance(self.kv_cache_groups, int) \
                or self.kv_cache_groups < 1:
            raise InvalidArgumentError(
                f"Capabilities.kv_cache_groups must be an int >= 1, got {self.kv_cache_groups!r}"
            )
        if self.async_loads and self.failure_reporting is FailureReporting.NEVER_FAILS:
            raise CapabilityError(
                "a connector with async_loads moves KV from outside the engine and can fail; "
                "declare failure_reporting=FailureReporting.INVALID_BLOCKS (WRK-011)",
                clause="WRK-011",
            )

    def check_groups(self, groups: Sequence[KVCacheGroup], connector: str = "the connector",
                     ) -> None:
        """Refuse an engine's KV-cache groups this declaration does not cover (KVG-002):
        ``check_groups(groups, self.group_kinds, self.kv_cache_groups)``.

        Raises:
            CapabilityError: a group of a kind not in ``group_kinds``, named, or more groups
                than ``kv_cache_groups``.
            InvalidArgumentError: ``groups`` malformed (KVG-001).
        """
        check_groups(groups, self.group_kinds, self.kv_cache_groups, connector=connector)

    def check_sleep_mode(self, connector: str = "the connector") -> None:
        """Refuse to put an engine to sleep with a connector that does not declare
        ``sleep_mode`` (WRK-020). Engines call it when sleep mode is configured, before the
        engine serves, and again before each sleep.

        Raises:
            CapabilityError: ``sleep_mode`` is False; the message names ``connector`` and
                the capability.
        """
        if not self.sleep_mode:
            raise CapabilityError(
                f"{connector} does not declare Capabilities.sleep_mode: it cannot follow "
                "an engine's sleep and wake (its registrations of the KV tensors would "
                "outlive the memory behind them); the engine refuses to sleep with it",
                clause="WRK-020",
            )

    @property
    def has_layer_hooks(self) -> bool:
        """True if the engine calls ``wait_for_layer_load`` and ``save_kv_layer``."""
        return self.layer_hooks is not HookGraphMode.NO_LAYER_HOOKS

    def layout_offer(self) -> LayoutOffer:
        """The connector's side of layout negotiation (LAY-010), from this declaration.

        Orders are ``accepted_layouts`` (empty: any); packings are both when
        ``accepts_split_kv``, otherwise concatenated K/V only; ``needs_token_rows`` as
        declared (LAY-014).
        """
        packings = () if self.accepts_split_kv else (KVPacking.CONCAT,)
        return LayoutOffer("connector", self.accepted_layouts, packings,
                           needs_token_rows=self.needs_token_rows)

    def describe(self) -> dict[str, object]:
        """Plain-data form for report headers and JSON reports."""
        out: dict[str, object] = {}
        for f in attrs.fields(Capabilities):
            v = getattr(self, f.name)
            if isinstance(v, frozenset):
                out[f.name] = sorted(x.value for x in v)
            elif isinstance(v, tuple):
                out[f.name] = [x.value if isinstance(x, enum.Enum) else x for x in v]
            else:
                out[f.name] = v.value if isinstance(v, enum.Enum) else v
        return out
