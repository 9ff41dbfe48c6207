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
  rank order (the salvaged outputs of a failed step first, their events dropped).
* EXE-007 -- worker metadata is reduced with ``aggregate`` in rank order.
* EXE-008 -- the number of reports that completes a request defaults to the world
  size, is overridable per aggregator (the connector's finished count), per awaited
  request, and per output for requests that have not started counting.
* EXE-009 -- a rejected step leaves the aggregator unchanged.
* EXE-010 -- each step that did not fail passes exactly one output per rank.
* EXE-011 -- the engine registers each awaited request/direction before any rank can
  report it.
* EXE-013 -- the outputs a failed step salvaged (``defer``) count once, as their ranks'
  reports, and are delivered with the next aggregate.

This module imports nothing of kvspec but its sibling protocol modules.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import repeat
from operator import attrgetter
from types import MappingProxyType
from typing import Any, NoReturn, cast

import attrs

from kvspec.protocols.errors import (
    DoubleReportError,
    InvalidArgumentError,
    ReportError,
    UnknownRequestError,
)
from kvspec.protocols.events import (
    EMPTY_OUTPUT,
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

    __slots__ = ("_world_size", "_default_count", "_full", "_bits", "_left", "_counts",
                 "_failed", "_held")

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
        # Enum in Python): for each awaited request, a bit mask of the ranks that have not
        # reported it yet (bit r: rank r), so that a report is one dict lookup and one XOR;
        # and the number of reports that completes those whose count is not the world
        # size. And the receives that failed on some rank so far.
        self._full = (1 << world_size) - 1
        self._bits = tuple(1 << rank for rank in range(world_size))
        self._left: tuple[dict[str, int], dict[str, int]] = ({}, {})
        self._counts: tuple[dict[str, int], dict[str, int]] = ({}, {})
        self._failed: set[str] = set()
        # What salvaged outputs of failed steps completed or carried (``defer``), to be
        # delivered with the next aggregate (EXE-013); None when nothing is held.
        self._held: KVConnectorOutput | None = None

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
        d = _index(direction)
        left = self._left[d]
        if request_id in left:
            _raise_again(request_id, direction)
        n = self._default_count if count is None else _check_count(
            count, "count", self._world_size)
        left[request_id] = self._full
        if n != self._world_size:
            self._counts[d][request_id] = n

    def expect_many(self, request_ids: Iterable[str], direction: Direction) -> None:
        """``expect`` for several requests of one direction at once, with the default count:
        what an engine registers in one step (the requests whose ``request_finished``
        returned True, or whose async loads start). All or none are registered.

        Raises:
            InvalidArgumentError: as ``expect``, for the first bad id; nothing changed then.
        """
        ids = (cast("Sequence[str]", request_ids) if type(request_ids) in _INDEXED
               else tuple(request_ids))
        d = 0 if direction is _SEND else 1 if direction is _RECV else _index(direction)
        try:
            "".join(ids)  # the fast check that every id is a str (a TypeError otherwise)
            bad_ids = "" in ids
        except TypeError:
            bad_ids = True
        if bad_ids:  # then why
            for bad in ids:
                if not isinstance(bad, str) or not bad:
                    raise InvalidArgumentError(
                        f"request_id is {bad!r}; expected a non-empty string",
                        clause="EXE-011",
                    )
        left, full = self._left[d], self._full
        before = len(left)
        for request_id in ids:  # faster than a set operation for a few ids
            if request_id in left:  # ids[:i] are new and distinct, i = len(left) - before
                self._registered(ids, len(left) - before, left, full, direction)
                break
            left[request_id] = full
        if self._default_count != self._world_size:
            self._counts[d].update(dict.fromkeys(ids, self._default_count))

    @staticmethod
    def _registered(ids: Sequence[str], i: int, left: dict[str, int], full: int,
                    direction: Direction) -> None:
        """``expect_many`` met ``ids[i]`` awaited already, having registered ``ids[:i]``
        (new and distinct): register the rest, where an id earlier in ``ids`` is no error
        and any other awaited one undoes the call and raises."""
        for j in range(i, len(ids)):
            request_id = ids[j]
            if request_id in left:
                if request_id in ids[:j]:
                    continue
                for new in ids[:j]:
                    left.pop(new, None)
                _raise_again(request_id, direction)
            left[request_id] = full

    def aggregate(self, outputs: Sequence[KVConnectorOutput]) -> KVConnectorOutput:
        """Combine one step's outputs, one per rank (index = rank), into one.

        Called by the executor once per model step. The result names each
        request/direction in ``finished_sending`` / ``finished_recving`` exactly once,
        in the step its last expected report arrives (EXE-001); ``failed_recving`` holds
        the completing receives that failed on any rank (EXE-004); invalid block ids are
        the union over ranks (EXE-005); stats and worker metadata are reduced with
        ``aggregate`` in rank order, events concatenated in rank order (EXE-006,
        EXE-007). Its ``expected_finished_count`` is None.

        Work: one dict lookup and update per reported id; a request whose count is not
        the world size costs a few Python steps more in each step it is reported in.

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

        After ``defer``, the salvaged outputs' completions, failed receives, invalid block
        ids, stats and worker metadata come first in the result (EXE-013, EXE-006).

        On any error nothing changed (EXE-009).
        """
        if self._held is not None:
            return self._with_held(outputs)
        if type(outputs) is not list and type(outputs) is not tuple:
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
        # Each output's type, and whether any sets a rarely used field (one flag each).
        rare = False
        for out in outputs:  # a loop: faster than two C passes for the usual few ranks
            if type(out) is not KVConnectorOutput:
                self._check_types(outputs)
            if out._rare:
                rare = True
        if rare:  # validate what can still fail before any state changes (EXE-009)
            fixed = self._overrides(outputs)
            stats_sum = _reduce(outputs, "stats", "EXE-006")
            metadata_sum = _reduce(outputs, "worker_metadata", "EXE-007")
        elif self._world_size == 1:  # every report completes its request at once
            return self._alone(outputs[0])
        else:
            fixed = _NO_COUNTS

        # Each report clears its rank's bit of the request; a request whose bits are all
        # clear is complete. The executor's per-step hot path: one loop per direction.
        left_s, left_r = self._left
        done_s: list[str] = []
        done_r: list[str] = []
        add_s, add_r = done_s.append, done_r.append
        bit = d = 0
        request_id = ""
        try:
            for bit, out in zip(self._bits, outputs):
                d = 0
                for request_id in out.finished_sending:
                    mask = left_s[request_id]
                    if mask == bit:  # the last rank it awaited: complete
                        del left_s[request_id]
                        add_s(request_id)
                    elif mask & bit:
                        left_s[request_id] = mask ^ bit
                    else:  # the bit was clear: this rank reported it already
                        raise _Double
                d = 1
                for request_id in out.finished_recving:
                    mask = left_r[request_id]
                    if mask == bit:
                        del left_r[request_id]
                        add_r(request_id)
                    elif mask & bit:
                        left_r[request_id] = mask ^ bit
                    else:
                        raise _Double
        except (KeyError, _Double) as exc:
            self._uncount(outputs, (bit, d, request_id))
            rank = bit.bit_length() - 1
            # A request every rank reported earlier in this step was deleted: reporting
            # it again is this rank's second report.
            if isinstance(exc, KeyError) and request_id not in (done_r if d else done_s):
                self._raise_unknown(rank, request_id, d)
            self._raise_double(rank, request_id, d)

        if fixed is not _NO_COUNTS or self._counts[0] or self._counts[1]:
            # Some request's count is not the world size: count each one's reports.
            sending, recving = self._completions(outputs, fixed)
        else:
            sending, recving = frozenset(done_s), frozenset(done_r)
        if not rare:
            if not (sending or recving):
                return EMPTY_OUTPUT
            failed = recving & self._failed if recving and self._failed else _NONE
            if failed:
                self._failed.difference_update(recving)
            return _TRUSTED_IDS(sending, recving, failed)
        failed_now: set[str] = set().union(*(o.failed_recving for o in outputs))
        failed = recving & (failed_now | self._failed) if recving else _NONE
        self._failed.update(failed_now)
        self._failed.difference_update(recving)
        return KVConnectorOutput._trusted(
            sending, recving, failed,
            frozenset().union(*(o.invalid_block_ids for o in outputs)),
            stats_sum, tuple(e for o in outputs for e in o.events), metadata_sum)

    def defer(self, outputs: Mapping[int, KVConnectorOutput]) -> None:
        """Salvage the outputs of a step that failed, for the next ``aggregate`` (EXE-013).

        Called by the executor instead of ``aggregate`` when a step failed on some rank
        after its connector outputs were collected (vLLM 0.33's fault-tolerant executor,
        ``KVOutputAggregator.ft_defer_kv_connector_outputs``). ``outputs`` maps each rank
        that produced an output in that step (index = rank) to it; a rank that produced
        none is left out. Each report counts now, once, as its rank's report: a rank that
        reports the same request/direction again later is a double report (EXE-002). What
        the salvaged outputs complete, fail and invalidate, and their stats and worker
        metadata, are delivered with the next ``aggregate``'s result, before that step's
        own; their KV-cache events are dropped, as vLLM drops them (EXE-006). Several
        failed steps in a row accumulate, in order.

        Raises:
            InvalidArgumentError: ``outputs`` is not a mapping of ranks in
                ``[0, world_size)`` to ``KVConnectorOutput`` (EXE-013).
            DoubleReportError, UnknownRequestError, ReportError: as ``aggregate``, for the
                salvaged reports (EXE-002, EXE-003, EXE-008, EXE-006, EXE-007).

        On any error nothing changed (EXE-009).
        """
        if not isinstance(outputs, Mapping):
            raise InvalidArgumentError(
                f"outputs is {type(outputs).__name__}; expected a mapping of rank to the "
                "KVConnectorOutput that rank produced in the failed step", clause="EXE-013")
        full: list[KVConnectorOutput] = [EMPTY_OUTPUT] * self._world_size
        for rank, out in outputs.items():
            if isinstance(rank, bool) or not isinstance(rank, int) \
                    or not 0 <= rank < self._world_size:
                raise InvalidArgumentError(
                    f"rank {rank!r} in the salvaged outputs; expected ranks in "
                    f"[0, {self._world_size})", clause="EXE-013")
            if not isinstance(out, KVConnectorOutput):
                raise InvalidArgumentError(
                    f"salvaged output of rank {rank} is {type(out).__name__}; expected a "
                    "KVConnectorOutput", clause="EXE-013")
            full[rank] = attrs.evolve(out, events=()) if out.events else out
        held = self._held
        self._held = None  # counted as a step of its own, then held again
        try:
            got = self.aggregate(full)
            merged = got if held is None else _merge(held, got)
        except BaseException:
            self._held = held
            raise
        self._held = merged

    def _with_held(self, outputs: Sequence[KVConnectorOutput]) -> KVConnectorOutput:
        """``aggregate`` after ``defer``: this step's result merged after what is held,
        the held part cleared only once the step succeeded (EXE-009, EXE-013)."""
        held = self._held
        assert held is not None
        self._held = None
        try:
            got = self.aggregate(outputs)
            merged = _merge(held, got)
        except BaseException:
            self._held = held
            raise
        return merged

    @staticmethod
    def _check_types(outputs: Sequence[object]) -> None:
        """Raise for the first output that is not a ``KVConnectorOutput`` (EXE-010)."""
        for rank, out in enumerate(outputs):
            if not isinstance(out, KVConnectorOutput):
                raise InvalidArgumentError(
                    f"output of rank {rank} is {type(out).__name__}; expected a "
                    "KVConnectorOutput",
                    clause="EXE-010",
                )

    def _alone(self, out: KVConnectorOutput) -> KVConnectorOutput:
        """``aggregate`` for one rank reporting nothing but finished ids: each completes
        its request, so the output is the aggregate (nothing failed, no counts)."""
        for d, ids in ((0, out.finished_sending), (1, out.finished_recving)):
            if ids and not self._left[d].keys() >= ids:
                self._raise_unknown(0, min(ids - self._left[d].keys()), d)
        _consume(map(self._left[0].__delitem__, out.finished_sending))
        _consume(map(self._left[1].__delitem__, out.finished_recving))
        return out

    def _completions(self, outputs: Sequence[KVConnectorOutput],
                     fixed: tuple[dict[str, int], dict[str, int]]
                     ) -> tuple[frozenset[str], frozenset[str]]:
        """The step's completions (sends, receives) when some count is not the world
        size, counted per request; commits the counts fixed in this step.

        Raises:
            UnknownRequestError: more reports than the count in this step (EXE-003);
                every change of the step is undone first.
        """
        complete: list[frozenset[str]] = []
        for d in (0, 1):
            reported = [o.finished_recving if d else o.finished_sending for o in outputs]
            counts, left = self._counts[d], self._left[d]
            done = []
            for request_id in frozenset().union(*reported):
                count = fixed[d].get(request_id) or counts.get(request_id, self._world_size)
                have = self._world_size - left.get(request_id, 0).bit_count()
                if have > count:
                    self._uncount(outputs, None)
                    now = [rank for rank, ids in enumerate(reported) if request_id in ids]
                    extra = now[count - (have - len(now))]
                    direction = _DIRECTIONS[d]
                    _unknown(
                        f"rank {extra} reports request {request_id!r} finished "
                        f"{direction.value}ing, but it already completed in this step "
                        f"after {count} reports; expected at most {count} reports",
                        rank=extra, request_id=request_id, direction=direction,
                    )
                if have == count:
                    done.append(request_id)
            complete.append(frozenset(done))
        for d in (0, 1):
            counts, left = self._counts[d], self._left[d]
            for request_id, n in fixed[d].items():  # counts hold those not the world size
                if n == self._world_size:
                    counts.pop(request_id, None)
                else:
                    counts[request_id] = n
            for request_id in complete[d]:
                left.pop(request_id, None)
                counts.pop(request_id, None)
        return complete[0], complete[1]

    def _uncount(self, outputs: Sequence[KVConnectorOutput],
                 stop: tuple[int, int, str] | None) -> None:
        """Undo ``aggregate``'s loop up to ``(rank bit, direction, request_id)``, not
        included, or all of it (the same order; XOR undoes itself, and restores the
        requests the loop deleted)."""
        for bit, out in zip(self._bits, outputs):
            for d, ids in ((0, out.finished_sending), (1, out.finished_recving)):
                left = self._left[d]
                for request_id in ids:
                    if (bit, d, request_id) == stop:
                        return
                    left[request_id] = left.get(request_id, 0) ^ bit

    @staticmethod
    def _raise_unknown(rank: int, request_id: str, d: int) -> NoReturn:
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
    def _raise_double(rank: int, request_id: str, d: int) -> NoReturn:
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
        for awaited requests no rank reported before, from the outputs that report them
        (EXE-008).

        Raises:
            ReportError: a count above the world size, or two ranks give different
                counts for one request.
        """
        fixed: tuple[dict[str, int], dict[str, int]] = ({}, {})
        source: dict[tuple[int, str], int] = {}
        for rank, out in enumerate(outputs):
            override = out.expected_finished_count
            if override is None:
                continue
            if override > self._world_size:
                raise ReportError(
                    f"rank {rank} reports expected_finished_count {override}; expected "
                    f"at most the world size {self._world_size}",
                    rank=rank,
                    clause="EXE-008",
                )
            for d, ids in ((0, out.finished_sending), (1, out.finished_recving)):
                left = self._left[d]
                for request_id in ids:
                    if left.get(request_id) != self._full:
                        continue  # not awaited, or its count is already fixed
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
        ws = self._world_size
        return MappingProxyType({
            (request_id, _DIRECTIONS[d]):
                self._counts[d].get(request_id, ws) - (ws - mask.bit_count())
            for d in (0, 1) for request_id, mask in self._left[d].items()
        })

    def reported_by(self, request_id: str, direction: Direction) -> frozenset[int]:
        """The ranks that reported an awaited request/direction so far.

        Empty when none did, or when it is not awaited (never registered, or complete).
        """
        mask = self._left[_index(direction)].get(request_id, self._full)
        return frozenset(rank for rank, bit in enumerate(self._bits) if not mask & bit)


class _Double(Exception):
    """A rank reported a request twice (raised and caught inside ``aggregate``)."""


_SEND, _RECV = _DIRECTIONS = (Direction.SEND, Direction.RECV)
_INDEXED = frozenset({list, tuple})
_TRUSTED_IDS = KVConnectorOutput._trusted_ids
# No count fixed in a step (never changed).
_NO_COUNTS: tuple[dict[str, int], dict[str, int]] = ({}, {})
_NONE: frozenset[Any] = frozenset()
# Runs an iterator of calls to its end, in C (the deletions of completed requests).
_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend
_SENDING = attrgetter("finished_sending")
_RECVING = attrgetter("finished_recving")


def _merge(first: KVConnectorOutput, then: KVConnectorOutput) -> KVConnectorOutput:
    """Two aggregated outputs as one, ``first``'s before ``then``'s: what salvaged
    outputs held merged into the next step's aggregate (EXE-013). Stats and worker
    metadata are reduced ``first`` then ``then`` (EXE-006, EXE-007).

    Raises:
        ReportError: a stats or metadata reduction failed (nothing is changed then).
    """
    if first.is_empty() and first.stats is None:
        return then
    pair = (first, then)
    return KVConnectorOutput._trusted(
        first.finished_sending | then.finished_sending,
        first.finished_recving | then.finished_recving,
        first.failed_recving | then.failed_recving,
        first.invalid_block_ids | then.invalid_block_ids,
        _reduce(pair, "stats", "EXE-006"), first.events + then.events,
        _reduce(pair, "worker_metadata", "EXE-007"))


def _raise_again(request_id: str, direction: Direction) -> NoReturn:
    raise InvalidArgumentError(
        f"request {request_id!r} is already awaited for {direction.value}; "
        "expected each request/direction to be registered once until it completes",
        clause="EXE-011",
    )


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
