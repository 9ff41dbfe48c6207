"""Capability names into checks; re-exports the factory loader of ``kvspec.protocols``.

A connector under test is named by a *spec* (``"pkg.module:Name"``, a class or an instance);
``load_factory`` and ``factory_spec`` live in ``kvspec.protocols._loading`` because
engines (the vLLM adapter) load factories the same way.
"""

from __future__ import annotations

import attrs

from ..protocols._loading import factory_spec, load_factory
from ..protocols.capabilities import Capabilities, FailureReporting, HookGraphMode
from ..protocols.errors import InvalidArgumentError

__all__ = ["capability_names", "factory_spec", "has_capability", "load_factory"]

_DERIVED = {
    "layer_hooks": "the connector has per-layer hooks (layer_hooks is EAGER or CAPTURABLE)",
    "capturable_hooks": "layer_hooks is CAPTURABLE",
    "eager_hooks": "layer_hooks is EAGER",
    "reports_failures": "failure_reporting is INVALID_BLOCKS",
    "multiple_kv_cache_groups": "kv_cache_groups > 1",
}


def _bool_fields() -> tuple[str, ...]:
    return tuple(f.name for f in attrs.fields(Capabilities) if f.type in ("bool", bool))


def capability_names() -> tuple[str, ...]:
    """Every name ``has_capability`` and ``@pytest.mark.kvspec_requires`` accept.

    They are the bool fields of ``Capabilities`` (true means the
    connector has the capability) plus the derived names ``layer_hooks`` (per-layer hooks),
    ``capturable_hooks``, ``eager_hooks``, ``reports_failures`` (failure_reporting is
    INVALID_BLOCKS) and ``multiple_kv_cache_groups`` (kv_cache_groups > 1).
    """
    return _bool_fields() + tuple(_DERIVED)


def has_capability(caps: Capabilities, name: str) -> bool:
    """Say whether a declaration includes the named capability.

    See ``capability_names`` for the names. This is the one place that maps names to
    declarations: the suite's ``kvspec_requires`` marker uses it.

    Raises:
        InvalidArgumentError: ``name`` is not a capability name.
    """
    if name in _bool_fields():
        return bool(getattr(caps, name))
    if name == "layer_hooks":
        return caps.has_layer_hooks
    if name == "capturable_hooks":
        return caps.layer_hooks is HookGraphMode.CAPTURABLE
    if name == "eager_hooks":
        return caps.layer_hooks is HookGraphMode.EAGER
    if name == "reports_failures":
        return caps.failure_reporting is FailureReporting.INVALID_BLOCKS
    if name == "multiple_kv_cache_groups":
        return caps.kv_cache_groups > 1
    raise InvalidArgumentError(
        f"unknown capability name {name!r}; known: {', '.join(capability_names())}"
    )
