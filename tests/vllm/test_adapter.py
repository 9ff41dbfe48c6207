"""The adapter's parts against real vLLM objects: signatures, translation, layout, wire
objects and what it refuses. Engines are started only where a refusal must be seen end to end."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from conftest import engine

from kvspec.protocols import (
    Capabilities,
    ConnectorStats,
    InvalidArgumentError,
    KVPacking,
    LayoutMismatchError,
    LayoutNegotiationError,
    MalformedMetadataError,
    RequestStatus,
    StrideOrder,
)
from kvspec.vllm._layout import describe_kv_caches, required_layout_name
from kvspec.vllm._settings import engine_config_view, factory_from_extra, transfer_role
from kvspec.vllm._translate import RequestCache, output_from_vllm, request_status

vllm_base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

OFFLOAD = "kvspec.backends.offload:OffloadConnector"


def test_overrides_keep_vllm_signatures_and_cover_every_abstract_hook() -> None:
    """The adapter is a drop-in KVConnectorBase_V1 of the installed vLLM."""
    from kvspec.vllm import KVSpecConnector

    base = vllm_base.KVConnectorBase_V1
    abstract = {n for n, v in vars(base).items() if getattr(v, "__isabstractmethod__", False)}
    assert abstract and not KVSpecConnector.__abstractmethods__
    checked = 0
    for name, ours in vars(KVSpecConnector).items():
        theirs = getattr(base, name, None)
        if name.startswith("_") or theirs is None or not callable(theirs):
            continue
        ours_fn = getattr(KVSpecConnector, name)
        want = list(inspect.signature(theirs).parameters)
        got = list(inspect.signature(ours_fn).parameters)
        assert got[:len(want)] == want, (name, want, got)
        checked += 1
    assert checked >= 25


def _request(rid: str = "r1", n: int = 70, **kw: Any) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    req = Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4), None, **kw)
    req.block_hashes = [bytes([i + 1]) * 8 for i in range(n // 32)]
    return req


def test_requests_become_views_and_are_cached_until_they_change() -> None:
    cache = RequestCache()
    req = _request(cache_salt="tenant-a")
    view = cache.view(req)
    assert view.request_id == "r1" and view.num_prompt_tokens == 70
    assert view.cache_salt == "tenant-a" and len(view.block_hashes) == 2
    assert cache.view(req) is view
    req.num_computed_tokens = 64
    assert cache.view(req).num_computed_tokens == 64
    from vllm.v1.request import RequestStatus as V

    assert request_status(V.FINISHED_ABORTED) is RequestStatus.ABORTED
    assert request_status(V.FINISHED_LENGTH_CAPPED) is RequestStatus.FINISHED
    assert request_status(V.WAITING_FOR_REMOTE_KVS) is RequestStatus.WAITING_FOR_REMOTE_KV


def test_hostile_transfer_params_fail_typed() -> None:
    """SCH-018: a client's kv_transfer_params must be JSON data; anything else is refused
    with a typed error naming the field, before any connector sees it."""
    req = _request()
    req.kv_transfer_params = {"peers": {1: "x"}}  # a non-str key
    with pytest.raises(InvalidArgumentError, match="kv_transfer_params"):
        RequestCache().view(req)
    req.kv_transfer_params = {"x": float("nan")}
    with pytest.raises(InvalidArgumentError, match="NaN"):
        RequestCache().view(req)


def test_scheduler_output_translates_new_and_cached_requests() -> None:
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    cache = RequestCache()
    req = _request()
    cache.view(req)
    so = SchedulerOutput.make_empty()
    so.scheduled_new_reqs = [NewRequestData.from_request(req, ([3, 4, 5],))]
    so.scheduled_cached_reqs = CachedRequestData(
        req_ids=["old"], resumed_req_ids={"old"}, new_token_ids=[[9]], all_token_ids={},
        new_block_ids=[None], num_computed_tokens=[40], num_output_tokens=[1])
    so.num_scheduled_tokens = {"r1": 70, "old": 1}
    so.total_num_scheduled_tokens = 71
    so.preempted_req_ids = {"gone"}
    view = cache.scheduler_output(so, 7, 1)
    assert view.step_id == 7 and view.total_num_scheduled_tokens == 71
    assert view.scheduled_new_reqs[0].request.block_hashes == tuple(req.block_hashes)
    assert view.scheduled_new_reqs[0].blocks.block_ids(0) == (3, 4, 5)
    old = view.scheduled_cached_reqs[0]
    assert old.resumed_from_preemption and old.new_blocks.block_ids(0) == ()
    assert view.preempted_req_ids == frozenset({"gone"})


def test_blocks_checked_at_allocation_are_reused_only_when_the_step_names_the_same() -> None:
    """ERR-003: the step's scheduler output reuses the allocation's checked blocks only
    when they are equal; other blocks are checked again, and a negative id still fails."""
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    from kvspec.protocols import InvalidBlockIdError

    cache = RequestCache()
    req = _request()
    cache.view(req)
    alloc = cache.blocks("r1", ([3, 4, 5],), 1)

    def step(block_ids: tuple[list[int], ...]) -> Any:
        so = SchedulerOutput.make_empty()
        so.scheduled_new_reqs = [NewRequestData.from_request(req, block_ids)]
        so.num_scheduled_tokens = {"r1": 70}
        return cache.scheduler_output(so, 1, 1).scheduled_new_reqs[0].blocks

    assert step(([3, 4, 5],)) is alloc  # the same blocks: not checked twice
    cache.blocks("r1", ([3, 4, 5],), 1)
    other = step(([3, 4, 6],))
    assert other is not alloc and other.block_ids(0) == (3, 4, 6)
    cache.blocks("r1", ([3, 4, 5],), 1)
    with pytest.raises(InvalidBlockIdError):
        step(([3, -4, 5],))
    cache.blocks("r1", ([1],), 1)
    cache.forget("r1")
    assert cache._blocks == {}  # nothing kept for a finished request


def test_running_requests_translate_like_the_views_constructor_and_fail_typed() -> None:
    """The bulk-checked path of the running requests builds exactly the views the
    checking constructor builds; a bad column raises the constructor's typed error."""
    from vllm.v1.core.sched.output import CachedRequestData

    from kvspec.protocols import AllocatedBlocks, CachedRequestView, InvalidBlockIdError
    from kvspec.vllm._translate import _cached_views

    def data(**over: Any) -> Any:
        cols: dict[str, Any] = dict(
            req_ids=["a", "b", "c"], resumed_req_ids={"b"}, new_token_ids=[[9], [], [1, 2]],
            all_token_ids={}, new_block_ids=[None, ([7, 8],), ([],)],
            num_computed_tokens=[40, 0, 3], num_output_tokens=[1, 1, 1])
        return CachedRequestData(**{**cols, **over})

    want = [CachedRequestView("a", AllocatedBlocks(((),)), 40, (9,), False),
            CachedRequestView("b", AllocatedBlocks(((7, 8),)), 0, (), True),
            CachedRequestView("c", AllocatedBlocks(((),)), 3, (1, 2), False)]
    assert _cached_views(data(), 1) == want
    no_tokens = _cached_views(data(new_token_ids=[]), 1)  # vLLM without PP sends none
    assert [v.new_token_ids for v in no_tokens] == [(), (), ()]
    for bad in (dict(req_ids=["a", "", "c"]), dict(num_computed_tokens=[40, -1, 3]),
                dict(num_computed_tokens=[40, True, 3]), dict(new_token_ids=[[9], [-2], []]),
                dict(new_token_ids=[[9], [1.0], []]), dict(new_token_ids=[[9], 5, []])):
        with pytest.raises(InvalidArgumentError):
            _cached_views(data(**bad), 1)
    with pytest.raises(InvalidBlockIdError):
        _cached_views(data(new_block_ids=[None, ([-1],), None]), 1)


def test_outputs_translate_with_failed_receives() -> None:
    from vllm.v1.outputs import KVConnectorOutput

    out = output_from_vllm(KVConnectorOutput(finished_recving={"a", "b"}, failed_recving={"b"},
                                             invalid_block_ids={3}), None, None, ())
    assert out.finished_recving == {"a", "b"} and out.failed_recving == {"b"}
    assert out.invalid_block_ids == {3}
    with pytest.raises(InvalidArgumentError, match="EVT-002|finished_recving"):
        output_from_vllm(KVConnectorOutput(failed_recving={"x"}), None, None, ())


def _cpu_caches(layers: int = 2, blocks: int = 8) -> dict[str, torch.Tensor]:
    buf = torch.zeros(layers, blocks, 2, 32, 128)
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(layers)}


def test_vllm_cpu_caches_are_described_as_opaque_pages() -> None:
    """LAY-014: vLLM-CPU's [B, H, N, 2*D] pages are kernel-packed."""
    d = describe_kv_caches(_cpu_caches(), capabilities=Capabilities(), num_blocks=8,
                           num_heads=2, block_size=32, head_size=64, opaque_pages=True,
                           vllm_layout="LBHNC")
    lay = d.layout
    assert (lay.order, lay.packing, lay.opaque_pages, lay.restridable) == (
        StrideOrder.LBHNC, KVPacking.CONCAT, True, False)
    assert lay.num_layers == 2 and lay.region_nbytes == 2 * 32 * 128 * 4
    with pytest.raises(InvalidArgumentError, match="opaque page"):
        lay.byte_offset(0, 1, 5, 0)
    assert lay.byte_offset(1, 1, 0, 1) == 8 * 2 * 32 * 128 * 4 + (2 + 1) * 32 * 128 * 4


def test_a_connector_that_needs_token_rows_is_refused_naming_the_backend() -> None:
    with pytest.raises(LayoutNegotiationError) as info:
        describe_kv_caches(_cpu_caches(), capabilities=Capabilities(needs_token_rows=True),
                           num_blocks=8, num_heads=2, block_size=32, head_size=64,
                           opaque_pages=True, vllm_layout=None)
    assert info.value.clause == "LAY-014"
    assert "vLLM attention backend refused token-row access" in str(info.value)


def test_refused_orders_and_unknown_shapes() -> None:
    with pytest.raises(LayoutNegotiationError, match="vLLM attention backend refused LBNHC"):
        describe_kv_caches(_cpu_caches(), capabilities=Capabilities(accepted_layouts=("NHD",)),
                           num_blocks=8, num_heads=2, block_size=32, head_size=64,
                           opaque_pages=False, vllm_layout=None)
    with pytest.raises(LayoutMismatchError, match="expected"):
        describe_kv_caches({"l": torch.zeros(8, 3, 32, 128)}, capabilities=Capabilities(),
                           num_blocks=8, num_heads=2, block_size=32, head_size=64,
                           opaque_pages=False, vllm_layout=None)
    assert required_layout_name(Capabilities(accepted_layouts=("HND", "NHD"))) == "LBHNC"
    assert required_layout_name(Capabilities()) is None


def test_split_gpu_layouts_are_described_through_a_view() -> None:
    """A [2, B, N, H, D] flash-attention cache, HND-strided: kvspec's (2, B, H, N, D) view."""
    buf = torch.zeros(2, 2, 8, 2, 32, 64)  # L, S, B, H, N, D in memory: HND
    caches = {f"l{i}": buf[i].permute(0, 1, 3, 2, 4) for i in range(2)}  # vLLM's shape
    d = describe_kv_caches(caches, capabilities=Capabilities(), num_blocks=8, num_heads=2,
                           block_size=32, head_size=64, opaque_pages=False, vllm_layout=None)
    assert d.layout.packing is KVPacking.SPLIT and d.layout.order is StrideOrder.LBHNC
    assert not d.layout.opaque_pages
    assert d.tensors["l0"].data_ptr() == caches["l0"].data_ptr()


def test_bad_configuration_fails_typed() -> None:
    with pytest.raises(InvalidArgumentError, match="kvspec_factory"):
        factory_from_extra({})
    with pytest.raises(InvalidArgumentError, match="kvspec_factory"):
        factory_from_extra({"kvspec_factory": 42})
    with pytest.raises(InvalidArgumentError, match="not found"):
        factory_from_extra({"kvspec_factory": "no_such_module:Factory"})
    with pytest.raises(InvalidArgumentError, match="mapping"):
        factory_from_extra(["kvspec_factory"])
    with pytest.raises(InvalidArgumentError, match="kv_role"):
        transfer_role("kv_sideways")
    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="e", kv_role="kv_both",
                                           kv_connector_extra_config={"kvspec_factory": OFFLOAD,
                                                                      "offload_slots": 4}),
        cache_config=SimpleNamespace(block_size=32),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))
    kv = SimpleNamespace(num_blocks=100, kv_cache_groups=[SimpleNamespace(layer_names=["a", "b"])])
    view = engine_config_view(cfg, kv)
    assert view.num_layers == 2 and view.num_blocks == 100
    assert dict(view.extra) == {"offload_slots": 4}  # the adapter's own key is consumed
    with pytest.raises(InvalidArgumentError, match="KVCacheConfig"):
        engine_config_view(cfg, None)
    cfg.kv_transfer_config.kv_connector_extra_config = {"kvspec_factory": OFFLOAD,
                                                        "x": object()}
    with pytest.raises(InvalidArgumentError, match="JSON"):
        engine_config_view(cfg, kv)


def test_wire_objects_hold_plain_data_and_reject_bad_types() -> None:
    """ERR-005 ERR-006: metadata crosses as the connector's own bytes; the type it names
    must be a metadata class; garbage bytes fail in the connector's decoder, typed."""
    import pickle

    from kvspec.backends.offload import OffloadMetadata
    from kvspec.vllm._wire import StatsWire, StepWire, WorkerMetaWire, metadata_type

    wire = StepWire(b"{}", "kvspec.backends.offload:OffloadMetadata", 3, 10, frozenset({"p"}))
    back = pickle.loads(pickle.dumps(wire))  # what vLLM does between its processes
    assert (back.payload, back.step_id, back.preempted) == (b"{}", 3, frozenset({"p"}))
    assert metadata_type(wire.meta_type) is OffloadMetadata
    for bad in ("os:system", "no_such_mod:X", "kvspec.protocols:SPEC_VERSION"):
        with pytest.raises(MalformedMetadataError):
            metadata_type(bad)
    with pytest.raises(MalformedMetadataError):
        OffloadMetadata.decode(b"\x80\x04garbage")
    a = StatsWire.of(ConnectorStats({"loads": 2}))
    b = StatsWire.of(ConnectorStats({"loads": 3, "stores": 1}))
    assert a is not None and b is not None
    assert a.aggregate(b).reduce() == {"loads": 5.0, "stores": 1.0}
    assert StatsWire({"loads": 1}).aggregate(StatsWire({"loads": 2})).data == {"loads": 3.0}
    meta = WorkerMetaWire(None, ()).aggregate(WorkerMetaWire(ConnectorStats({"x": 1}), ()))
    assert meta.metadata == ConnectorStats({"x": 1})


@pytest.mark.needs_engine
def test_an_engine_refuses_a_connector_that_needs_token_rows(vllm_logs: Path) -> None:
    """LAY-014 LAY-010, end to end: vLLM-CPU fails to start, with the typed error naming the
    vLLM attention backend, instead of running a connector that would move garbage."""
    from kvspec.bench.vllm_engine import EngineError

    with pytest.raises(EngineError) as info:
        engine({"factory": "kvspec_vllm_probes:TokenRowsOffload"}, vllm_logs, "token-rows")
    text = str(info.value) + "".join(getattr(info.value, "args", ()))
    assert "LayoutNegotiationError" in text or "token-row" in text, text[-2000:]
