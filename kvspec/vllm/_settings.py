"""What the adapter reads from vLLM's configuration: the factory and the engine view.

The adapter is configured the vLLM way, through ``KVTransferConfig``; its own keys live in
``kv_connector_extra_config`` next to the connector's settings:

* ``kvspec_factory`` (required): ``"pkg.module:Factory"``, the kvspec connector to run;
* everything else passes through, unchanged, as ``EngineConfigView.extra``.

Nothing here imports vLLM: the functions take the config objects vLLM hands the connector
and read plain attributes off them, so they can be checked with any object of that shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvspec.protocols import (
    CapabilityError,
    ConnectorFactory,
    EngineConfigView,
    GroupKind,
    InvalidArgumentError,
    TransferRole,
    load_factory,
)

from ._groups import groups_of

__all__ = [
    "ADAPTER_KEYS",
    "FACTORY_KEY",
    "engine_config_view",
    "factory_from_extra",
    "transfer_role",
]

FACTORY_KEY = "kvspec_factory"
"""The ``kv_connector_extra_config`` key naming the kvspec connector factory."""

ADAPTER_KEYS = frozenset({FACTORY_KEY})
"""Extra-config keys the adapter consumes; every other key reaches the connector."""

_ROLES = {
    "kv_producer": TransferRole.PRODUCER,
    "kv_consumer": TransferRole.CONSUMER,
    "kv_both": TransferRole.BOTH,
}

_FACTORIES: dict[str, ConnectorFactory] = {}


def _extra(extra: object) -> Mapping[str, Any]:
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise InvalidArgumentError(
            f"kv_connector_extra_config must be a mapping, got {type(extra).__name__}",
            clause="ERR-002",
        )
    return extra


def factory_from_extra(extra: object) -> ConnectorFactory:
    """The factory ``extra[kvspec_factory]`` names, loaded once per process.

    Raises:
        InvalidArgumentError: the key is missing or not a ``"pkg.module:Factory"`` string,
            or the factory cannot be loaded (the message says why).
    """
    spec = _extra(extra).get(FACTORY_KEY)
    if not isinstance(spec, str) or not spec:
        raise InvalidArgumentError(
            f"KVSpecConnector needs kv_connector_extra_config[{FACTORY_KEY!r}] = "
            f"'pkg.module:Factory' naming a kvspec connector factory, got {spec!r}",
            clause="ERR-002",
        )
    factory = _FACTORIES.get(spec)
    if factory is None:
        factory = _FACTORIES[spec] = load_factory(spec)
    return factory


def transfer_role(kv_role: object) -> TransferRole:
    """vLLM's ``kv_role`` as a ``TransferRole``.

    Raises:
        InvalidArgumentError: ``kv_role`` is not one of vLLM's three roles.
    """
    role = _ROLES.get(kv_role) if isinstance(kv_role, str) else None
    if role is None:
        raise InvalidArgumentError(
            f"kv_role is {kv_role!r}; expected one of {', '.join(sorted(_ROLES))}",
            clause="ERR-002",
        )
    return role


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(
            f"vLLM's {name} is {value!r}; expected an int >= 1", clause="ERR-002"
        )
    return value


def engine_config_view(vllm_config: Any, kv_cache_config: Any) -> EngineConfigView:
    """The ``EngineConfigView`` of a vLLM engine, from its ``VllmConfig`` and
    ``KVCacheConfig`` (the two objects vLLM passes a connector's constructor).

    ``num_layers`` counts the attention layers of every KV-cache group (not a state
    group's: those are registered with ``register_state_caches``, STG-001), ``num_blocks`` is
    the KV-cache config's block budget (LAY-003), ``extra`` is the extra config without the
    adapter's own keys, ``kv_cache_groups`` vLLM's groups when there are several or the one
    is not full attention (KVG-001; vLLM's hybrid allocator is on).

    Raises:
        InvalidArgumentError: a field vLLM should have set is missing or malformed, or the
            extra config is not JSON-representable plain data (SCH-018).
        CapabilityError: a group kvspec cannot describe (``groups_of``, KVG-001).
    """
    xfer = getattr(vllm_config, "kv_transfer_config", None)
    if xfer is None:
        raise InvalidArgumentError(
            "vllm_config.kv_transfer_config is None; KVSpecConnector runs only as a "
            "configured KV connector", clause="ERR-002",
        )
    if kv_cache_config is None:
        raise InvalidArgumentError(
            "KVSpecConnector needs the KVCacheConfig vLLM passes its constructor (vLLM 0.32 "
            "and newer); got None", clause="ERR-002",
        )
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    # Attention layers only: a state group's layers are registered apart (STG-001).
    num_layers = sum(len(getattr(g, "layer_names", ())) for g in groups
                     if type(getattr(g, "kv_cache_spec", None)).__name__ != "MambaSpec")
    if groups and not num_layers:
        raise CapabilityError(
            "vLLM's model has state layers only (every KV-cache group is a MambaSpec); "
            "kvspec's KV layout needs at least one attention layer to describe the shared "
            "cache buffer, so pure state-space models (Mamba, Mamba2) are not supported yet",
            clause="STG-001")
    first = getattr(groups[0], "kv_cache_spec", None) if groups else None
    described = groups_of(kv_cache_config) if len(groups) > 1 or (
        first is not None and type(first).__name__ != "FullAttentionSpec") else ()
    if len(described) == 1 and described[0].kind is GroupKind.FULL:
        described = ()  # one full-attention group (an MLA spec, say): the default
    parallel = vllm_config.parallel_config
    extra = {k: v for k, v in _extra(xfer.kv_connector_extra_config).items()
             if k not in ADAPTER_KEYS}
    engine_id = xfer.engine_id
    if not isinstance(engine_id, str) or not engine_id:
        raise InvalidArgumentError(
            f"kv_transfer_config.engine_id is {engine_id!r}; expected a non-empty str",
            clause="ERR-002",
        )
    return EngineConfigView(
        engine_id=engine_id,
        role=transfer_role(xfer.kv_role),
        num_layers=_positive("number of attention layers", num_layers),
        block_size=_positive("cache_config.block_size", vllm_config.cache_config.block_size),
        num_blocks=_positive("kv_cache_config.num_blocks", kv_cache_config.num_blocks),
        tp_size=_positive("tensor_parallel_size", parallel.tensor_parallel_size),
        pp_size=_positive("pipeline_parallel_size", parallel.pipeline_parallel_size),
        extra=extra,
        async_scheduling=bool(getattr(getattr(vllm_config, "scheduler_config", None),
                                      "async_scheduling", False)),
        kv_cache_groups=described,
    )
