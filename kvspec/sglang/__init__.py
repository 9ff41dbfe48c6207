"""SGLang's HiCache storage backends under kvspec's STO clauses.

SGLang's hierarchical cache keeps an L3 tier behind ``HiCacheStorage`` backends (``file``,
``nixl``, out-of-tree classes loaded with ``--hicache-storage-backend dynamic``). This
package creates such a backend exactly as SGLang's cache controller does, with SGLang's own
CPU host pool, and checks it against the [STO clauses](../spec/sto.md) with the test base
class in ``kvspec.sglang.suite``. Only this package imports SGLang, and only when a backend
is created: ``import kvspec.sglang`` works without SGLang installed. SGLang itself lives in
the environment ``scripts/sglang_env.sh`` builds.

Example:
    >>> from kvspec.sglang import HiCacheConfig, parse_target
    >>> parse_target("pkg.store:MyBackend").name
    'dynamic'
    >>> HiCacheConfig(layout="page_first_direct").page_size
    4
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..protocols.errors import InvalidArgumentError
from ._config import (
    BUILTIN_ZERO_COPY,
    HICACHE_EXTRA_ENV,
    HICACHE_TARGET_ENV,
    HOST_LAYOUTS,
    KVSPEC_BACKEND,
    NIXL_BACKEND,
    BackendUnavailableError,
    HiCacheConfig,
    HiCacheTarget,
    parse_target,
)

if TYPE_CHECKING:
    from ._loader import StorageRig

__all__ = ["BUILTIN_ZERO_COPY", "BackendUnavailableError", "HICACHE_EXTRA_ENV", "HICACHE_TARGET_ENV", "HOST_LAYOUTS", "KVSPEC_BACKEND", "NIXL_BACKEND", "HiCacheConfig", "HiCacheTarget", "open_backend",
           "parse_target"]


def open_backend(target: str | HiCacheTarget, config: HiCacheConfig, storage_dir: str | Path,
                 *, deadline_s: float = 30.0) -> StorageRig:
    """Create the backend ``target`` names for one rank, as SGLang's controller does, with
    SGLang's CPU host pool in ``config.layout``; returns the ``StorageRig`` that drives it.

    Raises:
        ImportError: SGLang is not installed here (run under ``scripts/sglang_env.sh``'s
            environment).
        InvalidArgumentError: ``target`` or ``config`` is malformed.
        BackendUnavailableError: the backend needs a package that is not installed
            (``nixl`` for SGLang's ``nixl`` backend), or SGLang's nixl L3 cleaner would
            delete its pages as they are written (``storage_dir``'s filesystem at or above
            the cleaner's high watermark, 80 % by default).
    """
    from ._loader import StorageRig

    if not isinstance(target, HiCacheTarget):
        target = parse_target(target)
    if not isinstance(config, HiCacheConfig):
        raise InvalidArgumentError(f"config must be a HiCacheConfig, got {type(config).__name__}")
    return StorageRig(target, config, Path(storage_dir), deadline_s=deadline_s)
