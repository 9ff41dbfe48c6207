"""A service a connector needs (a cache server, a metadata store), started for one run.

``kvspec conform --service CMD --service-wait HOST:PORT`` starts ``CMD`` before the engines,
waits until ``HOST:PORT`` accepts a TCP connection (bounded), and stops it after the run:
SIGTERM to its process group and every process below it, SIGKILL when one has not exited
within a few seconds.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from .protocols import InvalidArgumentError, TransferTimeoutError, parse_decimal

__all__ = ["parse_address", "running_service"]

_STOP_GRACE_S = 5.0


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``tcp://HOST:PORT``) as a pair.

    Raises:
        InvalidArgumentError: not ``HOST:PORT`` with a port in 1..65535.
    """
    host, sep, port = text.removeprefix("tcp://").rpartition(":")
    try:
        if not sep or not host:
            raise InvalidArgumentError("no HOST:PORT")
        return host, parse_decimal(port, what="port", minimum=1, maximum=65535,
                                   error=InvalidArgumentError, clause=None)
    except InvalidArgumentError:
        raise InvalidArgumentError(f"bad service address {text!r}; expected HOST:PORT, e.g. "
                                   "localhost:5555") from None


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def running_service(command: str, wait_for: str | None, *, timeout_s: float = 60.0,
                    log: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``command`` (a shell-style command line) for the duration of the block.

    Args:
        command: The service's command line.
        wait_for: ``HOST:PORT`` that accepts connections once the service is ready, or None
            to go on as soon as it started.
        timeout_s: Longest wait for readiness.
        log: File that receives the service's output (default: discarded).

    Raises:
        InvalidArgumentError: the command line is empty or cannot be started.
        TransferTimeoutError: the service did not accept connections in ``timeout_s``, or
            exited before it did (its exit code and log file are named).
    """
    argv = shlex.split(command)
    if not argv:
        raise InvalidArgumentError("an empty --service command; expected a command line")
    address = parse_address(wait_for) if wait_for else None
    if address is not None and _accepts(*address):
        raise InvalidArgumentError(f"{wait_for} already accepts connections before the service "
                                   "started: another process holds that address")
    out = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        if log is not None:
            out.close()  # type: ignore[union-attr]
        raise InvalidArgumentError(f"cannot start service {command!r}: {e}") from None
    previous = None
    if threading.current_thread() is threading.main_thread():
        # a SIGTERM (a CI timeout, `timeout`) ends the run through the finally below,
        # which stops the service, instead of killing Python with the service left running
        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        deadline = time.monotonic() + timeout_s
        while address is not None and not _accepts(*address):
            if proc.poll() is not None:
                raise TransferTimeoutError(
                    f"service {command!r} exited with code {proc.returncode} before "
                    f"{wait_for} accepted connections" + (f" (its output: {log})" if log else ""))
            if time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"service {command!r} did not accept connections on {wait_for} within "
                    f"{timeout_s:.0f} s" + (f" (its output: {log})" if log else ""))
            time.sleep(0.2)
        yield proc
    finally:
        _stop(proc)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if log is not None:
            out.close()  # type: ignore[union-attr]


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (Linux ``/proc``; empty elsewhere), children first."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, dead but not reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the service's process group and every process below it (a launcher may
    start the server in a session of its own), SIGKILL what lingers."""
    targets = _descendants(proc.pid)  # before the launcher dies and its children re-parent
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        for pid in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + _STOP_GRACE_S
        while time.monotonic() < deadline and (
                proc.poll() is None or any(_alive(p) for p in targets)):
            time.sleep(0.05)
        if proc.poll() is not None and not any(_alive(p) for p in targets):
            return
