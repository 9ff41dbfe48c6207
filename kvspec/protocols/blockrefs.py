"""Block references: how a scheduler connector keeps KV blocks past their request (SCH-030).

A connector that copies blocks out after the step that scheduled the copy (a store job the
workers run in the background) needs those blocks to keep their bytes until the copy is done,
even when the request that owned them finishes first. Delayed free (SCH-016) does this per
request; block references do it per block, for as long as the connector says. The engine
hands the scheduler role a ``BlockReferences`` once, before the first step
(``SchedulerConnector.bind_block_references``); vLLM 0.32 does the same by binding its GPU
block pool (``KVConnectorBase_V1.bind_gpu_block_pool``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["BlockReferences"]


@runtime_checkable
class BlockReferences(Protocol):
    """The engine's reference counts on its KV blocks, lent to the scheduler role (SCH-030).

    Every method is called from the scheduler thread, inside a scheduler hook.
    """

    @property
    def num_blocks(self) -> int:
        """The number of blocks of the physical budget (ids ``0 .. num_blocks - 1``)."""
        ...

    def take(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each block.

        May assume nothing about a block that no request holds now: its bytes may already
        belong to another request.
        Must: name only blocks a request of this engine holds at the time of the call (the
        blocks of a running request, or of a finishing one inside ``request_finished``).
        Raises ``InvalidBlockIdError`` for an id outside the budget and ``ContractViolation``
        (SCH-030) for a block no one holds.
        While referenced, a block is neither reallocated nor evicted.
        """
        ...

    def drop(self, block_ids: Sequence[int]) -> None:
        """Drop one reference the connector took on each block (``take``).

        Must: drop only references it took, each once; drop every one of them before it
        reports no pending work (``SchedulerConnector.has_pending_work``) and before
        ``shutdown`` returns (SCH-030). Raises ``ContractViolation`` (SCH-030) for a block
        the connector holds no reference on.
        """
        ...
