"""Unit tests of the layerwise-storage connector and its graph-unsafe variants, no engine.

Metadata codec; worker round trips over every stride order and both K/V packings; dummy
metadata; failed loads; the capturability of the per-layer hooks (no host sync, persistent
buffers, capture with dummy metadata then replay with real metadata); the scheduler's
synchronous matching, per-step save planning and marker writing; each broken variant's one
deviation.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvspec.conformance.connectors.broken_graphs import (
    BROKEN_GRAPH_CONNECTORS,
    AssertsRealMetadataConnector,
    BrokenGraphConnector,
    ItemInHookConnector,
    PythonDecidesConnector,
)
from kvspec.conformance.connectors.layerwise import (
    DEFAULT_MAX_BLOCKS_PER_STEP,
    LayerwiseMetadata,
    LayerwiseStorageConnector,
    LayerwiseStorageScheduler,
    LayerwiseStorageWorker,
)
from kvspec.conformance.connectors.shared_storage import (
    LoadJob,
    SharedStorageConnector,
    SharedStorageMetadata,
    block_path,
    marker_path,
)
from kvspec.protocols import (
    AllocatedBlocks,
    BlockRemoved,
    BlockStored,
    CachedRequestView,
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
    MalformedMetadataError,
    MetadataNotBoundError,
    NewRequestView,
    RequestView,
    SchedulerConnector,
    SchedulerOutputView,
    StrideOrder,
    TransferRole,
    UnknownRequestError,
    WorkerConnector,
)

BS = 4  # tokens per block
LAYERS = 3
NUM_BLOCKS = 12
S = 4  # max_blocks_per_step in most tests: small, so that padding and limits are exercised
LAYER_NAMES = tuple(f"layer.{i}" for i in range(LAYERS))

HOST_SYNC = "aten._local_scalar_dense"
DATA_DEPENDENT = "aten.nonzero"


# ------------------------------------------------------------------------------ helpers


def make_config(tmp_path: Path, **extra: Any) -> EngineConfigView:
    return EngineConfigView(
        engine_id="engine-0",
        role=TransferRole.BOTH,
        num_layers=LAYERS,
        block_size=BS,
        num_blocks=NUM_BLOCKS,
        extra={"kvspec.tmpdir": str(tmp_path), "max_blocks_per_step": S, **extra},
    )


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
    return layout, buffer, {name: view[i] for i, name in enumerate(LAYER_NAMES)}


def block_bytes(kv: Mapping[str, torch.Tensor], layout: KVCacheLayout, block: int) -> list[bytes]:
    split = layout.packing is KVPacking.SPLIT
    out = []
    for t in kv.values():
        b = (t[:, block] if split else t[block]).contiguous()
        out.append(bytes(b.view(torch.uint8).reshape(-1).tolist()))
    return out


def all_blocks(kv: Mapping[str, torch.Tensor], layout: KVCacheLayout) -> list[list[bytes]]:
    return [block_bytes(kv, layout, b) for b in range(layout.block_capacity)]


def real_ctx(step: int = 0) -> ForwardContextView:
    return ForwardContextView(ForwardKind.REAL, step, 8, LAYER_NAMES)


def dummy_ctx() -> ForwardContextView:
    return ForwardContextView(ForwardKind.WARMUP, None, 8, LAYER_NAMES)


def layers(
    worker: WorkerConnector, kv: Mapping[str, torch.Tensor], ctx: ForwardContextView
) -> None:
    """The per-layer hooks of one forward, in order (WRK-005, WRK-006)."""
    for name, tensor in kv.items():
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, tensor, ctx)


def forward(worker: WorkerConnector, meta: Any, kv: Mapping[str, torch.Tensor]) -> None:
    """Ship ``meta`` as bytes, like the engine, and run one eager forward's hooks."""
    decoded = type(meta).decode(meta.encode())
    assert decoded == meta
    ctx = dummy_ctx() if meta.dummy else real_ctx()
    worker.bind_connector_metadata(decoded)
    worker.start_load_kv(ctx)
    layers(worker, kv, ctx)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def new_worker(
    tmp_path: Path,
    order: StrideOrder = StrideOrder.LBHNC,
    packing: KVPacking = KVPacking.CONCAT,
    dtype: torch.dtype = torch.float16,
    factory: ConnectorFactory | None = None,
    **extra: Any,
) -> tuple[WorkerConnector, KVCacheLayout, torch.Tensor, dict[str, torch.Tensor]]:
    worker = (factory or LayerwiseStorageConnector()).create_worker(
        make_config(tmp_path, **extra), 0
    )
    layout, buffer, kv = make_kv(order, packing, dtype)
    worker.register_kv_caches(kv, layout)
    return worker, layout, buffer, kv


KEYS = ["a1" * 8, "b2" * 8, "c3" * 8]


def save_then_load(
    worker: WorkerConnector, layout: KVCacheLayout, buffer: torch.Tensor,
    kv: dict[str, torch.Tensor], tmp_path: Path,
) -> dict[int, list[bytes]]:
    """Save blocks 1, 3, 4 under KEYS, zero the cache, load KEYS into 7, 8, 9."""
    saved = {b: block_bytes(kv, layout, b) for b in (1, 3, 4)}
    forward(worker, LayerwiseMetadata(saves=tuple(zip((1, 3, 4), KEYS))), kv)
    for key in KEYS:
        assert os.path.exists(block_path(str(tmp_path), key, 0))
    buffer.zero_()
    forward(worker, LayerwiseMetadata(loads=tuple(zip((7, 8, 9), KEYS))), kv)
    return saved


class OpRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the ATen ops (overload packets) that run under it, and runs them."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@contextmanager
def recording() -> Iterator[OpRecorder]:
    with OpRecorder() as rec:
        yield rec


# ------------------------------------------------------------------------------ factory


def test_factory_and_capabilities(tmp_path: Path) -> None:
    factory = LayerwiseStorageConnector()
    assert isinstance(factory, ConnectorFactory)
    assert factory.name == "layerwise-storage"
    caps = factory.capabilities
    assert caps.layer_hooks is HookGraphMode.CAPTURABLE
    assert not caps.async_loads and not caps.delayed_free
    assert caps.failure_reporting is FailureReporting.INVALID_BLOCKS
    assert caps.accepted_layouts == () and caps.accepts_split_kv
    assert isinstance(factory.create_scheduler(make_config(tmp_path)), SchedulerConnector)
    assert isinstance(factory.create_worker(make_config(tmp_path), 0), WorkerConnector)
    assert DEFAULT_MAX_BLOCKS_PER_STEP == 64


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "8"])
def test_max_blocks_per_step_is_validated(tmp_path: Path, value: Any) -> None:
    with pytest.raises(InvalidArgumentError):
        LayerwiseStorageWorker(make_config(tmp_path, max_blocks_per_step=value), 0)
    with pytest.raises(InvalidArgumentError):
        LayerwiseStorageScheduler(make_config(tmp_path, max_blocks_per_step=value))


# ----------------------------------------------------------------------------- metadata


def test_metadata_round_trip() -> None:
    meta = LayerwiseMetadata(loads=((1, "ab"), (2, "ab")), saves=((3, "cd"), (5, "ef")))
    assert LayerwiseMetadata.decode(meta.encode()) == meta
    assert not meta.is_empty and not meta.dummy
    dummy = LayerwiseMetadata(dummy=True)
    assert LayerwiseMetadata.decode(dummy.encode()) == dummy
    assert dummy.is_empty
    raw = bytearray(LayerwiseMetadata().encode())
    assert LayerwiseMetadata.decode(raw) == LayerwiseMetadata()  # type: ignore[arg-type]


GOOD = (
    b'{"dummy":false,"kind":"kvspec.layerwise_storage","loads":[[1,"ab"]],"saves":[],'
    b'"version":1}'
)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff",
        b"[]",
        b"{}",
        GOOD.replace(b'"dummy":false,', b""),
        GOOD.replace(b'"version":1', b'"version":1,"extra":0'),
        GOOD.replace(b"layerwise_storage", b"shared_storage"),
        GOOD.replace(b'"version":1', b'"version":2'),
        GOOD.replace(b'"version":1', b'"version":true'),
        GOOD.replace(b'"dummy":false', b'"dummy":0'),
        GOOD.replace(b'"dummy":false', b'"dummy":true'),  # dummy with a job (DRY-006)
        GOOD.replace(b'[[1,"ab"]]', b'{"1":"ab"}'),
        GOOD.replace(b'[[1,"ab"]]', b'[[1,"ab",0]]'),
        GOOD.replace(b'[[1,"ab"]]', b'[[-1,"ab"]]'),
        GOOD.replace(b'[[1,"ab"]]', b'[[1.0,"ab"]]'),
        GOOD.replace(b'[[1,"ab"]]', b'[[true,"ab"]]'),
        GOOD.replace(b'[[1,"ab"]]', b'[[1,"AB"]]'),
        GOOD.replace(b'[[1,"ab"]]', b'[[1,"abc"]]'),
        GOOD.replace(b'[[1,"ab"]]', b'[[1,"ab"],[1,"cd"]]'),  # one block loaded twice
        GOOD.replace(b'"saves":[]', b'"saves":[[1,"ab"],[2,"ab"]]'),  # one key saved twice
        GOOD.replace(b'[[1,"ab"]]', b"[[NaN,\"ab\"]]"),
        GOOD.replace(b'[[1,"ab"]]', b"[" * 5000 + b"]" * 5000),
    ],
)
def test_metadata_rejects_malformed(data: bytes) -> None:
    with pytest.raises(MalformedMetadataError):
        LayerwiseMetadata.decode(data)


def test_metadata_decode_rejects_non_bytes() -> None:
    with pytest.raises(MalformedMetadataError):
        LayerwiseMetadata.decode(GOOD.decode())  # type: ignore[arg-type]


def test_metadata_constructor_validates() -> None:
    with pytest.raises(InvalidBlockIdError):
        LayerwiseMetadata(loads=((-1, "ab"),))
    with pytest.raises(InvalidArgumentError):
        LayerwiseMetadata(loads=[(1, "ab")])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        LayerwiseMetadata(saves=((1, "ab"), (1, "cd")))
    with pytest.raises(InvalidArgumentError):
        LayerwiseMetadata(dummy=True, saves=((1, "ab"),))
    with pytest.raises(InvalidArgumentError):
        LayerwiseMetadata(dummy=1)  # type: ignore[arg-type]
    LayerwiseMetadata(loads=((1, "ab"), (2, "ab")))  # one key into two blocks is fine


# ------------------------------------------------------------------------------- worker


@pytest.mark.parametrize("packing", list(KVPacking))
@pytest.mark.parametrize("order", list(StrideOrder))
def test_worker_round_trip(tmp_path: Path, order: StrideOrder, packing: KVPacking) -> None:
    worker, layout, buffer, kv = new_worker(tmp_path, order, packing)
    saved = save_then_load(worker, layout, buffer, kv, tmp_path)
    for src, dst in ((1, 7), (3, 8), (4, 9)):
        assert block_bytes(kv, layout, dst) == saved[src]
    zero = block_bytes(kv, layout, 0)
    assert set(zero[0]) == {0}
    for other in set(range(layout.block_capacity)) - {7, 8, 9}:  # WRK-002
        assert block_bytes(kv, layout, other) == zero
    out = worker.build_connector_output(frozenset())
    assert not out.invalid_block_ids and not out.finished_recving and not out.finished_sending
    worker.shutdown()
    worker.shutdown()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.int8])
def test_worker_round_trip_other_dtypes(tmp_path: Path, dtype: torch.dtype) -> None:
    worker, layout, buffer, kv = new_worker(tmp_path, StrideOrder.BLHNC, KVPacking.SPLIT, dtype)
    saved = save_then_load(worker, layout, buffer, kv, tmp_path)
    assert block_bytes(kv, layout, 8) == saved[3]


def test_full_buffers_and_one_key_into_two_blocks(tmp_path: Path) -> None:
    """S loads (no padding), one stored block loaded into two engine blocks."""
    worker, layout, buffer, kv = new_worker(tmp_path, StrideOrder.LHBNC, KVPacking.SPLIT)
    saved = {b: block_bytes(kv, layout, b) for b in (0, 1, 2, 3)}
    keys = ["d1" * 8, "d2" * 8, "d3" * 8, "d4" * 8]
    forward(worker, LayerwiseMetadata(saves=tuple(zip((0, 1, 2, 3), keys))), kv)
    buffer.zero_()
    loads = ((4, keys[0]), (5, keys[1]), (6, keys[1]), (11, keys[3]))
    forward(worker, LayerwiseMetadata(loads=loads), kv)
    assert block_bytes(kv, layout, 4) == saved[0]
    assert block_bytes(kv, layout, 5) == block_bytes(kv, layout, 6) == saved[1]
    assert block_bytes(kv, layout, 11) == saved[3]
    with pytest.raises(InvalidArgumentError):  # more than the buffers hold
        too_many = LayerwiseMetadata(loads=tuple((b, keys[0]) for b in range(5)))
        worker.bind_connector_metadata(too_many)


def test_dummy_metadata_moves_nothing(tmp_path: Path) -> None:
    worker, layout, _, kv = new_worker(tmp_path)
    forward(worker, LayerwiseMetadata(saves=((2, KEYS[0]),)), kv)  # buffers hold a real step
    before = all_blocks(kv, layout)
    files = sorted(os.listdir(tmp_path))
    meta = worker.build_dummy_connector_meta(dummy_ctx())
    assert isinstance(meta, LayerwiseMetadata) and meta.dummy and meta.is_empty  # DRY-006
    forward(worker, meta, kv)
    assert all_blocks(kv, layout) == before
    assert sorted(os.listdir(tmp_path)) == files
    bufs = worker.persistent_buffers  # type: ignore[attr-defined]
    assert not bool(bufs["load_mask"].any())
    worker.get_kv_connector_stats()  # drain the real step's counters
    out = worker.build_connector_output(frozenset())
    assert out.is_empty()


def test_dummy_metadata_is_built_without_the_scheduler(tmp_path: Path) -> None:
    """DRY-007: the worker builds it alone, even before registration."""
    worker = LayerwiseStorageConnector().create_worker(make_config(tmp_path), 0)
    meta = worker.build_dummy_connector_meta(dummy_ctx())
    worker.bind_connector_metadata(meta)
    worker.clear_connector_metadata()
    with pytest.raises(InvalidArgumentError):
        worker.bind_connector_metadata(LayerwiseMetadata(loads=((1, "ab"),)))


def test_missing_or_corrupt_file_is_reported_and_left_alone(tmp_path: Path) -> None:
    worker, layout, _, kv = new_worker(tmp_path, StrideOrder.LBNHC, KVPacking.SPLIT)
    forward(worker, LayerwiseMetadata(saves=((0, KEYS[0]), (1, KEYS[2]))), kv)
    path = block_path(str(tmp_path), KEYS[2], 0)
    Path(path).write_bytes(Path(path).read_bytes()[:-1])  # truncated
    before = {b: block_bytes(kv, layout, b) for b in (7, 8, 9)}
    # The first load fails too, so the padding entries repeat a masked-off entry.
    meta = LayerwiseMetadata(loads=((8, KEYS[1]), (7, KEYS[0]), (9, KEYS[2])))
    worker.bind_connector_metadata(meta)
    mask = worker.persistent_buffers["load_mask"]  # type: ignore[attr-defined]
    assert mask.tolist() == [False, True, False, False]
    worker.start_load_kv(real_ctx())
    layers(worker, kv, real_ctx())
    worker.wait_for_save()
    worker.clear_connector_metadata()
    assert block_bytes(kv, layout, 7) == block_bytes(kv, layout, 0)
    assert block_bytes(kv, layout, 8) == before[8]  # never written (SCH-024: recomputed)
    assert block_bytes(kv, layout, 9) == before[9]
    out = worker.build_connector_output(frozenset())
    assert out.invalid_block_ids == {8, 9}  # WRK-011
    assert not out.finished_recving and not out.failed_recving
    assert worker.get_block_ids_with_load_errors() == frozenset()  # each once


def test_worker_checks_hooks_and_arguments(tmp_path: Path) -> None:
    worker, layout, _, kv = new_worker(tmp_path)
    with pytest.raises(MetadataNotBoundError):  # DRY-001
        worker.wait_for_layer_load(LAYER_NAMES[0])
    with pytest.raises(MetadataNotBoundError):
        worker.save_kv_layer(LAYER_NAMES[0], kv[LAYER_NAMES[0]], real_ctx())
    with pytest.raises(MetadataNotBoundError):
        worker.start_load_kv(real_ctx())
    with pytest.raises(MetadataNotBoundError):
        worker.wait_for_save()
    with pytest.raises(InvalidArgumentError):
        worker.bind_connector_metadata(SharedStorageMetadata())
    with pytest.raises(InvalidBlockIdError):  # LAY-012: capacity is not the budget
        worker.bind_connector_metadata(LayerwiseMetadata(loads=((NUM_BLOCKS, "aa"),)))
    with pytest.raises(MetadataNotBoundError):  # a refused binding binds nothing
        worker.start_load_kv(real_ctx())
    worker.bind_connector_metadata(LayerwiseMetadata())
    with pytest.raises(InvalidArgumentError):
        worker.wait_for_layer_load("no.such.layer")
    with pytest.raises(InvalidArgumentError):
        worker.save_kv_layer(LAYER_NAMES[0], kv[LAYER_NAMES[0]][:2], real_ctx())
    with pytest.raises(InvalidArgumentError):  # WRK-001
        worker.register_kv_caches(kv, layout)
    worker.shutdown()
    assert worker.persistent_buffers == {}  # type: ignore[attr-defined]


def test_shared_storage_is_moved_once(tmp_path: Path) -> None:
    """LAY-011: layers sharing storage are moved by the first of them only."""
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
    worker = LayerwiseStorageConnector().create_worker(make_config(tmp_path), 0)
    worker.register_kv_caches(kv, shared)
    staging = worker.persistent_buffers["load_staging"]  # type: ignore[attr-defined]
    assert staging.shape == (S, 2, 1, 4, 4)
    ctx = ForwardContextView(ForwardKind.REAL, 0, 8, tuple(kv))
    worker.bind_connector_metadata(LayerwiseMetadata(saves=((2, "aa"),)))
    with recording() as rec:
        worker.save_kv_layer("c", kv["c"], ctx)
    assert rec.ops == []  # layer c's storage is moved by layer a
    for name, t in kv.items():
        worker.save_kv_layer(name, t, ctx)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    stored = safetensors.torch.load_file(block_path(str(tmp_path), "aa", 0))
    assert stored["block"].shape == (2, 1, 4, 4)  # two storages, not three layers
    expected = view[:, 2].clone()
    buffer.zero_()
    worker.bind_connector_metadata(LayerwiseMetadata(loads=((2, "aa"),)))
    for name in kv:
        worker.wait_for_layer_load(name)
    worker.clear_connector_metadata()
    assert torch.equal(view[:, 2], expected)
    assert int(torch.count_nonzero(view)) == int(torch.count_nonzero(expected))


def test_files_interoperate_with_the_shared_storage_connector(tmp_path: Path) -> None:
    worker, layout, buffer, kv = new_worker(tmp_path, StrideOrder.BHLNC, KVPacking.SPLIT)
    saved = block_bytes(kv, layout, 5)
    forward(worker, LayerwiseMetadata(saves=((5, KEYS[0]),)), kv)
    buffer.zero_()
    other = SharedStorageConnector().create_worker(make_config(tmp_path), 0)
    other.register_kv_caches(kv, layout)
    other.bind_connector_metadata(SharedStorageMetadata(loads=(LoadJob("r", ((6, KEYS[0]),)),)))
    other.start_load_kv(real_ctx())
    other.wait_for_save()
    other.clear_connector_metadata()
    deadline = time.monotonic() + 5
    while "r" not in other.get_finished(frozenset())[1]:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert not other.get_failed_recving()
    other.shutdown()
    assert block_bytes(kv, layout, 6) == saved


# ----------------------------------------------------------------- capturable hooks (GRA)


def test_hooks_do_no_host_sync(tmp_path: Path) -> None:
    """GRA-004: the per-layer hooks run only fixed-shape device ops, real step or dummy."""
    for packing in KVPacking:
        worker, _, _, kv = new_worker(tmp_path, StrideOrder.LBHNC, packing)
        forward(worker, LayerwiseMetadata(saves=((1, KEYS[0]), (2, KEYS[1]))), kv)
        metas = [
            LayerwiseMetadata(loads=((7, KEYS[0]), (8, KEYS[1])), saves=((3, KEYS[2]),)),
            LayerwiseMetadata(loads=((8, "ee" * 8),)),  # a failed load
            worker.build_dummy_connector_meta(dummy_ctx()),
        ]
        for meta in metas:
            worker.bind_connector_metadata(meta)
            with recording() as rec:
                layers(worker, kv, real_ctx())
            assert HOST_SYNC not in rec.ops and DATA_DEPENDENT not in rec.ops
            assert {"aten.index_select", "aten.where", "aten.index_copy_", "aten.copy_"} <= set(
                rec.ops
            )
            worker.wait_for_save()
            worker.clear_connector_metadata()


def test_item_in_hook_variant_syncs(tmp_path: Path) -> None:
    worker, _, _, kv = new_worker(tmp_path, factory=ItemInHookConnector())
    worker.bind_connector_metadata(worker.build_dummy_connector_meta(dummy_ctx()))
    with recording() as rec:
        worker.wait_for_layer_load(LAYER_NAMES[0])
    assert HOST_SYNC in rec.ops


def test_buffers_are_never_reallocated(tmp_path: Path) -> None:
    """GRA-005: the buffers the hooks read stay at their addresses across every binding."""
    worker, _, _, kv = new_worker(tmp_path, StrideOrder.BLNHC, KVPacking.SPLIT)
    bufs = dict(worker.persistent_buffers)  # type: ignore[attr-defined]
    assert set(bufs) == {"load_idx", "load_mask", "save_idx", "load_staging", "save_staging"}
    assert bufs["load_idx"].dtype == bufs["save_idx"].dtype == torch.int64
    assert bufs["load_mask"].dtype == torch.bool
    assert bufs["load_idx"].shape == bufs["load_mask"].shape == (S,)
    ptrs = {k: v.data_ptr() for k, v in bufs.items()}
    metas = [
        LayerwiseMetadata(saves=((1, KEYS[0]), (2, KEYS[1]))),
        worker.build_dummy_connector_meta(dummy_ctx()),
        LayerwiseMetadata(loads=((7, KEYS[0]), (8, "ee" * 8)), saves=((3, KEYS[2]),)),
        LayerwiseMetadata(loads=tuple(zip((4, 5, 6, 9), [KEYS[0]] * 4))),
        LayerwiseMetadata(),
    ]
    for meta in metas:
        forward(worker, meta, kv)
        now = worker.persistent_buffers  # type: ignore[attr-defined]
        assert {k: v.data_ptr() for k, v in now.items()} == ptrs
        assert all(now[k] is bufs[k] for k in bufs)


def test_capture_with_dummy_metadata_then_replay_real_steps(tmp_path: Path) -> None:
    """GRA-006: hooks captured once under dummy metadata replay each real step's transfers,
    byte-identical to running them eagerly."""
    graphs = pytest.importorskip("kvspec.conformance.graphs")
    worker, layout, buffer, kv = new_worker(tmp_path, StrideOrder.LBNHC, KVPacking.SPLIT)
    eager, _, eager_buf, eager_kv = new_worker(tmp_path / "eager", StrideOrder.LBNHC,
                                               KVPacking.SPLIT)
    worker.bind_connector_metadata(worker.build_dummy_connector_meta(dummy_ctx()))
    before = all_blocks(kv, layout)
    graph, _ = graphs.make_capturer("cpu", warmup=1).capture(
        lambda: layers(worker, kv, real_ctx())
    )
    worker.clear_connector_metadata()
    assert all_blocks(kv, layout) == before  # warm-up and capture moved nothing (DRY-006)

    def step(meta: LayerwiseMetadata) -> None:
        worker.bind_connector_metadata(meta)
        graph.replay()
        worker.wait_for_save()
        worker.clear_connector_metadata()
        forward(eager, meta, eager_kv)

    saves = LayerwiseMetadata(saves=((1, KEYS[0]), (3, KEYS[1]), (4, KEYS[2])))
    step(saves)
    for key in KEYS:
        assert os.path.exists(block_path(str(tmp_path), key, 0))
        assert (Path(block_path(str(tmp_path), key, 0)).read_bytes()
                == Path(block_path(str(tmp_path / "eager"), key, 0)).read_bytes())
    saved = {b: block_bytes(kv, layout, b) for b in (1, 3, 4)}
    buffer.zero_()
    eager_buf.zero_()
    step(LayerwiseMetadata(loads=((7, KEYS[0]), (8, KEYS[1]), (9, KEYS[2]))))
    assert block_bytes(kv, layout, 7) == saved[1]
    assert block_bytes(kv, layout, 9) == saved[4]
    assert all_blocks(kv, layout) == all_blocks(eager_kv, layout)
    step(LayerwiseMetadata(loads=((2, KEYS[1]), (3, "ee" * 8))))  # one file is missing
    assert block_bytes(kv, layout, 2) == saved[3]
    assert all_blocks(kv, layout) == all_blocks(eager_kv, layout)
    assert worker.get_block_ids_with_load_errors() == {3}
    graph.reset()


# ---------------------------------------------------------------------- broken variants


def test_broken_graph_catalogue() -> None:
    assert [(c, v) for c, v in BROKEN_GRAPH_CONNECTORS] == [
        (PythonDecidesConnector, "GRA-006"),
        (ItemInHookConnector, "GRA-004"),
        (AssertsRealMetadataConnector, "DRY-005"),
    ]
    names = {cls().name for cls, _ in BROKEN_GRAPH_CONNECTORS}
    assert len(names) == 3
    for cls, clause in BROKEN_GRAPH_CONNECTORS:
        assert issubclass(cls, BrokenGraphConnector) and cls.violates == clause
        assert cls().capabilities == LayerwiseStorageConnector().capabilities  # claims conformance


@pytest.mark.parametrize("factory", [c for c, _ in BROKEN_GRAPH_CONNECTORS])
def test_broken_variants_are_correct_when_eager(tmp_path: Path, factory: type) -> None:
    """Each variant moves the right bytes on eager real steps: only graphs or dummy runs
    expose it."""
    worker, layout, buffer, kv = new_worker(tmp_path, StrideOrder.LBHNC, KVPacking.SPLIT,
                                            factory=factory())
    saved = save_then_load(worker, layout, buffer, kv, tmp_path)
    assert block_bytes(kv, layout, 8) == saved[3]
    assert set(block_bytes(kv, layout, 5)[0]) == {0}


def test_python_decides_variant_replays_nothing(tmp_path: Path) -> None:
    graphs = pytest.importorskip("kvspec.conformance.graphs")
    worker, layout, buffer, kv = new_worker(tmp_path, factory=PythonDecidesConnector())
    forward(worker, LayerwiseMetadata(saves=((1, KEYS[0]),)), kv)
    buffer.zero_()
    worker.bind_connector_metadata(worker.build_dummy_connector_meta(dummy_ctx()))
    graph, _ = graphs.make_capturer("cpu", warmup=0).capture(
        lambda: layers(worker, kv, real_ctx())
    )
    worker.clear_connector_metadata()
    worker.bind_connector_metadata(LayerwiseMetadata(loads=((7, KEYS[0]),)))
    graph.replay()
    worker.clear_connector_metadata()
    assert set(block_bytes(kv, layout, 7)[0]) == {0}  # the load was silently skipped
    assert graph.recorded_ops == ()


def test_item_in_hook_variant_is_refused_by_capture(tmp_path: Path) -> None:
    graphs = pytest.importorskip("kvspec.conformance.graphs")
    from kvspec.protocols import ContractViolation

    worker, _, _, kv = new_worker(tmp_path, factory=ItemInHookConnector())
    worker.bind_connector_metadata(worker.build_dummy_connector_meta(dummy_ctx()))
    with pytest.raises(ContractViolation, match="GRA-004"):
        graphs.make_capturer("cpu", warmup=0).capture(lambda: layers(worker, kv, real_ctx()))


def test_asserts_real_metadata_variant_fails_dummy_runs(tmp_path: Path) -> None:
    worker, _, _, kv = new_worker(tmp_path, factory=AssertsRealMetadataConnector())
    worker.bind_connector_metadata(worker.build_dummy_connector_meta(dummy_ctx()))
    with pytest.raises(AssertionError, match="dummy"):
        layers(worker, kv, dummy_ctx())


# ---------------------------------------------------------------------------- scheduler


def toy_hashes(tokens: tuple[int, ...], salt: str | None = None) -> tuple[bytes, ...]:
    parent = hashlib.sha256(f"root|{salt}".encode()).digest()
    out = []
    for i in range(len(tokens) // BS):
        parent = hashlib.sha256(parent + repr(tokens[i * BS:(i + 1) * BS]).encode()).digest()
        out.append(parent)
    return tuple(out)


def make_request(rid: str, prompt: Iterable[int], *, computed: int = 0,
                 salt: str | None = None) -> RequestView:
    prompt = tuple(prompt)
    return RequestView(request_id=rid, prompt_token_ids=prompt,
                       block_hashes=toy_hashes(prompt, salt), cache_salt=salt,
                       num_computed_tokens=computed)


def keys_of(request: RequestView, *positions: int) -> list[str]:
    return [request.block_hashes[i].hex() for i in positions]


def mark_stored(tmp_path: Path, request: RequestView, *positions: int) -> None:
    for key in keys_of(request, *positions):
        Path(marker_path(str(tmp_path), key)).write_bytes(b"x")


def is_stored(tmp_path: Path, key: str) -> bool:
    return os.path.exists(marker_path(str(tmp_path), key))


def new_req(request: RequestView, blocks: Iterable[int], computed: int) -> NewRequestView:
    return NewRequestView(request, AllocatedBlocks.single(blocks), computed)


def step_view(step: int, *, new: Iterable[tuple[NewRequestView, int]] = (),
              cached: Iterable[tuple[CachedRequestView, int]] = (),
              preempted: Iterable[str] = ()) -> SchedulerOutputView:
    new, cached = list(new), list(cached)
    counts = {r.request_id: n for r, n in new} | {r.request_id: n for r, n in cached}
    return SchedulerOutputView(step, tuple(r for r, _ in new), tuple(r for r, _ in cached),
                               counts, preempted_req_ids=preempted)


def admit(sched: SchedulerConnector, request: RequestView, blocks: list[int]) -> int:
    """Match, allocate and report the allocation like an engine; return the matched count."""
    sched.on_new_request(request)
    count, is_async = sched.get_num_new_matched_tokens(request, request.num_computed_tokens)
    assert count is not None and not is_async
    sched.update_state_after_alloc(request, AllocatedBlocks.single(blocks), count)
    return count


def wrote(directory: Path, *metas: Any) -> None:
    """Stand in for the worker: write the block files of the saves in ``metas``."""
    for meta in metas:
        for _, key in meta.saves:
            Path(block_path(str(directory), key, 0)).write_bytes(b"x")


def settle(sched: SchedulerConnector, invalid: Iterable[int] = ()) -> list[Any]:
    sched.update_connector_output(KVConnectorOutput(invalid_block_ids=frozenset(invalid)))
    return list(sched.take_events())


PROMPT = tuple(range(100, 114))  # 14 tokens: 3 full prompt blocks, 2 left over


def test_match_is_synchronous_and_capped(tmp_path: Path) -> None:
    sched = LayerwiseStorageScheduler(make_config(tmp_path, max_blocks_per_step=2))
    a = make_request("a", PROMPT)
    b = make_request("b", PROMPT, salt="other")
    mark_stored(tmp_path, a, 0, 1, 2)
    mark_stored(tmp_path, b, 0)
    sched.on_new_request(a)
    sched.on_new_request(b)
    assert sched.get_num_new_matched_tokens(a, 4) == (8, False)
    assert sched.get_num_new_matched_tokens(a, 0) == (8, False)  # capped to 2 blocks
    assert sched.get_num_new_matched_tokens(a, 0) == (8, False)  # SCH-001
    assert sched.get_num_new_matched_tokens(b, 0) == (4, False)
    sched.update_state_after_alloc(a, AllocatedBlocks.single([5, 6, 7, 8]), 8)
    assert sched.get_num_new_matched_tokens(b, 0) == (0, False)  # the step's loads are full
    with pytest.raises(InvalidArgumentError):
        sched.update_state_after_alloc(b, AllocatedBlocks.single([9]), 4)
    meta = sched.build_connector_meta(step_view(0, new=[(new_req(a, [5, 6, 7, 8], 8), 6)]))
    assert isinstance(meta, LayerwiseMetadata)
    assert meta.loads == tuple(zip((5, 6), keys_of(a, 0, 1)))
    assert meta.saves == ()  # block 2 is stored already
    assert sched.get_num_new_matched_tokens(b, 0) == (4, False)  # a new step, room again
    later = sched.build_connector_meta(step_view(1))
    assert later == LayerwiseMetadata()  # each load described once (SCH-013)


def test_load_starts_at_the_computed_tokens(tmp_path: Path) -> None:
    sched = LayerwiseStorageScheduler(make_config(tmp_path))
    a = make_request("a", PROMPT, computed=4)
    mark_stored(tmp_path, a, 0, 1, 2)
    assert admit(sched, a, [3, 4, 5, 6]) == 8
    meta = sched.build_connector_meta(step_view(0, new=[(new_req(a, [3, 4, 5, 6], 12), 2)]))
    assert isinstance(meta, LayerwiseMetadata)
    assert meta.loads == tuple(zip((4, 5), keys_of(a, 1, 2)))


def test_saves_follow_the_filled_prompt_blocks(tmp_path: Path) -> None:
    sched = LayerwiseStorageScheduler(make_config(tmp_path))
    a = make_request("a", PROMPT)
    assert admit(sched, a, [0, 1]) == 0
    m0 = sched.build_connector_meta(step_view(0, new=[(new_req(a, [0, 1], 0), 6)]))
    assert isinstance(m0, LayerwiseMetadata) and m0.saves == ((0, keys_of(a, 0)[0]),)
    # chunk 2: tokens 6..14 fill prompt blocks 1 and 2; block 3 is never full in the prompt
    m1 = sched.build_connector_meta(step_view(1, cached=[
        (CachedRequestView("a", AllocatedBlocks.single([2, 3]), 6), 8)]))
    assert isinstance(m1, LayerwiseMetadata)
    assert m1.saves == tuple(zip((1, 2), keys_of(a, 1, 2)))
    m2 = sched.build_connector_meta(step_view(2, cached=[
        (CachedRequestView("a", AllocatedBlocks.single([]), 14), 1)]))
    assert m2 == LayerwiseMetadata()  # decode: generated tokens are never saved
    # outputs arrive in step order, possibly after later steps were built (SCH-014)
    assert not is_stored(tmp_path, keys_of(a, 0)[0])
    wrote(tmp_path, m0, m1)
    events = settle(sched)
    assert is_stored(tmp_path, keys_of(a, 0)[0]) and not is_stored(tmp_path, keys_of(a, 1)[0])
    assert [type(e) for e in events] == [BlockStored]
    events = settle(sched)
    assert all(is_stored(tmp_path, k) for k in keys_of(a, 1, 2))
    assert len(events) == 1 and isinstance(events[0], BlockStored)
    assert events[0].block_hashes == tuple(a.block_hashes[1:3])
    assert settle(sched) == []
    assert sched.request_finished(a, (0, 1, 2, 3)) == (False, None)
    with pytest.raises(UnknownRequestError):
        sched.request_finished(a, (0, 1, 2, 3))


def test_saves_are_deduplicated_and_bounded(tmp_path: Path) -> None:
    sched = LayerwiseStorageScheduler(make_config(tmp_path, max_blocks_per_step=2))
    a, b = make_request("a", PROMPT), make_request("b", PROMPT)  # same prefix
    admit(sched, a, [0, 1, 2, 3])
    admit(sched, b, [4, 5, 6, 7])
    m0 = sched.build_connector_meta(step_view(0, new=[
        (new_req(a, [0, 1, 2, 3], 0), 14), (new_req(b, [4, 5, 6, 7], 0), 14)]))
    assert isinstance(m0, LayerwiseMetadata)
    assert m0.saves == tuple(zip((0, 1), keys_of(a, 0, 1)))  # budget of 2; b's are a's keys
    m1 = sched.build_connector_meta(step_view(1, cached=[
        (CachedRequestView("a", AllocatedBlocks.single([]), 14), 1),
        (CachedRequestView("b", AllocatedBlocks.single([]), 14), 1)]))
    assert isinstance(m1, LayerwiseMetadata)
    assert m1.saves == ((2, keys_of(a, 2)[0]),)  # the rest, in a's next step; b skips it
    wrote(tmp_path, m0, m1)
    settle(sched)
    settle(sched)
    assert all(is_stored(tmp_path, k) for k in keys_of(a, 0, 1, 2))


def test_failed_load_is_unmarked_and_saved_again(tmp_path: Path) -> None:
    sched = LayerwiseStorageScheduler(make_config(tmp_path))
    a = make_request("a", PROMPT)
    mark_stored(tmp_path, a, 0, 1)
    assert admit(sched, a, [5, 6, 7, 8]) == 8
    m0 = sched.build_connector_meta(step_view(0, new=[(new_req(a, [5, 6, 7, 8], 8), 6)]))
    assert isinstance(m0, LayerwiseMetadata) and m0.loads == tuple(zip((5, 6), keys_of(a, 0, 1)))
    wrote(tmp_path, m0)
    events = settle(sched, invalid=[6])
    assert [type(e) for e in events] == [BlockRemoved, BlockStored]
    assert not is_stored(tmp_path, keys_of(a, 1)[0]) and is_stored(tmp_path, keys_of(a, 0)[0])
    # the engine recomputes from block 1 (SCH-024): its save is planned again
    m1 = sched.build_connector_meta(step_view(1, cached=[
        (CachedRequestView("a", AllocatedBlocks.single([]), 4), 10)]))
    assert isinstance(m1, LayerwiseMetadata)
    assert m1.saves == ((6, keys_of(a, 1)[0]),)  # block 2 was saved in step 0


def test_preempted_request_restarts_its_saves(tmp_path: Path) -> None:
    sched = LayerwiseStorageScheduler(make_config(tmp_path))
    a = make_request("a", PROMPT)
    admit(sched, a, [0, 1, 2, 3])
    sched.build_connector_meta(step_view(0, new=[(new_req(a, [0, 1, 2, 3], 0), 4)]))
    assert sched.build_connector_meta(step_view(1, preempted=["a"])) == LayerwiseMetadata()
    m2 = sched.build_connector_meta(step_view(2, cached=[
        (CachedRequestView("a", AllocatedBlocks.single([9, 10, 11]), 4,
                           resumed_from_preemption=True), 10)]))
    assert isinstance(m2, LayerwiseMetadata)
    assert m2.saves == tuple(zip((10, 11), keys_of(a, 1, 2)))  # block 0 is being saved


def test_scheduler_rejects_what_it_never_awaits(tmp_path: Path) -> None:
    sched = LayerwiseStorageScheduler(make_config(tmp_path))
    ghost = make_request("ghost", PROMPT)
    with pytest.raises(UnknownRequestError):
        sched.update_state_after_alloc(ghost, AllocatedBlocks.single([1]), 0)
    with pytest.raises(UnknownRequestError):
        sched.request_finished(ghost, ())
    with pytest.raises(UnknownRequestError):
        sched.update_connector_output(KVConnectorOutput(finished_sending=frozenset({"x"})))
    settle(sched)  # an output with no step built is ignored
    sched.shutdown()
    sched.shutdown()


def test_dropped_load_of_a_finished_request(tmp_path: Path) -> None:
    sched = LayerwiseStorageScheduler(make_config(tmp_path))
    a = make_request("a", PROMPT)
    mark_stored(tmp_path, a, 0)
    assert admit(sched, a, [1, 2]) == 4
    assert sched.request_finished(a, (1, 2)) == (False, None)
    assert sched.build_connector_meta(step_view(0)) == LayerwiseMetadata()


# ---------------------------------------------------------------------------- end to end


def write_kv(kv: Mapping[str, torch.Tensor], layout: KVCacheLayout, blocks: Iterable[int],
             seed: int) -> None:
    """What the model's forward writes into the request's blocks (before save_kv_layer)."""
    gen = torch.Generator().manual_seed(seed)
    split = layout.packing is KVPacking.SPLIT
    for t in kv.values():
        for b in blocks:
            block = t[:, b] if split else t[b]
            block.copy_(torch.randn(block.shape, generator=gen).to(t.dtype))


def run_forward(worker: WorkerConnector, meta: Any, kv: Mapping[str, torch.Tensor],
                write: Callable[[], None]) -> KVConnectorOutput:
    worker.bind_connector_metadata(type(meta).decode(meta.encode()))
    worker.start_load_kv(real_ctx())
    write()
    layers(worker, kv, real_ctx())
    worker.wait_for_save()
    worker.clear_connector_metadata()
    return worker.build_connector_output(frozenset())


def test_end_to_end_scheduler_and_worker(tmp_path: Path) -> None:
    factory = LayerwiseStorageConnector()
    sched = factory.create_scheduler(make_config(tmp_path))
    worker, layout, _, kv = new_worker(tmp_path, StrideOrder.BLHNC, KVPacking.CONCAT)
    a = make_request("a", PROMPT)
    admit(sched, a, [0, 1, 2, 3])
    meta = sched.build_connector_meta(step_view(0, new=[(new_req(a, [0, 1, 2, 3], 0), 14)]))
    out = run_forward(worker, meta, kv, lambda: write_kv(kv, layout, [0, 1, 2, 3], seed=1))
    sched.update_connector_output(out)
    sched.request_finished(a, (0, 1, 2, 3))
    expected = {b: block_bytes(kv, layout, b) for b in (0, 1, 2)}

    b = make_request("b", PROMPT)
    assert admit(sched, b, [8, 9, 10, 11]) == 12
    meta = sched.build_connector_meta(step_view(1, new=[(new_req(b, [8, 9, 10, 11], 12), 2)]))
    out = run_forward(worker, meta, kv, lambda: None)
    assert not out.invalid_block_ids
    for src, dst in ((0, 8), (1, 9), (2, 10)):
        assert block_bytes(kv, layout, dst) == expected[src]
    sched.update_connector_output(out)
    worker.shutdown()
    sched.shutdown()
