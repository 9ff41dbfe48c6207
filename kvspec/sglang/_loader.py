"""Create SGLang HiCache storage backends the way SGLang's cache controller does.

This module imports SGLang (0.5.23 was read; see docs/sglang-hicache.md). The controller
builds a ``HiCacheStorageConfig`` from the rank's coordinates, asks
``StorageBackendFactory.create_backend`` for the backend (a registered name, or
``dynamic`` with ``backend_name`` / ``module_path`` / ``class_name`` in the extra
configuration), registers the host pool and calls ``on_host_pools_registered``. Every
backend call made through ``StorageRig`` runs on a helper thread with a deadline, so a call
that never returns is reported (STO-012) instead of hanging the suite.

SGLang's ``nixl`` backend takes no directory from its configuration: the factory builds it
from the ``HiCacheStorageConfig`` alone and it reads ``SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR``
(default ``/tmp/hicache_storage``) once, in its constructor. kvspec sets that variable to
the storage directory it gives the backend while the backend is built, and restores it.
"""

from __future__ import annotations

import copy
import importlib
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..protocols.errors import ContractViolation, InvalidArgumentError
from ._config import BackendUnavailableError, HiCacheConfig, HiCacheTarget

__all__ = ["NIXL_STORAGE_DIR_ENV", "StorageRig", "build_host_pool", "check_available", "create_backend",
           "filesystem_used_pct", "make_storage_config"]

STORAGE_BATCH_SIZE = 128
"""Pages per backend call, as SGLang's controller batches them."""

_TOKEN_DIM = {"layer_first": 2, "page_first": 1}
"""The token dimension of the host pool's ``kv_buffer`` per layout (``[2, layers, tokens,
heads, dim]``, ``[2, tokens, layers, heads, dim]``); ``page_first_direct`` is per page."""

NIXL_STORAGE_DIR_ENV = "SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR"
"""Where SGLang's ``nixl`` backend keeps its files (read once, when it is built)."""
_ENV_LOCK = threading.Lock()
"""Held while a backend that reads its directory from the environment is built."""


def check_available(target: HiCacheTarget, extra_config: Mapping[str, Any] | None = None,
                    storage_dir: Path | None = None) -> None:
    """Raise unless ``target`` can run here: the packages it needs beyond SGLang import and,
    for SGLang's ``nixl`` backend with ``storage_dir``, its L3 cleaner would not empty that
    directory as the suite writes it.

    The cleaner (on by default in SGLang 0.5.23) is an eviction policy keyed on the whole
    filesystem's usage, not the cache's: from ``l3_cleaner_high_watermark`` (80 %) on, it
    deletes the backend's files every second until usage is under the low watermark, or
    none is left. On a filesystem already that full, every page the suite stores vanishes
    before it is read back; that is the machine's state, not a broken clause.

    Raises:
        BackendUnavailableError: ``target`` is SGLang's ``nixl`` backend and ``nixl`` cannot
            be imported (``scripts/sglang_env.sh`` installs ``nixl==1.5.1``), or its cleaner
            is on and ``storage_dir``'s filesystem is at or above its high watermark.
        InvalidArgumentError: an ``l3_cleaner_*`` key SGLang refuses.
    """
    if target.name != "nixl":
        return
    try:
        importlib.import_module("nixl._api")
    except ImportError as e:
        raise BackendUnavailableError(
            "SGLang's nixl HiCache backend needs the nixl package, which is not installed in "
            f"this environment ({e}); scripts/sglang_env.sh installs nixl==1.5.1") from None
    if storage_dir is None:
        return
    from sglang.srt.mem_cache.storage.nixl.nixl_utils import NixlBackendConfig

    try:
        cleaner = NixlBackendConfig({**dict(target.defaults), **(extra_config or {})}
                                    ).get_l3_cleaner_config()
    except ValueError as e:  # SGLang's own check of the l3_cleaner_* keys
        raise InvalidArgumentError(f"SGLang's nixl backend refuses its extra config: {e}") from None
    used = filesystem_used_pct(storage_dir)
    if cleaner["enabled"] and used >= cleaner["high_watermark"]:
        raise BackendUnavailableError(
            f"the filesystem of {storage_dir} is {used:.1f}% full, at or above the "
            f"{cleaner['high_watermark']:g}% high watermark of SGLang's nixl L3 cleaner, which "
            "then deletes the backend's files as they are written: no stored page could be read "
            "back. Free space there, give the suite a directory on another filesystem (TMPDIR), "
            "or run with the cleaner off (--extra l3_cleaner_enabled=false)")


def filesystem_used_pct(path: Path) -> float:
    """How full ``path``'s filesystem is, in percent, as SGLang's L3 cleaner counts it
    (blocks not available to an unprivileged user); ``path`` or its nearest existing parent."""
    while not path.exists() and path != path.parent:
        path = path.parent
    stat = os.statvfs(path)
    total = stat.f_blocks * stat.f_frsize
    return 0.0 if total == 0 else 100.0 * (total - stat.f_bavail * stat.f_frsize) / total


def build_host_pool(config: HiCacheConfig) -> Any:
    """SGLang's real CPU host pool (``MHATokenToKVPoolHost``, pinned memory off) over an
    ``MHATokenToKVPool`` on device ``cpu``, in ``config.layout``."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    tokens = config.host_pages * config.page_size // 2  # the host pool holds twice the device's
    device = MHATokenToKVPool(
        tokens, config.page_size, getattr(torch, config.dtype), config.num_heads,
        config.head_dim, config.num_layers, "cpu", False, v_head_dim=config.head_dim)
    return MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info, 2.0, 0, config.page_size,
        config.layout, pin_memory=False, device="cpu", device_capacity_tokens=device.size,
        start_layer=device.start_layer, end_layer=device.end_layer,
        write_back_staging=device.hicache_write_back_staging)


def make_storage_config(config: HiCacheConfig, target: HiCacheTarget, storage_dir: Path) -> Any:
    """The ``HiCacheStorageConfig`` the controller would build for this rank; the extra
    configuration gains ``file_storage_path`` (``storage_dir``) and, for a class, the
    ``dynamic`` loader's three fields."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    extra: dict[str, Any] = copy.deepcopy({"file_storage_path": str(storage_dir),
                                           **dict(target.defaults), **config.extra_config})
    if target.name == "dynamic":
        extra.update(backend_name=target.spec, module_path=target.module_path,
                     class_name=target.class_name)
    return HiCacheStorageConfig(
        tp_rank=config.tp_rank, tp_size=config.tp_size, pp_rank=config.pp_rank,
        pp_size=config.pp_size, attn_cp_rank=config.attn_cp_rank,
        attn_cp_size=config.attn_cp_size, is_mla_model=config.is_mla,
        enable_storage_metrics=False, is_page_first_layout=config.layout == "page_first",
        model_name=config.model_name, extra_config=extra)


def create_backend(target: HiCacheTarget, config: HiCacheConfig, host_pool: Any,
                   storage_dir: Path) -> Any:
    """Create, register and announce the backend, in the controller's order.

    Raises:
        InvalidArgumentError: SGLang's file or nixl directory variable is set (it would
            send every rank and every test to one directory).
        BackendUnavailableError: ``target`` is ``nixl`` and ``nixl`` is not installed, or its
            L3 cleaner would delete what the suite stores (``check_available``).
    """
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    for name in ("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", NIXL_STORAGE_DIR_ENV):
        if os.environ.get(name):
            raise InvalidArgumentError(f"unset {name}: it overrides the storage directory "
                                       "kvspec gives each backend")
    check_available(target, config.extra_config, storage_dir)
    storage_config = make_storage_config(config, target, storage_dir)
    if target.name == "nixl":
        if "," in str(storage_dir):  # the variable is a comma-separated list of directories
            raise InvalidArgumentError(f"SGLang's nixl backend cannot use {storage_dir}: "
                                       "a comma separates its storage directories")
        with _ENV_LOCK:
            before = os.environ.get(NIXL_STORAGE_DIR_ENV)
            os.environ[NIXL_STORAGE_DIR_ENV] = str(storage_dir)
            try:
                backend = StorageBackendFactory.create_backend(target.name, storage_config, host_pool)
            finally:
                if before is None:
                    os.environ.pop(NIXL_STORAGE_DIR_ENV, None)
                else:
                    os.environ[NIXL_STORAGE_DIR_ENV] = before
    else:
        backend = StorageBackendFactory.create_backend(target.name, storage_config, host_pool)
    backend.register_mem_pool_host(host_pool)
    backend.on_host_pools_registered()
    return backend


def _bounded(fn: Callable[[], Any], deadline_s: float, what: str) -> Any:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    worker = threading.Thread(target=run, name=f"kvspec-hicache-{what}", daemon=True)
    worker.start()
    worker.join(deadline_s)
    if worker.is_alive():
        raise ContractViolation("STO-012", observed=f"{what} had not returned after {deadline_s:g} s",
                                expected="every backend call returns in bounded time")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class StorageRig:
    """One backend with its host pool, driven as SGLang's controller drives it.

    Attributes:
        target: The backend under test.
        config: The rank's configuration.
        host: SGLang's host pool the backend was registered with.
        backend: The backend object.
        zero_copy: Whether the controller would use ``batch_get_v1`` / ``batch_set_v1``.
        deadline_s: The longest any one backend call may take (STO-012).
    """

    def __init__(self, target: HiCacheTarget, config: HiCacheConfig, storage_dir: Path, *,
                 host: Any = None, deadline_s: float = 30.0) -> None:
        self.target, self.config, self.deadline_s = target, config, deadline_s
        self.host = build_host_pool(config) if host is None else host
        self.backend = _bounded(lambda: create_backend(target, config, self.host, storage_dir),
                                deadline_s, "creating the backend")
        self.zero_copy = target.zero_copy(config.extra_config)

    def call(self, clause: str, method: str, *args: Any) -> Any:
        """Call ``backend.method(*args)`` within the deadline; an exception out of it is a
        violation of ``clause``."""
        fn = getattr(self.backend, method)
        try:
            return _bounded(lambda: fn(*args), self.deadline_s, method)
        except ContractViolation:
            raise
        except Exception as e:
            raise ContractViolation(clause, observed=f"{method} raised {type(e).__name__}: {e}",
                                    expected=f"{method} returns: a miss or a failure is an answer, an "
                                    "exception costs SGLang's controller the whole batch") from e

    # -- host pages ------------------------------------------------------------------------
    def alloc(self, pages: int) -> torch.Tensor:
        """Host slots for ``pages`` pages (page-aligned token indices)."""
        indices = self.host.alloc(pages * self.config.page_size)
        if indices is None:
            raise InvalidArgumentError(f"the host pool has no room for {pages} more pages")
        return indices  # type: ignore[no-any-return]

    def page_index(self, indices: torch.Tensor, i: int) -> int:
        """The first token slot of page ``i`` of ``indices``."""
        return int(indices[i * self.config.page_size])

    def page_bytes(self, indices: torch.Tensor, i: int) -> torch.Tensor:
        """Page ``i`` of ``indices`` as bytes, in the layout's page order."""
        page = self.host.get_data_page(self.page_index(indices, i), flat=True)
        return page.contiguous().view(torch.uint8).clone()  # type: ignore[no-any-return]

    def fill(self, indices: torch.Tensor, seed: int) -> list[torch.Tensor]:
        """Write seeded random bytes into every page of ``indices``; return them."""
        gen = torch.Generator().manual_seed(seed)
        out = []
        for i in range(len(indices) // self.config.page_size):
            view = self.host.get_data_page(self.page_index(indices, i), flat=False)
            raw = torch.randint(0, 256, (view.numel() * view.element_size(),),
                                dtype=torch.uint8, generator=gen)
            view.copy_(raw.view(view.dtype).view(view.shape))
            out.append(raw)
        return out

    def clear(self, indices: torch.Tensor) -> None:
        """Zero every page of ``indices``."""
        for i in range(len(indices) // self.config.page_size):
            self.host.get_data_page(self.page_index(indices, i), flat=False).zero_()

    def snapshot(self) -> torch.Tensor:
        """A copy of the whole host pool's bytes, for ``pages_changed``."""
        return self.host.kv_buffer.contiguous().view(torch.uint8).clone()  # type: ignore[no-any-return]

    def pages_changed(self, before: torch.Tensor) -> set[int]:
        """The first token slot of every host page whose bytes differ from ``before`` (a
        ``snapshot``): where a load wrote (STO-006)."""
        now = self.host.kv_buffer.contiguous().view(torch.uint8)
        diff = now != before
        ps = self.config.page_size
        if self.config.layout == "page_first_direct":  # [2, pages, layers, page, heads, dim]
            per_page = diff.movedim(1, 0).reshape(diff.shape[1], -1).any(dim=1)
            return {int(p) * ps for p in per_page.nonzero().flatten().tolist()}
        dim = _TOKEN_DIM[self.config.layout]
        per_token = diff.movedim(dim, 0).reshape(diff.shape[dim], -1).any(dim=1)
        return {int(t) // ps * ps for t in per_token.nonzero().flatten().tolist()}

    def page_slots(self, indices: torch.Tensor) -> set[int]:
        """The first token slot of every page of ``indices``."""
        return {self.page_index(indices, i) for i in range(len(indices) // self.config.page_size)}

    # -- the controller's three paths --------------------------------------------------------
    def query(self, keys: Sequence[str]) -> int:
        """The controller's hit query: ``batch_exists`` per batch of 128, stopping at the
        first batch that is not a full hit; the pages found."""
        found = 0
        for start in range(0, len(keys), STORAGE_BATCH_SIZE):
            batch = list(keys[start:start + STORAGE_BATCH_SIZE])
            n = self.call("STO-001", "batch_exists", batch, None)
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(batch):
                raise ContractViolation("STO-001", observed=f"batch_exists answered {n!r} for "
                                        f"{len(batch)} keys", expected=f"an int in [0, {len(batch)}]")
            found += n
            if n < len(batch):
                break
        return found

    def store(self, keys: Sequence[str], indices: torch.Tensor) -> Any:
        """One backup batch, as the controller writes it; the backend's raw answer."""
        if self.zero_copy:
            return self.call("STO-010", "batch_set_v1", list(keys), indices, None)
        pages = [self.host.get_data_page(self.page_index(indices, i)) for i in range(len(keys))]
        return self.call("STO-010", "batch_set", list(keys), pages)

    def load(self, keys: Sequence[str], indices: torch.Tensor) -> Any:
        """One prefetch batch, as the controller reads it (generic pages are copied into
        the host pool, as the controller copies them); the backend's raw answer."""
        if self.zero_copy:
            return self.call("STO-003", "batch_get_v1", list(keys), indices, None)
        dummies = [self.host.get_dummy_flat_data_page() for _ in keys]
        got = self.call("STO-003", "batch_get", list(keys), dummies)
        for i, page in enumerate(got if isinstance(got, list) else []):
            if page is None:
                break
            self.host.set_from_flat_data_page(self.page_index(indices, i), page)
        return got

    def close(self) -> None:
        """Close the backend if it has ``close`` (the controller's detach does the same)."""
        close = getattr(self.backend, "close", None)
        if callable(close):
            self.call("STO-013", "close")
