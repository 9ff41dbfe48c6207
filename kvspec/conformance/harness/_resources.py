"""Snapshots of what a process holds, for the harness's leak checks (WRK-015, ERR-009):
its threads, open file descriptors (files, sockets, pipes, shared memory) and child
processes. On systems without ``/proc`` only threads are compared."""

from __future__ import annotations

import os
import threading

import attrs

__all__ = ["Snapshot", "snapshot"]

_PROC = "/proc/self"


@attrs.frozen
class Snapshot:
    """What this process held at one moment.

    Attributes:
        threads: Thread idents to names.
        fds: Open file descriptors to what they point to.
        children: Child process ids to their command names.
    """

    threads: dict[int | None, str]
    fds: dict[int, str]
    children: dict[int, str]

    def new_since(self, before: Snapshot) -> dict[str, list[str]]:
        """What this snapshot holds that ``before`` did not, by kind (empty kinds left
        out); a descriptor number reused for another target counts as new."""
        found = {
            "threads": [n for i, n in self.threads.items() if i not in before.threads],
            "file descriptors": [f"{fd} -> {t}" for fd, t in sorted(self.fds.items())
                                 if before.fds.get(fd) != t],
            "child processes": [f"{pid} ({c})" for pid, c in sorted(self.children.items())
                                if pid not in before.children],
        }
        return {kind: items for kind, items in found.items() if items}


def _fds() -> dict[int, str]:
    try:
        names = os.listdir(f"{_PROC}/fd")
    except OSError:
        return {}
    out: dict[int, str] = {}
    for name in names:
        try:
            out[int(name)] = os.readlink(f"{_PROC}/fd/{name}")
        except (OSError, ValueError):  # closed meanwhile (the listing's own fd, too)
            continue
    return out


def _children() -> dict[int, str]:
    pids: set[int] = set()
    try:
        tasks = os.listdir(f"{_PROC}/task")
    except OSError:
        return {}
    for tid in tasks:
        try:
            with open(f"{_PROC}/task/{tid}/children") as f:
                pids.update(int(p) for p in f.read().split())
        except (OSError, ValueError):
            continue
    out: dict[int, str] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as f:
                out[pid] = f.read().strip()
        except OSError:
            continue  # exited meanwhile
    return out


def snapshot() -> Snapshot:
    """What this process holds now (only live threads)."""
    return Snapshot(
        threads={t.ident: t.name for t in threading.enumerate() if t.is_alive()},
        fds=_fds(), children=_children(),
    )
