"""Deprecated (removed in the next release): the adapter's per-step measurement moved to
``kvspec.bench.vllm_adapter`` (``kvspec bench vllm-adapter``); ``measure`` warns
and returns the function from there."""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["measure"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from kvspec.bench import vllm_adapter

    warnings.warn(f"kvspec.vllm.bench.{name} is deprecated: use "
                  f"kvspec.bench.vllm_adapter.{name}", DeprecationWarning, stacklevel=2)
    return vllm_adapter.measure
