"""``KVSpecHiCacheStorage``: kvspec's host-memory page store as an SGLang HiCache L3 backend.

Load it in SGLang (this module imports SGLang; nothing else in kvspec imports it)::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "kvspec", "module_path": "kvspec.sglang.backend",
      "class_name": "KVSpecHiCacheStorage", "interface_v1": 1}'

Extra configuration: ``kvspec_store_dir`` (default ``file_storage_path``, else
``/dev/shm/kvspec-hicache``), ``kvspec_bytes`` (page bytes per shard, default 1 GiB),
``kvspec_ways`` (pages per set, default 8), ``kvspec_timeout_s`` (the longest a call waits
for a lock, default 5).

Why not kvspec's offload connector (``kvspec.backends.offload``) itself: its roles answer
an engine's step loop (match a request's hashed blocks, allocate, load before a forward,
report finished transfers), and a HiCache call is a synchronous move of keyed pages between
SGLang's host pool and storage; driving the roles would mean inventing requests and
scheduler outputs per call. Its ``HostPool`` copies device blocks into a private pool of the
process, but SGLang's host pool already is host memory, and a private pool cannot serve
STO-008: with MLA only TP rank 0 writes, and the other ranks, separate processes, must read
its pages. So the pages live in one shared-memory file per shard (``_store.PageStore``):
still host memory, now shared by every process of the node, with kvspec's layout
descriptor doing the addressing (``_layout.describe_host_pool``: a page is a block, its
regions are ``KVCacheLayout.block_region_offsets``), moved with one ``preadv`` /
``pwritev`` straight from and into SGLang's pool. Eviction is per set (the way written
longest ago), because an LRU order like the offload backend's ``LRUPolicy`` would have to
be shared by every process that reads.

Obligations (STO clauses): one lock serialises the controller's three threads, acquired
with a timeout like every file lock, so a call that cannot proceed in ``kvspec_timeout_s``
misses instead of waiting (STO-011, STO-012); every batch answer has one entry per key
(STO-002); a miss, a damaged file or an I/O error is a miss or ``False``, never an
exception (STO-003, STO-010); names carry the model and the rank coordinates, without the
TP rank for MLA, where only the storage writer stores (STO-007, STO-008).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from ..protocols.errors import InvalidArgumentError
from ._layout import describe_host_pool
from ._store import Buffers, PageStore, digest

__all__ = ["KVSpecHiCacheStorage"]

_DEFAULT_DIR = "/dev/shm/kvspec-hicache"


class KVSpecHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's ``cls(storage_config, kwargs)`` for ``--hicache-storage-backend dynamic``;
    the store is built when SGLang registers its host pool."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        c = storage_config
        mla = bool(c.is_mla_model)
        tp = "tp*" if mla else f"tp{c.tp_rank}of{c.tp_size}"
        self.suffix = (f"{c.model_name}|{tp}|pp{c.pp_rank}of{c.pp_size}"
                       f"|cp{getattr(c, 'attn_cp_rank', 0)}of{getattr(c, 'attn_cp_size', 1)}")
        self.writer = bool(getattr(c, "is_storage_writer", not mla or c.tp_rank == 0))
        self.root = Path(extra.get("kvspec_store_dir") or extra.get("file_storage_path") or _DEFAULT_DIR)
        self.capacity = int(extra.get("kvspec_bytes", 1 << 30))
        self.ways = int(extra.get("kvspec_ways", 8))
        self.timeout_s = float(extra.get("kvspec_timeout_s", 5.0))
        self.store: PageStore | None = None
        self._lock = threading.Lock()

    # -- set-up ------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Describe the pool (refusing layouts a ``KVCacheLayout`` cannot state, LAY-001 /
        LAY-008) and open the shard's store; the storage writer creates it."""
        super().register_mem_pool_host(mem_pool_host)
        layout = describe_host_pool(mem_pool_host)
        self.page_size = int(mem_pool_host.page_size)
        self.dtype = layout.dtype
        self._bytes = mem_pool_host.kv_buffer.reshape(-1).view(torch.uint8).numpy().data
        self._bases = [int(b) for b in layout.block_region_offsets([0])[0]]
        self._stride, self._region = layout.block_stride_bytes, layout.region_nbytes
        self._pages = layout.num_blocks
        page_bytes = self._region * len(self._bases)
        tag = re.sub(r"[^A-Za-z0-9._-]", "_", self.suffix)[:160]
        self.root.mkdir(parents=True, exist_ok=True)
        self.store = PageStore(self.root / f"{tag}.p{page_bytes}.kvspec", page_bytes,
                               self.capacity, self.ways, self.timeout_s)
        if self.writer:
            with self._call(write=True) as fd:
                if fd is None:
                    raise InvalidArgumentError(f"{self.store.path} stayed locked for "
                                               f"{self.timeout_s} s", clause="STO-012")

    @contextmanager
    def _call(self, write: bool) -> Iterator[int | None]:
        """The in-process lock, then the file's, both within ``timeout_s``; None (and the
        caller misses) when either is not had in time, the store is closed or invalid."""
        deadline = time.monotonic() + self.timeout_s
        if self.store is None or not self._lock.acquire(timeout=self.timeout_s):
            yield None
            return
        try:
            with self.store.locked(write, deadline) as fd:
                try:
                    ok = fd is not None and self.store.valid(fd)
                    if fd is not None and write and not ok:
                        self.store.format(fd)  # new, or damaged: start empty
                        ok = True
                except OSError:
                    ok = False
                yield fd if ok else None
        finally:
            self._lock.release()

    def _page(self, host_index: int) -> Buffers | None:
        """The regions of the host page starting at token slot ``host_index``."""
        page, rest = divmod(host_index, self.page_size)
        if rest or not 0 <= page < self._pages:
            return None
        at = page * self._stride
        return [self._bytes[at + b:at + b + self._region] for b in self._bases]

    def _flat(self, tensor: Any) -> Buffers | None:
        """A generic interface's flat page as one buffer (None: not a page's size)."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            return None
        raw = tensor.contiguous().view(-1).view(torch.uint8)
        return [raw.numpy().data] if self.store and raw.numel() == self.store.page_bytes else None

    def _names(self, keys: list[str]) -> list[bytes]:
        return [digest(k, self.suffix) for k in keys]

    # -- reads -------------------------------------------------------------------------------
    def _load(self, keys: list[str], pages: list[Buffers | None]) -> list[bool]:
        """Read the leading run of stored keys into ``pages``; one bool per key."""
        done = [False] * len(keys)
        with self._call(write=False) as fd:
            if fd is None or self.store is None:
                return done
            try:
                for i, name in enumerate(self._names(keys)):
                    slot, page = self.store.find(fd, name), pages[i]
                    if slot is None or page is None or not self.store.read(fd, slot, page):
                        break
                    done[i] = True
            except OSError:  # an I/O error is a miss from there on
                pass
        return done

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """The number of leading keys stored (STO-001); 0 when the store cannot answer."""
        with self._call(write=False) as fd:
            if fd is None or self.store is None:
                return 0
            n = 0
            try:
                for name in self._names(keys):
                    if self.store.find(fd, name) is None:
                        break
                    n += 1
            except OSError:
                pass
            return n

    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored (False when the store cannot answer in time)."""
        return self.batch_exists([key]) == 1

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Zero copy: page ``i`` goes to host slots ``host_indices[i * page_size:]``."""
        if self.store is None or len(host_indices) != len(keys) * self.page_size:
            return [False] * len(keys)
        firsts = host_indices[::self.page_size].tolist()
        return self._load(keys, [self._page(int(i)) for i in firsts])

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Generic: the page of ``key`` (in ``target_location`` when that is a contiguous
        page), or None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Generic: each page into its target (a fresh tensor where none is given)."""
        if self.store is None:
            return [None] * len(keys)
        targets = list(target_locations or [None] * len(keys))[:len(keys)]
        targets += [None] * (len(keys) - len(targets))
        for i, t in enumerate(targets):  # read in place only into a contiguous page
            if not (isinstance(t, torch.Tensor) and t.is_contiguous()
                    and t.nbytes == self.store.page_bytes):
                targets[i] = torch.empty(self.store.page_bytes // self.dtype.itemsize, dtype=self.dtype)
        done = self._load(keys, [self._flat(t) for t in targets])
        return [t if ok else None for t, ok in zip(targets, done)]

    # -- writes ------------------------------------------------------------------------------
    def _save(self, keys: list[str], pages: list[Buffers | None]) -> list[bool]:
        """Store each page (the storage writer only, STO-008); one bool per key."""
        done = [False] * len(keys)
        if not self.writer:
            return done
        with self._call(write=True) as fd:
            if fd is None or self.store is None:
                return done
            for i, name in enumerate(self._names(keys)):
                page = pages[i]
                try:
                    done[i] = page is not None and self.store.write(fd, name, page)
                except OSError:  # a full /dev/shm: the rest fails too
                    break
        return done

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Zero copy: page ``i`` is read from host slots ``host_indices[i * page_size:]``."""
        if self.store is None or len(host_indices) != len(keys) * self.page_size:
            return [False] * len(keys)
        firsts = host_indices[::self.page_size].tolist()
        return self._save(keys, [self._page(int(i)) for i in firsts])

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """Generic: store the flat page ``value``; False when it was not stored."""
        return self._save([key], [self._flat(value)])[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Generic: store each flat page; True only when every one was stored."""
        values = list(values or [])
        return len(values) == len(keys) and all(self._save(keys, [self._flat(v) for v in values]))

    # -- the rest ----------------------------------------------------------------------------
    def clear(self) -> None:
        """Forget every page of this shard (the storage writer only)."""
        if self.writer:
            with self._call(write=True) as fd:
                if fd is not None and self.store is not None:
                    self.store.clear(fd)

    def close(self) -> None:
        """Drop the store and the view of SGLang's pool; later calls miss. No file
        descriptor or thread outlives a call, so there is nothing else to release."""
        if self._lock.acquire(timeout=self.timeout_s):
            self.store, self._bytes = None, memoryview(b"")
            self._lock.release()
