"""Fault injection for the offloading backend (issue 14): injected load faults and copies
that hang. Each ends as failed transfers the engine recomputes, no hook blocks on a stuck
copy, shutdown is bounded, and threads, file descriptors and the host pool are back to
their baseline afterwards (WRK-011, WRK-014, WRK-015)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvspec.backends.offload import (
    FailedStores,
    HostPool,
    OffloadConnector,
    OffloadMetadata,
    OffloadWorker,
    TransferJob,
)
from kvspec.conformance.harness import Engine, HarnessConfig, RequestSpec, Workload
from kvspec.protocols import (
    EngineConfigView,
    KVCacheLayout,
    KVPacking,
    StrideOrder,
    TransferRole,
)

BS = 4
DEADLINE_S = 0.3


def _worker(**extra: Any) -> OffloadWorker:
    config = EngineConfigView(engine_id="faults", role=TransferRole.BOTH, num_layers=2,
                              block_size=BS, num_blocks=10, extra=extra)
    layout = KVCacheLayout.contiguous(StrideOrder.LBNHC, KVPacking.CONCAT, torch.float32,
                                      2, 10, BS, 2, 4)
    full = layout.view(torch.randn(layout.span_elems))
    worker = OffloadWorker(config, 0)
    worker.register_kv_caches({f"l{i}": full[layout.layer_slots[i]] for i in range(2)}, layout)
    return worker


def _step(worker: OffloadWorker, meta: OffloadMetadata) -> None:
    worker.bind_connector_metadata(meta)
    worker.wait_for_save()
    worker.clear_connector_metadata()  # starts the transfers (a step without a forward)


def _offload_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvspec-offload")]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0


class _Hang:
    """Arms copies to hang: the first copy of an armed direction blocks until
    ``release`` (a stuck device); later copies run normally."""

    def __init__(self) -> None:
        self.events = {"store": threading.Event(), "load": threading.Event()}
        self.armed = {"store": False, "load": False}

    def arm(self, direction: str) -> None:
        self.armed[direction] = True

    def release(self, direction: str) -> None:
        self.events[direction].set()


@pytest.fixture
def hang(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Hang]:
    h = _Hang()
    for name in ("store", "load"):
        original = getattr(HostPool, name)

        def stuck(self: HostPool, plan: Any, _n: str = name, _orig: Any = original) -> None:
            if h.armed[_n]:
                h.armed[_n] = False
                h.events[_n].wait(60)
            _orig(self, plan)

        monkeypatch.setattr(HostPool, name, stuck)
    try:
        yield h
    finally:
        for event in h.events.values():
            event.set()  # never leave a thread stuck past the test
        for thread in _offload_threads():
            thread.join(timeout=5)


def _until(worker: OffloadWorker, rid: str, *, recv: bool, limit_s: float = 5.0) -> float:
    """Poll get_finished until ``rid`` is reported; return the longest single call."""
    longest = 0.0
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        start = time.monotonic()
        sending, recving = worker.get_finished(frozenset() if recv else frozenset({rid}))  # WRK-010
        longest = max(longest, time.monotonic() - start)
        if rid in (recving if recv else sending):
            return longest
        time.sleep(0.01)
    raise AssertionError(f"{rid} not reported within {limit_s} s")


def test_a_stuck_store_blocks_no_hook_and_is_never_advertised(
    hang: _Hang, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 14, defect 8: a copy stuck past io_timeout_s made get_finished block 5 s,
    shutdown take 5 s and the thread outlive shutdown. Now the store is reported (failed)
    at its deadline without blocking, the worker fails new transfers at once while the copy
    hangs, shutdown returns at once naming the stuck thread, and the thread (a daemon)
    ends when the copy does, without tagging the slots it wrote."""
    worker = _worker(offload_slots=4, io_timeout_s=DEADLINE_S)
    hang.arm("store")
    try:
        _step(worker, OffloadMetadata(stores=(TransferJob.of("s", ((1, 0, 11),), False),)))
        longest = _until(worker, "s", recv=False)
        assert longest < 0.2  # no call waited on the stuck copy
        failed = worker.build_connector_worker_meta()
        assert isinstance(failed, FailedStores) and failed.request_ids == {"s"}
        # wedged: a load queued behind the stuck copy fails in the next call, not later
        _step(worker, OffloadMetadata(loads=(TransferJob.of("l", ((2, 0, 11),), True),)))
        start = time.monotonic()
        assert worker.get_finished(frozenset()) == (frozenset(), frozenset({"l"}))
        assert time.monotonic() - start < 0.2
        assert worker.get_failed_recving() == {"l"}
        assert worker.get_block_ids_with_load_errors() == {2}
        # the copy ends late: the slot stays invalid (a load expecting it fails), and the
        # worker serves again
        hang.release("store")
        time.sleep(0.1)
        _step(worker, OffloadMetadata(loads=(TransferJob.of("l2", ((3, 0, 11),), True),)))
        _until(worker, "l2", recv=True)
        assert worker.get_failed_recving() == {"l2"}
        _step(worker, OffloadMetadata(stores=(TransferJob.of("s2", ((4, 1, 12),), False),)))
        _until(worker, "s2", recv=False)
        assert worker.build_connector_worker_meta() is None  # stored
        _step(worker, OffloadMetadata(loads=(TransferJob.of("l3", ((5, 1, 12),), True),)))
        _until(worker, "l3", recv=True)
        assert worker.get_failed_recving() == frozenset()
    finally:
        worker.shutdown()
    assert any("ended after its deadline" in r.getMessage() for r in caplog.records)
    assert not _offload_threads()


def test_shutdown_with_a_stuck_copy_is_bounded_and_names_the_thread(
    hang: _Hang, caplog: pytest.LogCaptureFixture
) -> None:
    worker = _worker(offload_slots=4, io_timeout_s=DEADLINE_S)
    hang.arm("load")
    _step(worker, OffloadMetadata(stores=(TransferJob.of("s", ((1, 0, 11),), False),)))
    _until(worker, "s", recv=False)
    _step(worker, OffloadMetadata(loads=(TransferJob.of("l", ((2, 0, 11),), True),)))
    deadline = time.monotonic() + 5
    while not any(t.is_alive() for t in _offload_threads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # the background thread took the load and hangs in its copy
    longest = _until(worker, "l", recv=True)
    assert longest < 0.2
    assert worker.get_failed_recving() == {"l"}
    assert worker.get_block_ids_with_load_errors() == {2}
    with caplog.at_level(logging.ERROR, logger="kvspec.backends.offload._worker"):
        start = time.monotonic()
        worker.shutdown()
        worker.shutdown()
        assert time.monotonic() - start < 1.0
    assert any("did not stop" in r.getMessage() and "kvspec-offload-rank0" in r.getMessage()
               for r in caplog.records)
    threads = _offload_threads()
    assert threads and all(t.daemon for t in threads)  # never keeps the process alive
    assert worker.pool is None
    hang.release("load")
    for thread in threads:
        thread.join(timeout=5)
    assert not _offload_threads()


@pytest.mark.parametrize("fault", ["load-faults", "stuck-load"])
def test_the_engine_recomputes_and_everything_is_released(
    fault: str, hang: _Hang, caplog: pytest.LogCaptureFixture
) -> None:
    """A whole engine (the reference harness, which checks every KV byte the model reads):
    pass 1 stores, pass 2 would hit, but every load fails (injected faults) or the first
    load's copy hangs for a second past its deadline. Every request finishes with correct
    KV, recomputed; the hung copy's request keeps its blocks until the copy ended (the
    engine checks that nothing writes a freed block, WRK-017); afterwards the threads,
    file descriptors and host pool are back to their baseline."""
    extra: dict[str, Any] = {"offload_slots": 64, "io_timeout_s": DEADLINE_S}
    if fault == "load-faults":
        extra["load_fault_rate"] = 1.0
    else:  # a slow device-like load; the copy runs on the background thread either way
        extra["load_delay_s"] = 0.01
    config = HarnessConfig(prefix_caching=False, extra=extra)
    prompts = [tuple(range(i * 100, i * 100 + 13 + i)) for i in range(4)]
    fds = _fds()
    with Engine(OffloadConnector(), config) as engine:
        first = engine.run(Workload([RequestSpec(f"a{i}", p, max_new_tokens=2)
                                     for i, p in enumerate(prompts)], name="store"))
        assert len(first.finished) == 4
        release = threading.Timer(DEADLINE_S + 1.0, hang.release, ("load",))
        if fault == "stuck-load":  # the copy ends a second after its deadline
            hang.arm("load")
            release.start()
        start = time.monotonic()
        second = engine.run(Workload([RequestSpec(f"b{i}", p, max_new_tokens=2)
                                      for i, p in enumerate(prompts)], name="hit"))
        if fault == "stuck-load":  # the hung copy's request was held until it ended
            assert time.monotonic() - start > DEADLINE_S + 0.9
        release.cancel()
        assert {f"b{i}" for i in range(4)} <= set(second.finished)
        worker = engine.workers.runtime.connector  # type: ignore[attr-defined]
        assert isinstance(worker, OffloadWorker)
        assert not hang.armed["load"]  # a copy did hang (and was cut off at its deadline)
        hang.release("load")
    # every hit failed and was recomputed; the harness checked the KV bytes the model read
    assert {rid: n for rid, n in second.external_tokens.items() if n} == {}
    assert set(first.external_tokens.values()) <= {0}
    # and found no thread left at shutdown; the pool and every descriptor are released
    assert not _offload_threads()
    assert worker.pool is None
    assert _fds() == fds


def test_a_hung_host_copy_in_engine_order_blocks_no_hook(
    hang: _Hang, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 34: in an engine's hook order (start the load, then the output hooks at once,
    before the background thread has looked at it) a host-memory load whose copy hangs
    holds no hook past its deadline: the engine's thread never runs the copy itself, the
    load is reported failed with its block invalid, and shutdown is bounded."""
    from kvspec.protocols import ForwardContextView, ForwardKind

    worker = _worker(offload_slots=4, io_timeout_s=DEADLINE_S)
    _step(worker, OffloadMetadata(stores=(TransferJob.of("s", ((1, 0, 11),), False),)))
    _until(worker, "s", recv=False)
    hang.arm("load")
    release = threading.Timer(DEADLINE_S + 5, hang.release, ("load",))
    release.start()
    try:
        worker.bind_connector_metadata(
            OffloadMetadata(loads=(TransferJob.of("l", ((2, 0, 11),), True),)))
        worker.start_load_kv(ForwardContextView(ForwardKind.REAL, 7, 1, ("l0", "l1")))
        worker.wait_for_save()
        start = time.monotonic()
        out = worker.build_connector_output(frozenset())
        first = time.monotonic() - start
        worker.clear_connector_metadata()
        assert first < 0.2, f"the first output hook took {first:.2f} s"
        recving = set(out.finished_recving)
        failed = set(out.failed_recving)
        invalid = set(out.invalid_block_ids)
        limit = time.monotonic() + DEADLINE_S + 2
        while "l" not in recving and time.monotonic() < limit:
            time.sleep(0.01)
            t0 = time.monotonic()
            out = worker.build_connector_output(frozenset())
            assert time.monotonic() - t0 < 0.2
            recving |= out.finished_recving
            failed |= out.failed_recving
            invalid |= out.invalid_block_ids
        assert "l" in recving and failed == {"l"} and invalid == {2}
        assert time.monotonic() - start < DEADLINE_S + 0.2 + 0.05  # reported at the deadline
        with caplog.at_level(logging.ERROR, logger="kvspec.backends.offload._worker"):
            t0 = time.monotonic()
            worker.shutdown()
            assert time.monotonic() - t0 < 1.0
    finally:
        release.cancel()
        hang.release("load")


def test_a_hung_sync_load_holds_start_load_kv_only_to_its_deadline(hang: _Hang) -> None:
    """Issue 34: a synchronous load of one block (a few regions, which ran on the engine's
    thread before) whose copy hangs: ``start_load_kv`` returns at the load's deadline, the
    step names its block invalid, the next sync load fails at once while the loader is
    stuck, and shutdown is bounded."""
    from kvspec.protocols import ForwardContextView, ForwardKind

    worker = _worker(offload_slots=4, io_timeout_s=DEADLINE_S, sync_loads=True)
    try:
        _step(worker, OffloadMetadata(stores=(TransferJob.of("s", ((1, 0, 11),), False),)))
        _until(worker, "s", recv=False)
        hang.arm("load")
        for rid, block in (("l", 2), ("next", 3)):
            worker.bind_connector_metadata(
                OffloadMetadata(loads=(TransferJob.of(rid, ((block, 0, 11),), True),)))
            start = time.monotonic()
            worker.start_load_kv(ForwardContextView(ForwardKind.REAL, 7, 1, ("l0", "l1")))
            took = time.monotonic() - start
            worker.wait_for_save()
            out = worker.build_connector_output(frozenset())
            worker.clear_connector_metadata()
            assert set(out.invalid_block_ids) == {block} and not out.finished_recving
            if rid == "l":
                assert DEADLINE_S - 0.05 < took < DEADLINE_S + 0.2, took
            else:
                assert took < 0.05, took  # the loader is stuck: failed at once
    finally:
        t0 = time.monotonic()
        worker.shutdown()
        assert time.monotonic() - t0 < 1.5
