"""vLLM's KV-cache groups as kvspec's ``KVCacheGroup`` descriptors (KVG-001).

vLLM 0.32 describes each group with a ``KVCacheGroupSpec``: its layer names and one
``KVCacheSpec`` whose class says what the layers attend to. The classes are matched by
their names along the spec's MRO (``MLAAttentionSpec`` is a ``FullAttentionSpec``,
``SlidingWindowMLASpec`` a ``SlidingWindowSpec``), so this module needs no vLLM import.
A group kvspec has no kind for (cross attention, encoder-only, the sparse-attention
tiers) or one vLLM keeps out of transfers (``enable_kv_transfer=False``) is refused by name.
"""

from __future__ import annotations

from typing import Any

from kvspec.protocols import (
    CapabilityError,
    GroupKind,
    InvalidArgumentError,
    KVCacheGroup,
    StateCaching,
)

__all__ = ["groups_of", "state_caching"]

_CACHING = {"none": StateCaching.RUNNING, "align": StateCaching.ALIGNED}
"""vLLM's ``MambaSpec.mamba_cache_mode`` -> kvspec's ``StateCaching`` (STG-001): "none"
(prefix caching off) keeps one running state block per request of ``max_model_len``
tokens; "align" (prefix caching on) a position-indexed list of boundary states."""


def state_caching(spec: Any) -> StateCaching:
    """The caching mode of a vLLM ``MambaSpec`` (STG-001).

    Raises:
        CapabilityError: a mode kvspec does not describe (vLLM 0.32 and 0.33 know "none"
            and "align"), named.
    """
    mode = getattr(spec, "mamba_cache_mode", "none")
    found = _CACHING.get(str(mode))
    if found is None:
        raise CapabilityError(f"vLLM state group with mamba_cache_mode={mode!r}; kvspec "
                              "describes 'none' (RUNNING) and 'align' (ALIGNED)",
                              clause="STG-001")
    return found

_KINDS = {
    "SlidingWindowSpec": GroupKind.SLIDING_WINDOW,
    "ChunkedLocalAttentionSpec": GroupKind.CHUNKED_LOCAL,
    "MambaSpec": GroupKind.STATE,
    "FullAttentionSpec": GroupKind.FULL,
}
"""vLLM spec class (or a base of it) -> kind; the first match along the MRO wins."""


def _kind(spec: Any) -> GroupKind | None:
    for cls in type(spec).__mro__:
        if cls.__name__ in ("EncoderOnlyAttentionSpec", "CrossAttentionSpec"):
            return None
        if cls.__name__ in _KINDS:
            return _KINDS[cls.__name__]
    return None


def groups_of(kv_cache_config: Any) -> tuple[KVCacheGroup, ...]:
    """The engine's KV-cache groups, in vLLM's group order (KVG-001).

    Raises:
        CapabilityError: a group of a kind kvspec does not describe, or one vLLM excludes
            from KV transfer, named by index, spec class and first layer.
        InvalidArgumentError: a group without a spec or layer names.
    """
    out = []
    for index, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", ()) or ()):
        spec = getattr(group, "kv_cache_spec", None)
        if spec is None or not isinstance(getattr(group, "layer_names", None), (list, tuple)):
            raise InvalidArgumentError(
                f"vLLM KV-cache group {index} is {group!r:.120}; expected a KVCacheGroupSpec "
                "with kv_cache_spec and layer_names", clause="KVG-001")
        kind = _kind(spec)
        name = type(spec).__name__
        layers = tuple(group.layer_names)
        where = f"vLLM KV-cache group {index} ({name}, layers {layers[:1]}...)"
        if kind is None:
            raise CapabilityError(f"{where} is of a kind kvspec does not describe; expected "
                                  "full, sliding-window or chunked-local attention or a "
                                  "state (Mamba) group", clause="KVG-001")
        if not getattr(group, "enable_kv_transfer", True) or getattr(group, "host_resident",
                                                                      False):
            raise CapabilityError(f"{where} is excluded from KV transfer or host-resident in "
                                  "vLLM; kvspec connectors move every group", clause="KVG-002")
        window = (spec.sliding_window if kind is GroupKind.SLIDING_WINDOW
                  else spec.attention_chunk_size if kind is GroupKind.CHUNKED_LOCAL else None)
        if kind is GroupKind.STATE:
            out.append(KVCacheGroup(kind, int(spec.block_size), layers,
                                    state_caching=state_caching(spec),
                                    num_scratch_blocks=int(getattr(
                                        spec, "num_speculative_blocks", 0) or 0)))
            continue
        out.append(KVCacheGroup(kind, int(spec.block_size), layers,
                                int(window) if window is not None else None))
    return tuple(out)
