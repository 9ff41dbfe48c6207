"""Unit tests of the example connectors, without an engine.

The null connector, the shared-storage connector (metadata codec, scheduler matching and
planning, worker save/load round trips over every layout) and each broken variant's one
deviation from the shared-storage connector.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import pytest
import safetensors.torch
import torch

from kvspec.conformance.connectors.broken import FullPromptStateConnector
from kvspec.conformance.connectors.state import StateCache
from kvspec.conformance.connectors.tiny import TinyCache
from kvspec.conformance.connectors import (
    BROKEN_CONNECTORS,
    AsyncZeroConnector,
    CorruptLoadConnector,
    DoubleReportConnector,
    DropsAbortedRecvConnector,
    FullPromptHitConnector,
    HANDOFF_PARAM,
    ImpureMatchConnector,
    LayerwiseStorageConnector,
    LoadJob,
    NoSaltConnector,
    NoSendReportConnector,
    NullConnector,
    NullMetadata,
    ReadAfterFreeConnector,
    SaveJob,
    SharedStorageConnector,
    SharedStorageMetadata,
    SharedStorageScheduler,
    SharedStorageWorker,
    StorageSettings,
    UnknownReportConnector,
    block_path,
    marker_path,
)
from kvspec.protocols import (
    AllocatedBlocks,
    BlockRemoved,
    BlockStored,
    ConnectorFactory,
    EngineConfigView,
    FailureReporting,
    ForwardContextView,
    ForwardKind,
    HookGraphMode,
    InvalidArgumentError,
    InvalidBlockIdError,
    KVCacheLayout,
    KVConnectorOutput,
    KVPacking,
    LayoutMismatchError,
    MalformedMetadataError,
    MetadataNotBoundError,
    RequestView,
    SchedulerConnector,
    SchedulerOutputView,
    StandardAggregator,
    StrideOrder,
    TransferRole,
    UnknownRequestError,
    WorkerConnector,
    Direction,
)

BS = 4  # tokens per block
LAYERS = 3
NUM_BLOCKS = 12


# ------------------------------------------------------------------------------ helpers


def make_config(
    tmp_path: Path, *, tp: int = 1, role: TransferRole = TransferRole.BOTH, **extra: Any
) -> EngineConfigView:
    return EngineConfigView(
        engine_id="engine-0",
        role=role,
        num_layers=LAYERS,
        block_size=BS,
        num_blocks=NUM_BLOCKS,
        tp_size=tp,
        extra={"kvspec.tmpdir": str(tmp_path), **extra},
    )


def toy_hashes(tokens: tuple[int, ...], salt: str | None, lora: int | None) -> tuple[bytes, ...]:
    parent = hashlib.sha256(f"root|{salt}|{lora}".encode()).digest()
    out = []
    for i in range(len(tokens) // BS):
        parent = hashlib.sha256(parent + repr(tokens[i * BS:(i + 1) * BS]).encode()).digest()
        out.append(parent)
    return tuple(out)


def make_request(
    rid: str,
    prompt: Iterable[int],
    *,
    output: Iterable[int] = (),
    computed: int = 0,
    salt: str | None = None,
    lora: int | None = None,
    params: dict[str, Any] | None = None,
) -> RequestView:
    prompt, output = tuple(prompt), tuple(output)
    return RequestView(
        request_id=rid,
        prompt_token_ids=prompt,
        output_token_ids=output,
        block_hashes=toy_hashes(prompt + output, salt, lora),
        cache_salt=salt,
        lora_id=lora,
        num_computed_tokens=computed,
        kv_transfer_params=params,
    )


def mark_stored(tmp_path: Path, request: RequestView, n: int, *, skip: Iterable[int] = ()) -> None:
    for i in range(n):
        if i not in set(skip):
            Path(marker_path(str(tmp_path), request.block_hashes[i].hex())).write_bytes(b"x")


def worker_wrote(directory: Path, meta: Any, ranks: int = 1) -> None:
    """Stand in for the workers: write the block files of every save in ``meta``."""
    for save in meta.saves:
        for _, key in save.blocks:
            for rank in range(ranks):
                Path(block_path(str(directory), key, rank)).write_bytes(b"x")


def sched_output(step: int = 0) -> SchedulerOutputView:
    return SchedulerOutputView(step_id=step)


def make_kv(
    order: StrideOrder = StrideOrder.LBHNC,
    packing: KVPacking = KVPacking.CONCAT,
    dtype: torch.dtype = torch.float16,
    *,
    seed: int = 0,
) -> tuple[KVCacheLayout, torch.Tensor, dict[str, torch.Tensor]]:
    layout = KVCacheLayout.contiguous(
        order, packing, dtype, num_layers=LAYERS, num_blocks=NUM_BLOCKS, block_size=BS,
        num_heads=2, head_size_k=3, block_capacity=NUM_BLOCKS + 2,
    )
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (layout.span_bytes,), dtype=torch.uint8, generator=gen)
    buffer = raw.view(dtype)
    view = layout.view(buffer)
    return layout, buffer, {f"layer.{i}": view[i] for i in range(LAYERS)}


def block_bytes(kv: dict[str, torch.Tensor], layout: KVCacheLayout, block: int) -> list[bytes]:
    split = layout.packing is KVPacking.SPLIT
    out = []
    for t in kv.values():
        b = (t[:, block] if split else t[block]).contiguous()
        out.append(bytes(b.view(torch.uint8).reshape(-1).tolist()))
    return out


def forward(kv: dict[str, torch.Tensor], step: int = 0) -> ForwardContextView:
    return ForwardContextView(ForwardKind.REAL, step, 8, tuple(kv))


def run_step(worker: WorkerConnector, meta: Any, kv: dict[str, torch.Tensor]) -> None:
    """Ship ``meta`` as bytes, like the engine, and run one forward's hooks."""
    decoded = type(meta).decode(meta.encode())
    assert decoded == meta
    worker.bind_connector_metadata(decoded)
    worker.start_load_kv(forward(kv))
    worker.wait_for_save()
    worker.clear_connector_metadata()


class Collected:
    def __init__(self) -> None:
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.failed: set[str] = set()
        self.invalid: set[int] = set()
        self.outputs: list[KVConnectorOutput] = []


def collect(
    worker: WorkerConnector,
    *,
    sending: Iterable[str] = (),
    recving: Iterable[str] = (),
    timeout: float = 5.0,
) -> Collected:
    """Poll the worker's output until the wanted ids were reported; no id twice (WRK-009)."""
    got = Collected()
    want_s, want_r = set(sending), set(recving)
    deadline = time.monotonic() + timeout
    while True:
        out = worker.build_connector_output(frozenset())
        assert not out.finished_sending & got.sending, "reported twice (WRK-009)"
        assert not out.finished_recving & got.recving, "reported twice (WRK-009)"
        got.outputs.append(out)
        got.sending |= out.finished_sending
        got.recving |= out.finished_recving
        got.failed |= out.failed_recving
        got.invalid |= out.invalid_block_ids
        if want_s <= got.sending and want_r <= got.recving:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting: have {got.sending}, {got.recving}")
        time.sleep(0.002)


def keys_of(request: RequestView, *positions: int) -> list[str]:
    return [request.block_hashes[i].hex() for i in positions]


# --------------------------------------------------------------------------- null connector


def test_null_connector(tmp_path: Path) -> None:
    factory = NullConnector()
    assert isinstance(factory, ConnectorFactory)
    assert factory.name == "null"
    caps = factory.capabilities
    assert not caps.async_loads and not caps.delayed_free
    assert caps.layer_hooks is HookGraphMode.NO_LAYER_HOOKS
    assert caps.failure_reporting is FailureReporting.NEVER_FAILS

    config = make_config(tmp_path)
    sched = factory.create_scheduler(config)
    assert isinstance(sched, SchedulerConnector)
    req = make_request("r1", range(10))
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, AllocatedBlocks.single([0, 1, 2]), 0)
    meta = sched.build_connector_meta(sched_output())
    assert meta.encode() == b"{}" and NullMetadata.decode(meta.encode()) == meta
    assert sched.request_finished(req, (0, 1, 2)) == (False, None)
    with pytest.raises(UnknownRequestError):
        sched.request_finished(req, (0, 1, 2))  # a second call (SCH-015, SCH-028)
    with pytest.raises(UnknownRequestError):
        sched.update_state_after_alloc(make_request("ghost", [1]), AllocatedBlocks.single([]), 0)
    sched.update_connector_output(KVConnectorOutput())
    with pytest.raises(UnknownRequestError):
        sched.update_connector_output(KVConnectorOutput(finished_recving={"r1"}))
    assert list(sched.take_events()) == []
    sched.shutdown()
    sched.shutdown()

    worker = factory.create_worker(config, 0)
    assert isinstance(worker, WorkerConnector)
    layout, _, kv = make_kv()
    worker.register_kv_caches(kv, layout)
    with pytest.raises(InvalidArgumentError):
        worker.register_kv_caches(kv, layout)  # WRK-001
    with pytest.raises(MetadataNotBoundError):
        worker.start_load_kv(forward(kv))  # DRY-001
    run_step(worker, meta, kv)
    assert worker.build_connector_output(frozenset({"r1"})).is_empty()
    worker.shutdown()
    worker.shutdown()


@pytest.mark.parametrize(
    "data", [b"", b"[]", b'{"a": 1}', b"\xff", b"null", "{}"]  # type: ignore[list-item]
)
def test_null_metadata_rejects_malformed(data: bytes) -> None:
    with pytest.raises(MalformedMetadataError):
        NullMetadata.decode(data)


def test_null_worker_rejects_mismatching_tensors(tmp_path: Path) -> None:
    layout, _, kv = make_kv()
    kv["layer.1"] = kv["layer.1"].clone()  # another buffer
    with pytest.raises(LayoutMismatchError):
        NullConnector().create_worker(make_config(tmp_path), 0).register_kv_caches(kv, layout)


# -------------------------------------------------------------------------------- metadata


def sample_meta() -> SharedStorageMetadata:
    return SharedStorageMetadata(
        loads=(LoadJob("r1", ((3, "ab" * 16), (5, "cd" * 16))),),
        saves=(SaveJob("r2", ((0, "ef" * 16),)), SaveJob("r3", ((1, "01"),), report=False)),
        aborted_loads=("r0",),
    )


def test_metadata_round_trip() -> None:
    for meta in (SharedStorageMetadata(), sample_meta()):
        data = meta.encode()
        json.loads(data)  # plain JSON (ERR-006)
        assert SharedStorageMetadata.decode(data) == meta
        assert SharedStorageMetadata.decode(bytearray(data)) == meta
    assert SharedStorageMetadata().is_empty and not sample_meta().is_empty


def _mutations() -> list[Any]:
    good = json.loads(sample_meta().encode())

    def edit(fn: Any) -> bytes:
        obj = json.loads(json.dumps(good))
        fn(obj)
        return json.dumps(obj).encode()

    return [
        b"", b"\xff\xfe", b"[]", b"not json", "a str, not bytes",
        b'{"kind": NaN}',
        edit(lambda o: o.update(kind="other")),
        edit(lambda o: o.update(version=2)),
        edit(lambda o: o.update(version=True)),
        edit(lambda o: o.update(extra=1)),
        edit(lambda o: o.pop("saves")),
        edit(lambda o: o.update(loads={})),
        edit(lambda o: o["loads"][0].update(request_id="")),
        edit(lambda o: o["loads"][0].update(request_id=7)),
        edit(lambda o: o["loads"][0].update(blocks=[])),
        edit(lambda o: o["loads"][0].update(blocks=[[-1, "ab"]])),
        edit(lambda o: o["loads"][0].update(blocks=[[True, "ab"]])),
        edit(lambda o: o["loads"][0].update(blocks=[[1.0, "ab"]])),
        edit(lambda o: o["loads"][0].update(blocks=[[1, "../etc/passwd"]])),
        edit(lambda o: o["loads"][0].update(blocks=[[1, "ABCD"]])),
        edit(lambda o: o["loads"][0].update(blocks=[[1, "abc"]])),
        edit(lambda o: o["loads"][0].update(blocks=[[1, "ab"], [1, "cd"]])),
        edit(lambda o: o["loads"][0].update(blocks=[[1, "ab", 3]])),
        edit(lambda o: o["loads"][0].update(extra=1)),
        edit(lambda o: o["loads"].append(o["loads"][0])),
        edit(lambda o: o["saves"][0].update(report="yes")),
        edit(lambda o: o["saves"][0].pop("report")),
        edit(lambda o: o.update(aborted_loads=["r0", "r0"])),
        edit(lambda o: o.update(aborted_loads=[3])),
    ]


@pytest.mark.parametrize("data", _mutations())
def test_metadata_rejects_malformed(data: Any) -> None:
    with pytest.raises(MalformedMetadataError):
        SharedStorageMetadata.decode(data)


def test_metadata_constructor_validates() -> None:
    with pytest.raises(InvalidBlockIdError):
        LoadJob("r", ((-1, "ab"),))
    with pytest.raises(InvalidArgumentError):
        SaveJob("r", ())
    with pytest.raises(InvalidArgumentError):
        SharedStorageMetadata(loads=(LoadJob("r", ((1, "ab"),)),) * 2)


def test_settings_and_paths(tmp_path: Path) -> None:
    s = StorageSettings.from_config(make_config(tmp_path, storage_dir=str(tmp_path / "x")))
    assert s.directory == str(tmp_path / "x") and s.io_timeout_s == 30.0
    assert StorageSettings.from_config(make_config(tmp_path)).directory == str(tmp_path)
    with pytest.raises(InvalidArgumentError):
        StorageSettings.from_config(make_config(tmp_path, io_timeout_s=0))
    with pytest.raises(InvalidArgumentError):
        StorageSettings.from_config(make_config(tmp_path, load_delay_s="1"))
    assert block_path("/d", "ab12", 3) == os.path.join("/d", "ab12.rank3")
    assert marker_path("/d", "ab12") == os.path.join("/d", "ab12.done")
    with pytest.raises(InvalidArgumentError):
        marker_path("/d", "../x")


# ------------------------------------------------------------------------------- scheduler


def new_scheduler(tmp_path: Path, factory: ConnectorFactory | None = None) -> SchedulerConnector:
    return (factory or SharedStorageConnector()).create_scheduler(make_config(tmp_path))


def test_shared_storage_capabilities() -> None:
    caps = SharedStorageConnector().capabilities
    assert caps.async_loads and caps.delayed_free and caps.accepts_split_kv
    assert caps.layer_hooks is HookGraphMode.NO_LAYER_HOOKS
    assert caps.failure_reporting is FailureReporting.INVALID_BLOCKS
    assert caps.accepted_layouts == ()
    assert SharedStorageConnector().name == "shared-storage"


def test_match_rules(tmp_path: Path) -> None:
    sched = new_scheduler(tmp_path)
    req = make_request("r", range(13))  # 3 full blocks + 1 token
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    mark_stored(tmp_path, req, 2)
    assert sched.get_num_new_matched_tokens(req, 0) == (8, True)
    assert sched.get_num_new_matched_tokens(req, 4) == (4, True)  # from block 1
    assert sched.get_num_new_matched_tokens(req, 8) == (0, False)
    assert sched.get_num_new_matched_tokens(req, 2) == (0, False)  # not block aligned
    mark_stored(tmp_path, req, 3)
    assert sched.get_num_new_matched_tokens(req, 0) == (12, True)  # one token left

    exact = make_request("x", range(12))  # exactly 3 blocks, all stored
    mark_stored(tmp_path, exact, 3)
    assert sched.get_num_new_matched_tokens(exact, 0) == (8, True)  # SCH-005
    assert sched.get_num_new_matched_tokens(exact, 8) == (0, False)

    gap = make_request("g", range(100, 113))
    mark_stored(tmp_path, gap, 3, skip=[1])
    assert sched.get_num_new_matched_tokens(gap, 0) == (4, True)  # consecutive only

    salted = make_request("s", range(13), salt="tenant-b")  # SCH-020
    assert sched.get_num_new_matched_tokens(salted, 0) == (0, False)


def test_match_has_no_side_effects(tmp_path: Path) -> None:
    sched = new_scheduler(tmp_path)
    req = make_request("r", range(13))
    mark_stored(tmp_path, req, 2)
    before = sorted(os.listdir(tmp_path))
    answers = {sched.get_num_new_matched_tokens(req, 0) for _ in range(3)}
    assert answers == {(8, True)}
    assert sorted(os.listdir(tmp_path)) == before
    assert sched.build_connector_meta(sched_output()) == SharedStorageMetadata()


def test_alloc_plans_one_load(tmp_path: Path) -> None:
    sched = new_scheduler(tmp_path)
    req = make_request("r", range(17))
    mark_stored(tmp_path, req, 4)
    assert sched.get_num_new_matched_tokens(req, 4) == (12, True)
    blocks = AllocatedBlocks.single([9, 2, 5, 7, 1])
    sched.update_state_after_alloc(req, blocks, 0)  # SCH-008: count decides, not blocks
    assert sched.build_connector_meta(sched_output(0)).is_empty
    sched.update_state_after_alloc(req, blocks, 12)
    meta = sched.build_connector_meta(sched_output(1))
    assert isinstance(meta, SharedStorageMetadata)
    assert meta.loads == (LoadJob("r", tuple(zip((2, 5, 7), keys_of(req, 1, 2, 3)))),)
    assert sched.build_connector_meta(sched_output(2)).is_empty  # SCH-013
    sched.update_connector_output(KVConnectorOutput(finished_recving={"r"}))
    sched.update_state_after_alloc(req, blocks, 0)  # SCH-009: no second load
    assert sched.build_connector_meta(sched_output(3)).is_empty
    with pytest.raises(InvalidBlockIdError):
        sched.update_state_after_alloc(req, AllocatedBlocks.single([NUM_BLOCKS]), 4)


def test_finish_saves_computed_blocks_and_marks_them(tmp_path: Path) -> None:
    sched = new_scheduler(tmp_path)
    req = make_request("r", range(10), output=range(50, 57), computed=15)  # 17 tokens
    sched.on_new_request(req)
    mark_stored(tmp_path, req, 1)
    # 4 full blocks by hash, 3 fully computed (15 // 4); block 0 is stored already.
    assert sched.request_finished(req, (4, 5, 6, 7, 8)) == (True, None)
    meta = sched.build_connector_meta(sched_output())
    assert isinstance(meta, SharedStorageMetadata)
    assert meta.saves == (SaveJob("r", tuple(zip((5, 6), keys_of(req, 1, 2)))),)
    assert list(sched.take_events()) == []
    for key in keys_of(req, 1, 2):
        assert not os.path.exists(marker_path(str(tmp_path), key))
        Path(block_path(str(tmp_path), key, 0)).write_bytes(b"x")  # the worker wrote them
    sched.update_connector_output(KVConnectorOutput(finished_sending={"r"}))
    for key in keys_of(req, 1, 2):
        assert os.path.exists(marker_path(str(tmp_path), key))
    events = list(sched.take_events())
    assert events == [
        BlockStored(
            block_hashes=req.block_hashes[1:3],
            parent_block_hash=req.block_hashes[0],
            token_ids=req.all_token_ids[4:12],
            block_size=BS,
            medium="shared-storage",
        )
    ]
    assert list(sched.take_events()) == []  # EVT-004
    with pytest.raises(UnknownRequestError):
        sched.update_connector_output(KVConnectorOutput(finished_sending={"r"}))

    again = make_request("r2", range(10), output=range(50, 57), computed=15)
    sched.on_new_request(again)
    assert sched.request_finished(again, (1, 2, 3, 4)) == (False, None)  # all stored
    nothing = make_request("r3", range(10), computed=0)
    sched.on_new_request(nothing)
    assert sched.request_finished(nothing, (1, 2)) == (False, None)  # nothing computed


def test_a_failed_save_is_not_marked_stored(tmp_path: Path) -> None:
    """Issue 34: a block the worker could not write (a full disk, an injected store fault)
    was marked stored when the save was reported, so every later hit on it failed its load
    and was recomputed. Only blocks whose files every rank wrote are marked; the others
    are planned again by the next request that computes them."""
    sched = SharedStorageConnector().create_scheduler(make_config(tmp_path, tp=2))
    req = make_request("r", range(10), output=range(50, 57), computed=15)
    sched.on_new_request(req)
    assert sched.request_finished(req, (4, 5, 6, 7, 8)) == (True, None)
    sched.build_connector_meta(sched_output())
    first, second, third = keys_of(req, 0, 1, 2)
    for rank in (0, 1):
        Path(block_path(str(tmp_path), first, rank)).write_bytes(b"x")
    Path(block_path(str(tmp_path), second, 0)).write_bytes(b"x")  # rank 1 failed it
    sched.update_connector_output(KVConnectorOutput(finished_sending={"r"}))
    marked = [os.path.exists(marker_path(str(tmp_path), k)) for k in (first, second, third)]
    assert marked == [True, False, False]
    assert [e.block_hashes for e in sched.take_events()] == [req.block_hashes[:1]]
    again = make_request("r2", range(10), output=range(50, 57), computed=15)
    sched.on_new_request(again)
    assert sched.get_num_new_matched_tokens(again, 0) == (4, True)
    assert sched.request_finished(again, (1, 2, 3, 4)) == (True, None)  # saved again


def test_abort_while_loading(tmp_path: Path) -> None:
    sched = new_scheduler(tmp_path)
    req = make_request("r", range(9))
    mark_stored(tmp_path, req, 2)
    assert sched.get_num_new_matched_tokens(req, 0) == (8, True)
    sched.update_state_after_alloc(req, AllocatedBlocks.single([3, 4, 5]), 8)
    assert sched.request_finished(req, (3, 4, 5)) == (False, None)  # SCH-021
    meta = sched.build_connector_meta(sched_output())
    assert isinstance(meta, SharedStorageMetadata)
    assert [j.request_id for j in meta.loads] == ["r"] and meta.aborted_loads == ("r",)
    sched.update_connector_output(KVConnectorOutput(finished_recving={"r"}))


def test_failed_load_unmarks_blocks(tmp_path: Path) -> None:
    sched = new_scheduler(tmp_path)
    req = make_request("r", range(13))
    mark_stored(tmp_path, req, 3)
    assert sched.get_num_new_matched_tokens(req, 0) == (12, True)
    sched.update_state_after_alloc(req, AllocatedBlocks.single([3, 4, 5, 6]), 12)
    sched.build_connector_meta(sched_output())
    sched.update_connector_output(
        KVConnectorOutput(finished_recving={"r"}, failed_recving={"r"}, invalid_block_ids={4})
    )
    stored = [os.path.exists(marker_path(str(tmp_path), k)) for k in keys_of(req, 0, 1, 2)]
    assert stored == [True, False, True]
    assert list(sched.take_events()) == [BlockRemoved([req.block_hashes[1]], "shared-storage")]
    assert sched.get_num_new_matched_tokens(req, 0) == (4, True)


def test_scheduler_rejects_unknown_requests(tmp_path: Path) -> None:
    sched = new_scheduler(tmp_path)
    ghost = make_request("ghost", range(8), computed=8)
    with pytest.raises(UnknownRequestError):
        sched.update_state_after_alloc(ghost, AllocatedBlocks.single([1, 2]), 4)
    with pytest.raises(UnknownRequestError):
        sched.request_finished(ghost, (1, 2))
    with pytest.raises(UnknownRequestError):
        sched.update_connector_output(KVConnectorOutput(finished_recving={"ghost"}))
    assert sched.build_connector_meta(sched_output()) == SharedStorageMetadata()
    sched.shutdown()
    sched.shutdown()


def test_producer_hands_off_and_consumer_defers(tmp_path: Path) -> None:
    producer = SharedStorageConnector().create_scheduler(
        make_config(tmp_path, role=TransferRole.PRODUCER)
    )
    done = make_request("r", range(13), output=(5,), computed=13)
    producer.on_new_request(done)
    delay, params = producer.request_finished(done, (0, 1, 2, 3))
    assert delay and params == {HANDOFF_PARAM: {"blocks": 3}}
    json.dumps(dict(params))  # SCH-018

    consumer = new_scheduler(tmp_path)  # another engine on the same directory
    handed = make_request("r", range(13), params={HANDOFF_PARAM: {"blocks": 3}})
    consumer.on_new_request(handed)
    assert [consumer.get_num_new_matched_tokens(handed, 0) for _ in range(2)] == [(None, False)] * 2
    consumer.build_connector_meta(sched_output())
    assert consumer.get_num_new_matched_tokens(handed, 0) == (None, False)  # SCH-002
    worker_wrote(tmp_path, producer.build_connector_meta(sched_output()))
    producer.update_connector_output(KVConnectorOutput(finished_sending={"r"}))
    assert consumer.get_num_new_matched_tokens(handed, 0) == (12, True)
    plain = make_request("p", range(13))  # no hand-off: never deferred
    assert consumer.get_num_new_matched_tokens(plain, 0) == (12, True)


def test_handoff_deferral_is_bounded(tmp_path: Path) -> None:
    consumer = SharedStorageConnector().create_scheduler(
        make_config(tmp_path, handoff_timeout_s=0.01)
    )
    handed = make_request("r", range(13), params={HANDOFF_PARAM: {"blocks": 3}})
    consumer.on_new_request(handed)
    assert consumer.get_num_new_matched_tokens(handed, 0) == (None, False)
    time.sleep(0.02)
    consumer.build_connector_meta(sched_output())
    assert consumer.get_num_new_matched_tokens(handed, 0) == (0, False)


# ---------------------------------------------------------------------------------- worker


def save_then_load(
    tmp_path: Path,
    order: StrideOrder,
    packing: KVPacking,
    dtype: torch.dtype = torch.float16,
    factory: ConnectorFactory | None = None,
) -> tuple[dict[int, list[bytes]], dict[str, torch.Tensor], KVCacheLayout, Collected]:
    """Save blocks 1, 3, 4 as r1, zero the cache, load them into 7, 8, 9 as r2."""
    worker = (factory or SharedStorageConnector()).create_worker(make_config(tmp_path), 0)
    layout, buffer, kv = make_kv(order, packing, dtype)
    worker.register_kv_caches(kv, layout)
    keys = ["a1" * 8, "b2" * 8, "c3" * 8]
    saved = {b: block_bytes(kv, layout, b) for b in (1, 3, 4)}
    run_step(worker, SharedStorageMetadata(saves=(SaveJob("r1", tuple(zip((1, 3, 4), keys))),)), kv)
    got = collect(worker, sending={"r1"})
    assert got.sending == {"r1"} and not got.recving
    for key in keys:
        assert os.path.exists(block_path(str(tmp_path), key, 0))
    buffer.zero_()
    run_step(worker, SharedStorageMetadata(loads=(LoadJob("r2", tuple(zip((7, 8, 9), keys))),)), kv)
    got = collect(worker, recving={"r2"})
    worker.shutdown()
    worker.shutdown()
    return saved, kv, layout, got


@pytest.mark.parametrize("packing", list(KVPacking))
@pytest.mark.parametrize("order", list(StrideOrder))
def test_worker_round_trip(tmp_path: Path, order: StrideOrder, packing: KVPacking) -> None:
    saved, kv, layout, got = save_then_load(tmp_path, order, packing)
    assert got.recving == {"r2"} and not got.failed and not got.invalid
    for src, dst in ((1, 7), (3, 8), (4, 9)):
        assert block_bytes(kv, layout, dst) == saved[src]
    zero = block_bytes(kv, layout, 0)
    assert set(zero[0]) == {0}
    for other in set(range(layout.block_capacity)) - {7, 8, 9}:  # WRK-002
        assert block_bytes(kv, layout, other) == zero


def test_worker_round_trip_bfloat16(tmp_path: Path) -> None:
    saved, kv, layout, got = save_then_load(
        tmp_path, StrideOrder.BLHNC, KVPacking.SPLIT, torch.bfloat16
    )
    assert not got.failed
    assert block_bytes(kv, layout, 8) == saved[3]


def test_worker_moves_shared_storage_once(tmp_path: Path) -> None:
    layout = KVCacheLayout.contiguous(
        "HND", KVPacking.CONCAT, torch.float32, num_layers=2, num_blocks=NUM_BLOCKS,
        block_size=BS, num_heads=1, head_size_k=2,
    )
    buffer = torch.randn(layout.span_elems)
    view = layout.view(buffer)
    kv = {"a": view[0], "b": view[1], "c": view[0]}  # layer c shares layer a's storage
    shared = KVCacheLayout.from_layer_tensors(
        list(kv.values()), packing=KVPacking.CONCAT, num_blocks=NUM_BLOCKS, num_heads=1,
        head_size_k=2,
    )
    worker = SharedStorageConnector().create_worker(make_config(tmp_path), 0)
    worker.register_kv_caches(kv, shared)
    run_step(worker, SharedStorageMetadata(saves=(SaveJob("s", ((2, "aa"),)),)), kv)
    collect(worker, sending={"s"})
    stored = safetensors.torch.load_file(block_path(str(tmp_path), "aa", 0))
    assert stored["block"].shape == (2, 1, 4, 4)  # two storages, not three layers
    expected = view[:, 2].clone()
    buffer.zero_()
    run_step(worker, SharedStorageMetadata(loads=(LoadJob("l", ((2, "aa"),)),)), kv)
    assert not collect(worker, recving={"l"}).failed
    assert torch.equal(view[:, 2], expected)
    assert int(torch.count_nonzero(view)) == int(torch.count_nonzero(expected))
    worker.shutdown()


def write_saved(tmp_path: Path, worker: WorkerConnector, kv: dict[str, torch.Tensor]) -> list[str]:
    keys = ["d1" * 8, "d2" * 8, "d3" * 8]
    run_step(worker, SharedStorageMetadata(saves=(SaveJob("s", tuple(zip((0, 1, 2), keys))),)), kv)
    collect(worker, sending={"s"})
    return keys


def corrupt_header(path: str) -> None:
    data = bytearray(Path(path).read_bytes())
    data[:8] = b"NOTMAGIC"
    Path(path).write_bytes(bytes(data))


def wrong_dtype(path: str) -> None:
    data = Path(path).read_bytes()
    assert b'"F16"' in data
    Path(path).write_bytes(data.replace(b'"F16"', b'"F32"'))


def truncate(path: str) -> None:
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:-1])


def pad(path: str) -> None:
    Path(path).write_bytes(Path(path).read_bytes() + b"\0")


@pytest.mark.parametrize("damage", [os.unlink, corrupt_header, wrong_dtype, truncate, pad])
def test_failed_load_is_reported(tmp_path: Path, damage: Any) -> None:
    """A damaged or missing file ends as a failed receive with invalid blocks, never as an
    exception or a hang (ERR-008, WRK-011)."""
    worker = SharedStorageConnector().create_worker(make_config(tmp_path), 0)
    layout, _, kv = make_kv()
    worker.register_kv_caches(kv, layout)
    keys = write_saved(tmp_path, worker, kv)
    damage(block_path(str(tmp_path), keys[1], 0))
    before = block_bytes(kv, layout, 6)
    run_step(worker, SharedStorageMetadata(loads=(LoadJob("r", tuple(zip((5, 6, 7), keys))),)), kv)
    got = collect(worker, recving={"r"})
    assert got.recving == got.failed == {"r"}  # WRK-011
    assert got.invalid == {6}
    assert block_bytes(kv, layout, 6) == before  # a failed block is left alone
    assert block_bytes(kv, layout, 5) == block_bytes(kv, layout, 0)
    worker.shutdown()


def test_load_times_out_as_failed(tmp_path: Path) -> None:
    config = make_config(tmp_path, io_timeout_s=0.3, load_delay_s=2.0)
    worker = SharedStorageConnector().create_worker(config, 0)
    layout, _, kv = make_kv()
    worker.register_kv_caches(kv, layout)
    run_step(worker, SharedStorageMetadata(loads=(LoadJob("r", ((3, "ee"), (4, "ff"))),)), kv)
    assert worker.build_connector_output(frozenset()).is_empty()
    got = collect(worker, recving={"r"}, timeout=2.0)
    assert got.failed == {"r"} and got.invalid == {3, 4}  # WRK-014
    start = time.monotonic()
    worker.shutdown()  # interrupts the delay
    assert time.monotonic() - start < 1.5


def test_a_stuck_copy_does_not_hold_the_output_hook(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 34: a load whose copy into the KV caches is stuck (holding the job's lock)
    timed out inside build_connector_output, whose cancel then waited up to 5 s for that
    lock. The output hooks stay bounded; the load fails with its blocks invalid."""
    worker = SharedStorageConnector().create_worker(make_config(tmp_path, io_timeout_s=0.3), 0)
    layout, _, kv = make_kv()
    worker.register_kv_caches(kv, layout)
    keys = write_saved(tmp_path, worker, kv)
    release = threading.Event()
    blocks = worker._kv  # type: ignore[attr-defined]
    original = blocks.copy_in

    def stuck(block: int, src: torch.Tensor) -> None:
        release.wait(10)
        original(block, src)

    monkeypatch.setattr(blocks, "copy_in", stuck)
    try:
        run_step(worker, SharedStorageMetadata(loads=(LoadJob("r", ((5, keys[0]),)),)), kv)
        start = time.monotonic()
        longest = 0.0
        recving: set[str] = set()
        failed: set[str] = set()
        invalid: set[int] = set()
        while "r" not in recving and time.monotonic() - start < 3:
            t0 = time.monotonic()
            out = worker.build_connector_output(frozenset())
            longest = max(longest, time.monotonic() - t0)
            recving |= out.finished_recving
            failed |= out.failed_recving
            invalid |= out.invalid_block_ids
            time.sleep(0.005)
        assert failed == {"r"} and invalid == {5}
        assert longest < 0.2, longest
    finally:
        release.set()
        worker.shutdown()


_STUCK_WRITE = """
import sys, threading, time
import torch
from kvspec.conformance.connectors import SharedStorageConnector, SaveJob, SharedStorageMetadata
from kvspec.conformance.connectors import shared_storage
from kvspec.protocols import (EngineConfigView, ForwardContextView, ForwardKind,
                              KVCacheLayout, KVPacking, StrideOrder, TransferRole)

shared_storage.write_block_file = lambda *a: threading.Event().wait()  # a write that hangs
config = EngineConfigView(engine_id="e", role=TransferRole.BOTH, num_layers=2, block_size=4,
                          num_blocks=8, extra={"kvspec.tmpdir": sys.argv[1], "io_timeout_s": 0.5})
layout = KVCacheLayout.contiguous(StrideOrder.LBHNC, KVPacking.CONCAT, torch.float32, 2, 8, 4, 2, 4)
view = layout.view(torch.zeros(layout.span_elems))
worker = SharedStorageConnector().create_worker(config, 0)
worker.register_kv_caches({"a": view[0], "b": view[1]}, layout)
worker.bind_connector_metadata(SharedStorageMetadata(saves=(SaveJob("s", ((1, "ab" * 8),)),)))
worker.start_load_kv(ForwardContextView(ForwardKind.REAL, 0, 1, ("a", "b")))
worker.wait_for_save()
worker.clear_connector_metadata()
time.sleep(0.2)  # the write is stuck now
worker.shutdown()
print("exiting", flush=True)
"""


def test_a_stuck_write_does_not_keep_the_process_alive(tmp_path: Path) -> None:
    """Issue 34: the worker's thread pool (concurrent.futures) is joined when the
    interpreter exits, so one stuck write kept the engine's process from ever exiting.
    Its thread is a daemon now: shutdown is bounded and the process exits."""
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-c", _STUCK_WRITE, str(tmp_path)],
                              capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit within 30 s with a write stuck")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exiting" in proc.stdout
    assert time.monotonic() - start < 15


def test_shutdown_does_not_wait_for_jobs_that_never_started(tmp_path: Path) -> None:
    """A queued job cancelled at shutdown must not hold shutdown until io_timeout_s
    (a CANCELLED future never counts as done for concurrent.futures.wait)."""
    config = make_config(tmp_path, io_timeout_s=20.0, load_delay_s=0.5)
    worker = SharedStorageConnector().create_worker(config, 0)
    layout, _, kv = make_kv()
    worker.register_kv_caches(kv, layout)
    run_step(worker, SharedStorageMetadata(loads=(LoadJob("a", ((3, "ee"),)),)), kv)
    run_step(worker, SharedStorageMetadata(loads=(LoadJob("b", ((4, "ff"),)),)), kv)  # queued
    start = time.monotonic()
    worker.shutdown()
    assert time.monotonic() - start < 3.0  # was 20 s before the fix


def test_worker_checks_hooks_and_block_ids(tmp_path: Path) -> None:
    worker = SharedStorageConnector().create_worker(make_config(tmp_path), 0)
    layout, _, kv = make_kv()
    worker.register_kv_caches(kv, layout)
    with pytest.raises(MetadataNotBoundError):
        worker.start_load_kv(forward(kv))
    with pytest.raises(InvalidArgumentError):
        worker.bind_connector_metadata(NullMetadata())
    outside = SharedStorageMetadata(loads=(LoadJob("r", ((NUM_BLOCKS, "aa"),)),))
    worker.bind_connector_metadata(outside)
    with pytest.raises(InvalidBlockIdError):  # LAY-012: capacity is not the budget
        worker.start_load_kv(forward(kv))
    worker.clear_connector_metadata()
    assert worker.build_connector_output(frozenset()).is_empty()
    worker.shutdown()


def test_zero_token_step_without_start_load_kv(tmp_path: Path) -> None:
    worker = SharedStorageConnector().create_worker(make_config(tmp_path), 0)
    layout, _, kv = make_kv()
    worker.register_kv_caches(kv, layout)
    worker.bind_connector_metadata(SharedStorageMetadata(saves=(SaveJob("s", ((1, "aa"),)),)))
    worker.clear_connector_metadata()  # no forward: the save still starts
    assert collect(worker, sending={"s"}).sending == {"s"}
    worker.shutdown()


# ------------------------------------------------------------------- two ranks, end to end


def test_end_to_end_two_ranks(tmp_path: Path) -> None:
    """Scheduler + two ranks + the standard aggregator: save A's blocks, load them for B."""
    factory = SharedStorageConnector()
    config = make_config(tmp_path, tp=2)
    sched = factory.create_scheduler(config)
    workers = [factory.create_worker(config, r) for r in range(2)]
    caches = [make_kv(StrideOrder.LBNHC, KVPacking.SPLIT, seed=r) for r in range(2)]
    for w, (layout, _, kv) in zip(workers, caches):
        w.register_kv_caches(kv, layout)
    agg = StandardAggregator(world_size=2)

    def step(n: int) -> KVConnectorOutput:
        data = sched.build_connector_meta(sched_output(n)).encode()
        outs = []
        for w, (_, _, kv) in zip(workers, caches):
            run_step(w, SharedStorageMetadata.decode(data), kv)
            outs.append(w.build_connector_output(frozenset()))
        out = agg.aggregate(outs)
        sched.update_connector_output(out)
        return out

    a = make_request("a", range(11), output=(99,), computed=11)
    sched.on_new_request(a)
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    saved = [{b: block_bytes(kv, lay, b) for b in (4, 5)} for lay, _, kv in caches]
    assert sched.request_finished(a, (4, 5, 6)) == (True, None)
    agg.expect("a", Direction.SEND)
    for n in range(200):
        if step(n).finished_sending:
            break
        time.sleep(0.002)
    else:
        raise AssertionError("save never reported")
    assert len([e for e in sched.take_events() if isinstance(e, BlockStored)]) == 1

    b = make_request("b", list(range(11)) + [7, 7, 7])
    sched.on_new_request(b)
    assert sched.get_num_new_matched_tokens(b, 0) == (8, True)
    sched.update_state_after_alloc(b, AllocatedBlocks.single([9, 10, 11, 0]), 8)
    agg.expect("b", Direction.RECV)
    for n in range(200, 400):
        out = step(n)
        if out.finished_recving:
            assert not out.failed_recving
            break
        time.sleep(0.002)
    else:
        raise AssertionError("load never reported")
    sched.update_state_after_alloc(b, AllocatedBlocks.single([9, 10, 11, 0]), 0)
    for rank, (layout, _, kv) in enumerate(caches):
        assert block_bytes(kv, layout, 9) == saved[rank][4]
        assert block_bytes(kv, layout, 10) == saved[rank][5]
    for w in workers:
        w.shutdown()
    sched.shutdown()


# --------------------------------------------------------------------------------- broken


def test_broken_catalogue() -> None:
    clauses = [c for _, c in BROKEN_CONNECTORS]
    # one clause each; twice: WRK-013 (a corrupt load, and a save racing the next step)
    # and SPD-004 (a stale output after drafting, and saves reported before they ran)
    twice = {c for c in clauses if clauses.count(c) > 1}
    assert twice == {"WRK-013", "SPD-004"} and all(clauses.count(c) == 2 for c in twice)
    assert len(BROKEN_CONNECTORS) >= 25
    names = set()
    for cls, clause in BROKEN_CONNECTORS:
        factory = cls()
        # every variant breaks one clause of a reference connector and declares what it does
        base = (LayerwiseStorageConnector if issubclass(cls, LayerwiseStorageConnector)
                else StateCache if issubclass(cls, StateCache)
                else TinyCache if issubclass(cls, TinyCache) else SharedStorageConnector)
        assert isinstance(factory, base)
        assert cls.violates == clause and clause in (cls.__doc__ or "")
        want = base().capabilities
        if cls is FullPromptStateConnector:  # STG-004 is about asynchronous matches, and
            want = attrs.evolve(want, async_loads=True)  # StateCache loads synchronously
        assert factory.capabilities == want
        names.add(factory.name)
    assert len(names) == len(BROKEN_CONNECTORS)


def test_full_prompt_hit(tmp_path: Path) -> None:
    req = make_request("r", range(12))
    mark_stored(tmp_path, req, 3)
    assert new_scheduler(tmp_path).get_num_new_matched_tokens(req, 0) == (8, True)
    # the variant is synchronous (an async full hit is legal, SCH-005): the whole prompt
    broken = new_scheduler(tmp_path, FullPromptHitConnector())
    assert broken.get_num_new_matched_tokens(req, 0) == (12, False)


def test_async_zero(tmp_path: Path) -> None:
    req = make_request("r", range(12))
    assert new_scheduler(tmp_path).get_num_new_matched_tokens(req, 0) == (0, False)
    assert new_scheduler(tmp_path, AsyncZeroConnector()).get_num_new_matched_tokens(req, 0) == (
        0, True,
    )


def test_impure_match(tmp_path: Path) -> None:
    req = make_request("r", range(13))
    mark_stored(tmp_path, req, 3)
    base = new_scheduler(tmp_path)
    assert [base.get_num_new_matched_tokens(req, 0) for _ in range(2)] == [(12, True)] * 2
    broken = new_scheduler(tmp_path, ImpureMatchConnector())
    assert [broken.get_num_new_matched_tokens(req, 0) for _ in range(2)] == [
        (12, True), (8, True),
    ]


def test_no_salt(tmp_path: Path) -> None:
    tenant_a = make_request("a", range(9), salt="a", computed=9)
    tenant_b = make_request("b", range(9), salt="b")
    for factory, expected in ((SharedStorageConnector(), (0, False)),
                              (NoSaltConnector(), (8, True))):
        sched = new_scheduler(tmp_path / factory.name, factory)
        sched.on_new_request(tenant_a)
        assert sched.request_finished(tenant_a, (0, 1, 2)) == (True, None)
        worker_wrote(tmp_path / factory.name, sched.build_connector_meta(sched_output()))
        sched.update_connector_output(KVConnectorOutput(finished_sending={"a"}))
        assert sched.get_num_new_matched_tokens(tenant_b, 0) == expected


def test_read_after_free(tmp_path: Path) -> None:
    factory = ReadAfterFreeConnector()
    sched = new_scheduler(tmp_path, factory)
    worker = factory.create_worker(make_config(tmp_path), 0)
    layout, _, kv = make_kv()
    worker.register_kv_caches(kv, layout)
    req = make_request("r", range(9), computed=9)
    sched.on_new_request(req)
    assert sched.request_finished(req, (3, 4, 5)) == (False, None)  # freed at once...
    meta = sched.build_connector_meta(sched_output())
    assert isinstance(meta, SharedStorageMetadata)
    assert meta.saves == (SaveJob("r", tuple(zip((3, 4), keys_of(req, 0, 1))), report=False),)
    run_step(worker, meta, kv)  # ...but read here, a step later
    deadline = time.monotonic() + 5
    while not os.path.exists(marker_path(str(tmp_path), keys_of(req, 1)[0])):
        assert not worker.build_connector_output(frozenset()).finished_sending  # never
        sched.build_connector_meta(sched_output())
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert sched.get_num_new_matched_tokens(make_request("q", range(9)), 0) == (8, True)
    worker.shutdown()


def test_no_send_report(tmp_path: Path) -> None:
    worker = NoSendReportConnector().create_worker(make_config(tmp_path), 0)
    layout, _, kv = make_kv()
    worker.register_kv_caches(kv, layout)
    run_step(worker, SharedStorageMetadata(saves=(SaveJob("s", ((1, "aa"),)),)), kv)
    deadline = time.monotonic() + 5
    while not os.path.exists(block_path(str(tmp_path), "aa", 0)):
        assert time.monotonic() < deadline
        time.sleep(0.002)
    time.sleep(0.02)
    for _ in range(3):
        assert worker.build_connector_output(frozenset()).finished_sending == frozenset()
    worker.shutdown()


def test_double_report(tmp_path: Path) -> None:
    worker = DoubleReportConnector().create_worker(make_config(tmp_path), 0)
    layout, _, kv = make_kv()
    worker.register_kv_caches(kv, layout)
    keys = write_saved(tmp_path, worker, kv)
    run_step(worker, SharedStorageMetadata(loads=(LoadJob("r", ((5, keys[0]),)),)), kv)
    deadline = time.monotonic() + 5
    while not (out := worker.build_connector_output(frozenset())).finished_recving:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert worker.build_connector_output(frozenset()).finished_recving == {"r"}  # again
    assert worker.build_connector_output(frozenset()).finished_recving == frozenset()
    worker.shutdown()


def test_unknown_report(tmp_path: Path) -> None:
    worker = UnknownReportConnector().create_worker(make_config(tmp_path), 0)
    assert worker.build_connector_output(frozenset()).finished_sending == {"ghost-request"}
    assert worker.build_connector_output(frozenset()).is_empty()
    base = SharedStorageConnector().create_worker(make_config(tmp_path), 0)
    assert base.build_connector_output(frozenset()).is_empty()


def test_corrupt_load(tmp_path: Path) -> None:
    saved, kv, layout, got = save_then_load(
        tmp_path, StrideOrder.LBHNC, KVPacking.CONCAT, factory=CorruptLoadConnector()
    )
    assert not got.failed  # reported as a success
    loaded = block_bytes(kv, layout, 7)
    assert loaded[1:] == saved[1][1:]
    assert loaded[0][1:] == saved[1][0][1:]
    assert loaded[0][0] == saved[1][0][0] ^ 1


@pytest.mark.parametrize("factory", [SharedStorageConnector(), DropsAbortedRecvConnector()])
def test_drops_aborted_recv(tmp_path: Path, factory: ConnectorFactory) -> None:
    config = make_config(tmp_path, load_delay_s=0.1)
    sched = factory.create_scheduler(config)
    worker = factory.create_worker(config, 0)
    layout, _, kv = make_kv()
    worker.register_kv_caches(kv, layout)
    req = make_request("r", range(9))
    mark_stored(tmp_path, req, 2)  # markers without files: the load fails, still reported
    assert sched.get_num_new_matched_tokens(req, 0) == (8, True)
    sched.update_state_after_alloc(req, AllocatedBlocks.single([3, 4, 5]), 8)
    run_step(worker, sched.build_connector_meta(sched_output(0)), kv)
    assert worker.build_connector_output(frozenset()).is_empty()  # still in flight
    assert sched.request_finished(req, (3, 4, 5)) == (False, None)  # abort
    run_step(worker, sched.build_connector_meta(sched_output(1)), kv)
    deadline = time.monotonic() + 0.6
    reported: set[str] = set()
    while time.monotonic() < deadline and not reported:
        reported |= worker.build_connector_output(frozenset()).finished_recving
        time.sleep(0.005)
    assert reported == (set() if isinstance(factory, DropsAbortedRecvConnector) else {"r"})
    worker.shutdown()
