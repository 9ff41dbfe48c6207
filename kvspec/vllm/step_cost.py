"""What the vLLM adapter adds to one engine step (``kvspec bench vllm-adapter`` prints it).

Builds real vLLM objects for a step that touches ``blocks`` KV blocks (one request whose
prompt fills them, plus ``running`` decoding requests), runs the adapter's translations on
them the way ``KVSpecConnector`` does in one step, and times each part: medians of
``repeats`` runs. The connector's own hooks are not timed, only what the adapter adds:
vLLM objects to kvspec views, the step metadata's wire wrapping and unwrapping, the
forward-context view, and the outputs both ways. Needs vLLM (the CLI re-runs itself under
the vLLM environment for it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["measure"]


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def measure(blocks: int = 256, block_size: int = 32, running: int = 32,
            repeats: int = 200) -> dict[str, Any]:
    """Time the adapter's per-step translations for a ``blocks``-block step; returns the
    microseconds of each part and their sum, and the ``vllm`` version measured."""
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

    parts = {
        "request view, first sight (copies the prompt and hashes)": _median_us(fresh_view,
                                                                              repeats),
        "request views, cached (2 hooks)": _median_us(hooks_views, repeats),
        "allocated blocks": _median_us(alloc, repeats),
        "scheduler output view": _median_us(sched_out, repeats),
        "step metadata wrap (scheduler)": _median_us(wrap, repeats),
        "step metadata unwrap + forward view (worker)": _median_us(unwrap, repeats),
        "connector output, vLLM to kvspec": _median_us(outputs, repeats),
    }
    steady = sum(v for k, v in parts.items() if "first sight" not in k)
    return {"blocks": blocks, "block_size": block_size, "running": running,
            "repeats": repeats, "parts_us": parts,
            "per_step_us": steady,
            "per_step_us_with_new_request": steady + parts[
                "request view, first sight (copies the prompt and hashes)"],
            "vllm_own_us": _median_us(
                lambda: (NewRequestData.from_request(big, kv_blocks.get_block_ids()),
                         kv_blocks.get_block_ids()), repeats),
            "vllm": vllm.__version__}
