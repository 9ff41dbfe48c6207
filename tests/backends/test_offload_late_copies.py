"""Issue 34, late results: a load copy of the offloading backend that outlives its deadline
reads host memory and writes the engine's blocks directly, so it can still write them after
the load was reported failed. Its request's blocks stay held until the copy ended
(WRK-017): the worker names the load late (``FailedStores.late_loads``), the scheduler role
delays the request's free when it finishes and names it in ``OffloadMetadata.held``, and
every rank reports it in ``finished_sending`` once no copy of it runs there. A request
aborted while its late copy runs is reported in ``finished_recving`` only once the copy
ended."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvspec.backends.offload import (
    FailedStores,
    HostPool,
    OffloadMetadata,
    OffloadScheduler,
    OffloadWorker,
    TransferJob,
)
from kvspec.protocols import (
    EngineConfigView,
    KVCacheLayout,
    KVConnectorOutput,
    KVPacking,
    MalformedMetadataError,
    RequestView,
    SchedulerOutputView,
    StrideOrder,
    TransferRole,
    UnknownRequestError,
)

BS = 4
DEADLINE_S = 0.2


def _config(**extra: Any) -> EngineConfigView:
    return EngineConfigView(engine_id="late", role=TransferRole.BOTH, num_layers=2,
                            block_size=BS, num_blocks=10, extra=extra)


def _worker() -> OffloadWorker:
    layout = KVCacheLayout.contiguous(StrideOrder.LBNHC, KVPacking.CONCAT, torch.float32,
                                      2, 10, BS, 2, 4)
    full = layout.view(torch.randn(layout.span_elems))
    worker = OffloadWorker(_config(offload_slots=4, io_timeout_s=DEADLINE_S), 0)
    worker.register_kv_caches({f"l{i}": full[layout.layer_slots[i]] for i in range(2)}, layout)
    return worker


def _request(rid: str, prompt: list[int], computed: int = 0) -> RequestView:
    hashes = tuple(hashlib.sha256(f"x|{prompt[: (i + 1) * BS]}".encode()).digest()
                   for i in range(len(prompt) // BS))
    return RequestView(rid, tuple(prompt), block_hashes=hashes, num_computed_tokens=computed)


class _Gate:
    """Holds the first load copy inside ``HostPool.load`` until ``open``."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.released = threading.Event()
        self.armed = True

    def open(self) -> None:
        self.released.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Gate]:
    g = _Gate()
    original = HostPool.load

    def load(self: HostPool, plan: Any) -> None:
        if g.armed:
            g.armed = False
            g.reached.set()
            g.released.wait(30)
        original(self, plan)

    monkeypatch.setattr(HostPool, "load", load)
    try:
        yield g
    finally:
        g.open()


def _step(worker: OffloadWorker, meta: OffloadMetadata,
          finished: frozenset[str] = frozenset()) -> KVConnectorOutput:
    worker.bind_connector_metadata(OffloadMetadata.decode(meta.encode()))  # as if it crossed
    worker.wait_for_save()
    out = worker.build_connector_output(finished)
    worker.clear_connector_metadata()  # starts the transfers (a step without a forward)
    return out


def _poll(worker: OffloadWorker, until: Any, finished: frozenset[str] = frozenset(),
          limit_s: float = 5.0) -> KVConnectorOutput:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        out = worker.build_connector_output(finished)
        if until(out):
            return out
        time.sleep(0.01)
    raise AssertionError("not reported in time")


def _stored(worker: OffloadWorker) -> None:
    _step(worker, OffloadMetadata(stores=(TransferJob.of("s", ((1, 0, 11),), False),)))
    _poll(worker, lambda o: "s" in o.finished_sending, frozenset({"s"}))


def test_a_late_load_is_held_until_its_copy_ends(gate: _Gate) -> None:
    """Worker side: the load fails at its deadline and is named late in the same output;
    the held request is reported in finished_sending only once the copy ended."""
    worker = _worker()
    try:
        _stored(worker)
        _step(worker, OffloadMetadata(loads=(TransferJob.of("r", ((2, 0, 11),), True),)))
        assert gate.reached.wait(5)
        out = _poll(worker, lambda o: "r" in o.finished_recving)
        assert out.failed_recving == {"r"} and out.invalid_block_ids == {2}
        assert out.worker_metadata == FailedStores(frozenset(), frozenset({"r"}))
        # The request is recomputed, finishes; the scheduler role holds it.
        out = _step(worker, OffloadMetadata(held=("r",)), frozenset({"r"}))
        for _ in range(5):
            assert "r" not in out.finished_sending
            out = worker.build_connector_output(frozenset())
            time.sleep(0.02)
        gate.open()
        out = _poll(worker, lambda o: "r" in o.finished_sending)
        assert worker.build_connector_output(frozenset()).finished_sending == frozenset()
        assert not worker._late_copies and not worker._held
    finally:
        gate.open()
        worker.shutdown()


def test_a_held_request_without_a_late_copy_on_this_rank_is_reported_at_once() -> None:
    """Another rank's copy was late: this rank reports the held request in the next
    output, once."""
    worker = _worker()
    try:
        out = _step(worker, OffloadMetadata(held=("r",)), frozenset({"r"}))
        assert out.finished_sending == {"r"}
        assert worker.build_connector_output(frozenset()).finished_sending == frozenset()
    finally:
        worker.shutdown()


def test_a_request_aborted_during_its_late_copy_is_reported_once_the_copy_ends(
        gate: _Gate) -> None:
    """Aborted while loading (SCH-021): the engine frees its blocks once finished_recving
    is reported, so the worker reports it only after the late copy ended, and never
    names it late (the scheduler role cannot hold a finished request)."""
    worker = _worker()
    try:
        _stored(worker)
        _step(worker, OffloadMetadata(loads=(TransferJob.of("r", ((2, 0, 11),), True),)))
        assert gate.reached.wait(5)
        out = _step(worker, OffloadMetadata(aborted_loads=("r",)), frozenset({"r"}))
        start = time.monotonic()
        while time.monotonic() - start < DEADLINE_S + 0.3:  # past the deadline
            assert "r" not in out.finished_recving and out.worker_metadata is None
            t0 = time.monotonic()
            out = worker.build_connector_output(frozenset())
            assert time.monotonic() - t0 < 0.2  # nothing waits on the stuck copy
            time.sleep(0.01)
        gate.open()
        out = _poll(worker, lambda o: "r" in o.finished_recving)
        assert out.failed_recving == {"r"} and out.invalid_block_ids == {2}
    finally:
        gate.open()
        worker.shutdown()


def test_the_scheduler_holds_a_late_request_at_its_finish() -> None:
    sched = OffloadScheduler(_config(offload_slots=4))
    r = _request("r", list(range(6)), computed=6)  # one full block: stored at the finish
    q = _request("q", list(range(100, 102)), computed=2)  # no full block: nothing to store
    for req in (r, q):
        sched.on_new_request(req)
    sched.update_connector_output(KVConnectorOutput(
        worker_metadata=FailedStores(frozenset(), frozenset({"r", "q"}))))
    assert sched.request_finished(q, (7,)) == (True, None)  # held, though nothing is stored
    assert sched.request_finished(r, (3, 4)) == (True, None)
    meta = sched.build_connector_meta(SchedulerOutputView(step_id=1))
    assert isinstance(meta, OffloadMetadata)
    assert set(meta.held) == {"r", "q"} and [j.request_id for j in meta.stores] == ["r"]
    assert OffloadMetadata.decode(meta.encode()) == meta
    sched.update_connector_output(KVConnectorOutput(finished_sending=frozenset({"r", "q"})))
    with pytest.raises(UnknownRequestError):  # once only
        sched.update_connector_output(KVConnectorOutput(finished_sending=frozenset({"q"})))
    # r's store was made stored by the same report: a new request matches its block
    s = _request("s", list(range(6)))
    sched.on_new_request(s)
    assert sched.get_num_new_matched_tokens(s, 0) == (4, True)
    sched.shutdown()


def test_a_late_report_for_a_finished_request_is_counted_not_held() -> None:
    sched = OffloadScheduler(_config(offload_slots=4))
    r = _request("r", list(range(2)), computed=2)
    sched.on_new_request(r)
    assert sched.request_finished(r, (3,)) == (False, None)
    sched.update_connector_output(KVConnectorOutput(
        worker_metadata=FailedStores(frozenset(), frozenset({"r"}))))
    assert sched.stats()["late_loads_unheld"] == 1
    meta = sched.build_connector_meta(SchedulerOutputView(step_id=1))
    assert isinstance(meta, OffloadMetadata) and meta.held == ()
    sched.shutdown()


def test_failed_stores_with_late_loads_cross_processes_and_aggregate() -> None:
    a = FailedStores(frozenset({"s"}), frozenset({"x"}))
    b = FailedStores(frozenset(), frozenset({"y"}))
    assert FailedStores.decode(a.encode()) == a
    assert FailedStores.decode(b.encode()) == b
    assert FailedStores.decode(FailedStores({"s"}).encode()) == FailedStores({"s"})
    assert a.aggregate(b) == FailedStores({"s"}, {"x", "y"})
    for bad in (b'{"late_loads": []}', b'{"late_loads": ["a"], "other": 1}',
                b'{"failed_stores": ["a"]}', b'{"late_loads": [""]}'):
        with pytest.raises(MalformedMetadataError) as err:
            FailedStores.decode(bad)
        assert err.value.clause == "ERR-005"
