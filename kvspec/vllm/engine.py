"""Deprecated (removed in the next release): the engine-process client moved to
``kvspec.bench.vllm_engine``; these names warn and return the objects from there."""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["EngineError", "EngineProcess", "vllm_python"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from kvspec.bench import vllm_engine

    warnings.warn(f"kvspec.vllm.engine.{name} is deprecated: use "
                  f"kvspec.bench.vllm_engine.{name}", DeprecationWarning, stacklevel=2)
    return getattr(vllm_engine, name)
