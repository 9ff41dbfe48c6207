"""vLLM's offline ``LLM`` with a kvspec connector (or one of vLLM's), in this process.

The engine processes of ``kvspec.bench.vllm_engine`` (which the benchmarks, the demo and
the vLLM tests start) build their engine, generate and reach its connectors through these
functions: of that tooling, only this module imports vLLM. vLLM run in-process rewrites
``os.environ`` and torch's threading, so a process should hold one such engine and little
else.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from . import transfer_config

__all__ = ["engine_connectors", "generate", "offline_llm"]


def offline_llm(model: str, *, factory: str | None = None, kv_role: str = "kv_both",
                engine_id: str | None = None, extra: Mapping[str, Any] | None = None,
                vllm_connector: Mapping[str, Any] | None = None, **engine_args: Any) -> Any:
    """A ``vllm.LLM`` of ``model`` running the kvspec connector ``factory``
    (``"pkg.module:Factory"``, through ``transfer_config`` with ``kv_role``, ``engine_id``
    and ``extra``), or else vLLM's own connector of the ``KVTransferConfig`` fields
    ``vllm_connector``, or none; ``engine_args`` go to ``LLM`` as they are."""
    from vllm import LLM

    kwargs = dict(engine_args)
    if factory:
        kwargs["kv_transfer_config"] = transfer_config(factory, kv_role, engine_id=engine_id,
                                                       **dict(extra or {}))
    elif vllm_connector:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**vllm_connector)
    return LLM(model=model, **kwargs)


def generate(llm: Any, prompts: Sequence[Sequence[int]], *, max_tokens: int = 8,
             kv_transfer_params: Sequence[Mapping[str, Any] | None] | None = None,
             batch: bool = False, ignore_eos: bool = True) -> list[dict[str, Any]]:
    """Generate greedily for each prompt (token ids), one request at a time (per-request
    latency) or, with ``batch``, all at once (requests share steps and may preempt each
    other); per request ``tokens``, ``num_cached_tokens``, ``kv_transfer_params``,
    ``seconds``, vLLM's ``ttft`` and, with speculative decoding and vLLM's per-request
    metrics on (``per_request_spec_decode_metrics``), ``spec_decode``: its acceptance
    counts (``num_draft_tokens``, ``num_accepted_draft_tokens``, ...), else None."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = kv_transfer_params or [None] * len(prompts)
    sampling = [SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False,
                               ignore_eos=ignore_eos,
                               extra_args={"kv_transfer_params": p} if p is not None else None)
                for p in params]
    if batch:
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                            sampling, use_tqdm=False)
        timed = [(o, time.perf_counter() - t0) for o in outs]
    else:
        timed = []
        for prompt, sp in zip(prompts, sampling):
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], sp,
                               use_tqdm=False)[0]
            timed.append((out, time.perf_counter() - t0))
    return [{"tokens": list(out.outputs[0].token_ids),
             "num_cached_tokens": out.num_cached_tokens,
             "kv_transfer_params": out.kv_transfer_params,
             "seconds": elapsed,
             "ttft": getattr(getattr(out, "metrics", None), "first_token_latency", None),
             "spec_decode": _spec_decode(out)}
            for out, elapsed in timed]


def _spec_decode(out: Any) -> dict[str, Any] | None:
    metrics = getattr(out.outputs[0], "spec_decode_metrics", None)
    return None if metrics is None else dict(metrics.to_dict())


def engine_connectors(llm: Any) -> list[Any]:
    """The connectors of an in-process ``llm`` (vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
    its scheduler-side connector and, in this process, its worker-side one; whichever
    exist, any V1 connector."""
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    found = [llm.llm_engine.engine_core.engine_core.scheduler.connector]
    if has_kv_transfer_group():
        found.append(get_kv_transfer_group())
    return [c for c in found if c is not None]
