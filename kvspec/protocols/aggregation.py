"""The executor's reduction of per-rank connector outputs into one (EXE clauses).

Each worker rank (tensor x pipeline parallel) returns a
``KVConnectorOutput`` every step. The executor combines
them into one output for the scheduler with an aggregator. A request's asynchronous
send or receive is complete only when every expected rank has reported it; a double
report would free blocks while a rank still reads them, a missing one leaks them.
``StandardAggregator`` is the reference implementation of that accounting.

Clauses enforced here:

* EXE-001 -- a request/direction appears in the aggregate exactly once, in the step
  its last expected report arrives.
* EXE-002 -- a rank reports a request/direction at most once per completion.
* EXE-003 -- a report names only a request/direction the engine awaits.
* EXE-004 -- a receive that failed on any rank is reported failed when it completes.
* EXE-005 -- invalid block ids of all ranks are forwarded, unioned, in the same step.
* EXE-006 -- stats are reduced with ``aggregate`` in rank order; events concatenated in
  rank order.
* EXE-007 -- worker metadata is reduced with ``aggregate`` in rank order.
* EXE-008 -- the number of reports that completes a request defaults to the world
  size, is overridable per aggregator (the connector's finished count), per awaited
  request, and per output for requests that have not started counting.
* EXE-009 -- a rejected step leaves the aggregator unchanged.
* EXE-010 -- each step passes exactly one output per rank.
* EXE-011 -- the engine registers each awaited request/direction before any rank can
  report it.

This module imports nothing of kvspec but its sibling protocol modules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import NoReturn

from kvspec.protocols.errors import (
    DoubleReportError,
    InvalidArgumentError,
    ReportError,
    UnknownRequestError,
)
from kvspec.protocols.events import (
    Direction,
    KVCacheEvent,
    KVConnectorOutput,
    SupportsAggregate,
)

__all__ = ["StandardAggregator"]


class _Entry:
    """Accounting of one awaited request/direction."""

    __slots__ = ("count", "ranks", "failed")

    def __init__(self, count: int | None) -> None:
        # The count from expect() (None: the default) until the first report arrives;
        # from then on the fixed count.
        self.count = count
        self.ranks: set[int] = set()
        self.failed = False


class _Batch:
    """The new reports of one step for one request/direction (built before commit)."""

    __slots__ = ("ranks", "failed", "override", "override_rank")

    def __init__(self) -> None:
        self.ranks: list[int] = []
        self.failed = False
        self.override: int | None = None
        self.override_rank = -1


def _check_count(value: object, what: str, world_size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= world_size:
        raise InvalidArgumentError(
            f"{what} is {value!r}; expected an int between 1 and the world size "
            f"{world_size} (each rank reports a request at most once)",
            clause="EXE-008",
        )
    return value


def _unknown(message: str, *, rank: int, request_id: str, direction: Direction) -> NoReturn:
    raise UnknownRequestError(
        message, rank=rank, request_id=request_id, direction=direction, clause="EXE-003"
    )


class StandardAggregator:
    """The reference executor-side aggregation of per-rank connector outputs.

    Role: the engine's executor owns one aggregator per engine; nothing else calls it.
    The engine MUST call ``expect`` for every request/direction it will wait on
    (a delayed free after ``request_finished`` returned True is ``SEND``; an
    asynchronous load is ``RECV``) before any rank can report it (EXE-011), and MUST
    call ``aggregate`` once per model step with exactly one output per rank.

    How many reports complete a request/direction is fixed when its first report
    arrives, by the first that applies of (EXE-008):

    1. ``expected_finished_count`` of the outputs reporting it in that step (they MUST
       agree);
    2. the ``count`` given to ``expect``;
    3. the aggregator's ``expected_count`` (the connector's finished count);
    4. the world size.

    Every count is between 1 and the world size. A step is validated completely before
    any state changes, so a rejected step leaves the aggregator as it was (EXE-009).
    Work per step is proportional to the ids reported in it plus the world size.

    Args:
        world_size: The number of worker ranks (tensor x pipeline parallel), >= 1.
        expected_count: The default number of reports that completes a
            request/direction, when not the world size (EXE-008).

    Raises:
        InvalidArgumentError: ``world_size`` is not an int >= 1, or ``expected_count``
            is not between 1 and ``world_size``.
    """

    __slots__ = ("_world_size", "_default_count", "_pending")

    def __init__(self, world_size: int, *, expected_count: int | None = None) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise InvalidArgumentError(
                f"world_size is {world_size!r}; expected an int >= 1", clause="EXE-010"
            )
        self._world_size = world_size
        self._default_count = (
            world_size
            if expected_count is None
            else _check_count(expected_count, "expected_count", world_size)
        )
        self._pending: dict[tuple[str, Direction], _Entry] = {}

    @property
    def world_size(self) -> int:
        """The number of ranks; ``aggregate`` takes exactly this many outputs."""
        return self._world_size

    @property
    def expected_count(self) -> int:
        """The default number of reports that completes a request/direction (EXE-008)."""
        return self._default_count

    def expect(self, request_id: str, direction: Direction, *, count: int | None = None) -> None:
        """Register a request/direction the engine now awaits (EXE-011).

        Called by the engine before any rank can report it: when ``request_finished``
        returned True (``SEND``: blocks are held until the sends finish) or when an
        asynchronous load starts (``RECV``). After it completes (appears in an
        aggregate) it may be registered again.

        Args:
            request_id: The request, a non-empty string.
            direction: Which transfer is awaited.
            count: How many reports complete it, when not the aggregator's default;
                an output's ``expected_finished_count`` still takes precedence
                (EXE-008).

        Raises:
            InvalidArgumentError: An argument is malformed, or the request/direction is
                already awaited (EXE-011).
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError(
                f"request_id is {request_id!r}; expected a non-empty string",
                clause="EXE-011",
            )
        if not isinstance(direction, Direction):
            raise InvalidArgumentError(
                f"direction is {direction!r}; expected a Direction", clause="EXE-011"
            )
        if count is not None:
            count = _check_count(count, "count", self._world_size)
        key = (request_id, direction)
        if key in self._pending:
            raise InvalidArgumentError(
                f"request {request_id!r} is already awaited for {direction.value}; "
                "expected each request/direction to be registered once until it completes",
                clause="EXE-011",
            )
        self._pending[key] = _Entry(count)

    def aggregate(self, outputs: Sequence[KVConnectorOutput]) -> KVConnectorOutput:
        """Combine one step's outputs, one per rank (index = rank), into one.

        Called by the executor once per model step. The result names each
        request/direction in ``finished_sending`` / ``finished_recving`` exactly once,
        in the step its last expected report arrives (EXE-001); ``failed_recving`` holds
        the completing receives that failed on any rank (EXE-004); invalid block ids are
        the union over ranks (EXE-005); stats and worker metadata are reduced with
        ``aggregate`` in rank order, events concatenated in rank order (EXE-006,
        EXE-007). Its ``expected_finished_count`` is None.

        Raises:
            InvalidArgumentError: ``outputs`` does not hold exactly one
                ``KVConnectorOutput`` per rank (EXE-010).
            DoubleReportError: A rank reported a request/direction it already reported
                (EXE-002).
            UnknownRequestError: A rank reported a request/direction that is not awaited
                (never registered, or already complete) (EXE-003). The error has
                ``rank``, ``request_id`` and ``direction`` attributes.
            ReportError: Outputs disagree on ``expected_finished_count`` for a request,
                or a stats / metadata reduction failed (EXE-008, EXE-006, EXE-007).

        On any error nothing changed (EXE-009).
        """
        given: object = outputs
        if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
            raise InvalidArgumentError(
                f"outputs is {type(outputs).__name__}; expected a sequence of "
                f"{self._world_size} KVConnectorOutput, one per rank",
                clause="EXE-010",
            )
        if len(outputs) != self._world_size:
            raise InvalidArgumentError(
                f"got {len(outputs)} outputs; expected exactly one per rank, "
                f"{self._world_size} in all",
                clause="EXE-010",
            )
        for rank, out in enumerate(outputs):
            if not isinstance(out, KVConnectorOutput):
                raise InvalidArgumentError(
                    f"output of rank {rank} is {type(out).__name__}; expected a "
                    "KVConnectorOutput",
                    clause="EXE-010",
                )

        # Phase 1: validate and plan; no state changes.
        batches: dict[tuple[str, Direction], _Batch] = {}
        pending = self._pending
        for rank, out in enumerate(outputs):
            override = out.expected_finished_count
            if override is not None and override > self._world_size:
                raise ReportError(
                    f"rank {rank} reports expected_finished_count {override}; expected at "
                    f"most the world size {self._world_size}",
                    rank=rank,
                    clause="EXE-008",
                )
            for direction, ids in (
                (Direction.SEND, out.finished_sending),
                (Direction.RECV, out.finished_recving),
            ):
                for request_id in ids:
                    key = (request_id, direction)
                    entry = pending.get(key)
                    if entry is None:
                        _unknown(
                            f"rank {rank} reports request {request_id!r} finished "
                            f"{direction.value}ing, but the engine does not await that "
                            "(never registered with expect(), or already complete); "
                            "expected reports only for awaited requests",
                            rank=rank,
                            request_id=request_id,
                            direction=direction,
                        )
                    if rank in entry.ranks:
                        err = DoubleReportError(
                            f"rank {rank} reports request {request_id!r} finished "
                            f"{direction.value}ing a second time before it completed; "
                            "expected each rank to report it exactly once",
                            rank=rank,
                            request_id=request_id,
                            direction=direction,
                            clause="EXE-002",
                        )
                        raise err
                    batch = batches.get(key)
                    if batch is None:
                        batch = batches[key] = _Batch()
                    batch.ranks.append(rank)
                    if direction is Direction.RECV and request_id in out.failed_recving:
                        batch.failed = True
                    if override is not None and not entry.ranks:
                        if batch.override is None:
                            batch.override = override
                            batch.override_rank = rank
                        elif batch.override != override:
                            raise ReportError(
                                f"ranks {batch.override_rank} and {rank} disagree on "
                                f"expected_finished_count for request {request_id!r} "
                                f"({direction.value}): {batch.override} vs {override}; "
                                "expected every rank to report the same count",
                                rank=rank,
                                request_id=request_id,
                                clause="EXE-008",
                            )

        # Decide counts and completions.
        sending: list[str] = []
        recving: list[str] = []
        failed: list[str] = []
        fixed: dict[tuple[str, Direction], int] = {}
        for key, batch in batches.items():
            entry = pending[key]
            if entry.ranks:
                count = entry.count if entry.count is not None else self._default_count
            else:
                # Counting starts now: fix the count (EXE-008 precedence).
                if batch.override is not None:
                    count = batch.override
                elif entry.count is not None:
                    count = entry.count
                else:
                    count = self._default_count
                fixed[key] = count
            room = count - len(entry.ranks)
            if len(batch.ranks) > room:
                request_id, direction = key
                rank = batch.ranks[room]
                _unknown(
                    f"rank {rank} reports request {request_id!r} finished "
                    f"{direction.value}ing, but it already completed in this step after "
                    f"{count} reports; expected at most {count} reports",
                    rank=rank,
                    request_id=request_id,
                    direction=direction,
                )
            if len(batch.ranks) == room:
                request_id, direction = key
                if direction is Direction.SEND:
                    sending.append(request_id)
                else:
                    recving.append(request_id)
                    if entry.failed or batch.failed:
                        failed.append(request_id)

        stats = _reduce(outputs, "stats", "EXE-006")
        worker_metadata = _reduce(outputs, "worker_metadata", "EXE-007")
        events: list[KVCacheEvent] = []
        invalid: set[int] = set()
        for out in outputs:
            events.extend(out.events)
            invalid.update(out.invalid_block_ids)
        result = KVConnectorOutput(
            finished_sending=sending,
            finished_recving=recving,
            failed_recving=failed,
            invalid_block_ids=invalid,
            stats=stats,
            events=events,
            worker_metadata=worker_metadata,
        )

        # Phase 2: commit.
        for key, count in fixed.items():
            pending[key].count = count
        for key, batch in batches.items():
            entry = pending[key]
            entry.ranks.update(batch.ranks)
            entry.failed = entry.failed or batch.failed
        for request_id in sending:
            del pending[(request_id, Direction.SEND)]
        for request_id in recving:
            del pending[(request_id, Direction.RECV)]
        return result

    def pending(self) -> Mapping[tuple[str, Direction], int]:
        """A snapshot of every awaited request/direction and how many reports remain.

        For one that has not started counting, the remaining count is its ``count``
        from ``expect`` or the default; an output's ``expected_finished_count`` may
        still change it (EXE-008).
        """
        default = self._default_count
        return MappingProxyType(
            {
                key: (default if entry.count is None else entry.count) - len(entry.ranks)
                for key, entry in self._pending.items()
            }
        )

    def reported_by(self, request_id: str, direction: Direction) -> frozenset[int]:
        """The ranks that reported an awaited request/direction so far.

        Empty when none did, or when it is not awaited (never registered, or complete).
        """
        entry = self._pending.get((request_id, direction))
        return frozenset() if entry is None else frozenset(entry.ranks)


def _reduce(
    outputs: Sequence[KVConnectorOutput], field: str, clause: str
) -> SupportsAggregate | None:
    acc: SupportsAggregate | None = None
    for rank, out in enumerate(outputs):
        value: SupportsAggregate | None = getattr(out, field)
        if value is None:
            continue
        if acc is None:
            acc = value
            continue
        try:
            merged = acc.aggregate(value)
        except Exception as exc:
            raise ReportError(
                f"reducing {field} failed at rank {rank}: {exc}; expected the {field} of "
                "all ranks to aggregate with each other",
                rank=rank,
                clause=clause,
            ) from exc
        if merged is None:  # keeping either side would drop the other rank's values
            raise ReportError(
                f"reducing {field} at rank {rank}: {type(acc).__name__}.aggregate returned "
                f"None; expected the combined {field}",
                rank=rank,
                clause=clause,
            )
        acc = merged
    return acc
