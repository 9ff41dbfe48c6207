"""The page store behind ``KVSpecHiCacheStorage``: one shared-memory file per shard.

A shard (one model, one set of rank coordinates; for MLA every TP rank of a pipeline and
context stage) keeps its pages in one file, by default under ``/dev/shm`` so the pages are
host memory that every process of the node maps the same way::

    [header, 4 KiB][table: sets x ways entries of 48 bytes][data: slots x page_bytes]

A page goes to set ``digest mod sets`` (the digest is a SHA-256 of the key and the rank
suffix), into an empty way or else the way written longest ago (a write stamp per entry):
a set-associative cache, so a lookup reads one set's entries and no process holds an
index another cannot see. Writers hold an exclusive ``flock`` on the file for a batch,
readers a shared one, so a get never sees a page half written (STO-009); an entry is
cleared before its page is overwritten and written after it, so a writer that dies midway
leaves an empty way, never a torn page. Every lock is polled against a deadline, never
waited on (STO-012). A file descriptor lives for one call only (STO-013). A short read (a
truncated file), a bad header or any ``OSError`` is a miss or a failed store, never an
exception (STO-003, STO-010).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import struct
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from ..protocols.errors import InvalidArgumentError

__all__ = ["Buffers", "PageStore"]

Buffers = Sequence[memoryview]
"""The regions of one page, in the order they are stored (a ``readv`` / ``writev`` list)."""

_MAGIC = b"kvspec-hicache-1"
_HEAD = struct.Struct("<16sQQQQ")  # magic, page_bytes, sets, ways, next write stamp
_ENTRY = struct.Struct("<32sQQ")  # digest, write stamp, length (0: empty)
_TABLE = 4096
_IOV_MAX = 1024


def digest(key: str, suffix: str) -> bytes:
    """The stored name of ``key`` for one shard: SHA-256 of the key and the rank suffix."""
    return hashlib.sha256(f"{key}\0{suffix}".encode()).digest()


class PageStore:
    """The pages of one shard in the file ``path``.

    Args:
        path: The shard's file (created by ``create``; readers never create it).
        page_bytes: Bytes of one page.
        capacity_bytes: Page bytes the file may hold (rounded down to whole sets).
        ways: Pages per set.
        timeout_s: The longest any lock is waited for.

    Raises:
        InvalidArgumentError: ``capacity_bytes`` holds fewer than ``ways`` pages (ERR-002).
    """

    def __init__(self, path: Path, page_bytes: int, capacity_bytes: int, ways: int,
                 timeout_s: float) -> None:
        if ways < 1 or capacity_bytes < ways * page_bytes:
            raise InvalidArgumentError(
                f"kvspec_bytes={capacity_bytes} holds fewer than kvspec_ways={ways} pages of "
                f"{page_bytes} bytes", clause="ERR-002")
        self.path, self.page_bytes, self.ways, self.timeout_s = path, page_bytes, ways, timeout_s
        self.sets = capacity_bytes // page_bytes // ways
        self.slots = self.sets * ways
        self._data = -(-(_TABLE + self.slots * _ENTRY.size) // 4096) * 4096
        self._head = _HEAD.pack(_MAGIC, page_bytes, self.sets, ways, 1)[:-8]

    # -- files and locks -------------------------------------------------------------------
    @contextmanager
    def locked(self, write: bool, deadline: float) -> Iterator[int | None]:
        """The file, open and locked (exclusively to ``write``) until the deadline; None
        when it does not exist or the lock was not free in time."""
        try:
            fd = os.open(self.path, (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY, 0o600)
        except OSError:
            yield None
            return
        try:
            mode = (fcntl.LOCK_EX if write else fcntl.LOCK_SH) | fcntl.LOCK_NB
            while True:
                try:
                    fcntl.flock(fd, mode)
                    break
                except OSError as e:
                    if e.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                        yield None
                        return
                    time.sleep(0.0005)
            yield fd
        finally:
            os.close(fd)  # releases the lock

    def valid(self, fd: int) -> bool:
        """Whether the file's header is this store's (magic and geometry)."""
        head = os.pread(fd, _HEAD.size, 0)
        return len(head) == _HEAD.size and head[:-8] == self._head

    def format(self, fd: int) -> None:
        """Make the file an empty store of this geometry (write-locked ``fd``)."""
        os.ftruncate(fd, 0)
        os.ftruncate(fd, self._data + self.slots * self.page_bytes)  # sparse until written
        os.pwrite(fd, _HEAD.pack(_MAGIC, self.page_bytes, self.sets, self.ways, 1), 0)

    # -- pages -------------------------------------------------------------------------------
    def _set(self, fd: int, name: bytes) -> tuple[int, list[tuple[bytes, int, int]]]:
        first = int.from_bytes(name[:8], "little") % self.sets * self.ways
        raw = os.pread(fd, self.ways * _ENTRY.size, _TABLE + first * _ENTRY.size)
        if len(raw) < self.ways * _ENTRY.size:
            return first, []
        return first, [_ENTRY.unpack_from(raw, i * _ENTRY.size) for i in range(self.ways)]

    def find(self, fd: int, name: bytes) -> int | None:
        """The slot holding ``name``, or None."""
        first, entries = self._set(fd, name)
        return next((first + i for i, (d, _, n) in enumerate(entries)
                     if d == name and n == self.page_bytes), None)

    def read(self, fd: int, slot: int, page: Buffers) -> bool:
        """Read slot ``slot`` into ``page``; False on a short read (a truncated file)."""
        at = self._data + slot * self.page_bytes
        for i in range(0, len(page), _IOV_MAX):
            part = page[i:i + _IOV_MAX]
            want = sum(m.nbytes for m in part)
            if os.preadv(fd, part, at) != want:
                return False
            at += want
        return True

    def write(self, fd: int, name: bytes, page: Buffers) -> bool:
        """Store ``page`` under ``name`` (write-locked ``fd``); True when it is stored (or
        already was)."""
        if self.find(fd, name) is not None:
            return True
        first, entries = self._set(fd, name)
        if not entries:
            return False
        way = min(range(self.ways), key=lambda i: (entries[i][2] != 0, entries[i][1]))
        entry = _TABLE + (first + way) * _ENTRY.size
        stamp = _HEAD.unpack(os.pread(fd, _HEAD.size, 0))[4]
        os.pwrite(fd, bytes(_ENTRY.size), entry)  # empty while the page is rewritten
        at = self._data + (first + way) * self.page_bytes
        for i in range(0, len(page), _IOV_MAX):
            part = page[i:i + _IOV_MAX]
            want = sum(m.nbytes for m in part)
            if os.pwritev(fd, part, at) != want:
                return False
            at += want
        os.pwrite(fd, _ENTRY.pack(name, stamp, self.page_bytes), entry)
        os.pwrite(fd, struct.pack("<Q", stamp + 1), _HEAD.size - 8)
        return True

    def clear(self, fd: int) -> None:
        """Forget every page (write-locked ``fd``)."""
        os.pwrite(fd, bytes(self.slots * _ENTRY.size), _TABLE)
