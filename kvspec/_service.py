"""A service a connector needs (a cache server, a metadata store), started for one run.

``kvspec conform --service CMD --service-wait HOST:PORT`` starts ``CMD`` before the engines,
waits until ``HOST:PORT`` accepts a TCP connection (bounded), and stops it after the run:
SIGTERM to its process group, SIGKILL when it has not exited within a few seconds.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from .protocols import InvalidArgumentError, TransferTimeoutError

__all__ = ["parse_address", "running_service"]

_STOP_GRACE_S = 5.0


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``tcp://HOST:PORT``) as a pair.

    Raises:
        InvalidArgumentError: not ``HOST:PORT`` with a port in 1..65535.
    """
    host, sep, port = text.removeprefix("tcp://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"bad service address {text!r}; expected HOST:PORT, e.g. "
                                   "localhost:5555")
    return host, int(port)


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
        if log is not None:
            out.close()  # type: ignore[union-attr]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the service's process group, SIGKILL it when it lingers."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, _STOP_GRACE_S), (signal.SIGKILL, _STOP_GRACE_S)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
