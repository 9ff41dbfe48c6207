"""Deprecated: moved to ``kvspec.conformance.connectors.recording``.

``RecordingConnector`` and the call-order check live with the other connectors now; the
names here are aliases that warn, and go in the next release. A connector spec
``kvspec.conformance.recording:RecordingConnector`` still loads (with the warning).
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["Call", "RecordingConnector", "Violation", "check_call_order", "read_calls"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"kvspec.conformance.recording.{name} moved to "
        f"kvspec.conformance.connectors.recording.{name}; the old name goes in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    from .connectors import recording

    return getattr(recording, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
