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

from collections.abc import Iterable, Mapping, Sequence
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

    __slots__ = ("_world_size", "_default_count", "_count", "_custom", "_fresh", "_by_rank",
                 "_failed")

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
        # Per direction (0: SEND, 1: RECV), keyed by request id (a str hashes in C, an
        # Enum in Python): the number of reports that completes each awaited request; the
        # awaited requests whose count is not the world size; those no rank reported yet
        # (their count can still be overridden, EXE-008); per rank, the awaited requests
        # it reported. And the receives that failed on some rank so far.
        self._count: tuple[dict[str, int], dict[str, int]] = ({}, {})
        self._custom: tuple[set[str], set[str]] = (set(), set())
        self._fresh: tuple[set[str], set[str]] = (set(), set())
        self._by_rank: tuple[list[set[str]], list[set[str]]] = (
            [set() for _ in range(world_size)], [set() for _ in range(world_size)])
        self._failed: set[str] = set()

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
        if type(request_id) is not str or not request_id:
            if not isinstance(request_id, str) or not request_id:
                raise InvalidArgumentError(
                    f"request_id is {request_id!r}; expected a non-empty string",
                    clause="EXE-011",
                )
        d = _index(direction)
        counts = self._count[d]
        if request_id in counts:
            raise InvalidArgumentError(
                f"request {request_id!r} is already awaited for {direction.value}; "
                "expected each request/direction to be registered once until it completes",
                clause="EXE-011",
            )
        n = self._default_count if count is None else _check_count(
            count, "count", self._world_size)
        counts[request_id] = n
        if n != self._world_size:
            self._custom[d].add(request_id)
        self._fresh[d].add(request_id)

    def expect_many(self, request_ids: Iterable[str], direction: Direction) -> None:
        """``expect`` for several requests of one direction at once, with the default count:
        what an engine registers in one step (the requests whose ``request_finished``
        returned True, or whose async loads start). All or none are registered.

        Raises:
            InvalidArgumentError: as ``expect``, for the first bad id; nothing changed then.
        """
        ids = request_ids if type(request_ids) is frozenset else frozenset(request_ids)
        d = _index(direction)
        if not all(type(r) is str and r for r in ids):
            bad = next(r for r in ids if type(r) is not str or not r)
            raise InvalidArgumentError(
                f"request_id is {bad!r}; expected a non-empty string", clause="EXE-011"
            )
        counts = self._count[d]
        again = counts.keys() & ids
        if again:
            raise InvalidArgumentError(
                f"request {min(again)!r} is already awaited for {direction.value}; "
                "expected each request/direction to be registered once until it completes",
                clause="EXE-011",
            )
        counts.update(dict.fromkeys(ids, self._default_count))
        if self._default_count != self._world_size:
            self._custom[d].update(ids)
        self._fresh[d].update(ids)

    def aggregate(self, outputs: Sequence[KVConnectorOutput]) -> KVConnectorOutput:
        """Combine one step's outputs, one per rank (index = rank), into one.

        Called by the executor once per model step. The result names each
        request/direction in ``finished_sending`` / ``finished_recving`` exactly once,
        in the step its last expected report arrives (EXE-001); ``failed_recving`` holds
        the completing receives that failed on any rank (EXE-004); invalid block ids are
        the union over ranks (EXE-005); stats and worker metadata are reduced with
        ``aggregate`` in rank order, events concatenated in rank order (EXE-006,
        EXE-007). Its ``expected_finished_count`` is None.

        Work: set operations over each rank's reported ids (in C); a request whose count
        is not the world size costs one Python step more per step it is reported in.

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
        overridden = False
        failed_now: set[str] = set()
        stats = worker_metadata = events = invalid = False
        for rank, out in enumerate(outputs):
            if type(out) is not KVConnectorOutput and not isinstance(out, KVConnectorOutput):
                raise InvalidArgumentError(
                    f"output of rank {rank} is {type(out).__name__}; expected a "
                    "KVConnectorOutput",
                    clause="EXE-010",
                )
            override = out.expected_finished_count
            if override is not None:
                overridden = True
                if override > self._world_size:
                    raise ReportError(
                        f"rank {rank} reports expected_finished_count {override}; expected "
                        f"at most the world size {self._world_size}",
                        rank=rank,
                        clause="EXE-008",
                    )
            if out.failed_recving:
                failed_now |= out.failed_recving
            stats = stats or out.stats is not None
            worker_metadata = worker_metadata or out.worker_metadata is not None
            events = events or bool(out.events)
            invalid = invalid or bool(out.invalid_block_ids)

        # Phase 1: validate, and everything that can still fail; no state changes.
        fixed = self._overrides(outputs) if overridden else ({}, {})
        steps: list[frozenset[str]] = []
        planned: list[frozenset[str] | None] = []  # completions, or None: the fast path
        for d in (0, 1):
            counts, by_rank = self._count[d], self._by_rank[d]
            keys = counts.keys()
            reported = [out.finished_recving if d else out.finished_sending for out in outputs]
            for rank, ids in enumerate(reported):
                if ids:
                    if not keys >= ids:
                        self._raise_unknown(rank, d, min(ids.difference(counts)))
                    if not ids.isdisjoint(by_rank[rank]):
                        self._raise_double(rank, d, min(ids & by_rank[rank]))
            step = frozenset().union(*reported)
            steps.append(step)
            if step and (fixed[d] or not step.isdisjoint(self._custom[d])):
                planned.append(self._completions(d, reported, step, fixed[d]))
            else:  # every request reported counts to the world size: decided below
                planned.append(None)
        stats_sum = _reduce(outputs, "stats", "EXE-006") if stats else None
        metadata_sum = _reduce(outputs, "worker_metadata", "EXE-007") if worker_metadata else None

        # Phase 2: commit.
        done: list[frozenset[str]] = []
        for d in (0, 1):
            step = steps[d]
            if not step:
                done.append(step)
                continue
            fix = fixed[d]
            if fix:
                self._count[d].update(fix)
                self._custom[d].update(r for r, n in fix.items() if n != self._world_size)
            by_rank = self._by_rank[d]
            for rank, out in enumerate(outputs):
                new = out.finished_recving if d else out.finished_sending
                if new:
                    by_rank[rank].update(new)
            self._fresh[d].difference_update(step)
            complete = planned[d]
            if complete is None:  # complete once every rank reported it
                complete = step.intersection(*by_rank)
            done.append(complete)
            if complete:
                counts = self._count[d]
                for request_id in complete:
                    del counts[request_id]
                if self._custom[d]:
                    self._custom[d].difference_update(complete)
                for reported_ids in by_rank:
                    reported_ids.difference_update(complete)
        sending, recving = done
        failed: frozenset[str] = frozenset()
        if recving and (failed_now or self._failed):
            failed = recving & (failed_now | self._failed)
        if failed_now:
            self._failed.update(failed_now)
        if recving and self._failed:
            self._failed.difference_update(recving)
        return KVConnectorOutput._trusted(
            sending, recving, failed,
            frozenset().union(*(o.invalid_block_ids for o in outputs)) if invalid
            else frozenset(),
            stats_sum,
            tuple(e for o in outputs for e in o.events) if events else (),
            metadata_sum,
        )

    def _completions(self, d: int, reported: list[frozenset[str]], step: frozenset[str],
                     fixed: dict[str, int]) -> frozenset[str]:
        """The requests of ``step`` whose count the reports of this step reach, counted
        one by one (some count is not the world size, or was just overridden).

        Raises:
            UnknownRequestError: more reports than the count in this step (EXE-003).
        """
        counts, by_rank = self._count[d], self._by_rank[d]
        complete = []
        for request_id in step:
            count = fixed.get(request_id) or counts[request_id]
            before = sum(request_id in ids for ids in by_rank)
            now = sum(request_id in ids for ids in reported)
            if before + now >= count:
                if before + now > count:
                    ranks = [rank for rank, ids in enumerate(reported) if request_id in ids]
                    direction = _DIRECTIONS[d]
                    _unknown(
                        f"rank {ranks[count - before]} reports request {request_id!r} "
                        f"finished {direction.value}ing, but it already completed in this "
                        f"step after {count} reports; expected at most {count} reports",
                        rank=ranks[count - before],
                        request_id=request_id,
                        direction=direction,
                    )
                complete.append(request_id)
        return frozenset(complete)

    @staticmethod
    def _raise_unknown(rank: int, d: int, request_id: str) -> NoReturn:
        direction = _DIRECTIONS[d]
        _unknown(
            f"rank {rank} reports request {request_id!r} finished {direction.value}ing, "
            "but the engine does not await that (never registered with expect(), or "
            "already complete); expected reports only for awaited requests",
            rank=rank,
            request_id=request_id,
            direction=direction,
        )

    @staticmethod
    def _raise_double(rank: int, d: int, request_id: str) -> NoReturn:
        direction = _DIRECTIONS[d]
        raise DoubleReportError(
            f"rank {rank} reports request {request_id!r} finished {direction.value}ing a "
            "second time before it completed; expected each rank to report it exactly once",
            rank=rank,
            request_id=request_id,
            direction=direction,
            clause="EXE-002",
        )

    def _overrides(
        self, outputs: Sequence[KVConnectorOutput]
    ) -> tuple[dict[str, int], dict[str, int]]:
        """The counts fixed by ``expected_finished_count`` in this step, per direction:
        for requests no rank reported before, from the outputs that report them (EXE-008).

        Raises:
            ReportError: two ranks give different counts for one request.
        """
        fixed: tuple[dict[str, int], dict[str, int]] = ({}, {})
        source: dict[tuple[int, str], int] = {}
        for rank, out in enumerate(outputs):
            override = out.expected_finished_count
            if override is None:
                continue
            for d, ids in ((0, out.finished_sending), (1, out.finished_recving)):
                for request_id in ids & self._fresh[d]:
                    known = fixed[d].get(request_id)
                    if known is None:
                        fixed[d][request_id] = override
                        source[(d, request_id)] = rank
                    elif known != override:
                        raise ReportError(
                            f"ranks {source[(d, request_id)]} and {rank} disagree on "
                            f"expected_finished_count for request {request_id!r} "
                            f"({_DIRECTIONS[d].value}): {known} vs {override}; "
                            "expected every rank to report the same count",
                            rank=rank,
                            request_id=request_id,
                            clause="EXE-008",
                        )
        return fixed

    def pending(self) -> Mapping[tuple[str, Direction], int]:
        """A snapshot of every awaited request/direction and how many reports remain.

        For one that has not started counting, the remaining count is its ``count``
        from ``expect`` or the default; an output's ``expected_finished_count`` may
        still change it (EXE-008).
        """
        return MappingProxyType({
            (request_id, _DIRECTIONS[d]):
                count - sum(request_id in ids for ids in self._by_rank[d])
            for d in (0, 1) for request_id, count in self._count[d].items()
        })

    def reported_by(self, request_id: str, direction: Direction) -> frozenset[int]:
        """The ranks that reported an awaited request/direction so far.

        Empty when none did, or when it is not awaited (never registered, or complete).
        """
        d = _index(direction)
        return frozenset(rank for rank, ids in enumerate(self._by_rank[d]) if request_id in ids)


_DIRECTIONS = (Direction.SEND, Direction.RECV)


def _index(direction: Direction) -> int:
    """0 for SEND, 1 for RECV: the aggregator's per-direction state is indexed by it."""
    if direction is Direction.SEND:
        return 0
    if direction is Direction.RECV:
        return 1
    raise InvalidArgumentError(
        f"direction is {direction!r}; expected a Direction", clause="EXE-011"
    )


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
