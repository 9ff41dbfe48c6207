"""The shared-storage worker's background thread and its bounded, cancellable transfers.

``IoThread`` runs submitted calls in order on one daemon thread; ``Transfer`` is one
request's load or save on it, with a deadline (WRK-014), a cancel flag and a lock that a
block copy holds, so that a cancel never waits long for a copy in progress.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["IoThread", "Transfer"]

_log = logging.getLogger(__name__)

_LOCK_TIMEOUT_S = 5.0
"""The longest the background thread waits for a transfer's lock before a block copy."""
_JOIN_WAIT_S = 0.5
"""After the running transfer's own timeout, the longest ``IoThread.stop`` waits for it."""
_CANCEL_WAIT_S = 0.05
"""The longest an output hook waits, cancelling a timed-out transfer, for its block copy in
progress (a copy into memory takes microseconds; one that takes longer is stuck)."""


class Transfer:
    """One request's load or save on one rank, as the worker tracks it."""

    __slots__ = ("request_id", "block_ids", "report", "deadline", "cancelled", "lock", "future")

    def __init__(
        self, request_id: str, block_ids: tuple[int, ...], timeout_s: float, report: bool
    ) -> None:
        self.request_id = request_id
        self.block_ids = block_ids
        self.report = report
        self.deadline = time.monotonic() + timeout_s
        self.cancelled = threading.Event()
        self.lock = threading.Lock()
        self.future: concurrent.futures.Future[tuple[int, ...]] | None = None

    def copy(self, fn: Callable[[], None]) -> bool:
        """Background thread: run ``fn`` (one block's copy) under the lock unless the
        transfer is cancelled; False when it did not run. Every wait is bounded."""
        if not self.lock.acquire(timeout=_LOCK_TIMEOUT_S):
            return False
        try:
            if self.cancelled.is_set():  # timed out meanwhile: write nothing more
                return False
            fn()
            return True
        finally:
            self.lock.release()

    def cancel(self) -> None:
        """Dequeue the transfer, or keep it from copying any further block. Waits only
        ``_CANCEL_WAIT_S`` for a block copy in progress; if that one is stuck, the flag
        still stops every later block (WRK-014)."""
        if self.future is not None:
            self.future.cancel()
        locked = self.lock.acquire(timeout=_CANCEL_WAIT_S)
        self.cancelled.set()
        if locked:
            self.lock.release()

    def outcome(self, now: float) -> tuple[int, ...] | None:
        """None while the transfer runs; else the block ids that failed (all of them when
        it raised, was cancelled, or ran past its deadline: then it is cancelled)."""
        future = self.future
        if future is not None and future.done():
            if future.cancelled() or future.exception() is not None:
                return self.block_ids
            return future.result()
        if now >= self.deadline:
            _log.warning("transfer of request %s timed out", self.request_id)
            self.cancel()
            return self.block_ids
        return None

    def wait(self) -> None:
        """Wait for the transfer until its deadline; cancel it if it still runs then."""
        if self.future is None:
            return
        try:
            self.future.result(timeout=max(0.0, self.deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            self.cancel()
        except Exception:  # reported as failed by outcome()
            pass


class IoThread:
    """One daemon thread running submitted calls in order. A ``ThreadPoolExecutor``'s
    threads are joined when the interpreter exits, so one stuck write kept the engine's
    process from ever exiting (issue 34)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Queue ``fn(*args)``; its future can be cancelled until the call starts."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return future

    def close(self) -> None:
        """End the thread after the call it runs, if any; calls queued are dropped."""
        self._queue.put(None)

    def stop(self, transfers: Iterable[Transfer], timeout_s: float) -> None:
        """Cancel the transfers not started, end the thread, and wait for the running one
        at most ``timeout_s`` (its own timeout) plus ``_JOIN_WAIT_S``."""
        transfers = tuple(transfers)
        for t in transfers:
            if t.future is not None:
                t.future.cancel()  # those not started
        self.close()
        # A future cancelled before it started stays CANCELLED, which wait() never counts
        # as done: waiting on it would always run into the timeout.
        futures = [t.future for t in transfers if t.future is not None and not t.future.cancelled()]
        concurrent.futures.wait(futures, timeout=timeout_s)
        self.thread.join(timeout=_JOIN_WAIT_S)
        if self.thread.is_alive():  # a daemon: it does not keep the process alive
            _log.error("thread %s is stuck in a transfer; left behind", self.thread.name)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 (the future carries it)
                    future.set_exception(e)
