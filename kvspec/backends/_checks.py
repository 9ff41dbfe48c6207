"""Argument checks the reference backends' scheduler roles share (ERR-002): the protocols'
own, plus the engine objects the scheduler hooks take."""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated, Any

import msgspec

from kvspec.protocols import AllocatedBlocks, KVConnectorOutput, SchedulerOutputView
from kvspec.protocols._argchecks import as_ints, check_count, check_instance, check_request

__all__ = ["check_block_ids", "check_blocks", "check_count", "check_output", "check_request",
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


@lru_cache(maxsize=8)
def _in_budget(num_blocks: int) -> Any:
    return tuple[Annotated[int, msgspec.Meta(ge=0, lt=num_blocks)], ...]


def check_block_ids(block_ids: object, num_blocks: int) -> tuple[int, ...]:
    """``block_ids`` (one KV-cache group's, in token order) as a tuple, if they are ints in
    ``[0, num_blocks)``: one msgspec pass at C speed for a list or tuple. Otherwise the
    error ``AllocatedBlocks`` and its budget check raise: InvalidBlockIdError (ERR-003,
    LAY-012)."""
    checked = as_ints(block_ids, _in_budget(num_blocks))
    if checked is not None:
        return checked
    blocks = AllocatedBlocks.single(block_ids)  # type: ignore[arg-type]
    blocks.check_budget(num_blocks)
    return blocks.block_ids(0)
