"""Faults the HiCache storage suite injects from outside a backend, with no hook inside it.

Both are resource limits of this process, so they reach every backend that does its I/O
in the process through the file system (SGLang's ``file`` backend, kvspec's, a NIXL POSIX
plugin that opens files per call), whatever its code, and they work as root, where a
read-only directory does not. A backend that keeps its files open, maps them, or talks to
a service is not reached: the suite then skips the check, saying so, and such a backend's
suite overrides ``HiCacheStorageSuite.inject_fault`` with a fault of its own (stop the
service, cut the connection).

- ``no-fd``: ``RLIMIT_NOFILE`` at the lowest free descriptor, so every ``open`` fails with
  ``EMFILE`` (a process out of descriptors). Loads and stores fail alike.
- ``disk-full``: ``RLIMIT_FSIZE`` 0, so every write to a regular file fails with ``EFBIG``
  (Python ignores ``SIGXFSZ``), like a full disk. Writes this process makes to a regular
  file outside the backend fail too while it lasts: stdout and stderr are flushed first.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys
from collections.abc import Iterator

from ..protocols.errors import InvalidArgumentError

__all__ = ["FAULTS", "inject_fault"]

FAULTS = ("no-fd", "disk-full")
"""The faults ``inject_fault`` knows."""


@contextlib.contextmanager
def inject_fault(kind: str) -> Iterator[None]:
    """Hold fault ``kind`` (one of ``FAULTS``) for the body; the limit is restored after.

    Raises:
        InvalidArgumentError: ``kind`` is not one of ``FAULTS``, or ``disk-full`` where
            ``SIGXFSZ`` is not ignored (a write past the limit would kill the process).
    """
    if kind == "no-fd":
        limit = resource.RLIMIT_NOFILE
        probe = os.open(os.devnull, os.O_RDONLY)  # the lowest free descriptor
        os.close(probe)
        value = probe
    elif kind == "disk-full":
        if signal.getsignal(signal.SIGXFSZ) is not signal.SIG_IGN:
            raise InvalidArgumentError("the disk-full fault needs SIGXFSZ ignored (as Python "
                                       "sets it at start-up); something changed it")
        limit, value = resource.RLIMIT_FSIZE, 0
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    else:
        raise InvalidArgumentError(f"a fault is one of {FAULTS}, got {kind!r}")
    soft, hard = resource.getrlimit(limit)
    resource.setrlimit(limit, (value, hard))
    try:
        yield
    finally:
        resource.setrlimit(limit, (soft, hard))
