"""Argument checks that connector roles share (ERR-002): the reference backends and the
example connectors refuse arguments of the wrong type or range with a typed error before
touching any state."""

from __future__ import annotations

from typing import TypeVar

from .errors import InvalidArgumentError
from .views import RequestView, _nonneg
from .views import _as_ints as as_ints  # one msgspec pass over a list of ints

__all__ = ["as_ints", "check_count", "check_instance", "check_request"]

T = TypeVar("T")


def check_instance(name: str, value: object, cls: type[T]) -> T:
    """``value`` if it is a ``cls``, else InvalidArgumentError naming ``name``."""
    if not isinstance(value, cls):
        raise InvalidArgumentError(
            f"{name} must be a {cls.__name__}, got {type(value).__name__}", clause="ERR-002"
        )
    return value


def check_request(request: object) -> RequestView:
    """``request`` if it is a ``RequestView``, else InvalidArgumentError."""
    return check_instance("request", request, RequestView)


def check_count(name: str, value: object) -> int:
    """``value`` if it is an int >= 0 (not a bool), else InvalidArgumentError."""
    return _nonneg(name, value)
