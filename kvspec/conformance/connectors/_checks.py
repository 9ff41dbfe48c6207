"""Argument checks shared by the example connectors (ERR-002)."""

from __future__ import annotations

from kvspec.protocols import InvalidArgumentError, RequestView

__all__ = ["check_count", "check_request"]


def check_request(request: object) -> RequestView:
    """Return ``request`` if it is a RequestView, else raise InvalidArgumentError."""
    if not isinstance(request, RequestView):
        raise InvalidArgumentError(
            f"request must be a RequestView, got {type(request).__name__}", clause="ERR-002"
        )
    return request


def check_count(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 0 (not a bool), else raise InvalidArgumentError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"{name} must be an int >= 0, got {value!r}", clause="ERR-002")
    return value
