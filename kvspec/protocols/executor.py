"""The executor role: turns the per-rank outputs of one step into one output for the scheduler.

kvspec ships ``StandardAggregator``, which implements every EXE clause;
a connector that declares ``custom_aggregator`` supplies its own (EXE-012).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from .events import Direction, KVConnectorOutput

__all__ = ["ExecutorConnector"]


@runtime_checkable
class ExecutorConnector(Protocol):
    """The connector's executor role: one per engine, next to the scheduler.

    Optional: ``defer(outputs: Mapping[int, KVConnectorOutput]) -> None``, which salvages
    the outputs of a step that failed on some rank, for the next ``aggregate`` (EXE-013;
    ``StandardAggregator.defer`` states what it must do). An executor without it still
    conforms: kvspec's engine then merges each rank's salvaged output into that rank's
    next output itself, the salvaged events dropped.
    """

    @abstractmethod
    def expect(self, request_id: str, direction: Direction, *, count: int | None = None) -> None:
        """Register a request and direction the engine now awaits (EXE-011).

        When: when a delayed free starts (``request_finished`` returned True: SEND) or an
        async load is allocated (RECV), before any rank can report it. ``count`` overrides
        the expected number of reports for this request (EXE-008).
        Must raise: InvalidArgumentError if the pair is already awaited.
        """

    @abstractmethod
    def aggregate(self, outputs: Sequence[KVConnectorOutput]) -> KVConnectorOutput:
        """Aggregate one output per rank (index = rank) for one executed step.

        Must: report each awaited request exactly once per direction, in the step its last
        expected rank reported it (EXE-001); report failed receives only at completion
        (EXE-004); unite invalid blocks (EXE-005); reduce stats, events and worker metadata in
        rank order (EXE-006, EXE-007); honour the expected count and per-output overrides
        (EXE-008).
        Must raise, leaving its state unchanged (EXE-009): InvalidArgumentError for a number
        of outputs other than the world size (EXE-010); DoubleReportError (EXE-002) and
        UnknownRequestError (EXE-003) naming the rank and the request.
        """
