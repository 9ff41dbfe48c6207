"""Tests of the host-memory offloading backend (kvspec.backends.offload)."""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections import OrderedDict
from typing import Any

import attrs
import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvspec.backends.offload import (
    ARCPolicy,
    FailedStores,
    HostPool,
    LRUPolicy,
    OffloadCapacityError,
    OffloadConnector,
    OffloadMetadata,
    OffloadScheduler,
    OffloadSettings,
    OffloadWorker,
    SyncLoadOffloadConnector,
    TransferJob,
    make_policy,
)
from kvspec.protocols import (
    AllocatedBlocks,
    BlockRemoved,
    BlockStored,
    CachedRequestView,
    EngineConfigView,
    FaultPlan,
    ForwardContextView,
    ForwardKind,
    HookGraphMode,
    InvalidArgumentError,
    InvalidBlockIdError,
    KVCacheLayout,
    KVConnectorOutput,
    KVPacking,
    MalformedMetadataError,
    NewRequestView,
    RequestView,
    SchedulerOutputView,
    StrideOrder,
    TransferRole,
    UnknownRequestError,
)

BS = 4


def _config(**extra: Any) -> EngineConfigView:
    return EngineConfigView(
        engine_id="test", role=TransferRole.BOTH, num_layers=3, block_size=BS, num_blocks=10,
        extra=extra,
    )


# ------------------------------------------------------------------------------ eviction


def test_lru_evicts_least_recently_used_first() -> None:
    lru = LRUPolicy(3)
    for k in (1, 2, 3):
        lru.insert(k)
    lru.touch(1)
    never = lambda k: False  # noqa: E731
    assert [lru.evict(never), lru.evict(never), lru.evict(never)] == [2, 3, 1]
    assert lru.evict(never) is None


def test_lru_skips_pinned_and_refuses_overflow() -> None:
    lru = LRUPolicy(2)
    lru.insert(1)
    lru.insert(2)
    with pytest.raises(InvalidArgumentError):
        lru.insert(3)
    assert lru.evict(lambda k: k == 1) == 2
    assert lru.evict(lambda k: True) is None
    assert list(lru) == [1]


def test_arc_adapts_between_recency_and_frequency() -> None:
    arc = ARCPolicy(4)
    never = lambda k: False  # noqa: E731
    # Two frequent keys, then a scan of one-time keys: the scan is evicted, not the hot keys.
    for k in ("h1", "h2"):
        arc.insert(k)
        arc.touch(k)
    assert set(arc.frequent) == {"h1", "h2"}
    for k in ("s1", "s2", "s3", "s4"):
        if len(arc) == arc.capacity:
            assert arc.evict(never, incoming=k) in {"s1", "s2", "s3"}
        arc.insert(k)
    assert "h1" in arc and "h2" in arc
    # A re-reference of a key just evicted from T1 (a B1 ghost) grows the target p.
    p0 = arc.p
    ghost = next(k for k in ("s1", "s2", "s3") if k not in arc)
    arc.evict(never, incoming=ghost)
    arc.insert(ghost)
    assert arc.p > p0 and ghost in arc.frequent
    # Re-references of keys evicted from T2 (B2 ghosts) shrink it again.
    p1 = arc.p
    while arc.recent:
        arc.touch(arc.recent[0])
    victim = arc.evict(never, incoming="zz")
    assert victim is not None
    arc.insert("zz")
    arc.evict(never, incoming=victim)
    arc.insert(victim)
    assert arc.p < p1


def test_make_policy_rejects_unknown_names() -> None:
    assert isinstance(make_policy("lru", 1), LRUPolicy)
    assert isinstance(make_policy("arc", 1), ARCPolicy)
    with pytest.raises(InvalidArgumentError):
        make_policy("fifo", 1)
    with pytest.raises(InvalidArgumentError):
        LRUPolicy(0)


class _SlotCacheMachine(RuleBasedStateMachine):
    """Store / load (pin) / unpin / evict over a policy and a slot map, against a model."""

    policy_name = "lru"
    capacity = 3
    keys = st.sampled_from([f"{i:02x}" for i in range(8)])

    def __init__(self) -> None:
        super().__init__()
        self.policy = make_policy(self.policy_name, self.capacity)
        self.slots: dict[str, int] = {}
        self.free = list(range(self.capacity))
        self.pins: dict[str, int] = {}
        self.model_lru: OrderedDict[str, None] = OrderedDict()

    def _pinned(self, key: str) -> bool:
        return self.pins.get(key, 0) > 0

    def _evict(self, incoming: str | None = None) -> str | None:
        expected = next((k for k in self.model_lru if not self._pinned(k)), None)
        victim = self.policy.evict(self._pinned, incoming=incoming)
        if victim is None:
            assert all(self._pinned(k) for k in self.slots)
            return None
        assert not self._pinned(victim), "a pinned block was evicted"
        assert victim in self.slots
        if self.policy_name == "lru":
            assert victim == expected
        self.free.append(self.slots.pop(victim))
        self.model_lru.pop(victim)
        return victim

    @rule(key=keys)
    def store(self, key: str) -> None:
        if key in self.slots:
            return
        if not self.free and self._evict(incoming=key) is None:
            return
        self.slots[key] = self.free.pop()
        self.policy.insert(key)
        self.model_lru[key] = None

    @rule(key=keys)
    def load(self, key: str) -> None:
        if key in self.slots:
            self.policy.touch(key)
            self.model_lru.move_to_end(key)
            self.pins[key] = self.pins.get(key, 0) + 1

    @precondition(lambda self: any(v > 0 for v in self.pins.values()))
    @rule(data=st.data())
    def load_done(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(k for k, v in self.pins.items() if v > 0)))
        self.pins[key] -= 1

    @rule()
    def evict(self) -> None:
        self._evict()

    @invariant()
    def within_budget(self) -> None:
        assert len(self.policy) <= self.capacity
        assert len(self.slots) + len(self.free) == self.capacity
        assert len(set(self.slots.values())) == len(self.slots)
        assert set(self.policy) == set(self.slots)


class _LRUMachine(_SlotCacheMachine):
    policy_name = "lru"


class _ARCMachine(_SlotCacheMachine):
    policy_name = "arc"


_machine_settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                             suppress_health_check=list(HealthCheck))
TestLRUStateMachine = _LRUMachine.TestCase
TestLRUStateMachine.settings = _machine_settings
TestARCStateMachine = _ARCMachine.TestCase
TestARCStateMachine.settings = _machine_settings


# ----------------------------------------------------------------------------- scheduler


def _request(rid: str, prompt: list[int], salt: str = "x", computed: int = 0) -> RequestView:
    hashes = tuple(hashlib.sha256(f"{salt}|{prompt[: (i + 1) * BS]}".encode()).digest()
                   for i in range(len(prompt) // BS))
    return RequestView(rid, tuple(prompt), block_hashes=hashes, num_computed_tokens=computed)


def _finish_store(sched: OffloadScheduler, rid: str) -> None:
    sched.update_connector_output(KVConnectorOutput(finished_sending=frozenset({rid})))


def _store_a(sched: OffloadScheduler, prompt: list[int] | None = None) -> None:
    """Request "a" (9 tokens, two full blocks of 4) finishes and its store is reported."""
    a = _request("a", list(range(9)) if prompt is None else prompt, computed=9)
    sched.on_new_request(a)
    sched.request_finished(a, (3, 4, 5))
    _meta(sched)
    _finish_store(sched, "a")


def _meta(sched: OffloadScheduler, step: int = 0) -> OffloadMetadata:
    meta = sched.build_connector_meta(SchedulerOutputView(step_id=step))
    assert isinstance(meta, OffloadMetadata)
    return meta


def test_scheduler_stores_on_finish_matches_and_pins() -> None:
    sched = OffloadScheduler(_config(offload_slots=2))
    prompt = list(range(9))  # two full blocks, one token left
    a = _request("a", prompt, computed=9)
    sched.on_new_request(a)
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    assert sched.request_finished(a, (3, 4, 5)) == (True, None)  # deferred store, delayed free
    stores = _meta(sched).stores
    assert [j.block_ids for j in stores] == [(3, 4)]
    _finish_store(sched, "a")
    assert any(isinstance(e, BlockStored) for e in sched.take_events())
    b = _request("b", prompt)
    sched.on_new_request(b)
    assert sched.get_num_new_matched_tokens(b, 0) == (8, True)
    assert sched.get_num_new_matched_tokens(b, 0) == (8, True)  # side-effect free
    other_tenant = _request("c", prompt, salt="y")
    sched.on_new_request(other_tenant)
    assert sched.get_num_new_matched_tokens(other_tenant, 0) == (0, False)  # SCH-020
    sched.update_state_after_alloc(b, AllocatedBlocks.single((7, 8, 9)), 8)
    loads = _meta(sched).loads
    assert [j.block_ids for j in loads] == [(7, 8)]
    # Every slot is pinned by b's load: a new request's blocks find no room.
    d = _request("d", list(range(100, 109)), computed=9)
    sched.on_new_request(d)
    assert sched.request_finished(d, (0, 1, 2)) == (False, None)
    assert sched.stats()["stores_skipped"] >= 1 and sched.stats()["evictions"] == 0
    # The load completes: the slots unpin and become evictable.
    sched.update_connector_output(KVConnectorOutput(finished_recving=frozenset({"b"})))
    e = _request("e", list(range(200, 209)), computed=9)
    sched.on_new_request(e)
    assert sched.request_finished(e, (0, 1, 2)) == (True, None)
    assert any(isinstance(ev, BlockRemoved) for ev in sched.take_events())
    assert sched.stats()["evictions"] == 2
    assert sched.request_finished(other_tenant, ()) == (False, None)
    sched.request_finished(b, (7, 8, 9))
    sched.shutdown()
    sched.shutdown()


def test_a_failed_store_is_never_advertised_or_matched() -> None:
    """Issue 14, defect 7: a store that failed on a worker was still indexed and announced
    (BlockStored), so the next lookup matched it and its load was bound to fail. The
    worker now reports it (FailedStores worker metadata) and the scheduler frees its
    slots instead."""
    sched = OffloadScheduler(_config(offload_slots=4))
    worker, _, _ = _registered(offload_slots=4)
    try:
        def broken_store(*args: Any) -> Any:
            raise RuntimeError("disk on fire")
        worker._store = broken_store  # type: ignore[method-assign]
        prompt = list(range(9))
        a = _request("a", prompt, computed=9)
        sched.on_new_request(a)
        assert sched.request_finished(a, (3, 4, 5)) == (True, None)
        _run(worker, _meta(sched))
        _wait_finished(worker, "a", recv=False)
        meta = worker.build_connector_worker_meta()
        assert meta == FailedStores(frozenset({"a"}))
        assert worker.build_connector_worker_meta() is None  # reported once
        sched.update_connector_output(KVConnectorOutput(
            finished_sending=frozenset({"a"}), worker_metadata=meta))
        assert not any(isinstance(e, BlockStored) for e in sched.take_events())
        b = _request("b", prompt)
        sched.on_new_request(b)
        assert sched.get_num_new_matched_tokens(b, 0) == (0, False)
        assert sched.stats()["store_failures"] == 2
        # Its slots went back: four new blocks still fit without evicting anything.
        c = _request("c", list(range(100, 117)), computed=17)
        sched.on_new_request(c)
        assert sched.request_finished(c, (6, 7, 8, 9, 0)) == (True, None)
        assert [len(j) for j in _meta(sched).stores] == [4]
        assert sched.stats()["evictions"] == 0
        assert FailedStores({"x"}).aggregate(FailedStores({"y"})) == FailedStores({"x", "y"})
    finally:
        worker.shutdown()
        sched.shutdown()


def _scheduled(step: int, new: tuple[NewRequestView, ...] = (),
               cached: tuple[CachedRequestView, ...] = (),
               preempted: frozenset[str] = frozenset()) -> SchedulerOutputView:
    counts = {r.request_id: BS for r in (*new, *cached)}
    return SchedulerOutputView(step_id=step, scheduled_new_reqs=new,
                               scheduled_cached_reqs=cached, preempted_req_ids=preempted,
                               num_scheduled_tokens=counts)


def _run_two_steps(sched: OffloadScheduler) -> tuple[RequestView, Any]:
    """Request "a" (9 prompt tokens, blocks 1-3) computed in step 1; step 2's metadata."""
    a = _request("a", list(range(9)))
    sched.on_new_request(a)
    sched.get_num_new_matched_tokens(a, 0)
    sched.build_connector_meta(_scheduled(
        1, new=(NewRequestView(a, AllocatedBlocks.single((1, 2, 3)), 0),)))
    return a, sched.build_connector_meta(_scheduled(2, cached=(CachedRequestView(
        "a", num_computed_tokens=9),)))


def test_running_requests_prompt_blocks_are_stored_while_they_run() -> None:
    """``store_when="computed"`` (the default): the step after a prompt block is computed
    stores it; the request's stores are reported together once it finished (WRK-010), and
    its free is delayed until then (SCH-016), even when nothing is left to store."""
    sched = OffloadScheduler(_config(offload_slots=8))
    worker, layout, layers = _registered(offload_slots=8)
    try:
        a = _request("a", list(range(13)))  # three full prompt blocks
        sched.on_new_request(a)
        assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
        # Step 1 computes 8 tokens (blocks 0 and 1): nothing is stored before they exist.
        first = sched.build_connector_meta(_scheduled(
            1, new=(NewRequestView(a, AllocatedBlocks.single((5, 6)), 0),)))
        assert isinstance(first, OffloadMetadata) and not first.stores
        # Step 2 computes the rest; blocks 0 and 1 were computed by step 1: stored now.
        second = sched.build_connector_meta(_scheduled(2, cached=(CachedRequestView(
            "a", AllocatedBlocks.single((7, 8)), num_computed_tokens=8),)))
        assert isinstance(second, OffloadMetadata)
        assert [(j.request_id, j.block_ids) for j in second.stores] == [("a", (5, 6))]
        _run(worker, second)
        # Running: the completed store is not reported (WRK-010), yet its blocks match
        # as an asynchronous load the workers order after the store (SCH-031).
        time.sleep(0.05)
        assert worker.get_finished(frozenset()) == (frozenset(), frozenset())
        b = _request("b", list(range(13)))
        sched.on_new_request(b)
        assert sched.get_num_new_matched_tokens(b, 0) == (8, True)
        assert sched.get_num_new_matched_tokens(b, 0) == (8, True)  # no side effect
        # Step 3: block 2 (computed by step 2) is stored too.
        third = sched.build_connector_meta(_scheduled(3, cached=(CachedRequestView(
            "a", num_computed_tokens=13),)))
        assert isinstance(third, OffloadMetadata)
        assert [j.block_ids for j in third.stores] == [(7,)]
        _run(worker, third)
        done = _request("a", list(range(13)), computed=13)
        assert sched.request_finished(done, (5, 6, 7, 8)) == (True, None)  # nothing new
        assert not _meta(sched, 4).stores
        _wait_finished(worker, "a", recv=False)
        _finish_store(sched, "a")
        stored = [e for e in sched.take_events() if isinstance(e, BlockStored)]
        assert sum(len(e.block_hashes) for e in stored) == 3
        assert sched.get_num_new_matched_tokens(b, 0) == (12, True)
    finally:
        worker.shutdown()
        sched.shutdown()


def test_a_preempted_requests_stores_are_fenced_and_it_stores_again_when_resumed() -> None:
    """WRK-012: ``handle_preemptions`` returns only once the preempted request's copies
    ended; a resumed request (new blocks) does not store what is stored or being stored."""
    sched = OffloadScheduler(_config(offload_slots=8))
    worker, layout, layers = _registered(offload_slots=8, load_delay_s=0.0)
    worker._faults = FaultPlan(delay_s=0.2)  # every copy waits 0.2 s first
    try:
        a, meta = _run_two_steps(sched)
        assert isinstance(meta, OffloadMetadata) and [j.block_ids for j in meta.stores] == [(1, 2)]
        _run(worker, meta)
        (job,) = worker._stores["a"]
        assert not job.future.done()
        start = time.monotonic()
        worker.handle_preemptions(frozenset({"a"}))
        assert job.future.done() and time.monotonic() - start < 5
        resumed = sched.build_connector_meta(_scheduled(
            3, new=(NewRequestView(a, AllocatedBlocks.single((4, 5, 6)), 8),),
            preempted=frozenset()))
        assert isinstance(resumed, OffloadMetadata) and not resumed.stores
    finally:
        worker.shutdown()
        sched.shutdown()


def test_store_when_finished_stores_nothing_while_running() -> None:
    sched = OffloadScheduler(_config(offload_store="finished"))
    a, meta = _run_two_steps(sched)
    assert isinstance(meta, OffloadMetadata) and not meta.stores
    with pytest.raises(InvalidArgumentError, match="offload_store"):
        OffloadScheduler(_config(offload_store="sometimes"))


def test_stores_in_flight_are_tracked_per_block() -> None:
    """A store reported finished makes only its blocks stored; the blocks of another store
    still in flight match only as a load of that store (its slots and tag, SCH-031) and are
    not planned again, and blocks repeated in a request or already stored are left out of
    a new store."""
    sched = OffloadScheduler(_config(offload_store="finished"))
    a, b = _request("a", list(range(9)), computed=9), _request("b", list(range(50, 59)), computed=9)
    for r in (a, b):
        sched.on_new_request(r)
        assert sched.request_finished(r, (1, 2) if r is a else (3, 4)) == (True, None)
    assert [j.slots for j in _meta(sched).stores] == [(0, 1), (2, 3)]
    _finish_store(sched, "a")
    c = _request("c", list(range(50, 59)), computed=9)
    sched.on_new_request(c)
    assert sched.get_num_new_matched_tokens(c, 0) == (8, True)  # b's blocks: in flight
    assert sched.request_finished(c, (5, 6)) == (False, None)
    assert sched.stats()["pending_hit_blocks"] == 0  # matching plans nothing
    _finish_store(sched, "b")
    x = hashlib.sha256(b"x").digest()
    d = RequestView("d", tuple(range(17)), block_hashes=(*a.block_hashes, x, x),
                    num_computed_tokens=16)
    sched.on_new_request(d)
    assert sched.request_finished(d, (5, 6, 7, 8)) == (True, None)
    (job,) = _meta(sched).stores
    assert (job.block_ids, job.slots) == ((7,), (4,))  # a's two blocks stored, one repeat


def test_scheduler_drops_blocks_of_failed_loads() -> None:
    sched = OffloadScheduler(_config())
    prompt = list(range(9))
    _store_a(sched, prompt)
    b = _request("b", prompt)
    sched.on_new_request(b)
    sched.get_num_new_matched_tokens(b, 0)
    sched.update_state_after_alloc(b, AllocatedBlocks.single((7, 8, 9)), 8)
    _meta(sched)
    sched.take_events()
    sched.update_connector_output(KVConnectorOutput(
        finished_recving=frozenset({"b"}), failed_recving=frozenset({"b"}),
        invalid_block_ids=frozenset({8}),
    ))
    removed = [e for e in sched.take_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == 1 and len(removed[0].block_hashes) == 1
    c = _request("c", prompt)
    sched.on_new_request(c)
    assert sched.get_num_new_matched_tokens(c, 0) == (4, True)  # only the first block left


def test_metadata_round_trips_and_rejects_malformed() -> None:
    meta = OffloadMetadata(
        loads=(TransferJob.of("r1", ((1, 0, 1), (2, -1, 2)), True),),
        stores=(TransferJob.of("r2", ((3, 5, 3),), False),),
        aborted_loads=("r3",), held=("r4",),
    )
    good = meta.encode()
    assert OffloadMetadata.decode(good) == meta
    assert OffloadMetadata.decode(bytearray(good)) == meta
    assert OffloadMetadata.decode(OffloadMetadata().encode()) == OffloadMetadata()
    wire = msgspec.msgpack.decode(good)
    assert wire == ["kvspec.offload", 4, [["r1", [1, 2], [0, -1], [1, 2], []]],
                    [["r2", [3], [5], 3, []]], ["r3"], ["r4"]]  # one tag: every block's
    same = OffloadMetadata(stores=(TransferJob.of("r", ((4, 1, 9), (2, 0, 9)), False),))
    assert msgspec.msgpack.decode(same.encode())[3] == [["r", [4, 2], [1, 0], 9, []]]
    assert OffloadMetadata.decode(same.encode()) == same

    def edit(path: tuple[int, ...], value: Any) -> bytes:
        """``good`` with the element at ``path`` of its plain-data form replaced."""
        data = msgspec.msgpack.decode(good)
        *outer, last = path
        target = data
        for i in outer:
            target = target[i]
        target[last] = value
        return msgspec.msgpack.encode(data)

    for bad in (
        b"", b"[]", b"\xff" * 12, b"\x80\x04garbage", good[:-1], good + b"\0",
        b"\xdd\xff\xff\xff\xff" + good[1:],  # an array claiming 2**32 - 1 elements
        good.replace(b"\xa2r1", b"\xa2\xff\xfe"),  # a request id that is not UTF-8
        msgspec.msgpack.encode(wire[:5]), msgspec.msgpack.encode([*wire, []]),
        msgspec.msgpack.encode([wire[0], 3, *wire[2:5]]),  # version 3: no held list
        edit((0,), "other"), edit((1,), 1), edit((1,), True),
        edit((2, 0, 0), ""), edit((2, 0, 0), 7), edit((4, 0), ""),
        edit((3, 0, 2, 0), -1),  # a store needs a real slot
        edit((2, 0, 2, 1), -2),
        edit((2, 0, 1), [1, 1]),  # a block twice
        edit((2, 0, 2), [0, 0]),  # a slot twice
        edit((2, 0, 3), [1]),  # columns of different lengths
        edit((3, 0), ["r2", [], [], [], []]),  # an empty job
        edit((3, 0), ["r2", [3], [5]]), edit((3, 0), ["r2", [3], [5], [3], [], []]),
        edit((3, 0), ["r2", [3], [5], [3]]),  # no group columns (version 2's jobs)
        edit((2, 0, 4), [[1, 2]]),  # one group column: several or none
        edit((2, 0, 4), [[1, 2], [5]]),  # a group column of another length
        edit((2, 0, 4), [[1, 2], [-1, 0]]), edit((2, 0, 4), [[1, 2], [5, 5]]),
        edit((2, 0, 4), [[7, 8], [5, 0]]),  # block_ids is none of the columns
        edit((2, 0, 1, 0), True), edit((3, 0, 2, 0), 5.0), edit((3, 0, 3), "3"),
        edit((3, 0, 3), -1), edit((3, 0, 3), True), edit((3, 0, 3), []), edit((2, 0, 3), 1.5),
        edit((3, 0, 1, 0), -5), edit((3, 0, 1, 0), 1 << 63), edit((3, 0, 3), 1 << 63),
        edit((2, 0, 2, 0), -(1 << 63)),
        edit((2,), [["r1", [1], [0], [1], []], ["r1", [2], [1], [1], []]]),  # a request twice
        edit((4,), ["r3", "r3"]), edit((5,), ["r4", "r4"]), edit((5, 0), ""),
        edit((5,), "r4"),
    ):
        with pytest.raises(MalformedMetadataError, match="ERR-005"):
            OffloadMetadata.decode(bad)
    with pytest.raises(MalformedMetadataError):
        OffloadMetadata.decode("not bytes")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        TransferJob("r", (1, 2), (0, 0), (1, 1), False)  # one slot twice
    with pytest.raises(InvalidArgumentError):
        TransferJob("r", (1, True), (0, 1), (1, 1), False)  # a bool is not a block id
    with pytest.raises(InvalidArgumentError):
        TransferJob.of("r", ((1, -1, 1),), False)  # stores need a real slot


# -------------------------------------------------------------------------------- worker


def _layers(layout: KVCacheLayout, device: str = "cpu") -> tuple[torch.Tensor, list[torch.Tensor]]:
    storage = torch.randn(layout.span_elems).to(layout.dtype).to(device)
    full = layout.view(storage)
    return storage, [full[layout.layer_slots[i]] for i in range(layout.num_layers)]


def _block_bytes(layout: KVCacheLayout, layers: list[torch.Tensor], block: int) -> bytes:
    dim = 1 if layout.packing is KVPacking.SPLIT else 0
    return b"".join(
        layer.select(dim, block).contiguous().view(torch.uint8).cpu().numpy().tobytes()
        for layer in layers
    )


def _wait_finished(worker: OffloadWorker, rid: str, recv: bool) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        sending, recving = worker.get_finished(frozenset() if recv else frozenset({rid}))  # WRK-010
        if rid in (recving if recv else sending):
            return
        time.sleep(0.005)
    raise AssertionError(f"{rid} not reported")


def _run(worker: OffloadWorker, meta: OffloadMetadata) -> None:
    worker.bind_connector_metadata(OffloadMetadata.decode(meta.encode()))
    worker.wait_for_save()
    worker.clear_connector_metadata()  # starts the transfers (no forward in this step)


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize(
    ("order", "packing", "padding", "extra"),
    list(itertools.product(StrideOrder, KVPacking, [0, 2], [0, 3])),
)
def test_worker_store_load_round_trip_is_byte_exact(
    order: StrideOrder, packing: KVPacking, padding: int, extra: int, device: str
) -> None:
    """On the host, and with the KV caches on a GPU (the worker's copy stream, the pinned
    pool and the device-side gathers)."""
    layout = KVCacheLayout.contiguous(
        order, packing, torch.float16, 3, 10, BS, 2, 4, block_capacity=10 + extra,
        page_padding_elems=padding,
    )
    storage, layers = _layers(layout, device)
    worker = OffloadWorker(_config(offload_slots=4), 0)
    try:
        worker.register_kv_caches({f"l{i}": t for i, t in enumerate(layers)}, layout)
        pool = worker.pool
        assert pool is not None
        if order.block_outermost and padding == 0:
            assert layout.regions_per_block == 1 and pool.path == "block"
        assert pool.host.is_pinned() == (device == "cuda")
        src = {b: _block_bytes(layout, layers, b) for b in (2, 7, 9)}
        _run(worker, OffloadMetadata(stores=(
            TransferJob.of("s", ((2, 3, 1), (7, 0, 2), (9, 1, 3)), False),)))
        _wait_finished(worker, "s", recv=False)
        before = storage.clone()
        _run(worker, OffloadMetadata(loads=(
            TransferJob.of("l", ((5, 3, 1), (0, 0, 2), (4, 1, 3)), True),)))
        _wait_finished(worker, "l", recv=True)
        assert worker.get_failed_recving() == frozenset()
        assert _block_bytes(layout, layers, 5) == src[2]
        assert _block_bytes(layout, layers, 0) == src[7]
        assert _block_bytes(layout, layers, 4) == src[9]
        # Only the loaded blocks' bytes changed: never padding or other blocks (WRK-002).
        changed = (storage.view(torch.uint8) != before.view(torch.uint8)).cpu()
        allowed = torch.zeros(layout.span_bytes, dtype=torch.bool)
        for off in layout.block_region_offsets([5, 0, 4]).flatten().tolist():
            allowed[off: off + layout.region_nbytes] = True
        assert not bool((changed & ~allowed).any())
        stats = worker.get_kv_connector_stats()
        assert stats is not None and stats.counters["blocks_loaded"] == 3  # type: ignore[attr-defined]
        assert stats.counters["load_copy_us"] >= 1  # type: ignore[attr-defined]
    finally:
        worker.shutdown()


def _registered(**extra: Any) -> tuple[OffloadWorker, KVCacheLayout, list[torch.Tensor]]:
    layout = KVCacheLayout.contiguous(StrideOrder.LBNHC, KVPacking.CONCAT, torch.float32,
                                      3, 10, BS, 2, 4)
    _, layers = _layers(layout)
    worker = OffloadWorker(_config(**extra), 0)
    worker.register_kv_caches({f"l{i}": t for i, t in enumerate(layers)}, layout)
    return worker, layout, layers


def test_failed_loads_end_as_failed_recv_with_invalid_blocks() -> None:
    worker, _, _ = _registered(offload_slots=4)
    try:
        _run(worker, OffloadMetadata(stores=(
            TransferJob.of("s", ((1, 0, 1), (5, 1, 4)), False),)))
        _wait_finished(worker, "s", recv=False)
        # Slot 0 holds 1: a load that expects 2 there, and a missing slot, both fail.
        _run(worker, OffloadMetadata(loads=(
            TransferJob.of("l", ((2, 0, 2), (3, -1, 3), (4, 1, 4)), True),)))
        _wait_finished(worker, "l", recv=True)
        assert worker.get_failed_recving() == {"l"}
        assert worker.get_block_ids_with_load_errors() == {2, 3}
    finally:
        worker.shutdown()


def test_a_queued_load_is_reported_in_the_step_that_asks() -> None:
    """With its background thread busy for a moment (or waiting for the GIL), get_finished
    waits for a queued host-memory load, bounded, and reports it in that call, byte-exact:
    a hit costs no extra engine steps (found by kvspec bench vllm). The copy itself runs on
    the background thread, never the engine's (a hung copy: test_offload_faults.py)."""
    worker, layout, layers = _registered(offload_slots=4)
    try:
        _run(worker, OffloadMetadata(stores=(TransferJob.of("s", ((1, 0, 1),), False),)))
        _wait_finished(worker, "s", recv=False)
        want = _block_bytes(layout, layers, 1)
        assert worker._executor is not None
        copied_on: list[str] = []
        original = worker.pool.load  # type: ignore[union-attr]

        def load(plan: Any) -> None:
            copied_on.append(threading.current_thread().name)
            original(plan)

        worker.pool.load = load  # type: ignore[union-attr, method-assign]
        busy = worker._executor.submit(time.sleep, 0.01)  # the thread is taken
        _run(worker, OffloadMetadata(loads=(TransferJob.of("l", ((6, 0, 1),), True),)))
        assert worker.get_finished(frozenset()) == (frozenset(), frozenset({"l"}))
        assert worker.get_failed_recving() == frozenset()
        assert _block_bytes(layout, layers, 6) == want
        assert copied_on and threading.current_thread().name not in copied_on
        busy.result(timeout=10)
    finally:
        worker.shutdown()


def test_injected_faults_fail_every_load() -> None:
    worker, _, _ = _registered(offload_slots=4, load_fault_rate=1.0)
    try:
        _run(worker, OffloadMetadata(stores=(TransferJob.of("s", ((1, 0, 1),), False),)))
        _wait_finished(worker, "s", recv=False)
        _run(worker, OffloadMetadata(loads=(TransferJob.of("l", ((2, 0, 1),), True),)))
        _wait_finished(worker, "l", recv=True)
        assert worker.get_failed_recving() == {"l"}
        assert worker.get_block_ids_with_load_errors() == {2}
    finally:
        worker.shutdown()


def test_pool_must_fit_the_byte_budget() -> None:
    layout = KVCacheLayout.contiguous(StrideOrder.BLNHC, KVPacking.CONCAT, torch.float32,
                                      3, 10, BS, 2, 4)
    _, layers = _layers(layout)
    per_block = layout.regions_per_block * layout.region_nbytes
    HostPool(layers[0], layout, 4, 4 * per_block)
    with pytest.raises(OffloadCapacityError):
        HostPool(layers[0], layout, 5, 4 * per_block)
    worker = OffloadWorker(_config(offload_slots=1000, offload_bytes=1024), 0)
    with pytest.raises(OffloadCapacityError):
        worker.register_kv_caches({f"l{i}": t for i, t in enumerate(layers)}, layout)
    worker.shutdown()


def test_shutdown_is_bounded_idempotent_and_leaves_no_thread() -> None:
    worker, _, _ = _registered(offload_slots=8, load_delay_s=30.0)
    _run(worker, OffloadMetadata(stores=(TransferJob.of("s", ((1, 0, 1),), False),)))
    _run(worker, OffloadMetadata(loads=tuple(
        TransferJob.of(f"l{i}", ((2 + i, 0, 1),), True) for i in range(4))))
    worker.handle_preemptions(frozenset())  # nothing preempted: returns at once
    start = time.monotonic()
    worker.shutdown()
    worker.shutdown()
    assert time.monotonic() - start < 5.0
    assert not [t for t in threading.enumerate() if t.name.startswith("kvspec-offload")]


def test_factory_declares_the_capabilities() -> None:
    factory = OffloadConnector()
    caps = factory.capabilities
    assert factory.name == "offload"
    assert caps.async_loads and caps.delayed_free and not caps.has_layer_hooks
    assert caps.accepted_layouts == () and caps.accepts_split_kv


# --------------------------------------------------------------------------- conformance


@pytest.mark.parametrize(("factory", "tests"), [
    ("OffloadConnector", "test_scenario or test_async_scheduling"),
    # sync loads: the scenarios and a hit whose every load fails (WRK-011, invalid blocks)
    ("SyncLoadOffloadConnector", "(test_scenario and not prefix) or test_failed_loads_are"),
])
def test_conformance_scenarios_and_async_scheduling(factory: str, tests: str) -> None:
    from kvspec.conformance import run_conformance

    result = run_conformance(
        [f"kvspec.backends.offload:{factory}"],
        extra_pytest_args=["-q", "-p", "no:cacheprovider", "-k", tests],
    )
    assert result.exit_code == 0
    assert result.passed > 0 and result.failed == 0


# ------------------------------------------------------------------------------ host pool


@st.composite
def _pool_cases(draw: st.DrawFn) -> tuple[KVCacheLayout, list[int], list[int]]:
    order = draw(st.sampled_from(list(StrideOrder)))
    packing = draw(st.sampled_from(list(KVPacking)))
    dtype = draw(st.sampled_from([torch.float16, torch.float32, torch.uint8]))
    layers, blocks = draw(st.integers(1, 3)), draw(st.integers(2, 9))
    layout = KVCacheLayout.contiguous(
        order, packing, dtype, layers, blocks, draw(st.integers(1, 3)), draw(st.integers(1, 2)),
        draw(st.sampled_from([1, 3, 4, 8])), block_capacity=blocks + draw(st.integers(0, 2)),
        page_padding_elems=draw(st.sampled_from([0, 1, 5])),
    )
    n = draw(st.integers(1, blocks))
    ids = draw(st.permutations(range(blocks)))[:n]
    slots = draw(st.permutations(range(blocks)))[:n]  # arbitrary runs of consecutive slots
    return layout, list(ids), list(slots)


@pytest.mark.parametrize("few", [0, 1 << 30, -1], ids=["indexed", "memmove", "by-layer"])
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=_pool_cases())
def test_pool_store_and_load_are_byte_exact_on_every_path(
    case: tuple[KVCacheLayout, list[int], list[int]], few: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Any layout (every path and element width), any blocks, any slot order: a store then
    a load into other blocks moves exactly each block's bytes and touches nothing else,
    with the indexed tensor copies, with the per-region moves of few-block jobs, and
    layer by layer (``load_by_layer``, where the layout allows it: every layer storage
    once, in order)."""
    from kvspec.backends.offload import _pool

    monkeypatch.setattr(_pool, "_FEW", few)
    layout, ids, slots = case
    regions = layout.block_region_offsets([layout.num_blocks - 1]).tolist()[0]
    assert max(regions) + layout.region_nbytes <= layout.span_bytes  # raw moves stay inside
    storage = torch.randint(0, 256, (layout.span_bytes,), dtype=torch.uint8)
    layer0 = storage.view(layout.dtype)[: layout.span_elems] if layout.dtype != torch.uint8 \
        else storage
    pool = HostPool(layer0, layout, layout.num_blocks, 1 << 40)
    assert pool.path in ("block", "rows", "elements")
    assert pool._addrs is not None  # host memory, every region inside: memmove may run
    regions = layout.block_region_offsets(list(range(layout.num_blocks))).tolist()

    def block(b: int, buf: torch.Tensor) -> bytes:
        return b"".join(bytes(buf[o: o + layout.region_nbytes].tolist()) for o in regions[b])

    before = storage.clone()
    pool.store(pool.plan(ids, slots))
    for b, s in zip(ids, slots):
        assert bytes(pool.host[s].tolist()) == block(b, before)
    assert torch.equal(storage, before)  # a store reads only
    targets = list(reversed(ids))
    if few == -1 and pool.layer_chunks:
        assert layout.order.dims[0] == "L" and pool.path == "rows"
        done: list[int] = []
        plan = pool.plan(targets, slots)
        index = pool.layer_index(plan) if len(ids) % 2 else None  # built ahead, or not
        assert pool.load_by_layer(plan, done.append, lambda: False, index)
        assert done == list(range(layout.num_storage_layers))
    else:
        pool.load(pool.plan(targets, slots))
    for t, b in zip(targets, ids):
        assert block(t, storage) == block(b, before)
    changed = (storage != before).nonzero().flatten().tolist()
    allowed = {o + k for t in targets for o in regions[t] for k in range(layout.region_nbytes)}
    assert set(changed) <= allowed  # no padding, no other block, no other byte (WRK-002)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(_pool_cases())
def test_pool_index_of_few_rows_equals_the_tensor_index(
    case: tuple[KVCacheLayout, list[int], list[int]],
) -> None:
    """A plan of few rows builds its index in Python; it is the index the tensor ops
    build, row for row, on every path."""
    from kvspec.backends.offload import _pool

    layout, ids, slots = case
    storage = torch.zeros(layout.span_bytes, dtype=torch.uint8)
    layer0 = storage.view(layout.dtype)[: layout.span_elems] if layout.dtype != torch.uint8 \
        else storage
    pool = HostPool(layer0, layout, layout.num_blocks, 1 << 40)
    plan = pool.plan(ids, slots)
    small = pool._index(plan)
    saved, _pool._SMALL = _pool._SMALL, -1
    try:
        tensor = pool._index(plan)
    finally:
        _pool._SMALL = saved
    assert small.dtype == tensor.dtype == torch.int64 and torch.equal(small, tensor)


def test_pool_plan_checks_ids_slots_and_lengths() -> None:
    layout = KVCacheLayout.contiguous(StrideOrder.BLNHC, KVPacking.CONCAT, torch.float32,
                                      2, 6, BS, 1, 4, block_capacity=8)
    _, layers = _layers(layout)
    pool = HostPool(layers[0], layout, 4, 1 << 30)
    assert pool.path == "block" and pool.element_bytes == 16
    assert pool.plan([5, 1, 2], [1, 2, 3]).runs == ((1, 0, 3),)
    assert pool.plan([5, 1, 2], [3, 0, 1]).runs == ((3, 0, 1), (0, 1, 2))
    with pytest.raises(InvalidBlockIdError):
        pool.plan([6], [0])  # inside block_capacity, outside the budget (LAY-012)
    with pytest.raises(InvalidBlockIdError):
        pool.plan([True], [0])
    with pytest.raises(OffloadCapacityError):
        pool.plan([1], [4])
    with pytest.raises(OffloadCapacityError):
        pool.plan([1, 2], [0])


# ------------------------------------------------------------------ per-layer store path


def _layerwise_worker(
    order: StrideOrder, packing: KVPacking, **extra: Any
) -> tuple[OffloadWorker, KVCacheLayout, dict[str, torch.Tensor]]:
    layout = KVCacheLayout.contiguous(order, packing, torch.float16, 3, 10, BS, 2, 4,
                                      block_capacity=12, page_padding_elems=1)
    _, layers = _layers(layout)
    kv = {f"l{i}": t for i, t in enumerate(layers)}
    worker = OffloadWorker(_config(offload_slots=4, **extra), 0, store_path="layerwise")
    worker.register_kv_caches(kv, layout)
    return worker, layout, kv


def _forward(worker: OffloadWorker, kv: dict[str, torch.Tensor], meta: OffloadMetadata,
             *, hooks: bool = True) -> None:
    ctx = ForwardContextView(ForwardKind.REAL, 0, 4, tuple(kv))
    worker.bind_connector_metadata(OffloadMetadata.decode(meta.encode()))
    worker.start_load_kv(ctx)
    if hooks:
        for name, tensor in kv.items():
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, tensor, ctx)
    worker.wait_for_save()
    worker.clear_connector_metadata()


@pytest.mark.parametrize(("order", "packing"), list(itertools.product(StrideOrder, KVPacking)))
@pytest.mark.parametrize("hooks", [True, False], ids=["hooks", "no-forward"])
def test_layerwise_store_path_is_byte_exact(
    order: StrideOrder, packing: KVPacking, hooks: bool
) -> None:
    """Stores gathered by the save hooks into the staging (or, in a step whose forward never
    ran its hooks, by the background thread) load back byte for byte, on every layout."""
    worker, layout, kv = _layerwise_worker(order, packing, offload_stage_blocks=2)
    layers = list(kv.values())
    try:
        src = {b: _block_bytes(layout, layers, b) for b in (2, 7, 9)}
        # Three blocks through a stage of two: the third waits for the next forward.
        store = OffloadMetadata(stores=(TransferJob.of("s", ((2, 3, 1), (7, 0, 1), (9, 1, 1)),
                                                       False),))
        _forward(worker, kv, store, hooks=hooks)
        if hooks:
            assert worker.get_finished(frozenset()) == (frozenset(), frozenset())
            _forward(worker, kv, OffloadMetadata())
        _wait_finished(worker, "s", recv=False)
        load = OffloadMetadata(loads=(TransferJob.of("l", ((5, 3, 1), (0, 0, 1), (4, 1, 1)),
                                                     True),))
        _run(worker, load)
        _wait_finished(worker, "l", recv=True)
        assert worker.get_failed_recving() == frozenset()
        assert [_block_bytes(layout, layers, b) for b in (5, 0, 4)] == [src[2], src[7], src[9]]
    finally:
        worker.shutdown()


def test_layerwise_dummy_forwards_store_nothing_and_buffers_persist() -> None:
    worker, layout, kv = _layerwise_worker(StrideOrder.BLNHC, KVPacking.CONCAT)
    try:
        buffers = dict(worker.persistent_buffers)
        assert set(buffers) == {"save_idx", "staging", "saved"}
        ctx = ForwardContextView(ForwardKind.WARMUP, None, 4, tuple(kv))
        meta = worker.build_dummy_connector_meta(ctx)
        assert isinstance(meta, OffloadMetadata) and meta.is_empty
        before = torch.cat([t.flatten() for t in kv.values()]).clone()
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(ctx)
        for name, tensor in kv.items():
            worker.save_kv_layer(name, tensor, ctx)
        worker.wait_for_save()
        worker.clear_connector_metadata()
        assert torch.equal(torch.cat([t.flatten() for t in kv.values()]), before)
        assert worker.get_kv_connector_stats() is None  # nothing stored
        for name, tensor in worker.persistent_buffers.items():
            assert tensor.data_ptr() == buffers[name].data_ptr()  # updated in place only
        with pytest.raises(InvalidArgumentError):
            worker.bind_connector_metadata(OffloadMetadata())
            worker.save_kv_layer("nope", kv["l0"], ctx)
    finally:
        worker.shutdown()
    assert OffloadWorker(_config(), 0).persistent_buffers == {}
    with pytest.raises(InvalidArgumentError):
        OffloadWorker(_config(), 0, store_path="sideways")


def test_a_block_evicted_after_the_match_loads_with_slot_minus_one() -> None:
    """WRK-011: a block evicted between the match and the allocation is sent with slot -1
    (the workers fail it); the other blocks load, count as hits and are pinned."""
    sched = OffloadScheduler(_config(offload_slots=3))
    _store_a(sched)  # slots 0 and 1
    probe = _request("probe", list(range(9)))
    sched.on_new_request(probe)
    assert sched.get_num_new_matched_tokens(probe, 0) == (8, True)
    b = _request("b", list(range(50, 59)), computed=9)
    sched.on_new_request(b)
    sched.request_finished(b, (6, 7, 8))  # slot 2, and slot 0: a's first block evicted
    hits = sched.stats()["hit_blocks"]
    sched.update_state_after_alloc(probe, AllocatedBlocks.single((0, 1, 2)), 8)
    (load,) = _meta(sched).loads
    assert (load.block_ids, load.slots) == ((0, 1), (-1, 1))
    assert sched.stats()["hit_blocks"] == hits + 1 and sched.stats()["pinned_slots"] == 1


def test_matches_never_count_evicted_or_failed_blocks() -> None:
    """SCH-006: the match covers only blocks the connector can deliver now. Blocks evicted
    to make room, or dropped after a failed load, are not matched afterwards."""
    sched = OffloadScheduler(_config(offload_slots=2))
    _store_a(sched)
    probe = _request("probe", list(range(9)))
    sched.on_new_request(probe)
    assert sched.get_num_new_matched_tokens(probe, 0) == (8, True)
    b = _request("b", list(range(50, 59)), computed=9)
    sched.on_new_request(b)
    assert sched.request_finished(b, (6, 7, 8)) == (True, None)  # evicts both of a's blocks
    assert sched.get_num_new_matched_tokens(probe, 0) == (0, False)
    _meta(sched)
    _finish_store(sched, "b")
    c = _request("c", list(range(50, 59)))
    sched.on_new_request(c)
    sched.get_num_new_matched_tokens(c, 0)
    sched.update_state_after_alloc(c, AllocatedBlocks.single((0, 1, 2)), 8)
    _meta(sched)
    sched.update_connector_output(KVConnectorOutput(
        finished_recving=frozenset({"c"}), failed_recving=frozenset({"c"}),
        invalid_block_ids=frozenset({0, 1}),
    ))
    again = _request("again", list(range(50, 59)))
    sched.on_new_request(again)
    assert sched.get_num_new_matched_tokens(again, 0) == (0, False)


# ---------------------------------------------------------------------------- sync loads


def test_sync_loads_setting_is_a_bool() -> None:
    assert not OffloadSettings.from_config(_config()).sync_loads
    assert OffloadSettings.from_config(_config(sync_loads=True)).sync_loads
    for bad in ("yes", 1, None):
        with pytest.raises(InvalidArgumentError, match="sync_loads"):
            OffloadSettings.from_config(_config(sync_loads=bad))


def test_sync_load_scheduler_matches_synchronously_and_unpins_once_sent() -> None:
    """sync_loads: the match is (n, False) (SCH-004); the load goes out in the next
    metadata and its slots are free to evict once it is sent; the request is never
    awaited in finished_recving (SCH-028), and a block named invalid is dropped (WRK-011)."""
    sched = OffloadScheduler(_config(offload_slots=2, sync_loads=True))
    prompt = list(range(9))
    _store_a(sched, prompt)
    b = _request("b", prompt)
    sched.on_new_request(b)
    assert sched.get_num_new_matched_tokens(b, 0) == (8, False)
    sched.update_state_after_alloc(b, AllocatedBlocks.single((7, 8, 9)), 8)
    assert sched.stats()["pinned_slots"] == 2  # until the metadata is built
    (load,) = _meta(sched).loads
    assert (load.block_ids, load.is_load) == ((7, 8), True)
    assert sched.stats()["pinned_slots"] == 0
    assert sched.request_finished(b, (7, 8, 9)) == (False, None)  # no load to abort
    assert _meta(sched).aborted_loads == ()
    with pytest.raises(UnknownRequestError):
        sched.update_connector_output(KVConnectorOutput(finished_recving=frozenset({"b"})))
    sched.take_events()
    sched.update_connector_output(KVConnectorOutput(invalid_block_ids=frozenset({8})))
    removed = [e for e in sched.take_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == 1 and len(removed[0].block_hashes) == 1
    assert sched.stats()["load_failures"] == 1
    c = _request("c", prompt)
    sched.on_new_request(c)
    assert sched.get_num_new_matched_tokens(c, 0) == (4, False)  # only the first block left


def _sync_step(worker: OffloadWorker, meta: OffloadMetadata) -> None:
    worker.bind_connector_metadata(OffloadMetadata.decode(meta.encode()))
    worker.start_load_kv(ForwardContextView(ForwardKind.REAL, 0, 4, ("l0", "l1", "l2")))


def test_sync_load_is_done_when_start_load_kv_returns_and_never_reported() -> None:
    """sync_loads: start_load_kv loads on the calling thread, byte-exact, even with the
    background thread taken (WRK-004, WRK-013); nothing is reported in finished_recving."""
    worker, layout, layers = _registered(offload_slots=4, sync_loads=True)
    release = threading.Event()
    try:
        _run(worker, OffloadMetadata(stores=(
            TransferJob.of("s", ((1, 0, 1), (5, 1, 1)), False),)))
        _wait_finished(worker, "s", recv=False)
        want = [_block_bytes(layout, layers, b) for b in (1, 5)]
        assert worker._executor is not None
        busy = worker._executor.submit(release.wait, 10)  # the thread is taken
        _sync_step(worker, OffloadMetadata(loads=(
            TransferJob.of("l", ((6, 0, 1), (2, 1, 1)), True),)))
        assert [_block_bytes(layout, layers, b) for b in (6, 2)] == want
        worker.wait_for_save()
        assert worker.get_finished(frozenset()) == (frozenset(), frozenset())
        worker.clear_connector_metadata()
        assert worker.get_failed_recving() == frozenset()
        assert worker.get_block_ids_with_load_errors() == frozenset()
        stats = worker.get_kv_connector_stats()
        assert stats is not None and stats.counters["blocks_loaded"] == 2  # type: ignore[attr-defined]
        release.set()
        busy.result(timeout=10)
    finally:
        release.set()
        worker.shutdown()


def test_failed_sync_load_blocks_are_invalid_in_the_same_step() -> None:
    """sync_loads: a block whose slot holds other data (or none, slot -1) is named in the
    step's invalid block ids, and the request in neither finished_recving nor
    failed_recving (WRK-011); the good block loads."""
    worker, layout, layers = _registered(offload_slots=4, sync_loads=True)
    try:
        _run(worker, OffloadMetadata(stores=(
            TransferJob.of("s", ((1, 0, 1), (5, 1, 4)), False),)))
        _wait_finished(worker, "s", recv=False)
        want = _block_bytes(layout, layers, 5)
        _sync_step(worker, OffloadMetadata(loads=(
            TransferJob.of("l", ((2, 0, 2), (3, -1, 3), (4, 1, 4)), True),)))
        assert _block_bytes(layout, layers, 4) == want
        assert worker.get_finished(frozenset()) == (frozenset(), frozenset())
        worker.clear_connector_metadata()
        assert worker.get_failed_recving() == frozenset()
        assert worker.get_block_ids_with_load_errors() == {2, 3}
        worker.get_finished(frozenset())
        assert worker.get_block_ids_with_load_errors() == frozenset()  # reported once
    finally:
        worker.shutdown()


def test_sync_load_factory_declares_sync_loads_and_builds_sync_roles() -> None:
    factory = SyncLoadOffloadConnector()
    assert factory.name == "offload-sync"
    assert not factory.capabilities.async_loads
    assert factory.capabilities.layer_hooks is HookGraphMode.EAGER  # pipelined loads wait
    assert factory.capabilities.kv_cache_groups == 1  # its failures name blocks (KVG-005)
    full = OffloadConnector().capabilities
    assert attrs.evolve(factory.capabilities, async_loads=True,
                        layer_hooks=HookGraphMode.NO_LAYER_HOOKS, kv_cache_groups=8,
                        group_kinds=full.group_kinds) == full
    sched = factory.create_scheduler(_config(offload_slots=2))
    worker = factory.create_worker(_config(offload_slots=2), 0)
    try:
        assert isinstance(sched, OffloadScheduler) and isinstance(worker, OffloadWorker)
        assert sched._settings.sync_loads and worker._settings.sync_loads
    finally:
        worker.shutdown()
        sched.shutdown()
