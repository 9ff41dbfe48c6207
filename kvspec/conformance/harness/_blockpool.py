"""The harness engine's block pool and prefix cache.

Blocks are reference counted. With prefix caching, a full block is registered under its
chained hash (salted by cache salt and LoRA id, SCH-020) once computed; blocks whose count
drops to zero stay cached and evictable (LRU) until reused. Every block handed out is first
poisoned by the workers, and every block freed without being cached is poisoned, so stale
reads show up as poison (see _toymodel).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

from kvspec.protocols.errors import InvalidArgumentError

__all__ = ["BlockPool", "block_hashes"]


def block_hashes(
    tokens: tuple[int, ...], block_size: int, cache_salt: str | None, lora_id: int | None
) -> list[bytes]:
    """Chained hashes of the full blocks of ``tokens``, salted by tenant and adapter."""
    out: list[bytes] = []
    parent = hashlib.blake2b(f"{cache_salt!r}|{lora_id!r}".encode(), digest_size=16).digest()
    for i in range(len(tokens) // block_size):
        chunk = tokens[i * block_size : (i + 1) * block_size]
        h = hashlib.blake2b(parent + repr(chunk).encode(), digest_size=16).digest()
        out.append(h)
        parent = h
    return out


class BlockPool:
    """Reference-counted blocks ``first .. num_blocks - 1`` with an optional prefix cache.

    Blocks below ``first`` are never handed out: the engine reserves block 0 as vLLM does
    (its null block, which stands for a block a request does not hold)."""

    def __init__(self, num_blocks: int, *, prefix_caching: bool, first: int = 0) -> None:
        if not 0 <= first < num_blocks:
            raise InvalidArgumentError(
                f"num_blocks must exceed first ({first}), got {num_blocks}")
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(first, num_blocks))
        self._ref = [0] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._held: deque[tuple[float, int]] = deque()  # (free from, block), in order

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free or evictable)."""
        return len(self._free) + len(self._evictable)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes``."""
        out: list[int] = []
        if not self.prefix_caching:
            return out
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def refcount(self, block: int) -> int:
        """How many holders ``block`` has now (requests and connector references)."""
        return self._ref[block]

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on already-cached blocks (a local prefix hit)."""
        for b in blocks:
            self._ref[b] += 1
            self._evictable.pop(b, None)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks, evicting cached ones LRU-first; None if not enough."""
        if n > self.num_free:
            return None
        out: list[int] = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._cached[self._hash_of.pop(b)]
            self._ref[b] = 1
            out.append(b)
        return out

    @property
    def holding(self) -> bool:
        """True while freed blocks are held back from allocation (``free``)."""
        return bool(self._held)

    def release_held(self, now: float) -> None:
        """Make the blocks held until ``now`` or earlier allocatable."""
        while self._held and self._held[0][0] <= now:
            self._free.append(self._held.popleft()[1])

    def free(self, blocks: list[int], *, hold_until: float | None = None) -> list[int]:
        """Drop one reference per block; return the blocks that became free and uncached.
        With ``hold_until`` (a ``time.monotonic()`` value), those are not allocated before
        ``release_held`` is called with that time or later."""
        released: list[int] = []
        for b in reversed(blocks):
            if self._ref[b] <= 0:
                raise AssertionError(f"harness bug: block {b} freed with no reference")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                elif hold_until is None:
                    self._free.append(b)
                    released.append(b)
                else:
                    self._held.append((hold_until, b))
                    released.append(b)
        return released

    def cache(self, block: int, block_hash: bytes) -> None:
        """Register a computed full block under its hash (first writer wins)."""
        if self.prefix_caching and block_hash not in self._cached and block not in self._hash_of:
            self._cached[block_hash] = block
            self._hash_of[block] = block_hash

    def uncache(self, block: int) -> None:
        """Forget a block's cache entry (its KV turned out invalid)."""
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._cached[h]
            if self._ref[block] == 0:
                self._evictable.pop(block, None)
                self._free.append(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cache entry (a cache reset, SCH-033): no block is hit again; the
        unreferenced ones are free."""
        for block in list(self._hash_of):
            self.uncache(block)

    def evict_beyond(self, hashes: list[bytes], keep: int) -> list[int]:
        """Evict the unreferenced cached blocks of ``hashes[keep:]``, as memory pressure
        would; return them (now free and uncached)."""
        out: list[int] = []
        for h in hashes[keep:]:
            b = self._cached.get(h)
            if b is not None and self._ref[b] == 0:
                self.uncache(b)
                out.append(b)
        return out

    def forget_cached(self) -> list[int]:
        """Forget every cached block no request holds (the KV memory went away, as at an
        engine's sleep); return them (now free and uncached)."""
        out = [b for b in list(self._hash_of) if self._ref[b] == 0]
        for b in out:
            self.uncache(b)
        return out

    def check_all_free(self) -> list[int]:
        """Blocks still referenced (a leak when the engine is idle)."""
        return [b for b, r in enumerate(self._ref) if r > 0]
