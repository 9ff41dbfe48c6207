"""``kvspec.vllm.certify``'s parts against real vLLM classes: the metadata codec (no pickle,
strict), the spec scheme, the profiles and the translation into vLLM's objects."""

from __future__ import annotations

import base64
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from kvspec.protocols import (
    AllocatedBlocks,
    CachedRequestView,
    ForwardContextView,
    ForwardKind,
    HookGraphMode,
    InvalidArgumentError,
    MalformedMetadataError,
    NewRequestView,
    RequestStatus,
    RequestView,
    SchedulerOutputView,
    factory_spec,
    load_factory,
)

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

from kvspec.vllm.certify import VllmConnectorFactory  # noqa: E402
from kvspec.vllm.certify import _objects  # noqa: E402
from kvspec.vllm.certify._wire import VllmMetadata  # noqa: E402


def _example_meta() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
        ExampleConnectorMetadata,
    )

    meta = ExampleConnectorMetadata()
    meta.add_request(list(range(1, 18)), [3, 9, 4, 7, 8], 4, True, ["mm-a"])
    meta.add_request(list(range(5, 10)), [1, 2], 4, False, [])
    return meta


def _nixl_meta() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlConnectorMetadata,
        RemoteMeta,
        ReqMeta,
    )

    meta = NixlConnectorMetadata()
    meta.reqs_to_recv["r1"] = ReqMeta(
        local_block_ids=([1, 2, 3],), local_physical_block_ids=([1, 2, 3],), tp_size=2,
        remote=RemoteMeta(block_ids=([7, 8, 9],), host="127.0.0.1", port=5600,
                          engine_id="prefill", request_id="r1", blocks_expiry_time=1.5))
    meta.reqs_to_send["r2"] = 12.25
    meta.reqs_in_batch = {"r1", "r3"}
    return meta


def test_example_metadata_round_trips_with_its_tensors() -> None:
    meta = _example_meta()
    back = VllmMetadata.decode(VllmMetadata(meta).encode()).value
    assert type(back) is type(meta) and len(back.requests) == 2
    for a, b in zip(meta.requests, back.requests):
        assert torch.equal(a.token_ids, b.token_ids) and a.token_ids.dtype == b.token_ids.dtype
        assert torch.equal(a.slot_mapping, b.slot_mapping)
        assert (a.is_store, a.mm_hashes) == (b.is_store, b.mm_hashes)


def test_nixl_metadata_round_trips_through_its_init_annotations() -> None:
    """NixlConnectorMetadata is a plain class: its fields come from ``self.x: T = ...`` in
    its ``__init__``; unions msgspec refuses (tuple | list of lists) decode too."""
    meta = _nixl_meta()
    back = VllmMetadata.decode(VllmMetadata(meta).encode()).value
    assert vars(back) == vars(meta)
    assert back.reqs_to_recv["r1"].remote.block_ids == ([7, 8, 9],)


def test_metadata_bytes_are_not_pickle() -> None:
    data = VllmMetadata(_example_meta()).encode()
    assert not data.startswith(b"\x80")  # every pickle protocol >= 2 starts so
    assert b"example_connector:ExampleConnectorMetadata" in data


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_hostile_bytes_fail_typed(data: bytes) -> None:
    try:
        VllmMetadata.decode(data)
    except MalformedMetadataError:
        pass


@pytest.mark.parametrize("mutate", [
    lambda d: d[:-5],                                         # truncated
    lambda d: d.replace(b"ExampleConnectorMetadata", b"ExampleConnectorMetadatX"),  # no such class
    lambda d: d.replace(b"vllm.distributed", b"subprocess.distrib"),  # a module not loaded
    lambda d: d.replace(b"is_store\xc3", b"is_store\xa1x"),   # a bool field given a str
])
def test_tampered_metadata_fails_typed(mutate: Any) -> None:
    data = VllmMetadata(_example_meta()).encode()
    bad = mutate(data)
    assert bad != data
    with pytest.raises(MalformedMetadataError):
        VllmMetadata.decode(bad)


def test_a_tensor_whose_size_lies_fails_typed() -> None:
    data = VllmMetadata(_example_meta()).encode()
    bad = data.replace(b"int64", b"int32", 1)  # half the bytes the header now claims
    with pytest.raises(MalformedMetadataError, match="needs"):
        VllmMetadata.decode(bad)


def test_decoding_never_imports_a_module() -> None:
    import sys

    data = VllmMetadata(_example_meta()).encode()
    bad = data.replace(b"vllm.distributed.kv_transfer.kv_connector.v1.example_connector",
                       b"kvspec.demo.pd" + b" " * 48)
    assert len(bad) == len(data)
    before = "kvspec.demo.pd" in sys.modules
    with pytest.raises(MalformedMetadataError):
        VllmMetadata.decode(bad)
    assert ("kvspec.demo.pd" in sys.modules) == before


def test_spec_scheme_loads_and_names_itself_for_worker_processes() -> None:
    factory = load_factory("vllm:ExampleConnector")
    assert isinstance(factory, VllmConnectorFactory)
    assert factory_spec(factory) == "vllm:ExampleConnector"
    assert factory.capabilities.layer_hooks is HookGraphMode.EAGER
    out_of_tree = load_factory(
        "vllm:vllm.distributed.kv_transfer.kv_connector.v1.example_connector:ExampleConnector")
    assert out_of_tree.connector_class is factory.connector_class  # type: ignore[attr-defined]


@pytest.mark.parametrize("spec,match", [
    ("vllm:NoSuchConnector", "vLLM registers"),
    ("vllm:", "nothing after"),
    ("vllm:no_such_pkg.mod:Cls", "cannot be loaded"),
    ("vllm:bad name", "bad vLLM connector"),
])
def test_bad_vllm_specs_fail_typed(spec: str, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        load_factory(spec)


def test_a_connector_that_needs_cuda_says_so() -> None:
    factory = VllmConnectorFactory("OffloadingConnector")
    assert factory.unavailable_reason and "CUDA" in factory.unavailable_reason


def test_requests_are_live_vllm_requests_kept_in_step() -> None:
    from vllm.v1.request import RequestStatus as VllmStatus

    book = _objects.RequestBook(4, {"do_remote_decode": True})
    view = RequestView("r", tuple(range(1, 11)), cache_salt="tenant-a")
    req = book.get(view)
    assert req.kv_transfer_params == {"do_remote_decode": True}
    assert req.cache_salt == "tenant-a" and len(req.block_hashes) == 2
    later = RequestView("r", tuple(range(1, 11)), output_token_ids=(50, 51),
                        status=RequestStatus.FINISHED, num_computed_tokens=11)
    assert book.get(later) is req
    assert list(req.output_token_ids) == [50, 51] and req.num_computed_tokens == 11
    assert req.status is VllmStatus.FINISHED_LENGTH_CAPPED
    own = book.get(RequestView("s", (1, 2), kv_transfer_params={"do_remote_prefill": True}))
    assert own.kv_transfer_params == {"do_remote_prefill": True}


def test_client_params_vllm_refuses_fail_typed() -> None:
    book = _objects.RequestBook(4, None)
    with pytest.raises(InvalidArgumentError, match="vLLM refuses"):
        book.get(RequestView("r", (1, 2, 3), kv_transfer_params={"x": 2**70}))


def test_scheduler_output_carries_new_cached_and_resumed_requests() -> None:
    book = _objects.RequestBook(4, None)
    a = RequestView("a", tuple(range(9)))
    b = RequestView("b", tuple(range(20, 29)), output_token_ids=(5,), num_computed_tokens=9)
    book.get(b)
    view = SchedulerOutputView(
        step_id=3,
        scheduled_new_reqs=(NewRequestView(a, AllocatedBlocks.single((4, 5, 6)), 4),),
        scheduled_cached_reqs=(CachedRequestView("b", AllocatedBlocks.single((1, 2, 3)), 9,
                                                 (5,), resumed_from_preemption=True),),
        num_scheduled_tokens={"a": 5, "b": 1}, finished_req_ids={"z"}, preempted_req_ids={"y"})
    out = _objects.scheduler_output(view, book, 1)
    (new,) = out.scheduled_new_reqs
    assert (new.req_id, new.block_ids, new.num_computed_tokens) == ("a", ([4, 5, 6],), 4)
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["b"] and cached.resumed_req_ids == {"b"}
    assert cached.new_block_ids == [([1, 2, 3],)]
    assert cached.all_token_ids["b"] == [*range(20, 29), 5]
    assert out.total_num_scheduled_tokens == 6
    assert out.finished_req_ids == {"z"} and out.preempted_req_ids == {"y"}


def test_forward_context_exposes_layers_and_attention_metadata() -> None:
    kv = {"model.layers.0.attn": torch.zeros(2, 2, 4, 8)}
    ctx = _objects.forward_context(
        ForwardContextView(ForwardKind.REAL, 1, 3, tuple(kv)), kv)
    assert ctx.no_compile_layers["model.layers.0.attn"].kv_cache is kv["model.layers.0.attn"]
    assert set(ctx.attn_metadata) == set(kv)
    empty = _objects.forward_context(ForwardContextView(ForwardKind.REAL, 2, 0, tuple(kv)), kv)
    assert empty.attn_metadata is None  # vLLM's value for a step with nothing scheduled


def test_handshake_payload_round_trips() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlHandshakePayload

    from kvspec.vllm.certify.factory import _unwrap_handshake, _wrap_handshake
    from kvspec.conformance.harness import HarnessConfig

    value = NixlHandshakePayload(compatibility_hash="abc", agent_metadata_bytes=b"\x00\x01")
    hs = _wrap_handshake(value, "e", 0, HarnessConfig().layout())
    assert _unwrap_handshake(type(hs).decode(hs.encode())) == value
    bad = type(hs)(engine_id="e", rank=0, spec_version=hs.spec_version, layout=hs.layout,
                   payload={"type_path": hs.payload["type_path"],
                            "data": base64.b64encode(b"\xc1").decode()})
    with pytest.raises(MalformedMetadataError):
        _unwrap_handshake(bad)


def test_metadata_holding_an_object_fails_typed_at_encode() -> None:
    from kvspec.vllm.certify._wire import encode_value

    with pytest.raises(InvalidArgumentError, match="cannot be encoded without pickle"):
        encode_value({"callback": object()})


def test_fixed_length_tuple_fields_round_trip() -> None:
    """DecodeBenchConnector's metadata holds ``tuple[tuple[list[int], ...], int]``: the codec
    swapped value and type in fixed-length tuples, and the harness then blamed the connector
    for ERR-005 in 40 tests. What kvspec encodes it now decodes."""
    from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
        DecodeBenchConnectorMetadata,
    )

    meta = DecodeBenchConnectorMetadata(reqs_to_fill={"r": (([1, 2, 3], [4]), 5)})
    assert VllmMetadata.decode(VllmMetadata(meta).encode()).value == meta


def test_metadata_kvspec_cannot_read_back_is_kvspecs_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvspec.protocols import HarnessError
    from kvspec.vllm.certify import _wire

    def broken(cls: type, body: bytes) -> object:
        raise MalformedMetadataError("simulated codec gap", clause="ERR-005")

    from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
        DecodeBenchConnectorMetadata,
    )

    monkeypatch.setattr(_wire, "_metadata_value", broken)
    with pytest.raises(HarnessError, match="cannot decode"):
        VllmMetadata(DecodeBenchConnectorMetadata(reqs_to_fill={})).encode()


def _mooncake_store_meta() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        LoadSpec,
        MooncakeStoreConnectorMetadata,
        ReqMeta,
    )

    meta = MooncakeStoreConnectorMetadata({"r1", "r2"}, {"r0"})
    meta.add_request(ReqMeta(
        req_id="r1", token_len_chunk=64, block_ids=([1, 2],), block_hashes=[b"\x01" * 8],
        can_save=True, load_spec=LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=64,
                                          can_load=True), store_job_id=3))
    return meta


def test_a_plain_class_with_stored_init_parameters_round_trips() -> None:
    """MooncakeStoreConnectorMetadata's __init__ stores two annotated parameters beside one
    annotated attribute: the codec reads all three types, and decodes without __init__."""
    meta = _mooncake_store_meta()
    back = VllmMetadata.decode(VllmMetadata(meta).encode()).value
    assert type(back) is type(meta) and vars(back) == vars(meta)
    assert back.requests[0].load_spec.kvpool_cached_tokens == 64


def test_metadata_declared_as_a_base_class_decodes_into_its_subclass() -> None:
    """MultiConnector's metadata is a tuple of ``KVConnectorMetadata``: each element
    travels tagged with its own class (a dataclass and a plain class here)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiKVConnectorMetadata,
    )

    meta = MultiKVConnectorMetadata(metadata=(_example_meta(), _nixl_meta()),
                                    extra_async_saves={"r1": 2})
    back = VllmMetadata.decode(VllmMetadata(meta).encode()).value
    assert [type(m) for m in back.metadata] == [type(m) for m in meta.metadata]
    assert vars(back.metadata[1]) == vars(meta.metadata[1])
    assert back.extra_async_saves == {"r1": 2}


def test_a_tagged_class_outside_the_declared_base_fails_typed() -> None:
    data = VllmMetadata(_mooncake_store_meta()).encode()
    bad = data.replace(b"mooncake.store.data:ReqMeta", b"mooncake.store.data:LoadSpec", 1)
    assert bad != data
    with pytest.raises(MalformedMetadataError):
        VllmMetadata.decode(bad)


def test_worker_metadata_crosses_and_aggregates_without_changing_either_side() -> None:
    """vLLM's executor lets ``aggregate`` grow its accumulator in place (Mooncake's does);
    the wrapper aggregates copies, so kvspec's aggregator sees no operand change."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        MooncakeStoreWorkerMetadata,
    )

    from kvspec.vllm.certify._wire import VllmWorkerMetadata

    a = VllmWorkerMetadata(MooncakeStoreWorkerMetadata(completed_saves={1: 1}))
    b = VllmWorkerMetadata.decode(
        VllmWorkerMetadata(MooncakeStoreWorkerMetadata(completed_saves={1: 1, 2: 1})).encode())
    total = a.aggregate(b)
    assert total.value.completed_saves == {1: 2, 2: 1}
    assert a.value.completed_saves == {1: 1} and b.value.completed_saves == {1: 1, 2: 1}
    with pytest.raises(MalformedMetadataError):
        VllmMetadata.decode(a.encode())  # a worker's value is not step metadata
