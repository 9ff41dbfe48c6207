"""Dummy-run and graph semantics as types: what the engine binds and calls in each forward.

``plan_forward`` is the DRY and GRA clauses in executable form. Engines and the
conformance harness call it for every forward and do exactly what the returned
``ForwardPlan`` says; connector authors can read it to know what to expect.
"""

from __future__ import annotations

import enum

import attrs

from .capabilities import HookGraphMode
from .errors import CapabilityError, InvalidArgumentError
from .views import ForwardKind

__all__ = [
    "ForwardPlan",
    "GraphMode",
    "GraphModeDecision",
    "HookPlacement",
    "MetadataBinding",
    "plan_forward",
    "resolve_graph_mode",
]


class GraphMode(enum.Enum):
    """The engine's graph mode for the model forward."""

    NONE = "none"
    """Everything eager; no capture, no replay."""
    PIECEWISE = "piecewise"
    """Everything but attention and connector per-layer hooks is captured (GRA-003)."""
    FULL = "full"
    """The whole forward is captured, attention and captured hooks included."""


class MetadataBinding(enum.Enum):
    """What connector metadata the engine binds around a forward."""

    NONE = "none"
    """Nothing is bound; therefore no worker hook is called (DRY-001)."""
    STEP = "step"
    """The metadata ``build_connector_meta`` built for the step (WRK-003)."""
    DUMMY = "dummy"
    """Metadata the worker built with ``build_dummy_connector_meta`` (DRY-005)."""


class HookPlacement(enum.Enum):
    """How the per-layer hooks take part in a forward."""

    NOT_CALLED = "not_called"
    EAGER = "eager"
    """Called from Python at their place in every layer."""
    CAPTURED = "captured"
    """Called once while a graph records them; their device work is recorded."""
    REPLAYED = "replayed"
    """Not called: their recorded device work re-runs as part of the graph."""


@attrs.frozen
class GraphModeDecision:
    """The graph mode an engine runs with, and why (GRA-002)."""

    requested: GraphMode
    effective: GraphMode
    reason: str

    @property
    def downgraded(self) -> bool:
        """True when the engine runs a weaker mode than requested."""
        return self.requested is not self.effective


def resolve_graph_mode(
    requested: GraphMode, hooks: HookGraphMode, *, strict: bool = False
) -> GraphModeDecision:
    """Decide the graph mode for a connector with the given hook behaviour (GRA-002).

    FULL graphs with eager per-layer hooks would skip the hooks at every replay (vLLM issue
    29608). Such a request is downgraded to PIECEWISE, or refused when ``strict``.

    Raises:
        CapabilityError: ``strict`` and FULL was requested for eager hooks.
        InvalidArgumentError: an argument is not of its enum type.
    """
    if not isinstance(requested, GraphMode):
        raise InvalidArgumentError(f"requested must be a GraphMode, got {requested!r}")
    if not isinstance(hooks, HookGraphMode):
        raise InvalidArgumentError(f"hooks must be a HookGraphMode, got {hooks!r}")
    if requested is GraphMode.FULL and hooks is HookGraphMode.EAGER:
        reason = (
            "FULL graphs would skip the connector's eager per-layer hooks at replay "
            "(GRA-002, vLLM issue 29608)"
        )
        if strict:
            raise CapabilityError(
                f"refusing FULL graph mode: {reason}; declare capturable hooks or use PIECEWISE",
                clause="GRA-002",
            )
        return GraphModeDecision(requested, GraphMode.PIECEWISE, "downgraded to PIECEWISE: " + reason)
    return GraphModeDecision(requested, requested, "as requested")


@attrs.frozen
class ForwardPlan:
    """What the engine does with the connector around one forward.

    Attributes:
        kind: Why the forward runs.
        graph_mode: The effective graph mode.
        binding: What metadata is bound before and cleared after the forward.
        start_load: Whether ``start_load_kv`` is called (eagerly, GRA-007).
        layer_hooks: How ``wait_for_layer_load`` and ``save_kv_layer`` take part.
        wait_for_save: Whether ``wait_for_save`` is called (eagerly, GRA-007).
        collect_output: Whether ``get_finished`` and the other output hooks are called and the
            result aggregated into the step's output (DRY-008).
        clauses: The clauses that decide this plan.
    """

    kind: ForwardKind
    graph_mode: GraphMode
    binding: MetadataBinding
    start_load: bool
    layer_hooks: HookPlacement
    wait_for_save: bool
    collect_output: bool
    clauses: tuple[str, ...]

    @property
    def calls_connector(self) -> bool:
        """True if any worker hook of the connector runs in this forward."""
        return self.binding is not MetadataBinding.NONE


def plan_forward(kind: ForwardKind, graph_mode: GraphMode, hooks: HookGraphMode) -> ForwardPlan:
    """Return what the engine binds and calls for one forward.

    ``graph_mode`` is the effective mode from ``resolve_graph_mode``.

    Raises:
        InvalidArgumentError: CAPTURE or REPLAY with ``GraphMode.NONE``, or a non-enum argument.
        CapabilityError: FULL mode with eager hooks (GRA-002): resolve the mode first.
    """
    if not isinstance(kind, ForwardKind):
        raise InvalidArgumentError(f"kind must be a ForwardKind, got {kind!r}")
    if not isinstance(graph_mode, GraphMode):
        raise InvalidArgumentError(f"graph_mode must be a GraphMode, got {graph_mode!r}")
    if not isinstance(hooks, HookGraphMode):
        raise InvalidArgumentError(f"hooks must be a HookGraphMode, got {hooks!r}")
    if graph_mode is GraphMode.NONE and kind in (ForwardKind.CAPTURE, ForwardKind.REPLAY):
        raise InvalidArgumentError(
            f"a {kind.value} forward needs a graph mode; GraphMode.NONE runs everything eagerly"
        )
    if graph_mode is GraphMode.FULL and hooks is HookGraphMode.EAGER:
        raise CapabilityError(
            "FULL graph mode with eager per-layer hooks loses the hooks at replay; "
            "call resolve_graph_mode() first",
            clause="GRA-002",
        )

    def plan(
        binding: MetadataBinding, layer: HookPlacement, collect: bool, *clauses: str
    ) -> ForwardPlan:
        on = binding is not MetadataBinding.NONE
        if hooks is HookGraphMode.NO_LAYER_HOOKS:
            layer = HookPlacement.NOT_CALLED
            clauses = (*clauses, "DRY-003")
        return ForwardPlan(kind, graph_mode, binding, on, layer, on, collect, clauses)

    if kind is ForwardKind.PROFILE:
        return plan(MetadataBinding.NONE, HookPlacement.NOT_CALLED, False, "DRY-002")
    if kind in (ForwardKind.WARMUP, ForwardKind.CAPTURE):
        if hooks is not HookGraphMode.CAPTURABLE:
            return plan(MetadataBinding.NONE, HookPlacement.NOT_CALLED, False, "DRY-001", "DRY-004")
        in_graph = kind is ForwardKind.CAPTURE and graph_mode is GraphMode.FULL
        layer = HookPlacement.CAPTURED if in_graph else HookPlacement.EAGER
        return plan(MetadataBinding.DUMMY, layer, False, "DRY-005", "DRY-006", "DRY-008", "GRA-007")
    if kind is ForwardKind.REPLAY:
        if hooks is HookGraphMode.CAPTURABLE and graph_mode is GraphMode.FULL:
            layer = HookPlacement.REPLAYED
        else:
            layer = HookPlacement.EAGER
        return plan(MetadataBinding.STEP, layer, True, "WRK-003", "GRA-003", "GRA-006", "GRA-007")
    return plan(MetadataBinding.STEP, HookPlacement.EAGER, True, "WRK-003", "WRK-004", "WRK-005")
