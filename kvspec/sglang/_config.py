"""The small kvspec-side configuration a HiCache storage backend is created from."""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs

from ..protocols.errors import InvalidArgumentError, KVSpecError

__all__ = ["BUILTIN_ZERO_COPY", "BackendUnavailableError", "HICACHE_EXTRA_ENV", "KVSPEC_BACKEND", "HICACHE_TARGET_ENV", "HOST_LAYOUTS", "HiCacheConfig", "HiCacheTarget", "NIXL_BACKEND", "parse_target"]

class BackendUnavailableError(KVSpecError, ImportError):
    """A backend needs a package that is not installed in SGLang's environment (SGLang's
    ``nixl`` backend without ``nixl``); raised before the backend is created."""


HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
"""Host-pool layouts the suite builds (SGLang's ``page_head`` needs head splitting)."""

BUILTIN_ZERO_COPY = frozenset({"hf3fs", "mooncake", "npu_memcache", "eic", "nixl", "simm",
                               "mori", "tensorcast", "seaweedfs"})
"""Built-in backend names SGLang 0.5.23's controller drives through ``batch_get_v1`` /
``batch_set_v1`` (the rest, ``file`` among them, through ``batch_get`` / ``batch_set``)."""

HICACHE_TARGET_ENV = "KVSPEC_HICACHE_TARGET"
"""The backend ``kvspec conform hicache:TARGET`` hands to the suite it runs."""
HICACHE_EXTRA_ENV = "KVSPEC_HICACHE_EXTRA"
"""That backend's extra configuration, as a JSON object."""

_DTYPES = ("float16", "bfloat16", "float32")
_TARGET = re.compile(r"^(?:(?P<name>[a-z][a-z0-9_]*)|(?P<module>[A-Za-z_][\w.]*):(?P<cls>[A-Za-z_]\w*))$")


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"HiCacheConfig.{attribute.name} must be an int >= 1, got {value!r}")


def _frozen_mapping(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if value is None:
        return MappingProxyType({})
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"HiCacheConfig.extra_config must be a mapping, got {value!r}")
    return MappingProxyType(dict(value))


@attrs.frozen(eq=False)
class HiCacheConfig:
    """One rank's view of a HiCache set-up: what SGLang's controller would build the
    backend's ``HiCacheStorageConfig`` and the host pool from.

    Attributes:
        layout: The host pool's layout, one of ``HOST_LAYOUTS``.
        page_size: Tokens per page (one storage key).
        num_layers, num_heads, head_dim: The KV geometry of the rank (K and V alike).
        dtype: The KV dtype's torch name (``float16``, ``bfloat16``, ``float32``).
        host_pages: Pages of host memory to allocate.
        tp_rank, tp_size, pp_rank, pp_size, attn_cp_rank, attn_cp_size: The rank's
            coordinates (STO-007).
        is_mla: Whether the model is MLA (KV replicated across TP ranks, STO-008).
        model_name: The served model's name (backends put it in their keys).
        extra_config: The backend's extra configuration
            (``--hicache-storage-backend-extra-config``).
    """

    layout: str = "layer_first"
    page_size: int = attrs.field(default=4, validator=_positive)
    num_layers: int = attrs.field(default=2, validator=_positive)
    num_heads: int = attrs.field(default=2, validator=_positive)
    head_dim: int = attrs.field(default=8, validator=_positive)
    dtype: str = "float16"
    host_pages: int = attrs.field(default=512, validator=_positive)
    tp_rank: int = 0
    tp_size: int = attrs.field(default=1, validator=_positive)
    pp_rank: int = 0
    pp_size: int = attrs.field(default=1, validator=_positive)
    attn_cp_rank: int = 0
    attn_cp_size: int = attrs.field(default=1, validator=_positive)
    is_mla: bool = False
    model_name: str = "kvspec-hicache"
    extra_config: Mapping[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping)

    def __attrs_post_init__(self) -> None:
        if self.layout not in HOST_LAYOUTS:
            raise InvalidArgumentError(f"HiCacheConfig.layout must be one of {HOST_LAYOUTS}, "
                                       f"got {self.layout!r}")
        if self.dtype not in _DTYPES:
            raise InvalidArgumentError(f"HiCacheConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size"),
                           ("attn_cp_rank", "attn_cp_size")):
            r, n = getattr(self, rank), getattr(self, size)
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n:
                raise InvalidArgumentError(f"HiCacheConfig.{rank} must be an int in [0, {size}={n}), got {r!r}")

    def evolve(self, **changes: Any) -> HiCacheConfig:
        """A copy with ``changes`` applied (validated again)."""
        return attrs.evolve(self, **changes)


@attrs.frozen
class HiCacheTarget:
    """Which backend to create: a built-in name, or an out-of-tree class.

    Attributes:
        spec: What the user wrote (``file``, ``pkg.module:Class``).
        name: The built-in backend name, or ``dynamic`` for a class.
        module_path, class_name: The class's module and name (``dynamic`` only).
    """

    spec: str
    name: str
    module_path: str | None = None
    class_name: str | None = None
    defaults: tuple[tuple[str, Any], ...] = ()
    """Extra configuration the backend is loaded with unless the user's overrides it."""

    def zero_copy(self, extra_config: Mapping[str, Any]) -> bool:
        """Whether SGLang's controller would drive this backend through the zero-copy
        ``batch_get_v1`` / ``batch_set_v1`` (else the generic ``batch_get`` / ``batch_set``)."""
        if self.name == "dynamic":
            return bool({**dict(self.defaults), **extra_config}.get("interface_v1", 0))
        return self.name in BUILTIN_ZERO_COPY


KVSPEC_BACKEND = HiCacheTarget("kvspec", "dynamic", "kvspec.sglang.backend", "KVSpecHiCacheStorage",
                               (("interface_v1", 1),))
"""``kvspec``: kvspec's own backend, loaded as SGLang's ``dynamic`` option loads it, zero copy."""

NIXL_BACKEND = HiCacheTarget("nixl", "nixl", defaults=(("plugin", {"posix": {"active": True}}),))
"""``nixl``: SGLang's ``HiCacheNixl`` on NIXL's POSIX plugin (files in the storage directory
kvspec gives it), selected the way SGLang's README recommends, with the fully qualified
``{"plugin": {"posix": {"active": true}}}`` extra configuration; every other setting at
SGLang's default (O_DIRECT on, the L3 cleaner on). An extra configuration with its own
``plugin`` replaces this one."""


def parse_target(spec: str) -> HiCacheTarget:
    """Parse ``file`` / ``nixl`` (a built-in name), ``kvspec`` (kvspec's own backend,
    ``KVSPEC_BACKEND``) or ``pkg.module:Class`` (as SGLang's ``dynamic`` backend loads it).

    Raises:
        InvalidArgumentError: ``spec`` is neither.
    """
    m = _TARGET.match(spec) if isinstance(spec, str) else None
    if m is None:
        raise InvalidArgumentError(f"a HiCache backend is a built-in name (file, nixl) or "
                                   f"'pkg.module:Class', got {spec!r}")
    if spec == KVSPEC_BACKEND.spec:
        return KVSPEC_BACKEND
    if spec == NIXL_BACKEND.spec:
        return NIXL_BACKEND
    if m.group("name"):
        return HiCacheTarget(spec, m.group("name"))
    return HiCacheTarget(spec, "dynamic", m.group("module"), m.group("cls"))
