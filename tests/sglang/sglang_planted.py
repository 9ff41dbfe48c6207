"""Planted-defect HiCache backends: SGLang's ``file`` backend with one bug each, loaded by
the suite as out-of-tree classes (``sglang_planted:Class``, SGLang's ``dynamic`` path).
Imported only under SGLang (tests/sglang/test_planted.py)."""

from __future__ import annotations

from typing import Any

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
