"""Descheduled background threads: the harness makes the unlucky thread timing certain.

A connector that hands work to its own threads (a writer draining a staging buffer, a
store still reading blocks) is correct only if it waits for that work before the engine
reuses what the work reads (WRK-007, WRK-012). Whether a missing wait shows depends on
which thread runs first; on an idle machine the connector's thread usually wins and the
race hides. A busy machine, where the OS leaves the thread waiting for a core, makes it
lose. ``ThreadGate`` plays the busy machine: while the gate is closed, every thread of the
process but the harness's own stops at its next Python call or return (a profile hook),
so the engine's next step runs first, deterministically.

The harness closes the gate just before the ``wait_for_save`` of each step that computed
tokens, and opens it in steps that compute none (an engine waiting for transfers). A held
thread is let go, and the gate opened until it is next closed, when the harness waits (a
held thread watches the harness's thread: one asleep for ``stall_s`` waits, for example
for the very thread that is held, while one that is runnable but starved of a core by a
busy machine does not), when the gate
was closed ``_STEPS`` more times since the thread was held (four engine steps went by),
or after ``max_hold_s``. So a connector that waits for its own work is never stopped for
good; the work of one that does not runs only after the engine went on, past the next
steps' preemption fences, poisoning and forwards; and background work always progresses.
Threads in C code (a copy, a sleep) are not interrupted; they stop when they return to
Python.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["ThreadGate"]

_HARNESS = os.path.dirname(os.path.abspath(__file__))
_STEPS = 4
"""A held thread runs once the gate was closed this many more times (engine steps)."""


class ThreadGate:
    """Holds every other thread of this process at its next Python call while closed.

    Args:
        stall_s: How long the harness's thread must wait (asleep, ``_waiting_probe``)
            before the held threads are let go.
        max_hold_s: The longest any thread is held at once.
    """

    def __init__(self, *, stall_s: float = 0.02, max_hold_s: float = 1.0) -> None:
        self._stall_s = stall_s
        self._max_hold_s = max_hold_s
        self._owner = threading.get_ident()
        self._owner_native = threading.get_native_id()
        self._closed = False  # read on every profiled event: a plain attribute
        self._opened = threading.Event()
        self._opened.set()
        self._installed = False
        self._window = 0  # closes so far
        self.holds = 0
        """Times a thread was held (for tests and reports)."""

    def install(self) -> None:
        """Profile every other thread, running and future; not the calling thread."""
        if self._installed:
            return
        self._installed = True
        self._owner = threading.get_ident()
        self._owner_native = threading.get_native_id()
        setprofile_all = getattr(threading, "setprofile_all_threads", None)  # Python 3.12+
        if setprofile_all is not None:
            setprofile_all(self._profile)
        threading.setprofile(self._profile)
        sys.setprofile(None)  # the harness's own thread runs unprofiled

    def uninstall(self) -> None:
        """Open the gate and remove the profile hooks; idempotent."""
        self.open()
        if not self._installed:
            return
        self._installed = False
        threading.setprofile(None)
        setprofile_all = getattr(threading, "setprofile_all_threads", None)
        if setprofile_all is not None:
            setprofile_all(None)

    def close(self) -> None:
        """From now on, hold other threads at their next Python call."""
        if self._installed:
            self._window += 1
            self._opened.clear()
            self._closed = True

    def open(self) -> None:
        """Let every held thread go."""
        self._closed = False
        self._opened.set()

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self._closed or threading.get_ident() == self._owner:
            return
        self._hold()

    def _hold(self) -> None:
        self.holds += 1
        window = self._window
        end = time.monotonic() + self._max_hold_s
        period = min(0.002, self._stall_s)
        waiting = self._waiting_probe()
        still = 0.0
        while not self._opened.wait(period):
            state = waiting()
            still = still + period if state else 0.0
            if (still >= self._stall_s or self._window - window >= _STEPS
                    or time.monotonic() >= end or state is None):
                self.open()  # the harness waits (or is gone): everyone runs
                return

    def _waiting_probe(self) -> Callable[[], bool | None]:
        """A function telling whether the harness's thread waits now (True), works
        (False) or is gone (None). Where Linux shows the thread's scheduler state, a thread
        asleep (``S``: on a lock, an event, a sleep) waits, and one running or runnable does
        not: a harness thread starved of a core by a busy machine is not waiting, and the
        race stays decided. Else, where the OS gives a thread's CPU clock, a thread that
        used under a fifth of the time since the last call waits; else one whose frame
        and instruction did not change, outside the harness's own code, does."""
        by_state = self._state_probe()
        if by_state is not None:
            return by_state
        owner = self._owner
        try:
            clock = time.pthread_getcpuclockid(owner)
            last = [time.clock_gettime(clock), time.monotonic()]
        except (AttributeError, OSError):
            return self._frame_probe()

        def by_cpu() -> bool | None:
            try:
                cpu = time.clock_gettime(clock)
            except OSError:
                return None  # the thread ended
            now = time.monotonic()
            idle = cpu - last[0] < 0.2 * (now - last[1])
            last[:] = [cpu, now]
            return idle

        return by_cpu

    def _state_probe(self) -> Callable[[], bool | None] | None:
        path = f"/proc/self/task/{self._owner_native}/stat"

        def state() -> bool | None:
            try:
                with open(path, "rb") as f:
                    stat = f.read()
            except OSError:
                return None  # the thread ended
            # "pid (comm) S ...": the state follows the last ')' (comm may hold one)
            return stat[stat.rindex(b")") + 2: stat.rindex(b")") + 3] == b"S"

        return state if state() is not None else None

    def _frame_probe(self) -> Callable[[], bool | None]:
        owner = self._owner
        last: list[tuple[int, int] | None] = [None]

        def by_frame() -> bool | None:
            frame = sys._current_frames().get(owner)
            if frame is None:
                return None
            # still in the harness's own code (a slow first op, a capture) is not a wait
            where = (None if frame.f_code.co_filename.startswith(_HARNESS)
                     else (id(frame), frame.f_lasti))
            same = where is not None and where == last[0]
            last[0] = where
            return same

        return by_frame
