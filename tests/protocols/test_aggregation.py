"""Tests of kvspec.protocols.aggregation.StandardAggregator (EXE clauses)."""

from __future__ import annotations

import time
import attrs
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvspec.protocols.aggregation import StandardAggregator
from kvspec.protocols.errors import (
    DoubleReportError,
    InvalidArgumentError,
    KVSpecError,
    ReportError,
    UnknownRequestError,
)
from kvspec.protocols.events import (
    EMPTY_OUTPUT,
    BlockRemoved,
    ConnectorStats,
    Direction,
    KVConnectorOutput,
)

SEND, RECV = Direction.SEND, Direction.RECV
Key = tuple[str, Direction]


@attrs.frozen
class Trail:
    """Worker metadata whose reduction is associative but not commutative."""

    ranks: tuple[int, ...]

    def aggregate(self, other: Trail) -> Trail:
        return Trail(self.ranks + other.ranks)


def out(
    send: tuple[str, ...] = (),
    recv: tuple[str, ...] = (),
    failed: tuple[str, ...] = (),
    count: int | None = None,
) -> KVConnectorOutput:
    return KVConnectorOutput(
        finished_sending=send,
        finished_recving=recv,
        failed_recving=failed,
        expected_finished_count=count,
    )


def snapshot(agg: StandardAggregator) -> tuple[dict[Key, int], dict[Key, frozenset[int]]]:
    pending = dict(agg.pending())
    return pending, {key: agg.reported_by(*key) for key in pending}


# ------------------------------------------------------------------ unit tests


@pytest.mark.parametrize(
    ("world", "count", "fragment"),
    [
        (0, None, "world_size is 0"),
        (True, None, "world_size is True"),
        (2.0, None, "world_size is 2.0"),
        (2, 0, "expected_count is 0"),
        (2, 3, "expected_count is 3"),
        (2, True, "expected_count is True"),
    ],
)
def test_constructor_rejects(world: object, count: object, fragment: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        StandardAggregator(world, expected_count=count)  # type: ignore[arg-type]
    assert fragment in str(info.value)


def test_properties() -> None:
    agg = StandardAggregator(4, expected_count=3)
    assert agg.world_size == 4 and agg.expected_count == 3
    assert StandardAggregator(2).expected_count == 2


def test_expect_rejects() -> None:
    agg = StandardAggregator(2)
    with pytest.raises(InvalidArgumentError, match="request_id is ''"):
        agg.expect("", SEND)
    with pytest.raises(InvalidArgumentError, match="direction is 'send'"):
        agg.expect("a", "send")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="count is 3"):
        agg.expect("a", SEND, count=3)
    agg.expect("a", SEND)
    agg.expect("a", RECV)
    with pytest.raises(InvalidArgumentError, match="EXE-011") as info:
        agg.expect("a", SEND)
    assert "'a' is already awaited for send" in str(info.value)
    assert dict(agg.pending()) == {("a", SEND): 2, ("a", RECV): 2}


def test_wrong_outputs() -> None:
    agg = StandardAggregator(2)
    agg.expect("a", SEND)
    for bad, fragment in [
        ([EMPTY_OUTPUT], "got 1 outputs; expected exactly one per rank, 2 in all"),
        ([EMPTY_OUTPUT] * 3, "got 3 outputs"),
        ([], "got 0 outputs"),
        ([EMPTY_OUTPUT, None], "output of rank 1 is NoneType"),
        ({EMPTY_OUTPUT}, "outputs is set"),
        ("ab", "outputs is str"),
    ]:
        with pytest.raises(InvalidArgumentError, match="EXE-010") as info:
            agg.aggregate(bad)  # type: ignore[arg-type]
        assert fragment in str(info.value)
    assert dict(agg.pending()) == {("a", SEND): 2}


def test_counts_down_and_reports_once() -> None:
    agg = StandardAggregator(2)
    agg.expect("a", SEND)
    agg.expect("a", RECV)
    r1 = agg.aggregate([out(send=("a",)), out(recv=("a",))])
    assert r1.is_empty()
    assert agg.pending() == {("a", SEND): 1, ("a", RECV): 1}
    assert agg.reported_by("a", SEND) == {0}
    assert agg.reported_by("a", RECV) == {1}
    r2 = agg.aggregate([out(recv=("a",)), out(send=("a",))])
    assert r2.finished_sending == {"a"} and r2.finished_recving == {"a"}
    assert r2.expected_finished_count is None
    assert agg.pending() == {}
    assert agg.reported_by("a", SEND) == frozenset()
    # A completed request can be awaited again.
    agg.expect("a", SEND)
    agg.aggregate([out(send=("a",)), out()])
    assert agg.pending() == {("a", SEND): 1}


def test_aggregator_expected_count_override() -> None:
    agg = StandardAggregator(4, expected_count=2)
    agg.expect("a", RECV)
    assert agg.pending() == {("a", RECV): 2}
    assert agg.aggregate([out(recv=("a",)), out(), out(), out()]).finished_recving == set()
    res = agg.aggregate([out(), out(), out(), out(recv=("a",))])
    assert res.finished_recving == {"a"}
    assert agg.pending() == {}


def test_expect_count_override() -> None:
    agg = StandardAggregator(3)
    agg.expect("a", SEND, count=1)
    agg.expect("b", SEND)
    assert agg.pending() == {("a", SEND): 1, ("b", SEND): 3}
    res = agg.aggregate([out(), out(send=("a", "b")), out()])
    assert res.finished_sending == {"a"}
    assert agg.pending() == {("b", SEND): 2}


def test_per_output_override() -> None:
    agg = StandardAggregator(4)
    agg.expect("a", SEND, count=3)
    agg.expect("b", SEND)
    # The output override wins over the aggregator default and expect()'s count.
    res = agg.aggregate([out(send=("a", "b"), count=2), out(), out(), out()])
    assert res.finished_sending == set()
    assert agg.pending() == {("a", SEND): 1, ("b", SEND): 1}
    # Once counting started, a later override does not change the count.
    res = agg.aggregate([out(), out(send=("a",), count=1), out(), out(send=("b",), count=4)])
    assert res.finished_sending == {"a", "b"}
    assert agg.pending() == {}


def test_per_output_override_agreeing_and_silent_ranks() -> None:
    agg = StandardAggregator(4)
    agg.expect("a", RECV)
    # Rank 3's override concerns only what rank 3 reports; rank 1 has no opinion.
    res = agg.aggregate([out(recv=("a",), count=2), out(recv=("a",)), out(), out(count=3)])
    assert res.finished_recving == {"a"}


def test_per_output_override_conflict() -> None:
    agg = StandardAggregator(3)
    agg.expect("a", SEND)
    agg.expect("b", SEND)
    before = snapshot(agg)
    with pytest.raises(ReportError, match="EXE-008") as info:
        agg.aggregate([out(send=("a", "b"), count=2), out(), out(send=("a",), count=3)])
    err = info.value
    assert type(err) is ReportError
    assert (err.rank, err.request_id) == (2, "a")
    assert "ranks 0 and 2 disagree on expected_finished_count for request 'a'" in str(err)
    assert snapshot(agg) == before


def test_per_output_override_ignored_once_counting_started() -> None:
    agg = StandardAggregator(3)
    agg.expect("a", SEND)
    agg.aggregate([out(send=("a",)), out(), out()])
    # The count of "a" is fixed (3); overrides that disagree no longer concern it.
    res = agg.aggregate([out(), out(send=("a",), count=1), out(send=("a",), count=2)])
    assert res.finished_sending == {"a"}
    assert agg.pending() == {}


def test_per_output_override_above_world_size() -> None:
    agg = StandardAggregator(2)
    with pytest.raises(ReportError, match="rank 1 reports expected_finished_count 3") as info:
        agg.aggregate([out(), out(count=3)])
    assert info.value.rank == 1


def test_more_reports_than_count_in_one_step() -> None:
    agg = StandardAggregator(3)
    agg.expect("a", SEND)
    agg.expect("b", SEND)
    before = snapshot(agg)
    with pytest.raises(UnknownRequestError, match="EXE-003") as info:
        agg.aggregate([out(send=("a", "b"), count=2)] * 3)
    err = info.value
    assert getattr(err, "rank") == 2
    assert getattr(err, "request_id") in {"a", "b"}
    assert "already completed in this step after 2 reports" in str(err)
    assert snapshot(agg) == before


def test_double_report() -> None:
    agg = StandardAggregator(2)
    agg.expect("a", RECV)
    agg.expect("b", SEND)
    agg.aggregate([out(), out(recv=("a",))])
    before = snapshot(agg)
    with pytest.raises(DoubleReportError, match="EXE-002") as info:
        agg.aggregate([out(send=("b",)), out(recv=("a",))])
    err = info.value
    assert (err.rank, err.request_id, getattr(err, "direction")) == (1, "a", RECV)
    assert "rank 1 reports request 'a' finished recving a second time" in str(err)
    assert snapshot(agg) == before


def test_unknown_report() -> None:
    """A report for a request nobody awaits is rejected (EXE-003, ERR-004)."""
    agg = StandardAggregator(2)
    agg.expect("a", SEND)
    before = snapshot(agg)
    with pytest.raises(UnknownRequestError, match="EXE-003") as info:
        agg.aggregate([out(send=("a",)), out(recv=("a",))])
    err = info.value
    assert (getattr(err, "rank"), getattr(err, "request_id")) == (1, "a")
    assert getattr(err, "direction") is RECV
    assert "rank 1 reports request 'a' finished recving" in str(err)
    assert snapshot(agg) == before


def test_failed_receive_reported_at_completion() -> None:
    """A receive that failed on one rank is reported failed only once every rank finished it
    (EXE-004)."""
    agg = StandardAggregator(2)
    agg.expect("a", RECV)
    agg.expect("b", RECV)
    r1 = agg.aggregate([out(recv=("a", "b"), failed=("a",)), out()])
    assert r1.failed_recving == set() and r1.finished_recving == set()
    r2 = agg.aggregate([out(), out(recv=("a", "b"))])
    assert r2.finished_recving == {"a", "b"}
    assert r2.failed_recving == {"a"}


def test_invalid_blocks_events_stats_metadata() -> None:
    """Invalid blocks united, stats and events reduced in rank order, worker metadata
    aggregated (EXE-005, EXE-006, EXE-007, WRK-016)."""
    agg = StandardAggregator(3)
    outputs = [
        KVConnectorOutput(
            invalid_block_ids=[r, 10],
            events=[BlockRemoved([r, 100 + r])],
            stats=None if r == 1 else ConnectorStats({"n": 1, f"r{r}": r}),
            worker_metadata=Trail((r,)),
        )
        for r in range(3)
    ]
    res = agg.aggregate(outputs)
    assert res.invalid_block_ids == {0, 1, 2, 10}
    assert res.events == tuple(BlockRemoved([r, 100 + r]) for r in range(3))
    assert res.stats == ConnectorStats({"n": 2, "r0": 0, "r2": 2})
    assert res.worker_metadata == Trail((0, 1, 2))
    assert agg.aggregate([EMPTY_OUTPUT] * 3) == EMPTY_OUTPUT


def test_stats_reduction_failure_names_rank_and_changes_nothing() -> None:
    agg = StandardAggregator(2)
    agg.expect("a", SEND)
    before = snapshot(agg)
    with pytest.raises(ReportError, match="EXE-006") as info:
        agg.aggregate(
            [
                KVConnectorOutput(finished_sending=["a"], stats=ConnectorStats({"n": 1})),
                KVConnectorOutput(finished_sending=["a"], stats=Trail((1,))),
            ]
        )
    assert info.value.rank == 1
    assert "reducing stats failed at rank 1" in str(info.value)
    assert snapshot(agg) == before
    with pytest.raises(ReportError, match="EXE-007"):
        agg.aggregate(
            [
                KVConnectorOutput(worker_metadata=Trail((0,))),
                KVConnectorOutput(worker_metadata=ConnectorStats()),
            ]
        )


def test_unreported_requests_cost_nothing_per_step() -> None:
    agg = StandardAggregator(2)
    for i in range(50_000):
        agg.expect(f"req-{i}", SEND)
    quiet = [EMPTY_OUTPUT, EMPTY_OUTPUT]
    start = time.perf_counter()
    for _ in range(2_000):
        agg.aggregate(quiet)
    assert time.perf_counter() - start < 2.0


# ------------------------------------------------------------ property: scenarios


@attrs.frozen
class Plan:
    """A valid schedule: who expects what when, and which rank reports it when."""

    world: int
    default: int | None
    steps: int
    expects: dict[Key, tuple[int, int | None]]  # key -> (step of expect(), count)
    reports: dict[Key, dict[int, int]]  # key -> rank -> step
    failed: frozenset[tuple[str, int]]  # (request, rank) whose receive failed
    invalid: dict[tuple[int, int], frozenset[int]]  # (step, rank) -> block ids

    def completion(self, key: Key) -> int:
        return max(self.reports[key].values())

    def effective(self, key: Key) -> int:
        count = self.expects[key][1]
        return count if count is not None else (self.default or self.world)


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    world = draw(st.integers(1, 4))
    default = draw(st.none() | st.integers(1, world))
    steps = draw(st.integers(1, 6))
    names = draw(st.lists(st.sampled_from("abcdefgh"), unique=True, max_size=6))
    expects: dict[Key, tuple[int, int | None]] = {}
    reports: dict[Key, dict[int, int]] = {}
    failed: set[tuple[str, int]] = set()
    for name in names:
        dirs = draw(st.sampled_from([(SEND,), (RECV,), (SEND, RECV)]))
        for direction in dirs:
            key = (name, direction)
            count = draw(st.none() | st.integers(1, world))
            effective = count if count is not None else (default or world)
            ranks = draw(st.permutations(range(world)))[:effective]
            reports[key] = {r: draw(st.integers(0, steps - 1)) for r in ranks}
            expects[key] = (draw(st.integers(0, min(reports[key].values()))), count)
            if direction is RECV:
                failed.update((name, r) for r in ranks if draw(st.integers(0, 3)) == 0)
    invalid = {
        (s, r): draw(st.frozensets(st.integers(0, 20), max_size=3))
        for s in range(steps)
        for r in range(world)
    }
    return Plan(world, default, steps, expects, reports, frozenset(failed), invalid)


@attrs.frozen
class Injection:
    step: int
    rank: int
    request_id: str
    direction: Direction
    error: type[KVSpecError]


def step_outputs(plan: Plan, step: int, inject: Injection | None = None) -> list[KVConnectorOutput]:
    outputs = []
    for rank in range(plan.world):
        ids: dict[Direction, set[str]] = {SEND: set(), RECV: set()}
        for (rid, direction), by_rank in plan.reports.items():
            if by_rank.get(rank) == step:
                ids[direction].add(rid)
        if inject is not None and inject.rank == rank:
            ids[inject.direction].add(inject.request_id)
        outputs.append(
            KVConnectorOutput(
                finished_sending=ids[SEND],
                finished_recving=ids[RECV],
                failed_recving={rid for rid in ids[RECV] if (rid, rank) in plan.failed},
                invalid_block_ids=plan.invalid[(step, rank)],
                stats=ConnectorStats({"n": 1, f"r{rank}": step}),
                events=[BlockRemoved([step * 10 + rank])],
                worker_metadata=Trail((rank,)),
            )
        )
    return outputs


def model_pending(plan: Plan, step: int, *, after: bool) -> dict[Key, int]:
    """Remaining counts the model expects before (or after) ``step``'s aggregate."""
    result = {}
    for key, (expect_step, _) in plan.expects.items():
        if expect_step > step or plan.completion(key) < step:
            continue
        done = sum(1 for s in plan.reports[key].values() if s < step or (after and s == step))
        if after and plan.completion(key) == step:
            continue
        result[key] = plan.effective(key) - done
    return result


def drive(plan: Plan, inject: Injection | None = None) -> None:
    agg = StandardAggregator(plan.world, expected_count=plan.default)
    seen: dict[Key, int] = {}
    for step in range(plan.steps):
        for key, (expect_step, count) in plan.expects.items():
            if expect_step == step:
                agg.expect(*key, count=count)
        assert dict(agg.pending()) == model_pending(plan, step, after=False)
        if inject is not None and inject.step == step:
            before = snapshot(agg)
            with pytest.raises(inject.error) as info:
                agg.aggregate(step_outputs(plan, step, inject))
            err = info.value
            assert getattr(err, "rank") == inject.rank
            assert getattr(err, "request_id") == inject.request_id
            assert getattr(err, "direction") is inject.direction
            assert f"rank {inject.rank}" in str(err)
            assert repr(inject.request_id) in str(err)
            assert snapshot(agg) == before
        res = agg.aggregate(step_outputs(plan, step))
        done = {key for key in plan.reports if plan.completion(key) == step}
        assert res.finished_sending == {rid for rid, d in done if d is SEND}
        assert res.finished_recving == {rid for rid, d in done if d is RECV}
        assert res.failed_recving == {
            rid
            for rid, d in done
            if d is RECV and any((rid, r) in plan.failed for r in plan.reports[(rid, d)])
        }
        assert res.invalid_block_ids == frozenset().union(
            *(plan.invalid[(step, r)] for r in range(plan.world))
        )
        assert res.stats is not None
        assert res.stats.counters["n"] == plan.world  # type: ignore[attr-defined]
        assert res.events == tuple(BlockRemoved([step * 10 + r]) for r in range(plan.world))
        assert res.worker_metadata == Trail(tuple(range(plan.world)))
        for rid in res.finished_sending:
            seen[(rid, SEND)] = seen.get((rid, SEND), 0) + 1
        for rid in res.finished_recving:
            seen[(rid, RECV)] = seen.get((rid, RECV), 0) + 1
        assert dict(agg.pending()) == model_pending(plan, step, after=True)
    assert seen == {key: 1 for key in plan.reports}
    assert agg.pending() == {}


@settings(max_examples=500, deadline=None)
@given(plans())
def test_every_request_reported_once_at_its_last_report(plan: Plan) -> None:
    drive(plan)


@settings(max_examples=500, deadline=None)
@given(plans(), st.data())
def test_rejected_step_names_culprit_and_changes_nothing(plan: Plan, data: st.DataObject) -> None:
    """A rejected step names the rank and request and leaves the state unchanged (EXE-009,
    ERR-004)."""
    step = data.draw(st.integers(0, plan.steps - 1), label="step")
    candidates: list[Injection] = []
    for key, by_rank in plan.reports.items():
        rid, direction = key
        expect_step = plan.expects[key][0]
        if plan.completion(key) < step:
            # Already complete: any rank reporting it again is unknown.
            candidates.extend(
                Injection(step, r, rid, direction, UnknownRequestError) for r in range(plan.world)
            )
        elif expect_step > step:
            # Not registered yet.
            candidates.extend(
                Injection(step, r, rid, direction, UnknownRequestError)
                for r in range(plan.world)
                if by_rank.get(r) != step
            )
        else:
            # Pending: a rank that already reported reports again.
            candidates.extend(
                Injection(step, r, rid, direction, DoubleReportError)
                for r, s in by_rank.items()
                if s < step
            )
    ghost = Injection(
        step,
        data.draw(st.integers(0, plan.world - 1), label="rank"),
        "ghost",
        data.draw(st.sampled_from([SEND, RECV]), label="direction"),
        UnknownRequestError,
    )
    candidates.append(ghost)
    drive(plan, data.draw(st.sampled_from(candidates), label="injection"))


# --------------------------------------------------------- stateful comparison


@attrs.define
class ModelEntry:
    count: int | None
    ranks: set[int] = attrs.Factory(set)
    failed: bool = False


POOL = ("a", "b", "c", "d")


class AggregatorMachine(RuleBasedStateMachine):
    """Interleaves expect() and aggregate() and compares with a plain model."""

    def __init__(self) -> None:
        super().__init__()
        self.world = 1
        self.default = 1
        self.agg = StandardAggregator(1)
        self.model: dict[Key, ModelEntry] = {}

    @initialize(world=st.integers(1, 4), data=st.data())
    def setup(self, world: int, data: st.DataObject) -> None:
        default = data.draw(st.none() | st.integers(1, world))
        self.world = world
        self.default = default or world
        self.agg = StandardAggregator(world, expected_count=default)

    def remaining(self, entry: ModelEntry) -> int:
        return (entry.count if entry.count is not None else self.default) - len(entry.ranks)

    @rule(data=st.data())
    def expect(self, data: st.DataObject) -> None:
        keys = [(rid, d) for rid in POOL for d in (SEND, RECV)]
        free = [key for key in keys if key not in self.model]
        # Mostly a request not awaited yet; sometimes one already awaited (an error).
        again = data.draw(st.sampled_from([False, False, False, True]), label="again")
        key = data.draw(st.sampled_from(free if free and not again else keys), label="key")
        count = data.draw(st.sampled_from([None, None, None, 1, 2, 3, 4, 5]), label="count")
        rid, direction = key
        if (count is not None and count > self.world) or key in self.model:
            with pytest.raises(InvalidArgumentError):
                self.agg.expect(rid, direction, count=count)
            return
        self.agg.expect(rid, direction, count=count)
        self.model[key] = ModelEntry(count)

    @rule(data=st.data())
    def expect_many(self, data: st.DataObject) -> None:
        """Several requests of one direction at once, the default count: all or none."""
        direction = data.draw(st.sampled_from([SEND, RECV]), label="direction")
        # A list: the same id twice in one call is one registration, not an error.
        rids = data.draw(st.lists(st.sampled_from(POOL), max_size=4), label="rids")
        if any((rid, direction) in self.model for rid in rids):
            before = dict(self.agg.pending())
            with pytest.raises(InvalidArgumentError):
                self.agg.expect_many(rids, direction)
            assert dict(self.agg.pending()) == before
            return
        self.agg.expect_many(rids, direction)
        for rid in rids:
            self.model[(rid, direction)] = ModelEntry(None)

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        # Mostly valid reports; sometimes one stray report (unknown, double or surplus),
        # and per-output count overrides that are absent, agreeing or arbitrary.
        noisy = data.draw(st.sampled_from([False, False, False, False, True]), label="noisy")
        noise_rank = data.draw(st.integers(0, self.world - 1), label="noise rank")
        override_mode = data.draw(st.sampled_from(["none", "none", "same", "any"]))
        same = data.draw(st.integers(1, self.world), label="same override")
        picks: dict[int, dict[Direction, set[str]]] = {
            rank: {SEND: set(), RECV: set()} for rank in range(self.world)
        }
        for (rid, direction), pending in sorted(self.model.items(), key=lambda kv: kv[0][0]):
            free = [r for r in range(self.world) if r not in pending.ranks]
            if not free:
                continue
            most = min(len(free), self.remaining(pending))
            how_many = data.draw(st.sampled_from(range(most + 1)))
            for rank in data.draw(st.permutations(free))[:how_many]:
                picks[rank][direction].add(rid)
        outputs = []
        for rank in range(self.world):
            ids = picks[rank]
            if noisy and rank == noise_rank:
                direction = data.draw(st.sampled_from([SEND, RECV]), label="noise direction")
                ids[direction].add(data.draw(st.sampled_from(POOL + ("zz",)), label="noise"))
            recv = sorted(ids[RECV])
            failed = data.draw(st.sets(st.sampled_from(recv))) if recv else set()
            count: int | None = None
            if override_mode == "same":
                count = same
            elif override_mode == "any":
                count = data.draw(st.none() | st.integers(1, self.world + (rank == 0)))
            outputs.append(
                KVConnectorOutput(
                    finished_sending=ids[SEND],
                    finished_recving=ids[RECV],
                    failed_recving=failed,
                    invalid_block_ids=data.draw(st.frozensets(st.integers(0, 5), max_size=2)),
                    expected_finished_count=count,
                )
            )

        # The model's verdict.
        first: set[type[Exception]] = set()  # errors found while scanning reports
        later: set[type[Exception]] = set()  # errors found once counts are known
        new: dict[Key, list[int]] = {}
        overrides: dict[Key, set[int]] = {}
        failed_keys: set[Key] = set()
        for rank, o in enumerate(outputs):
            if o.expected_finished_count is not None and o.expected_finished_count > self.world:
                first.add(ReportError)
            for direction, rids in ((SEND, o.finished_sending), (RECV, o.finished_recving)):
                for rid in rids:
                    key = (rid, direction)
                    entry = self.model.get(key)
                    if entry is None:
                        first.add(UnknownRequestError)
                        continue
                    if rank in entry.ranks:
                        first.add(DoubleReportError)
                        continue
                    new.setdefault(key, []).append(rank)
                    if direction is RECV and rid in o.failed_recving:
                        failed_keys.add(key)
                    if not entry.ranks and o.expected_finished_count is not None:
                        overrides.setdefault(key, set()).add(o.expected_finished_count)
        if any(len(v) > 1 for v in overrides.values()):
            first.add(ReportError)
        counts: dict[Key, int] = {}
        for key, ranks in new.items():
            entry = self.model[key]
            if entry.ranks:
                count = entry.count if entry.count is not None else self.default
            elif key in overrides:
                count = min(overrides[key])
            else:
                count = entry.count if entry.count is not None else self.default
            counts[key] = count
            if len(entry.ranks) + len(ranks) > count:
                later.add(UnknownRequestError)

        expected_errors = first or later
        if expected_errors:
            before = snapshot(self.agg)
            with pytest.raises(KVSpecError) as info:
                self.agg.aggregate(outputs)
            assert type(info.value) in expected_errors, (info.value, expected_errors)
            assert snapshot(self.agg) == before
            return

        res = self.agg.aggregate(outputs)
        done: set[Key] = set()
        failed_done: set[str] = set()
        for key, ranks in new.items():
            entry = self.model[key]
            entry.count = counts[key]
            entry.ranks.update(ranks)
            entry.failed |= key in failed_keys
            if len(entry.ranks) == entry.count:
                done.add(key)
                if entry.failed:
                    failed_done.add(key[0])
                del self.model[key]
        assert res.finished_sending == {rid for rid, d in done if d is SEND}
        assert res.finished_recving == {rid for rid, d in done if d is RECV}
        assert res.failed_recving == failed_done
        assert res.invalid_block_ids == frozenset().union(*(o.invalid_block_ids for o in outputs))

    @invariant()
    def state_matches_model(self) -> None:
        assert dict(self.agg.pending()) == {
            key: self.remaining(entry) for key, entry in self.model.items()
        }
        for key, entry in self.model.items():
            assert self.agg.reported_by(*key) == entry.ranks


AggregatorMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None
)
test_aggregator_machine = AggregatorMachine.TestCase



def test_stats_whose_aggregate_returns_none_are_refused() -> None:
    """Issue 14, defect 9: the aggregator kept only the last rank's stats when a stats
    object's aggregate() returned None; it now refuses, naming the rank."""
    from kvspec.protocols import ConnectorStats, KVConnectorOutput, ReportError, StandardAggregator

    class Lossy(ConnectorStats):
        def aggregate(self, other: Any) -> Any:
            return None

    agg = StandardAggregator(2)
    outs = [KVConnectorOutput(stats=Lossy({"a": 1})), KVConnectorOutput(stats=Lossy({"a": 2}))]
    with pytest.raises(ReportError, match="returned None"):
        agg.aggregate(outs)


def test_expect_many_registers_all_or_none() -> None:
    agg = StandardAggregator(2)
    agg.expect_many(["a", "b"], SEND)
    assert dict(agg.pending()) == {("a", SEND): 2, ("b", SEND): 2}
    with pytest.raises(InvalidArgumentError, match="'b' is already awaited"):
        agg.expect_many(["c", "b"], SEND)
    with pytest.raises(InvalidArgumentError, match="non-empty string"):
        agg.expect_many(["d", ""], RECV)
    with pytest.raises(InvalidArgumentError, match="Direction"):
        agg.expect_many(["d"], "send")  # type: ignore[arg-type]
    assert set(agg.pending()) == {("a", SEND), ("b", SEND)}
    agg.expect_many([], RECV)
    out = agg.aggregate([KVConnectorOutput(finished_sending={"a"}),
                         KVConnectorOutput(finished_sending={"a", "b"})])
    assert out.finished_sending == {"a"} and dict(agg.pending()) == {("b", SEND): 1}


def test_expect_many_takes_a_repeated_id_once_and_refuses_unhashable_ids() -> None:
    agg = StandardAggregator(2)
    agg.expect_many(("a", "b", "a"), RECV)
    assert dict(agg.pending()) == {("a", RECV): 2, ("b", RECV): 2}
    with pytest.raises(InvalidArgumentError, match="non-empty string"):
        agg.expect_many(["c", ["d"]], RECV)  # type: ignore[list-item]
    agg.expect_many(iter(["c"]), RECV)  # any iterable
    assert ("c", RECV) in agg.pending()


def test_a_rank_reporting_again_after_its_request_completed_in_the_same_step() -> None:
    """Rank 0's report completes the request; rank 1, which reported it a step earlier,
    reports it again in the same step: a double report (EXE-002), not an unknown one, and
    the step changes nothing (EXE-009)."""
    agg = StandardAggregator(2)
    agg.expect_many(["a", "b"], SEND)
    agg.aggregate([KVConnectorOutput(), KVConnectorOutput(finished_sending={"a"})])
    with pytest.raises(DoubleReportError) as info:
        agg.aggregate([KVConnectorOutput(finished_sending={"a", "b"}),
                       KVConnectorOutput(finished_sending={"a"})])
    assert (info.value.rank, info.value.request_id) == (1, "a")
    assert dict(agg.pending()) == {("a", SEND): 1, ("b", SEND): 2}
    assert agg.reported_by("a", SEND) == {1}


# ------------------------------------------- salvaged outputs of failed steps (EXE-013)


def drive_with_failures(plan: Plan, failed_steps: frozenset[int], rereport: bool) -> None:
    """``drive`` where the steps in ``failed_steps`` fail after their outputs were collected:
    the executor defers them (vLLM 0.33's ``ft_defer_kv_connector_outputs``) and their
    reports are delivered with the next step that succeeds. With ``rereport``, the engine
    first hands the failed step's outputs again to the next ``aggregate`` (a failed step
    re-reported): refused, nothing changed."""
    agg = StandardAggregator(plan.world, expected_count=plan.default)
    seen: dict[Key, int] = {}
    held_steps: list[int] = []
    for step in range(plan.steps):
        for key, (expect_step, count) in plan.expects.items():
            if expect_step == step:
                agg.expect(*key, count=count)
        outputs = step_outputs(plan, step)
        if step in failed_steps:
            agg.defer(dict(enumerate(outputs)))
            held_steps.append(step)
            continue
        if rereport and held_steps:
            before = snapshot(agg)
            again = step_outputs(plan, held_steps[-1])
            if any(o.finished_sending or o.finished_recving for o in again):
                with pytest.raises((DoubleReportError, UnknownRequestError)):
                    agg.aggregate(again)
                assert snapshot(agg) == before
        res = agg.aggregate(outputs)
        steps = [*held_steps, step]
        done = {key for key in plan.reports if plan.completion(key) in steps}
        assert res.finished_sending == {rid for rid, d in done if d is SEND}
        assert res.finished_recving == {rid for rid, d in done if d is RECV}
        assert res.failed_recving == {
            rid for rid, d in done
            if d is RECV and any((rid, r) in plan.failed for r in plan.reports[(rid, d)])}
        assert res.invalid_block_ids == frozenset().union(
            *(plan.invalid[(s, r)] for s in steps for r in range(plan.world)))
        assert res.stats is not None
        assert res.stats.counters["n"] == plan.world * len(steps)  # type: ignore[attr-defined]
        # the failed steps' events are dropped, as vLLM drops them (EXE-006)
        assert res.events == tuple(BlockRemoved([step * 10 + r]) for r in range(plan.world))
        # the salvaged outputs' metadata first, in step and rank order (EXE-006, EXE-007)
        assert res.worker_metadata == Trail(tuple(range(plan.world)) * len(steps))
        for rid in res.finished_sending:
            seen[(rid, SEND)] = seen.get((rid, SEND), 0) + 1
        for rid in res.finished_recving:
            seen[(rid, RECV)] = seen.get((rid, RECV), 0) + 1
        held_steps = []
        assert dict(agg.pending()) == model_pending(plan, step, after=True)
    assert seen == {key: 1 for key in plan.reports}
    assert agg.pending() == {}


@st.composite
def plans_with_failures(draw: st.DrawFn) -> tuple[Plan, frozenset[int]]:
    plan = draw(plans())
    failed = draw(st.frozensets(st.integers(0, plan.steps - 2), max_size=plan.steps - 1)
                  if plan.steps > 1 else st.just(frozenset[int]()))
    return plan, failed


@settings(max_examples=300, deadline=None)
@given(plans_with_failures(), st.booleans())
def test_salvaged_reports_complete_once_in_the_next_step(
        case: tuple[Plan, frozenset[int]], rereport: bool) -> None:
    """EXE-013: whether a rank's report arrives in its own step or salvaged from a failed
    step into the next, each request completes exactly once, in the first step that
    succeeds after its last report; a failed step handed again is refused (EXE-002,
    EXE-003) and changes nothing (EXE-009)."""
    plan, failed = case
    drive_with_failures(plan, failed, rereport)


def test_defer_counts_a_rank_once_across_the_failed_and_the_next_step() -> None:
    agg = StandardAggregator(2)
    agg.expect("a", SEND)
    agg.defer({0: out(send=("a",)), 1: EMPTY_OUTPUT})
    assert agg.reported_by("a", SEND) == {0}
    with pytest.raises(DoubleReportError, match="rank 0") as info:
        agg.aggregate([out(send=("a",)), EMPTY_OUTPUT])
    assert info.value.clause == "EXE-002"
    assert agg.reported_by("a", SEND) == {0}
    res = agg.aggregate([EMPTY_OUTPUT, out(send=("a",))])
    assert res.finished_sending == {"a"}
    assert agg.aggregate([EMPTY_OUTPUT, EMPTY_OUTPUT]).is_empty()


def test_defer_completes_with_the_next_aggregate_and_drops_events() -> None:
    agg = StandardAggregator(2)
    agg.expect("r", RECV)
    salvaged = KVConnectorOutput(finished_recving={"r"}, failed_recving={"r"},
                                 invalid_block_ids={3}, events=[BlockRemoved([1])],
                                 stats=ConnectorStats({"n": 1}))
    agg.defer({0: salvaged, 1: out(recv=("r",))})  # rank 1 succeeded, rank 0 failed
    assert agg.pending() == {}
    res = agg.aggregate([KVConnectorOutput(events=[BlockRemoved([2])]), EMPTY_OUTPUT])
    assert res.finished_recving == res.failed_recving == {"r"}
    assert res.invalid_block_ids == {3}
    assert res.events == (BlockRemoved([2]),)
    assert res.stats == ConnectorStats({"n": 1})
    assert agg.aggregate([EMPTY_OUTPUT, EMPTY_OUTPUT]).is_empty()


def test_defer_of_a_rank_that_produced_no_output() -> None:
    """A rank left out of the salvaged outputs reported nothing: its report still counts
    when it comes."""
    agg = StandardAggregator(3)
    agg.expect("a", SEND)
    agg.defer({1: out(send=("a",))})
    agg.defer({2: out(send=("a",))})  # two failed steps in a row accumulate
    assert agg.reported_by("a", SEND) == {1, 2}
    assert agg.aggregate([out(send=("a",)), EMPTY_OUTPUT, EMPTY_OUTPUT]
                         ).finished_sending == {"a"}


@pytest.mark.parametrize(("outputs", "fragment"), [
    ([EMPTY_OUTPUT, EMPTY_OUTPUT], "expected a mapping of rank"),
    ({2: EMPTY_OUTPUT}, "rank 2 in the salvaged outputs"),
    ({True: EMPTY_OUTPUT}, "rank True in the salvaged outputs"),
    ({0: object()}, "salvaged output of rank 0 is object"),
])
def test_defer_rejects(outputs: Any, fragment: str) -> None:
    agg = StandardAggregator(2)
    with pytest.raises(InvalidArgumentError, match=fragment) as info:
        agg.defer(outputs)
    assert info.value.clause == "EXE-013"


def test_defer_of_an_unknown_report_changes_nothing() -> None:
    agg = StandardAggregator(2)
    agg.expect("a", SEND)
    agg.defer({0: out(send=("a",))})
    before = snapshot(agg)
    with pytest.raises(UnknownRequestError) as info:
        agg.defer({1: out(send=("a", "ghost"))})
    assert info.value.clause == "EXE-003" and info.value.request_id == "ghost"
    assert snapshot(agg) == before
    # what was held is still delivered
    assert agg.aggregate([EMPTY_OUTPUT, out(send=("a",))]).finished_sending == {"a"}
