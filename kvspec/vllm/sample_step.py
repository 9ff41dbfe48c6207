"""The vLLM adapter's per-step translations on a sample step of real vLLM objects.

``adapter_step_parts`` builds a step that touches ``blocks`` KV blocks (one request whose
prompt fills them, plus ``running`` decoding requests) and returns, as callables, each
translation ``KVSpecConnector`` makes in such a step: vLLM objects to kvspec views, the step
metadata's wire wrapping and unwrapping, the forward-context view, and the outputs both
ways; plus vLLM's own work for the same request, for scale. ``kvspec bench vllm-adapter``
(``kvspec.bench.vllm_adapter``) times them. Needs vLLM.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

__all__ = ["FIRST_SIGHT", "AdapterStep", "adapter_step_parts"]

FIRST_SIGHT = "request view, first sight (copies the prompt and hashes)"
"""The part that runs only in a request's first step."""


@attrs.frozen
class AdapterStep:
    """The adapter's translations of one sample step (see ``adapter_step_parts``).

    Attributes:
        blocks: KV blocks the step touches; ``block_size`` tokens each.
        block_size: Tokens per block.
        running: Decoding requests in the step.
        parts: Each translation, by name, as a callable that runs it once.
        vllm_own: vLLM's own NewRequestData and get_block_ids for the big request.
        vllm_version: The vLLM version the objects come from.
    """

    blocks: int
    block_size: int
    running: int
    parts: dict[str, Callable[[], object]]
    vllm_own: Callable[[], object]
    vllm_version: str


def adapter_step_parts(blocks: int = 256, block_size: int = 32, running: int = 32
                       ) -> AdapterStep:
    """The adapter's translations of a ``blocks``-block step with ``running`` decoding
    requests, as callables (see the module docstring)."""
    import vllm
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvspec.protocols import ConnectorStats, ForwardContextView, ForwardKind, HandshakeMetadata

    from ._translate import RequestCache, output_from_vllm
    from ._wire import StatsWire, StepWire, WorkerMetaWire, metadata_type

    tokens = blocks * block_size
    big = Request("big", [(i * 7) % 30000 + 1 for i in range(tokens)],
                  SamplingParams(max_tokens=1), None)
    big.block_hashes = [i.to_bytes(8, "little") * 4 for i in range(1, blocks + 1)]
    decoding = []
    for r in range(running):
        req = Request(f"run{r}", list(range(1, 2 * block_size + 2)),
                      SamplingParams(max_tokens=64), None)
        req.block_hashes = [bytes([r % 250 + 1]) * 32, bytes([r % 250 + 2]) * 32]
        req.num_computed_tokens = 2 * block_size + 1
        decoding.append(req)
    kv_blocks = KVCacheBlocks((tuple(KVCacheBlock(b) for b in range(1, blocks + 1)),))
    so = SchedulerOutput.make_empty()
    so.scheduled_new_reqs = [NewRequestData.from_request(big, kv_blocks.get_block_ids())]
    so.scheduled_cached_reqs = CachedRequestData(
        req_ids=[r.request_id for r in decoding], resumed_req_ids=set(),
        new_token_ids=[[5]] * running, all_token_ids={},
        new_block_ids=[None] * running, num_computed_tokens=[2 * block_size + 1] * running,
        num_output_tokens=[1] * running)
    so.num_scheduled_tokens = {"big": tokens, **{r.request_id: 1 for r in decoding}}
    so.total_num_scheduled_tokens = tokens + running
    layers = tuple(f"model.layers.{i}.self_attn.attn" for i in range(32))
    out = KVConnectorOutput(finished_sending={"run1"}, finished_recving={"big"},
                            kv_connector_stats=StatsWire.of(ConnectorStats({"loads": 1})),
                            kv_connector_worker_meta=WorkerMetaWire(None, ()))

    cache = RequestCache()
    cache.view(big)
    for r in decoding:
        cache.view(r)

    def fresh_view() -> object:
        return RequestCache().view(big)

    def hooks_views() -> object:
        # one step's scheduler hooks that take a request: the big one is matched, allocated
        # and (next step) running; each decoding request is seen by build only.
        cache.view(big)
        return cache.view(big)

    def alloc() -> object:  # update_state_after_alloc: checked and remembered
        return cache.blocks("big", kv_blocks.get_block_ids(), 1)

    remembered = cache.blocks("big", kv_blocks.get_block_ids(), 1)

    def sched_out() -> object:  # build_connector_meta, after that allocation
        cache._blocks["big"] = remembered  # what alloc() left, which each build consumes
        return cache.scheduler_output(so, 1, 1)

    payload = bytes(24 * blocks)  # a connector's encoded metadata: ~3 int64 per block
    path = f"{HandshakeMetadata.__module__}:{HandshakeMetadata.__qualname__}"  # has decode()

    def wrap() -> object:
        return StepWire(payload, path, 1, tokens + running, frozenset())

    def unwrap() -> object:
        wire = StepWire(payload, path, 1, tokens + running, frozenset())
        metadata_type(wire.meta_type)
        return ForwardContextView(ForwardKind.REAL, wire.step_id, wire.num_tokens, layers)

    def outputs() -> object:
        stats = out.kv_connector_stats
        return output_from_vllm(out, stats.kvspec if isinstance(stats, StatsWire) else None,
                                None, ())

    return AdapterStep(
        blocks=blocks, block_size=block_size, running=running,
        parts={
            FIRST_SIGHT: fresh_view,
            "request views, cached (2 hooks)": hooks_views,
            "allocated blocks": alloc,
            "scheduler output view": sched_out,
            "step metadata wrap (scheduler)": wrap,
            "step metadata unwrap + forward view (worker)": unwrap,
            "connector output, vLLM to kvspec": outputs,
        },
        vllm_own=lambda: (NewRequestData.from_request(big, kv_blocks.get_block_ids()),
                          kv_blocks.get_block_ids()),
        vllm_version=vllm.__version__,
    )
