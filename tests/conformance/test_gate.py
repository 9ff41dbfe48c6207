"""``ThreadGate`` (issue 35): the harness holds the connector's threads while the engine
works, lets them go when the harness waits, and never holds one for good."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import pytest

from kvspec.conformance.harness import HarnessConfig
from kvspec.conformance.harness._gate import ThreadGate
from kvspec.protocols import InvalidArgumentError


@pytest.fixture
def gate() -> Iterator[ThreadGate]:
    g = ThreadGate(stall_s=0.02, max_hold_s=2.0)
    g.install()
    try:
        yield g
    finally:
        g.uninstall()


def _consumer(jobs: queue.SimpleQueue[int | None], seen: list[tuple[int, float]]) -> threading.Thread:
    def run() -> None:
        while (job := jobs.get()) is not None:
            seen.append((job, time.monotonic()))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_thread_woken_while_closed_runs_only_after_the_gate_opens(gate: ThreadGate) -> None:
    """A worker thread blocked on a queue wakes while the gate is closed: it is held at its
    return to Python while the harness computes (a busy loop: not a wait), and runs at once
    when the gate opens."""
    jobs: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    seen: list[tuple[int, float]] = []
    t = _consumer(jobs, seen)
    gate.close()
    jobs.put(1)
    end = time.monotonic() + 0.3
    while time.monotonic() < end:  # the harness's own work: its frame keeps moving
        sum(range(100))
    assert seen == [] and gate.holds >= 1
    opened = time.monotonic()
    gate.open()
    jobs.put(None)
    t.join(timeout=5)
    assert [j for j, _ in seen] == [1] and seen[0][1] >= opened


def test_a_harness_that_waits_on_a_held_thread_lets_it_go(gate: ThreadGate) -> None:
    """The harness blocks on an event only the held thread sets (a connector's fence):
    the held thread notices the harness's thread standing still and runs."""
    jobs: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    done = threading.Event()

    def run() -> None:
        while jobs.get() is not None:
            done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    gate.close()
    jobs.put(1)
    start = time.monotonic()
    assert done.wait(5)
    assert time.monotonic() - start < 1.0  # stall_s, not max_hold_s
    gate.open()
    jobs.put(None)
    t.join(timeout=5)


def test_two_closes_later_a_held_thread_runs(gate: ThreadGate) -> None:
    """A thread held since one close runs once the gate was closed twice more (two engine
    steps went by), even while the harness keeps computing."""
    jobs: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    seen: list[tuple[int, float]] = []
    t = _consumer(jobs, seen)
    gate.close()
    jobs.put(1)
    time.sleep(0)  # let it reach its hold
    for _ in range(2):
        end = time.monotonic() + 0.05
        while time.monotonic() < end:
            sum(range(100))
        assert seen == []
        gate.close()
    end = time.monotonic() + 2
    while not seen and time.monotonic() < end:
        sum(range(100))
    assert [j for j, _ in seen] == [1]
    gate.open()
    jobs.put(None)
    t.join(timeout=5)


def test_no_thread_is_held_past_max_hold() -> None:
    g = ThreadGate(stall_s=10.0, max_hold_s=0.1)
    g.install()
    try:
        jobs: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        seen: list[tuple[int, float]] = []
        t = _consumer(jobs, seen)
        g.close()
        start = time.monotonic()
        jobs.put(1)
        while not seen and time.monotonic() < start + 3:
            sum(range(100))
        assert seen and seen[0][1] - start < 1.0
        jobs.put(None)
        t.join(timeout=5)
    finally:
        g.uninstall()


def test_uninstall_removes_the_profile_hooks_and_opens() -> None:
    g = ThreadGate()
    g.install()
    g.close()
    g.uninstall()
    assert threading.getprofile() is None if hasattr(threading, "getprofile") else True
    seen: list[tuple[int, float]] = []
    jobs: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    t = _consumer(jobs, seen)
    jobs.put(1)
    jobs.put(None)
    t.join(timeout=5)
    assert [j for j, _ in seen] == [1]


def test_hold_threads_is_a_bool() -> None:
    assert HarnessConfig(hold_threads=True).hold_threads
    with pytest.raises(InvalidArgumentError, match="hold_threads"):
        HarnessConfig(hold_threads=1)  # type: ignore[arg-type]
