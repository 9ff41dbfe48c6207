"""Planted-defect HiCache backends: SGLang's ``file`` backend with one bug each, loaded by
the suite as out-of-tree classes (``sglang_planted:Class``, SGLang's ``dynamic`` path).
``ZeroCopyFile`` is the unplanted base of the zero-copy ones (``interface_v1``).
Imported only under SGLang (tests/sglang/test_planted.py)."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile


class RankBlind(HiCacheFile):  # type: ignore[misc]
    """Keys objects without the rank: every rank reads every other rank's shard (STO-007)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        super().__init__(storage_config)
        self.config_suffix = self.tp_config_suffix = "_shared"


class NoneResults(HiCacheFile):  # type: ignore[misc]
    """Answers a batch get with None instead of a list (STO-002)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        super().__init__(storage_config)

    def batch_get(self, keys: Any, target_locations: Any = None, target_sizes: Any = None) -> Any:
        return None


class CountsPastHoles(HiCacheFile):  # type: ignore[misc]
    """Answers batch_exists with the number of stored keys, holes skipped (STO-001)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        super().__init__(storage_config)

    def batch_exists(self, keys: Any, extra_info: Any = None) -> int:
        return sum(1 for k in keys if self.exists(k))


class RaisesOnMiss(HiCacheFile):  # type: ignore[misc]
    """Raises KeyError from get when the key is not stored, instead of returning None
    (STO-003): SGLang's controller then drops the whole prefetch batch."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        super().__init__(storage_config)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        if not self.exists(key):
            raise KeyError(f"{key} is not stored")
        return super().get(key, target_location, target_sizes)


class GetLooksElsewhere(HiCacheFile):  # type: ignore[misc]
    """get reads the object under the key without the rank suffix while set and exists use
    the suffixed name: every stored page exists, and none can be read (STO-004)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        super().__init__(storage_config)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        path = os.path.join(self.file_path, f"{key}.bin")
        try:
            with open(path, "rb", buffering=0) as f:
                buf = memoryview(target_location.view(torch.uint8).contiguous().numpy())
                if f.readinto(buf) != len(buf):
                    return None
            return target_location
        except FileNotFoundError:
            return None


class LiesAboutFailedSets(HiCacheFile):  # type: ignore[misc]
    """set reports True even when the write failed (STO-010): the controller then marks the
    page backed up and every later prefix query stops at the hole."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        super().__init__(storage_config)

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        super().set(key, value, target_location, target_sizes)
        return True


class TornWrites(HiCacheFile):  # type: ignore[misc]
    """set writes the object in place, sized first, then each half (no temporary file and
    rename): a get between the halves reads a full-size object whose second half is zeros,
    as a hit (STO-009). The pause between the halves stands for a large page's write time."""

    pause_s = 0.02

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        super().__init__(storage_config)

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        if self.exists(key):
            return True
        raw = value.contiguous().view(torch.uint8).numpy().tobytes()
        path = os.path.join(self.file_path, f"{self._get_suffixed_key(key)}.bin")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.ftruncate(fd, len(raw))
                half = len(raw) // 2
                os.pwrite(fd, raw[:half], 0)
                time.sleep(self.pause_s)
                os.pwrite(fd, raw[half:], half)
            finally:
                os.close(fd)
        except OSError:  # a failed write leaves nothing behind, as the file backend's
            with contextlib.suppress(OSError):
                os.unlink(path)
            return False
        return True


class ZeroCopyFile(HiCacheFile):  # type: ignore[misc]
    """The file backend with ``batch_get_v1`` / ``batch_set_v1`` (load it with
    ``interface_v1``): page i moves between its object and the host page at
    ``host_indices[i * page_size]`` through the host pool's flat pages. Unplanted."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        super().__init__(storage_config)

    def _host_index(self, host_indices: torch.Tensor, i: int) -> int:
        return int(host_indices[i * self.mem_pool_host.page_size])

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        pool = self.mem_pool_host
        return [bool(self.set(key, pool.get_data_page(int(host_indices[i * pool.page_size]))))
                for i, key in enumerate(keys)]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        pool, out = self.mem_pool_host, [False] * len(keys)
        for i, key in enumerate(keys):
            page = self.get(key, pool.get_dummy_flat_data_page())
            if page is None:
                break
            pool.set_from_flat_data_page(self._host_index(host_indices, i), page)
            out[i] = True
        return out


class OffByOnePage(ZeroCopyFile):
    """batch_get_v1 writes page i one host page past the slots it was given (its first
    token slot plus page_size): each page lands on its neighbour's slots (STO-006)."""

    def _host_index(self, host_indices: torch.Tensor, i: int) -> int:
        return int(host_indices[i * self.mem_pool_host.page_size]) + int(self.mem_pool_host.page_size)
