"""Type test: mypy --strict must report exactly the error named on each ``# E:`` line.

tests/typing/test_typing.py runs mypy on this module and compares. pytest does not import it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvspec.protocols import (
    AllocatedBlocks,
    ConnectorMetadata,
    ExecutorConnector,
    ForwardContextView,
    KVConnectorOutput,
    RequestView,
    SchedulerConnector,
    SchedulerOutputView,
    WorkerConnector,
)


class Meta:
    def encode(self) -> bytes:
        return b""

    @classmethod
    def decode(cls, data: bytes) -> Meta:
        return cls()


class WrongMatchReturn(SchedulerConnector):
    def get_num_new_matched_tokens(  # E: override
        self, request: RequestView, num_computed_tokens: int
    ) -> int:
        return 0

    def update_state_after_alloc(
        self, request: RequestView, blocks: AllocatedBlocks, num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> Meta:
        return Meta()


class MissingBuildMeta(SchedulerConnector):
    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return None, False

    def update_state_after_alloc(
        self, request: RequestView, blocks: AllocatedBlocks, num_external_tokens: int
    ) -> None:
        return None


class OldRegisterSignature(WorkerConnector):
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:  # E: override
        return None

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        return None

    def clear_connector_metadata(self) -> None:
        return None

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


class ListFinished:
    """Structurally wrong: get_finished returns lists, aggregate takes one output."""

    def expect(self, request_id: str, direction: str) -> None:
        return None

    def aggregate(self, outputs: KVConnectorOutput) -> KVConnectorOutput:
        return outputs


class NotMetadata:
    def encode(self) -> str:
        return ""


missing: SchedulerConnector = MissingBuildMeta()  # E: abstract
executor: ExecutorConnector = ListFinished()  # E: assignment
meta: ConnectorMetadata = NotMetadata()  # E: assignment
caches: Mapping[str, torch.Tensor] = {}
OldRegisterSignature().register_kv_caches(caches)  # E: arg-type
