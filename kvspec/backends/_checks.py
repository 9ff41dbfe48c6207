"""Argument checks the reference backends' scheduler roles share: every public hook refuses
arguments of the wrong type or range with a typed error (ERR-002) before touching state."""

from __future__ import annotations

from kvspec.protocols import (
    AllocatedBlocks,
    InvalidArgumentError,
    KVConnectorOutput,
    RequestView,
    SchedulerOutputView,
)

__all__ = ["check_blocks", "check_count", "check_output", "check_request",
           "check_scheduler_output"]


def check_request(request: object) -> RequestView:
    """``request`` if it is a :class:`RequestView`, else InvalidArgumentError."""
    if not isinstance(request, RequestView):
        raise InvalidArgumentError(
            f"request must be a RequestView, got {type(request).__name__}", clause="ERR-002"
        )
    return request


def check_count(name: str, value: object) -> int:
    """``value`` if it is an int >= 0 (not a bool), else InvalidArgumentError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"{name} must be an int >= 0, got {value!r}", clause="ERR-002")
    return value


def check_blocks(blocks: object) -> AllocatedBlocks:
    """``blocks`` if it is :class:`AllocatedBlocks`, else InvalidArgumentError."""
    if not isinstance(blocks, AllocatedBlocks):
        raise InvalidArgumentError(
            f"blocks must be AllocatedBlocks, got {type(blocks).__name__}", clause="ERR-002"
        )
    return blocks


def check_scheduler_output(value: object) -> SchedulerOutputView:
    """``value`` if it is a :class:`SchedulerOutputView`, else InvalidArgumentError."""
    if not isinstance(value, SchedulerOutputView):
        raise InvalidArgumentError(
            f"scheduler_output must be a SchedulerOutputView, got {type(value).__name__}",
            clause="ERR-002",
        )
    return value


def check_output(value: object) -> KVConnectorOutput:
    """``value`` if it is a :class:`KVConnectorOutput`, else InvalidArgumentError."""
    if not isinstance(value, KVConnectorOutput):
        raise InvalidArgumentError(
            f"output must be a KVConnectorOutput, got {type(value).__name__}",
            clause="ERR-002",
        )
    return value
