"""Eviction policies of the offloading backend: LRU and ARC over a fixed number of slots.

The scheduler role owns the host pool's slot map; a policy only orders the resident keys
and picks victims. Capacity is counted in slots (blocks), which is the byte budget per rank
divided by the bytes of one block on that rank: ``capacity * bytes_per_block`` never exceeds
the budget (checked by the worker, see ``kvspec.backends.offload._pool``). A victim is
never a pinned key: the caller says which keys are pinned (blocks whose loads are in flight,
WRK-013), and ``EvictionPolicy.evict`` returns None when every resident key is pinned.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence

from kvspec.protocols import InvalidArgumentError

__all__ = ["ARCPolicy", "EvictionPolicy", "LRUPolicy", "make_policy"]


class EvictionPolicy(ABC):
    """Orders resident keys and picks eviction victims, for at most ``capacity`` keys.

    Calls: ``insert`` when a key becomes resident (its store completed), ``touch``
    on a hit (a load planned from it), ``evict`` to pick and remove a victim,
    ``remove`` when a key is dropped for another reason (a failed load).

    Raises:
        InvalidArgumentError: ``capacity`` is not an int >= 1.
    """

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise InvalidArgumentError(
                f"eviction capacity must be an int >= 1 (slots), got {capacity!r}",
                clause="ERR-002",
            )
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: bytes) -> None:
        """Make ``key`` resident. The caller has made room: inserting beyond
        ``capacity`` raises InvalidArgumentError."""

    @abstractmethod
    def touch(self, key: bytes) -> None:
        """Record a hit on resident ``key``; unknown keys are ignored."""

    def insert_many(self, keys: Sequence[bytes]) -> None:
        """``insert`` each of ``keys``, in order (policies may do it in bulk)."""
        for key in keys:
            self.insert(key)

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """``touch`` each of ``keys``, in order (policies may do it in bulk)."""
        for key in keys:
            self.touch(key)

    @abstractmethod
    def evict(self, is_pinned: Callable[[bytes], bool], incoming: bytes | None = None) -> bytes | None:
        """Remove and return the victim among unpinned resident keys, or None if every
        resident key is pinned (or none is resident). ``incoming`` is the key the room is
        made for, if known (ARC adapts on it)."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Forget resident ``key`` without counting it as an eviction; unknown keys are
        ignored."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """True when ``key`` is resident."""

    @abstractmethod
    def __len__(self) -> int:
        """The number of resident keys (never above ``capacity``)."""

    @abstractmethod
    def __iter__(self) -> Iterator[bytes]:
        """Resident keys, the next victim (of an unpinned set) first."""

    def _check_room(self, key: bytes) -> None:
        if len(self) >= self.capacity and key not in self:
            raise InvalidArgumentError(
                f"cannot insert {key!r}: {len(self)} keys resident at capacity "
                f"{self.capacity}; evict first",
                clause="ERR-002",
            )


def _pop_first_unpinned(
    entries: OrderedDict[bytes, None], is_pinned: Callable[[bytes], bool]
) -> bytes | None:
    for key in entries:
        if not is_pinned(key):
            del entries[key]
            return key
    return None


class LRUPolicy(EvictionPolicy):
    """Least recently used: the victim is the unpinned key whose last insert or hit is
    oldest."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._entries: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        """Make ``key`` resident as the most recently used."""
        self._check_room(key)
        self._entries[key] = None
        self._entries.move_to_end(key)

    def touch(self, key: bytes) -> None:
        """Mark ``key`` most recently used."""
        if key in self._entries:
            self._entries.move_to_end(key)

    def insert_many(self, keys: Sequence[bytes]) -> None:
        """Insert ``keys`` in order: when they fit, one ``__setitem__`` each
        (``OrderedDict.update`` is slower), then, if some were resident, ``move_to_end``."""
        entries = self._entries
        before = len(entries)
        if before + len(keys) > self.capacity:
            super().insert_many(keys)
            return
        for key in keys:
            entries[key] = None
        if len(entries) - before < len(keys):  # a resident key stays put on __setitem__
            for key in keys:
                entries.move_to_end(key)

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """Mark ``keys`` most recently used, the last one most; absent keys are ignored."""
        entries = self._entries
        try:
            if len(keys) <= 8:  # a few: a plain loop costs less than building the deque
                for key in keys:
                    entries.move_to_end(key)
            else:
                deque(map(entries.move_to_end, keys), maxlen=0)  # at C speed
        except KeyError:  # an absent key: again, skipping those (the order comes out the same)
            for key in keys:
                if key in entries:
                    entries.move_to_end(key)

    def evict(self, is_pinned: Callable[[bytes], bool], incoming: bytes | None = None) -> bytes | None:
        """Remove and return the least recently used unpinned key."""
        return _pop_first_unpinned(self._entries, is_pinned)

    def remove(self, key: bytes) -> None:
        """Forget ``key``."""
        self._entries.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self._entries))


class ARCPolicy(EvictionPolicy):
    """Adaptive replacement cache (Megiddo and Modha, 2003) over resident keys.

    ``T1`` holds keys seen once recently, ``T2`` keys hit at least twice; the ghost lists
    ``B1`` and ``B2`` remember keys recently evicted from each. A miss on a ghost of ``B1``
    grows the target size ``p`` of ``T1`` (recency pays), one on ``B2`` shrinks it
    (frequency pays). Victims come from ``T1`` while it exceeds ``p``, else from ``T2``,
    skipping pinned keys (falling back to the other list when one holds only pinned keys).
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0.0
        """The adaptive target size of ``T1``, in ``[0, capacity]``."""
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._adapted: set[bytes] = set()  # ghosts whose REPLACE already adapted p

    @property
    def recent(self) -> tuple[bytes, ...]:
        """Keys of ``T1`` (seen once), least recent first."""
        return tuple(self._t1)

    @property
    def frequent(self) -> tuple[bytes, ...]:
        """Keys of ``T2`` (hit again), least recent first."""
        return tuple(self._t2)

    def _adapt(self, key: bytes) -> None:
        c = self.capacity
        if key in self._b1:
            delta = max(1.0, len(self._b2) / max(1, len(self._b1)))
            self.p = min(float(c), self.p + delta)
        elif key in self._b2:
            delta = max(1.0, len(self._b1) / max(1, len(self._b2)))
            self.p = max(0.0, self.p - delta)

    def insert(self, key: bytes) -> None:
        """Make ``key`` resident: in ``T2`` if it is a ghost (adapting ``p``), else in
        ``T1``. Ghost lists are trimmed to the capacity."""
        self._check_room(key)
        if key in self._t1 or key in self._t2:
            self.touch(key)
            return
        if key in self._b1 or key in self._b2:
            if key not in self._adapted:
                self._adapt(key)
            self._adapted.discard(key)
            self._b1.pop(key, None)
            self._b2.pop(key, None)
            self._t2[key] = None
        else:
            self._t1[key] = None
        c = self.capacity
        while len(self._t1) + len(self._b1) > c and self._b1:
            self._b1.popitem(last=False)
        while len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c and (
            self._b2 or self._b1
        ):
            (self._b2 or self._b1).popitem(last=False)
        if len(self._adapted) > 2 * c:
            self._adapted = {k for k in self._adapted if k in self._b1 or k in self._b2}

    def touch(self, key: bytes) -> None:
        """A hit: move ``key`` to the most recent end of ``T2``."""
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def evict(self, is_pinned: Callable[[bytes], bool], incoming: bytes | None = None) -> bytes | None:
        """ARC's REPLACE: evict from ``T1`` when it exceeds ``p`` (or equals it and
        ``incoming`` is a ghost of ``B2``), else from ``T2``; the victim becomes a ghost.
        A ghost ``incoming`` adapts ``p`` first, once (its later insert does not)."""
        if incoming is not None and incoming not in self._adapted and (
            incoming in self._b1 or incoming in self._b2
        ):
            self._adapt(incoming)
            self._adapted.add(incoming)
        in_b2 = incoming is not None and incoming in self._b2
        t1_first = bool(self._t1) and (
            len(self._t1) > self.p or (in_b2 and len(self._t1) == int(self.p))
            or not self._t2
        )
        order = ((self._t1, self._b1), (self._t2, self._b2))
        for lst, ghost in (order if t1_first else order[::-1]):
            victim = _pop_first_unpinned(lst, is_pinned)
            if victim is not None:
                ghost[victim] = None
                return victim
        return None

    def remove(self, key: bytes) -> None:
        """Forget ``key`` (no ghost is kept)."""
        for lst in (self._t1, self._t2, self._b1, self._b2):
            lst.pop(key, None)
        self._adapted.discard(key)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __iter__(self) -> Iterator[bytes]:
        return iter([*self._t1, *self._t2])


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Build the policy named ``name`` (``"lru"`` or ``"arc"``) for ``capacity`` slots.

    Raises:
        InvalidArgumentError: an unknown name or a bad capacity (ERR-002).
    """
    if name == "lru":
        return LRUPolicy(capacity)
    if name == "arc":
        return ARCPolicy(capacity)
    raise InvalidArgumentError(
        f"config.extra['eviction'] is {name!r}; expected 'lru' or 'arc'", clause="ERR-002"
    )
