"""Tests of the host-memory offloading backend (kvspec.backends.offload)."""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections import OrderedDict
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvspec.backends.offload import (
    ARCPolicy,
    HostPool,
    LRUPolicy,
    OffloadCapacityError,
    OffloadConnector,
    OffloadMetadata,
    OffloadScheduler,
    OffloadWorker,
    TransferJob,
    make_policy,
)
from kvspec.protocols import (
    AllocatedBlocks,
    BlockRemoved,
    BlockStored,
    EngineConfigView,
    InvalidArgumentError,
    KVCacheLayout,
    KVConnectorOutput,
    KVPacking,
    MalformedMetadataError,
    RequestView,
    SchedulerOutputView,
    StrideOrder,
    TransferRole,
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
    for k in ("aa", "bb", "cc"):
        lru.insert(k)
    lru.touch("aa")
    never = lambda k: False  # noqa: E731
    assert [lru.evict(never), lru.evict(never), lru.evict(never)] == ["bb", "cc", "aa"]
    assert lru.evict(never) is None


def test_lru_skips_pinned_and_refuses_overflow() -> None:
    lru = LRUPolicy(2)
    lru.insert("aa")
    lru.insert("bb")
    with pytest.raises(InvalidArgumentError):
        lru.insert("cc")
    assert lru.evict(lambda k: k == "aa") == "bb"
    assert lru.evict(lambda k: True) is None
    assert list(lru) == ["aa"]


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


def test_scheduler_drops_blocks_of_failed_loads() -> None:
    sched = OffloadScheduler(_config())
    prompt = list(range(9))
    a = _request("a", prompt, computed=9)
    sched.on_new_request(a)
    sched.request_finished(a, (3, 4, 5))
    _meta(sched)
    _finish_store(sched, "a")
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
        loads=(TransferJob("r1", ((1, 0, "ab"), (2, -1, "cd")), True),),
        stores=(TransferJob("r2", ((3, 5, "ef"),), False),),
        aborted_loads=("r3",),
    )
    assert OffloadMetadata.decode(meta.encode()) == meta
    for bad in (b"", b"[]", b"\xff", meta.encode().replace(b'"version":1', b'"version":2'),
                meta.encode().replace(b"[3,5,", b"[3,-5,")):
        with pytest.raises(MalformedMetadataError):
            OffloadMetadata.decode(bad)
    with pytest.raises(InvalidArgumentError):
        TransferJob("r", ((1, -1, "ab"),), False)  # stores need a real slot


# -------------------------------------------------------------------------------- worker


def _layers(layout: KVCacheLayout) -> tuple[torch.Tensor, list[torch.Tensor]]:
    storage = torch.randn(layout.span_elems).to(layout.dtype)
    full = layout.view(storage)
    return storage, [full[layout.layer_slots[i]] for i in range(layout.num_layers)]


def _block_bytes(layout: KVCacheLayout, layers: list[torch.Tensor], block: int) -> bytes:
    dim = 1 if layout.packing is KVPacking.SPLIT else 0
    return b"".join(
        layer.select(dim, block).contiguous().view(torch.uint8).numpy().tobytes()
        for layer in layers
    )


def _wait_finished(worker: OffloadWorker, rid: str, recv: bool) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        sending, recving = worker.get_finished(frozenset())
        if rid in (recving if recv else sending):
            return
        time.sleep(0.005)
    raise AssertionError(f"{rid} not reported")


def _run(worker: OffloadWorker, meta: OffloadMetadata) -> None:
    worker.bind_connector_metadata(OffloadMetadata.decode(meta.encode()))
    worker.wait_for_save()
    worker.clear_connector_metadata()  # starts the transfers (no forward in this step)


@pytest.mark.parametrize(
    ("order", "packing", "padding", "extra"),
    list(itertools.product(StrideOrder, KVPacking, [0, 2], [0, 3])),
)
def test_worker_store_load_round_trip_is_byte_exact(
    order: StrideOrder, packing: KVPacking, padding: int, extra: int
) -> None:
    layout = KVCacheLayout.contiguous(
        order, packing, torch.float16, 3, 10, BS, 2, 4, block_capacity=10 + extra,
        page_padding_elems=padding,
    )
    storage, layers = _layers(layout)
    worker = OffloadWorker(_config(offload_slots=4), 0)
    try:
        worker.register_kv_caches({f"l{i}": t for i, t in enumerate(layers)}, layout)
        pool = worker.pool
        assert pool is not None
        if order.block_outermost and padding == 0:
            assert layout.regions_per_block == 1 and pool.path == "block"
        src = {b: _block_bytes(layout, layers, b) for b in (2, 7, 9)}
        _run(worker, OffloadMetadata(stores=(
            TransferJob("s", ((2, 3, "aa"), (7, 0, "bb"), (9, 1, "cc")), False),)))
        _wait_finished(worker, "s", recv=False)
        before = storage.clone()
        _run(worker, OffloadMetadata(loads=(
            TransferJob("l", ((5, 3, "aa"), (0, 0, "bb"), (4, 1, "cc")), True),)))
        _wait_finished(worker, "l", recv=True)
        assert worker.get_failed_recving() == frozenset()
        assert _block_bytes(layout, layers, 5) == src[2]
        assert _block_bytes(layout, layers, 0) == src[7]
        assert _block_bytes(layout, layers, 4) == src[9]
        # Only the loaded blocks' bytes changed: never padding or other blocks (WRK-002).
        changed = storage.view(torch.uint8) != before.view(torch.uint8)
        allowed = torch.zeros(layout.span_bytes, dtype=torch.bool)
        for off in layout.block_region_offsets([5, 0, 4]).flatten().tolist():
            allowed[off: off + layout.region_nbytes] = True
        assert not bool((changed & ~allowed).any())
        stats = worker.get_kv_connector_stats()
        assert stats is not None and stats.counters["blocks_loaded"] == 3  # type: ignore[attr-defined]
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
            TransferJob("s", ((1, 0, "aa"), (5, 1, "dd")), False),)))
        _wait_finished(worker, "s", recv=False)
        # Slot 0 holds "aa": a load that expects "bb" there, and a missing slot, both fail.
        _run(worker, OffloadMetadata(loads=(
            TransferJob("l", ((2, 0, "bb"), (3, -1, "cc"), (4, 1, "dd")), True),)))
        _wait_finished(worker, "l", recv=True)
        assert worker.get_failed_recving() == {"l"}
        assert worker.get_block_ids_with_load_errors() == {2, 3}
    finally:
        worker.shutdown()


def test_injected_faults_fail_every_load() -> None:
    worker, _, _ = _registered(offload_slots=4, load_fault_rate=1.0)
    try:
        _run(worker, OffloadMetadata(stores=(TransferJob("s", ((1, 0, "aa"),), False),)))
        _wait_finished(worker, "s", recv=False)
        _run(worker, OffloadMetadata(loads=(TransferJob("l", ((2, 0, "aa"),), True),)))
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
    _run(worker, OffloadMetadata(stores=(TransferJob("s", ((1, 0, "aa"),), False),)))
    _run(worker, OffloadMetadata(loads=tuple(
        TransferJob(f"l{i}", ((2 + i, 0, "aa"),), True) for i in range(4))))
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


def test_conformance_scenarios_and_async_scheduling() -> None:
    from kvspec.conformance import run_conformance

    result = run_conformance(
        ["kvspec.backends.offload:OffloadConnector"],
        extra_pytest_args=["-q", "-p", "no:cacheprovider", "-k",
                           "test_scenario or test_async_scheduling"],
    )
    assert result.exit_code == 0
    assert result.passed > 0 and result.failed == 0
