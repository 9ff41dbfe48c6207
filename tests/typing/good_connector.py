"""Type test: mypy --strict must accept every line of this module (pytest does not run it).

A minimal connector, once by subclassing the Protocols and once structurally, assigned to
the Protocol types the engine uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from typing_extensions import Self, assert_type

from kvspec.protocols import (
    AllocatedBlocks,
    Capabilities,
    ConnectorFactory,
    ConnectorMetadata,
    Direction,
    EngineConfigView,
    ExecutorConnector,
    ForwardContextView,
    KVCacheLayout,
    KVConnectorOutput,
    MetadataSlot,
    RequestView,
    SchedulerConnector,
    SchedulerOutputView,
    StandardAggregator,
    WorkerConnector,
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

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout
    ) -> None:
        return None

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        assert isinstance(metadata, Meta)
        self.slot.bind(metadata)

    def clear_connector_metadata(self) -> None:
        self.slot.clear()

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        assert_type(self.slot.get("start_load_kv"), Meta)

    def wait_for_save(self) -> None:
        return None


class StructuralExecutor:
    """Satisfies ExecutorConnector without inheriting from it."""

    def expect(self, request_id: str, direction: Direction, *, count: int | None = None) -> None:
        return None

    def aggregate(self, outputs: Sequence[KVConnectorOutput]) -> KVConnectorOutput:
        return KVConnectorOutput()


class Factory(ConnectorFactory):
    @property
    def name(self) -> str:
        return "minimal"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities()

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        return Scheduler()

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        return Worker()

    def create_executor(self, config: EngineConfigView) -> ExecutorConnector | None:
        return StructuralExecutor()


meta_type: type[ConnectorMetadata] = Meta
scheduler: SchedulerConnector = Scheduler()
worker: WorkerConnector = Worker()
executor: ExecutorConnector = StructuralExecutor()
standard: ExecutorConnector = StandardAggregator(world_size=2)
factory: ConnectorFactory = Factory()

# Optional methods keep their documented default signatures.
request = RequestView("r1", (1, 2, 3))
assert_type(scheduler.get_num_new_matched_tokens(request, 0), tuple[int | None, bool])
assert_type(scheduler.request_finished(request, (0, 1)), tuple[bool, Mapping[str, Any] | None])
assert_type(scheduler.get_finished_count(), int | None)
assert_type(worker.get_finished(frozenset()), tuple[frozenset[str], frozenset[str]])
assert_type(worker.build_connector_output(frozenset({"r1"})), KVConnectorOutput)
assert_type(standard.aggregate([KVConnectorOutput(), KVConnectorOutput()]), KVConnectorOutput)
