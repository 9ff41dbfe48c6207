"""The engine keeps stepping for a connector's pending work (SCH-029) and lends block
references that outlive requests (SCH-030), the way vLLM 0.32 does for its push-mode and
store connectors (has_pending_push_work, bind_gpu_block_pool)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from kvspec.conformance.connectors.null import NullConnector, NullScheduler
from kvspec.conformance.harness import Engine, HarnessConfig, RequestSpec, Workload
from kvspec.protocols import (
    BlockReferences,
    ContractViolation,
    EngineConfigView,
    InvalidBlockIdError,
    ConnectorMetadata,
    RequestView,
    SchedulerConnector,
    SchedulerOutputView,
)

_ONE = Workload([RequestSpec("r0", list(range(1, 18)), max_new_tokens=2)], name="one request")


class _Storing(NullScheduler):
    """Keeps a finished request's blocks referenced for ``steps`` more steps, as a
    background store job does, and reports pending work until it drops them."""

    def __init__(self, config: EngineConfigView, *, steps: int, mode: str) -> None:
        super().__init__(config)
        self.steps, self.mode = steps, mode
        self.refs: BlockReferences | None = None
        self.jobs: list[list[Any]] = []  # [blocks, outputs left]
        self.steps_while_pending = 0
        self.refcounts: list[int] = []

    def bind_block_references(self, references: BlockReferences) -> None:
        self.refs = references

    def request_finished(
        self, request: RequestView, block_ids: tuple[int, ...]
    ) -> tuple[bool, Mapping[str, Any] | None]:
        out = super().request_finished(request, block_ids)
        assert self.refs is not None
        if self.mode == "free-block":
            self.refs.take([self.refs.num_blocks - 1])  # the pad block: no request holds it
        elif self.mode == "bad-id":
            self.refs.take([self.refs.num_blocks])
        else:
            self.refs.take(list(block_ids))
            self.jobs.append([list(block_ids), self.steps])
        return out

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        assert self.refs is not None
        for job in list(self.jobs):
            self.steps_while_pending += 1
            job[1] -= 1
            if job[1] <= 0:
                self.jobs.remove(job)
                if self.mode != "keep":
                    self.refs.drop(job[0])
                if self.mode == "drop-twice":
                    self.refs.drop(job[0])
        return meta

    def has_pending_work(self) -> bool:
        return self.mode == "forever" or bool(self.jobs)


class _StoringConnector(NullConnector):
    def __init__(self, *, steps: int = 3, mode: str = "ok") -> None:
        self.steps, self.mode = steps, mode
        self.schedulers: list[_Storing] = []

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        s = _Storing(config, steps=self.steps, mode=self.mode)
        self.schedulers.append(s)
        return s


def test_the_engine_steps_until_pending_work_is_reported_and_references_hold_blocks() -> None:
    factory = _StoringConnector(steps=4)
    with Engine(factory, HarnessConfig()) as engine:
        result = engine.run(_ONE)
        s = factory.schedulers[0]
        assert s.steps_while_pending == 4  # the idle engine stepped four more times
        assert not s.jobs and engine.idle
        assert engine.pool.check_all_free() == []
    assert result.finished == ("r0",)


def test_referenced_blocks_are_not_reallocated_while_pending() -> None:
    factory = _StoringConnector(steps=2)
    with Engine(factory, HarnessConfig()) as engine:
        engine.add_request(RequestSpec("r0", list(range(1, 18)), max_new_tokens=1))
        while not factory.schedulers[0].jobs:
            engine.step()
        held = factory.schedulers[0].jobs[0][0]
        assert held and all(engine.pool.refcount(b) == 1 for b in held)
        assert 0 not in held  # block 0 is the null block, never handed out (as in vLLM)
        engine.run(Workload([], name="drain"))
        assert all(engine.pool.refcount(b) == 0 for b in held)


def test_pending_work_that_never_ends_fails_sch029() -> None:
    with pytest.raises(ContractViolation) as info:
        with Engine(_StoringConnector(mode="forever"),
                    HarnessConfig(transfer_timeout_s=0.3)) as engine:
            engine.run(_ONE, max_steps=100_000)
    assert info.value.clause == "SCH-029"
    assert "still True" in info.value.observed


@pytest.mark.parametrize(("mode", "words"), [
    ("free-block", "which no request holds"),
    ("keep", "still held"),
    ("drop-twice", "holds no reference on"),
])
def test_misused_references_fail_sch030(mode: str, words: str) -> None:
    with pytest.raises(ContractViolation) as info:
        with Engine(_StoringConnector(mode=mode), HarnessConfig()) as engine:
            engine.run(_ONE)
    assert info.value.clause == "SCH-030"
    assert words in info.value.observed


def test_a_reference_outside_the_budget_is_an_invalid_block_id() -> None:
    with pytest.raises(InvalidBlockIdError, match="is not an int in"):
        with Engine(_StoringConnector(mode="bad-id"), HarnessConfig()) as engine:
            engine.run(_ONE)
