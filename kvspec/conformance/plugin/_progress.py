"""The progress lines of ``kvspec conform``: each connector's start and end, and long tests.

``run_conformance`` passes a ``ConnectorProgress`` to ``pytest.main`` (as a plugin object,
which the kvspec plugin's hooks find and feed; a plain ``pytest --kvspec-conformance``
session has none, and its output is pytest's). It runs the suite connector by connector and
prints a line to a stream as each connector starts (with the elapsed time and an estimate of
the time left) and as it ends (its tests, outcomes and time), and a ``still running`` line
while one test runs long.

Imported only when a run starts (it imports pytest).
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

import pytest

from ._suite_discovery import connector_label

__all__ = ["ConnectorProgress", "format_seconds"]


def format_seconds(seconds: float) -> str:
    """``"0.4s"``, ``"12s"``, ``"1m05s"`` or ``"1h02m"``: a duration for a progress line."""
    if seconds < 9.95:
        return f"{max(0.0, seconds):.1f}s"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _uncaptured(stream: IO[str]) -> tuple[IO[str], bool]:
    """A duplicate of ``stream``'s file descriptor, which pytest's capture (``dup2`` onto
    fds 1 and 2 while a test runs) leaves where it was, and True; or ``stream`` itself and
    False where it has no file descriptor."""
    try:
        fd = stream.fileno()
        stream.flush()
        dup = os.dup(fd)
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return stream, False
    encoding = getattr(stream, "encoding", None) or "utf-8"
    return io.open(dup, "w", encoding=encoding, errors="replace", closefd=True), True


class _Connector:
    """What the progress plugin knows of one connector's tests."""

    def __init__(self, index: int, spec: str) -> None:
        self.index = index
        self.spec = spec
        self.expected: int | None = None  # None: not collected here (an xdist controller)
        self.started: float | None = None
        self.ended: float | None = None
        self.outcomes: dict[str, int] = {}

    @property
    def done(self) -> int:
        return sum(self.outcomes.values())


_OUTCOME_ORDER = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


class ConnectorProgress:
    """Run the suite connector after connector and print a line as each starts and ends.

    The start line gives the connector's place (``connector 3/6``), its spec, its test
    count, the time since the run started and, from the connectors done so far, an estimate
    of the time left. The end line gives its outcome counts and its time. A connector's
    tests are those parametrized with its spec (their node ids carry it as ``[spec-...]``).
    A test that runs longer than ``heartbeat_s`` gets a ``still running`` line every
    ``heartbeat_s`` seconds, written from a thread while the test runs.

    Create it just before ``pytest.main``, pass it in ``plugins`` (the kvspec plugin's
    hooks find it there and call its methods) and ``close`` it after: where the stream is a
    file descriptor (stderr), the lines go to a duplicate of it made here, which pytest's
    capture of the test's own output does not redirect.

    Args:
        specs: The connector specs, in the order given.
        stream: Where the lines go (``kvspec conform``: stderr).
        heartbeat_s: Seconds a test runs before (and between) its ``still running`` lines.
    """

    def __init__(self, specs: Sequence[str], stream: IO[str], *, heartbeat_s: float = 30.0
                 ) -> None:
        self.connectors = {s: _Connector(i, s) for i, s in enumerate(dict.fromkeys(specs))}
        self.stream = stream
        self.heartbeat_s = heartbeat_s
        self.start = time.monotonic()
        self.config: pytest.Config | None = None
        self._by_nodeid: dict[str, str] = {}
        self._outcome: dict[str, str] = {}
        self._pending: list[str] = []
        self._out, self._owns_out = _uncaptured(stream)
        self._lock = threading.Lock()
        self._running: dict[str, float] = {}  # node id -> start (several under xdist)
        self._beats: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def close(self) -> None:
        """Stop the ``still running`` thread and close the stream's duplicate (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._lock:
            if self._owns_out and not self._out.closed:
                self._out.close()

    # -- collection ------------------------------------------------------------------------------

    def _spec_of_item(self, item: pytest.Item) -> str | None:
        callspec = getattr(item, "callspec", None)
        params = getattr(callspec, "params", None) or {}
        if "kvspec_factory" not in params:
            return None
        label = connector_label(params["kvspec_factory"])
        return label if label in self.connectors else None

    def _spec_of_nodeid(self, nodeid: str) -> str | None:
        spec = self._by_nodeid.get(nodeid)
        if spec is not None:
            return spec
        # Not collected in this process (the xdist controller): read the node id's
        # parameters, the longest spec that opens them.
        params = nodeid.rpartition("::")[2].partition("[")[2]
        found = [s for s in self.connectors if params == s + "]" or params.startswith(s + "-")]
        return max(found, key=len) if found else None

    def attach(self, config: pytest.Config) -> None:
        """Keep the session's config, for its terminal reporter."""
        self.config = config

    def order(self, items: list[pytest.Item]) -> None:
        """Order the tests connector by connector, keeping pytest's order within each."""
        order = {s: c.index for s, c in self.connectors.items()}
        last = len(order)

        def key(pair: tuple[int, pytest.Item]) -> tuple[int, int]:
            spec = self._spec_of_item(pair[1])
            return (order[spec] if spec is not None else last, pair[0])

        items[:] = [item for _, item in sorted(enumerate(items), key=key)]

    def note_collected(self, session: pytest.Session) -> None:
        """Count each connector's tests."""
        if not session.items:
            return
        for c in self.connectors.values():
            c.expected = 0
        for item in session.items:
            spec = self._spec_of_item(item)
            if spec is not None:
                self._by_nodeid[item.nodeid] = spec
                expected = self.connectors[spec].expected
                self.connectors[spec].expected = (expected or 0) + 1

    # -- running ---------------------------------------------------------------------------------

    def note_start(self, nodeid: str) -> None:
        """Announce a connector when its first test starts (after the end lines due)."""
        spec = self._spec_of_nodeid(nodeid)
        if spec is not None:
            self._running[nodeid] = time.monotonic()
            if self._thread is None and self.heartbeat_s > 0:
                self._thread = threading.Thread(target=self._heartbeat, daemon=True,
                                                name="kvspec-conform-progress")
                self._thread.start()
        c = self.connectors[spec] if spec is not None else None
        if c is not None and c.started is not None:
            c = None
        if c is None and not self._pending:
            return
        self._end_terminal_line(fill=True)
        self._print_pending()
        if c is None:
            return
        now = time.monotonic()
        c.started = now
        count = f"{c.expected} tests" if c.expected is not None else "tests"
        timing = f"elapsed {format_seconds(now - self.start)}"
        eta = self._eta()
        if eta is not None:
            timing += f", ETA {format_seconds(eta)}"
        self._write(f"connector {c.index + 1}/{len(self.connectors)}: {c.spec}: {count} "
                    f"({timing})")

    def _eta(self) -> float | None:
        """The time left: the mean time of the connectors done so far, times those left
        (the one starting included); None before any is done."""
        times = [c.ended - c.started for c in self.connectors.values()
                 if c.started is not None and c.ended is not None]
        if not times:
            return None
        left = sum(1 for c in self.connectors.values()
                   if c.ended is None and (c.expected is None or c.expected > 0))
        return sum(times) / len(times) * left

    def note_report(self, report: pytest.TestReport) -> None:
        """Tally each test's outcome; end a connector when its last test is done."""
        spec = self._spec_of_nodeid(report.nodeid)
        if spec is None:
            return
        previous = self._outcome.get(report.nodeid, "")
        if previous in ("failed", "error"):
            outcome = previous
        elif report.failed:
            outcome = "failed" if report.when == "call" else "error"
        elif report.skipped:
            outcome = "xfailed" if hasattr(report, "wasxfail") else "skipped"
        elif report.when == "call":
            outcome = "xpassed" if hasattr(report, "wasxfail") else "passed"
        else:
            outcome = previous
        self._outcome[report.nodeid] = outcome
        if report.when != "teardown":
            return
        self._running.pop(report.nodeid, None)
        self._beats.pop(report.nodeid, None)
        c = self.connectors[spec]
        final = self._outcome.pop(report.nodeid) or "passed"
        c.outcomes[final] = c.outcomes.get(final, 0) + 1
        if c.expected is not None and c.done >= c.expected:
            self._end(c, "done")

    def _heartbeat(self) -> None:
        """The thread: a ``still running`` line for the longest-running test, if long."""
        step = min(1.0, self.heartbeat_s / 4)
        while not self._stop.wait(step):
            now = time.monotonic()
            running = dict(self._running)
            if not running:
                continue
            nodeid, since = min(running.items(), key=lambda kv: kv[1])
            if now - since < self.heartbeat_s or \
                    now - self._beats.get(nodeid, since) < self.heartbeat_s:
                continue
            self._beats[nodeid] = now
            spec = self._spec_of_nodeid(nodeid)
            where = ""
            if spec is not None:
                where = f"connector {self.connectors[spec].index + 1}/{len(self.connectors)}, "
            # The terminal reporter's line is open (the test's path and dots): start anew.
            self._write(f"still running {nodeid} ({format_seconds(now - since)}; {where}"
                        f"elapsed {format_seconds(now - self.start)})", newline_first=True)

    def finish(self) -> None:
        """Print the end lines due, and end the connectors still open: stopped early
        (``-x``), or counted nowhere in this process (the xdist controller)."""
        self._stop.set()
        for c in self.connectors.values():
            if c.started is not None and c.ended is None:
                self._end(c, "done" if c.expected is None else "stopped")
        if self._pending:
            self._end_terminal_line(fill=False)  # the reporter wrote the last percentage
            self._print_pending()

    def _end(self, c: _Connector, how: str) -> None:
        """End a connector; its line is printed before the next test starts (the terminal
        reporter's line of the test that ended is not complete yet)."""
        now = time.monotonic()
        c.ended = now
        assert c.started is not None
        counts = ", ".join(f"{c.outcomes[o]} {o}" for o in _OUTCOME_ORDER if c.outcomes.get(o))
        tests = f"{c.done} of {c.expected} tests" if how == "stopped" else f"{c.done} tests"
        self._pending.append(
            f"connector {c.index + 1}/{len(self.connectors)}: {c.spec}: {how}, {tests} in "
            f"{format_seconds(now - c.started)} ({counts or 'none run'}; elapsed "
            f"{format_seconds(now - self.start)})"
        )

    def _print_pending(self) -> None:
        for text in self._pending:
            self._write(text)
        self._pending.clear()

    def _write(self, text: str, *, newline_first: bool = False) -> None:
        with self._lock:
            if self._out.closed:
                return
            self._out.write(("\n" if newline_first else "") + f"kvspec conform: {text}\n")
            self._out.flush()

    def _end_terminal_line(self, *, fill: bool) -> None:
        """End the line pytest's terminal reporter has open (``test_x.py ....``), with its
        percentage if ``fill`` (as the reporter does when the next test's module differs),
        so that a progress line on a terminal shared with it starts on a line of its own.
        Does what it can through the reporter's attributes, and nothing where they are
        missing."""
        tr: Any = None
        if self.config is not None:
            tr = self.config.pluginmanager.get_plugin("terminalreporter")
        writer: Any = getattr(tr, "_tw", None)
        width: Any = getattr(writer, "width_of_current_line", 0)
        if getattr(tr, "currentfspath", None):
            filler = getattr(tr, "_write_progress_information_filling_space", None)
            if fill and callable(filler) and getattr(tr, "_show_progress_info", False) \
                    and not getattr(tr, "showlongtestinfo", True):
                filler()
            tr.ensure_newline()
        elif writer is not None and width:
            writer.line()
        if writer is not None:
            writer.flush()
        sys.stdout.flush()
