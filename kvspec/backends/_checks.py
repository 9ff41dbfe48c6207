"""Argument checks the reference backends' scheduler roles share (ERR-002): the protocols'
own, plus the engine objects the scheduler hooks take."""

from __future__ import annotations

from kvspec.protocols import AllocatedBlocks, KVConnectorOutput, SchedulerOutputView
from kvspec.protocols._argchecks import check_count, check_instance, check_request

__all__ = ["check_blocks", "check_count", "check_output", "check_request",
           "check_scheduler_output"]


def check_blocks(blocks: object) -> AllocatedBlocks:
    """``blocks`` if it is ``AllocatedBlocks``, else InvalidArgumentError."""
    return check_instance("blocks", blocks, AllocatedBlocks)


def check_scheduler_output(value: object) -> SchedulerOutputView:
    """``value`` if it is a ``SchedulerOutputView``, else InvalidArgumentError."""
    return check_instance("scheduler_output", value, SchedulerOutputView)


def check_output(value: object) -> KVConnectorOutput:
    """``value`` if it is a ``KVConnectorOutput``, else InvalidArgumentError."""
    return check_instance("output", value, KVConnectorOutput)
