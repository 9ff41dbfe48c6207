"""The role Protocols at run time: required methods enforced, documented defaults behave."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
import torch
from typing_extensions import Self

from kvspec.protocols import (
    AllocatedBlocks,
    Capabilities,
    ConnectorFactory,
    ConnectorMetadata,
    ConnectorStats,
    Direction,
    EngineConfigView,
    ExecutorConnector,
    ForwardContextView,
    ForwardKind,
    InvalidArgumentError,
    KVCacheLayout,
    KVConnectorOutput,
    KVPacking,
    LayoutNegotiationError,
    LayoutOffer,
    MetadataSlot,
    RequestView,
    SchedulerConnector,
    SchedulerOutputView,
    StandardAggregator,
    StrideOrder,
    TransferRole,
    UnsupportedOperationError,
    WorkerConnector,
    negotiate_layout,
)


class Meta:
    def __init__(self, step: int) -> None:
        self.step = step

    def encode(self) -> bytes:
        return str(self.step).encode()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        return cls(int(data))


class Scheduler(SchedulerConnector):
    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: RequestView, blocks: AllocatedBlocks, num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> Meta:
        return Meta(scheduler_output.step_id)


class Worker(WorkerConnector):
    def __init__(self) -> None:
        self.slot: MetadataSlot[Meta] = MetadataSlot(Meta)
        self.calls: list[str] = []

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout) -> None:
        self.calls.append("register")

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        assert isinstance(metadata, Meta)
        self.slot.bind(metadata)

    def clear_connector_metadata(self) -> None:
        self.slot.clear()

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        self.calls.append(f"load {self.slot.get('start_load_kv').step}")

    def wait_for_save(self) -> None:
        self.calls.append("wait_for_save")


class ReportingWorker(Worker):
    def get_finished(self, finished_req_ids: frozenset[str]) -> tuple[frozenset[str], frozenset[str]]:
        return frozenset({"s"}), frozenset({"r", "f"})

    def get_failed_recving(self) -> frozenset[str]:
        return frozenset({"f"})

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        return frozenset({7})

    def get_kv_connector_stats(self) -> ConnectorStats:
        return ConnectorStats(counters={"bytes": 10})


def _request() -> RequestView:
    return RequestView("r1", (1, 2, 3))


def test_subclass_with_required_methods_only_instantiates_and_uses_defaults() -> None:
    s = Scheduler()
    assert s.request_finished(_request(), (0,)) == (False, None)
    assert tuple(s.take_events()) == ()
    assert s.get_finished_count() is None
    assert s.on_new_request(_request()) is None
    assert s.update_connector_output(KVConnectorOutput()) is None
    s.shutdown()
    s.shutdown()  # SCH-027: idempotent
    w = Worker()
    assert w.get_finished(frozenset({"x"})) == (frozenset(), frozenset())
    assert w.get_handshake_metadata() is None
    assert w.build_connector_output(frozenset({"x"})) == KVConnectorOutput()
    w.wait_for_layer_load("layer.0")
    w.save_kv_layer("layer.0", torch.zeros(1), ForwardContextView(ForwardKind.REAL, 0, 1, ("layer.0",)))
    w.handle_preemptions(frozenset({"x"}))
    w.shutdown()


@pytest.mark.parametrize("missing", ["get_num_new_matched_tokens", "update_state_after_alloc",
                                     "build_connector_meta"])
def test_missing_required_scheduler_method_cannot_instantiate(missing: str) -> None:
    body = {k: v for k, v in vars(Scheduler).items() if k != missing}
    cls = type("Partial", (SchedulerConnector,), body)
    with pytest.raises(TypeError, match=missing):
        cls()


@pytest.mark.parametrize("missing", ["register_kv_caches", "bind_connector_metadata",
                                     "clear_connector_metadata", "start_load_kv", "wait_for_save"])
def test_missing_required_worker_method_cannot_instantiate(missing: str) -> None:
    body = {k: v for k, v in vars(Worker).items() if k != missing}
    cls = type("Partial", (WorkerConnector,), body)
    with pytest.raises(TypeError, match=missing):
        cls()


def test_default_build_connector_output_gathers_every_output_hook() -> None:
    out = ReportingWorker().build_connector_output(frozenset({"s"}))
    assert out.finished_sending == {"s"}
    assert out.finished_recving == {"r", "f"}
    assert out.failed_recving == {"f"}
    assert out.invalid_block_ids == {7}
    assert isinstance(out.stats, ConnectorStats) and out.stats.counters["bytes"] == 10


def test_default_build_connector_output_validates_what_hooks_return() -> None:
    class Broken(Worker):
        def get_failed_recving(self) -> frozenset[str]:
            return frozenset({"never-finished"})

    with pytest.raises(InvalidArgumentError, match="never-finished"):
        Broken().build_connector_output(frozenset())


def test_dummy_metadata_default_refuses_with_clause() -> None:
    ctx = ForwardContextView(ForwardKind.CAPTURE, None, 8, ("layer.0",))
    with pytest.raises(UnsupportedOperationError) as info:
        Worker().build_dummy_connector_meta(ctx)
    assert info.value.clause == "DRY-005"
    assert "Worker" in str(info.value)


def test_metadata_slot_guards_hooks_in_a_real_forward() -> None:
    w = Worker()
    ctx = ForwardContextView(ForwardKind.REAL, 3, 4, ("layer.0",))
    with pytest.raises(Exception, match="start_load_kv ran with no connector metadata bound"):
        w.start_load_kv(ctx)
    w.bind_connector_metadata(Meta(3))
    w.start_load_kv(ctx)
    w.clear_connector_metadata()
    assert w.calls == ["load 3"]


class StructuralExecutor:
    def expect(self, request_id: str, direction: Direction, *, count: int | None = None) -> None:
        return None

    def aggregate(self, outputs: Sequence[KVConnectorOutput]) -> KVConnectorOutput:
        return KVConnectorOutput()


def test_runtime_checkable_protocols() -> None:
    assert isinstance(StructuralExecutor(), ExecutorConnector)
    assert isinstance(StandardAggregator(world_size=2), ExecutorConnector)
    assert not isinstance(object(), ExecutorConnector)
    assert isinstance(Scheduler(), SchedulerConnector)
    assert not isinstance(Scheduler(), WorkerConnector)
    assert isinstance(Worker(), WorkerConnector)
    assert isinstance(Meta(1), ConnectorMetadata)
    assert not isinstance(object(), ConnectorMetadata)


def test_factory_default_executor_is_none() -> None:
    class Factory(ConnectorFactory):
        name = "f"  # type: ignore[assignment]
        capabilities = Capabilities()  # type: ignore[assignment]

        def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
            return Scheduler()

        def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
            return Worker()

    cfg = EngineConfigView("e", TransferRole.BOTH, num_layers=2, block_size=16, num_blocks=8)
    f = Factory()
    assert f.create_executor(cfg) is None
    assert isinstance(f, ConnectorFactory)


def test_capabilities_feed_layout_negotiation() -> None:
    caps = Capabilities(accepted_layouts=("BLHNC", "HND"), accepts_split_kv=False)
    offer = caps.layout_offer()
    assert offer.orders == (StrideOrder.BLHNC, StrideOrder.LBHNC)
    assert offer.packings == (KVPacking.CONCAT,)
    backend = LayoutOffer("attention backend", (StrideOrder.LBHNC, StrideOrder.LBNHC))
    provider = LayoutOffer("tensor provider")
    resolved = negotiate_layout(offer, backend, provider)
    assert resolved.order is StrideOrder.LBHNC and resolved.packing is KVPacking.CONCAT
    kvcached = LayoutOffer("tensor provider", (StrideOrder.LBNHC,), can_restride=False)
    with pytest.raises(LayoutNegotiationError, match="tensor provider refused"):
        negotiate_layout(offer, backend, kvcached)
