"""Pipelined synchronous loads of the offloading backend (issues 32 and 34): a sync load
of more than a few regions, on host memory with a layer-outermost layout, is copied by the
loader thread layer by layer while the forward runs; ``wait_for_layer_load`` waits for the
layer attention reads next, at most until the load's deadline (WRK-004, WRK-005, WRK-011,
WRK-014). ``_FEW`` is set to 0 so that the tests' small loads take the pipelined path."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvspec.backends.offload import (
    HostPool,
    OffloadMetadata,
    OffloadWorker,
    SyncLoadOffloadConnector,
    TransferJob,
)
from kvspec.backends.offload import _pool
from kvspec.protocols import (
    EngineConfigView,
    ForwardContextView,
    ForwardKind,
    KVCacheLayout,
    KVPacking,
    StrideOrder,
    TransferRole,
)

BS = 4
LAYERS = ("l0", "l1", "l2")
DEADLINE_S = 0.3


@pytest.fixture(autouse=True)
def _pipelined(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pool, "_FEW", 0)


def _registered(order: StrideOrder = StrideOrder.LBNHC, packing: KVPacking = KVPacking.CONCAT,
                **extra: Any) -> tuple[OffloadWorker, KVCacheLayout, list[torch.Tensor]]:
    layout = KVCacheLayout.contiguous(order, packing, torch.float16, 3, 10, BS, 2, 4)
    full = layout.view(torch.randn(layout.span_elems).to(layout.dtype))
    layers = [full[layout.layer_slots[i]] for i in range(3)]
    config = EngineConfigView(engine_id="pipelined", role=TransferRole.BOTH, num_layers=3,
                              block_size=BS, num_blocks=10,
                              extra={"offload_slots": 4, "sync_loads": True, **extra})
    worker = OffloadWorker(config, 0)
    worker.register_kv_caches(dict(zip(LAYERS, layers)), layout)
    return worker, layout, layers


def _layer_bytes(layout: KVCacheLayout, layer: torch.Tensor, block: int) -> bytes:
    dim = 1 if layout.packing is KVPacking.SPLIT else 0
    return bytes(layer.select(dim, block).contiguous().view(torch.uint8).numpy().tobytes())


def _stored(worker: OffloadWorker, stores: tuple[tuple[int, int, int], ...]) -> None:
    """Store ``(block, slot, tag)`` triples and wait until they are reported."""
    worker.bind_connector_metadata(OffloadMetadata(stores=(TransferJob.of("s", stores, False),)))
    worker.wait_for_save()
    worker.clear_connector_metadata()
    deadline = time.monotonic() + 10
    while "s" not in worker.get_finished(frozenset({"s"}))[0]:
        assert time.monotonic() < deadline, "the store was not reported"
        time.sleep(0.005)


def _start(worker: OffloadWorker, loads: tuple[tuple[int, int, int], ...]) -> None:
    worker.bind_connector_metadata(OffloadMetadata.decode(
        OffloadMetadata(loads=(TransferJob.of("l", loads, True),)).encode()))
    worker.start_load_kv(ForwardContextView(ForwardKind.REAL, 0, 4, LAYERS))


def _end(worker: OffloadWorker) -> tuple[frozenset[str], frozenset[str], frozenset[int]]:
    worker.wait_for_save()
    recving = worker.get_finished(frozenset())[1]
    worker.clear_connector_metadata()
    return recving, worker.get_failed_recving(), worker.get_block_ids_with_load_errors()


class _Gate:
    """Holds the loader before the copy of layer storage ``at`` until ``open``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: int) -> None:
        self.opened = threading.Event()
        self.reached = threading.Event()
        original = HostPool.load_by_layer

        def gated(pool: HostPool, plan: Any, done: Any, stop: Any, index: Any = None) -> bool:
            def step(n: int) -> None:
                done(n)
                if n + 1 == at:
                    self.reached.set()
                    self.opened.wait(30)

            if at == 0:
                self.reached.set()
                self.opened.wait(30)
            return original(pool, plan, step, stop, index)

        monkeypatch.setattr(HostPool, "load_by_layer", gated)

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def gates(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[_Gate]]:
    made: list[_Gate] = []
    yield made
    for gate in made:
        gate.open()  # never leave the loader stuck past the test


@pytest.mark.parametrize(("order", "packing"),
                         [o for o in itertools.product(StrideOrder, KVPacking)
                          if not o[0].block_outermost])
def test_each_layer_is_loaded_byte_exact_when_its_wait_returns(
        order: StrideOrder, packing: KVPacking, gates: list[_Gate],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader stops after layer 0: ``wait_for_layer_load("l0")`` returns with layer 0
    of every block loaded and layer 1 not yet; once it goes on, every layer is loaded,
    only the loaded blocks changed, and the load is never reported (SCH-024)."""
    worker, layout, layers = _registered(order, packing)
    try:
        pool = worker.pool
        assert pool is not None and len(pool.layer_chunks) == 3 and worker._loader is not None
        want = {b: [_layer_bytes(layout, t, b) for t in layers] for b in (1, 5, 8)}
        _stored(worker, ((1, 0, 11), (5, 1, 15), (8, 3, 18)))
        before = {b: [_layer_bytes(layout, t, b) for t in layers] for b in (2, 6, 9)}
        gate = _Gate(monkeypatch, at=1)
        gates.append(gate)
        _start(worker, ((2, 0, 11), (6, 1, 15), (9, 3, 18)))
        worker.wait_for_layer_load("l0")
        assert gate.reached.wait(5)
        for src, dst in ((1, 2), (5, 6), (8, 9)):
            assert _layer_bytes(layout, layers[0], dst) == want[src][0]
            assert _layer_bytes(layout, layers[1], dst) == before[dst][1]  # not yet
        threading.Timer(0.05, gate.open).start()
        start = time.monotonic()
        worker.wait_for_layer_load("l1")  # waits for the loader, not for its deadline
        assert time.monotonic() - start < 2
        worker.wait_for_layer_load("l2")
        for src, dst in ((1, 2), (5, 6), (8, 9)):
            assert [_layer_bytes(layout, t, dst) for t in layers] == want[src]
        assert _end(worker) == (frozenset(), frozenset(), frozenset())
        stats = worker.get_kv_connector_stats()
        assert stats is not None and stats.counters["blocks_loaded"] == 3  # type: ignore[attr-defined]
        assert stats.counters["loads_pipelined"] == 1  # type: ignore[attr-defined]
    finally:
        worker.shutdown()


def test_a_step_that_waits_for_no_layer_is_complete_before_it_is_reported() -> None:
    """No ``wait_for_layer_load`` at all (a model without per-layer hooks): the step's
    ``get_finished`` waits for the copy, so the next step reads loaded KV."""
    worker, layout, layers = _registered()
    try:
        want = [_layer_bytes(layout, t, 4) for t in layers]
        _stored(worker, ((4, 2, 7),))
        _start(worker, ((7, 2, 7),))
        assert _end(worker) == (frozenset(), frozenset(), frozenset())
        assert [_layer_bytes(layout, t, 7) for t in layers] == want
    finally:
        worker.shutdown()


def test_a_pipelined_load_of_a_slot_holding_other_data_fails_only_that_block() -> None:
    """Slot 0 holds tag 11: a block expecting tag 12 there, and an evicted slot, are named
    invalid after the step (WRK-011); the good block loads byte-exact."""
    worker, layout, layers = _registered()
    try:
        want = [_layer_bytes(layout, t, 5) for t in layers]
        _stored(worker, ((1, 0, 11), (5, 1, 15)))
        _start(worker, ((2, 0, 12), (3, -1, 13), (4, 1, 15)))
        for name in LAYERS:
            worker.wait_for_layer_load(name)
        assert [_layer_bytes(layout, t, 4) for t in layers] == want
        assert _end(worker) == (frozenset(), frozenset(), frozenset({2, 3}))
    finally:
        worker.shutdown()


def test_a_hung_pipelined_load_holds_no_hook_past_its_deadline(
        gates: list[_Gate], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Issue 34: the loader hangs before its first layer. ``wait_for_layer_load`` returns at
    the deadline, every block is named invalid after the step (recomputed, WRK-011,
    WRK-014), the next pipelined load fails at once while the copy is stuck, and shutdown
    is bounded and names the thread it could not stop."""
    worker, layout, layers = _registered(io_timeout_s=DEADLINE_S)
    gate = _Gate(monkeypatch, at=0)
    gates.append(gate)
    try:
        _stored(worker, ((1, 0, 11), (5, 1, 15)))
        _start(worker, ((2, 0, 11), (6, 1, 15)))
        assert gate.reached.wait(5)
        start = time.monotonic()
        worker.wait_for_layer_load("l0")
        assert DEADLINE_S - 0.1 < time.monotonic() - start < DEADLINE_S + 0.2
        t0 = time.monotonic()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvspec.backends.offload._worker"):
            worker.wait_for_layer_load("l1")
            worker.wait_for_layer_load("l2")
        assert "stuck past its deadline" not in caplog.text  # said once, at l0
        assert len(worker._stuck) == 1
        assert _end(worker) == (frozenset(), frozenset(), frozenset({2, 6}))
        assert time.monotonic() - t0 < 0.1  # past the deadline: nothing waits again
        t0 = time.monotonic()
        _start(worker, ((3, 0, 11),))  # the loader is still stuck: fails at once
        worker.wait_for_layer_load("l0")
        assert _end(worker) == (frozenset(), frozenset(), frozenset({3}))
        assert time.monotonic() - t0 < 0.1
        with caplog.at_level(logging.ERROR, logger="kvspec.backends.offload._worker"):
            t0 = time.monotonic()
            worker.shutdown()
            assert time.monotonic() - t0 < 0.5
        assert "kvspec-offload-loader-rank0" in caplog.text
    finally:
        gate.open()
        worker.shutdown()


def test_after_a_late_copy_ends_the_loader_serves_again(
        gates: list[_Gate], monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that ends after its deadline is discarded (counted failed) and un-wedges the
    loader: the next pipelined load succeeds."""
    worker, layout, layers = _registered(io_timeout_s=DEADLINE_S)
    gate = _Gate(monkeypatch, at=1)
    gates.append(gate)
    try:
        want = [_layer_bytes(layout, t, 1) for t in layers]
        _stored(worker, ((1, 0, 11),))
        _start(worker, ((2, 0, 11),))
        worker.wait_for_layer_load("l0")
        worker.wait_for_layer_load("l1")  # the deadline passes here
        assert _end(worker) == (frozenset(), frozenset(), frozenset({2}))
        gate.open()
        assert worker._loader is not None
        worker._loader.submit(lambda: None).result(timeout=5)  # the late copy ended
        monkeypatch.undo()
        monkeypatch.setattr(_pool, "_FEW", 0)
        _start(worker, ((7, 0, 11),))
        for name in LAYERS:
            worker.wait_for_layer_load(name)
        assert [_layer_bytes(layout, t, 7) for t in layers] == want
        assert _end(worker) == (frozenset(), frozenset(), frozenset())
        stats = worker.get_kv_connector_stats()
        assert stats is not None
        assert stats.counters["load_failures"] == 1  # type: ignore[attr-defined]
        assert stats.counters["blocks_loaded"] == 1  # type: ignore[attr-defined]
    finally:
        worker.shutdown()


def test_block_outermost_and_cuda_layouts_are_not_pipelined() -> None:
    """A cross-layer block layout has no per-layer regions: its sync loads are not
    pipelined (no layer to wait for), but still copied by the loader thread, never on the
    engine's (issue 34)."""
    worker, _, _ = _registered(StrideOrder.BLNHC)
    try:
        assert worker.pool is not None and worker.pool.layer_chunks == ()
        assert worker._loader is not None and not worker._layer_of
    finally:
        worker.shutdown()


def test_conformance_scenarios_with_every_sync_load_pipelined() -> None:
    """The suite's scenarios (byte checks of every loaded block in the forward that reads
    it, failed loads recomputed) with every sync load taking the pipelined path."""
    from kvspec.conformance import run_conformance

    result = run_conformance(
        [f"kvspec.backends.offload:{SyncLoadOffloadConnector.__name__}"],
        extra_pytest_args=["-q", "-p", "no:cacheprovider", "-k",
                           "(test_scenario and not prefix) or test_failed_loads_are"
                           " or preempt or fault"],
    )
    assert result.exit_code == 0
    assert result.passed > 0 and result.failed == 0
