"""Output paths checked before a long run, so that its work is not lost at the end."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["unwritable_reason"]


def unwritable_reason(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be written as a file, or None when it can: it is a directory, a
    file that is not writable, or its nearest existing ancestor is not a writable directory
    (missing parents are created when the file is written)."""
    target = Path(path)
    if str(path) == "":
        return "expected a file path"
    if target.is_dir():
        return "is a directory; expected a file path"
    if target.exists():
        return None if os.access(target, os.W_OK) else "the file is not writable"
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create it ({parent} is not a writable directory)"
    return None
