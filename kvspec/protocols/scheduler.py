"""The scheduler role of a KV connector: one instance per engine core, in the scheduler process.

Hook names follow vLLM's ``KVConnectorBase_V1`` where the meaning is the same, so connector
authors recognise them; the arguments are kvspec's read-only views.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from .blockrefs import BlockReferences
from .events import KVCacheEvent, KVConnectorOutput
from .metadata import ConnectorMetadata, HandshakeMetadata
from .views import AllocatedBlocks, RequestView, SchedulerOutputView

__all__ = ["SchedulerConnector"]


@runtime_checkable
class SchedulerConnector(Protocol):
    """The connector's scheduler role.

    Subclass it to inherit the documented defaults of the optional methods, or implement every
    method to satisfy it structurally. The engine calls these hooks from its single scheduler
    thread, in the order given in docs/spec/state-machines.md. No hook may block on a transfer
    (SCH-025), mutate what it is given (SCH-012) or keep a mutable engine object: the views it
    receives are immutable and may be kept.
    """

    # -- required -------------------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Say how many tokens beyond ``num_computed_tokens`` the connector can load.

        When: for a waiting request, each time the engine considers scheduling it, including
        again after a deferral, a failed allocation or a preemption (SCH-001, SCH-022).

        May assume: ``num_computed_tokens`` counts the tokens already in the engine's own
        prefix cache and is at most the number of prompt tokens.

        Must return ``(count, load_async)``: ``count`` is None to defer the answer
        (SCH-002; the engine asks again later, SCH-003) or an int in
        ``[0, prompt tokens - num_computed_tokens]`` (SCH-004); for a synchronous load,
        ``num_computed_tokens + count`` must leave at least one prompt token to compute (an
        asynchronous load may cover the whole prompt: the engine computes the last token
        again after it, SCH-005) and should end on a block boundary (SCH-007); only KV the
        connector can deliver now counts (SCH-006), keyed by salt and LoRA identity
        (SCH-020). ``load_async`` is True if the KV arrives between
        steps (the request then waits for ``finished_recving``, SCH-023); it must be False
        when ``count`` is 0, and is ignored when ``count`` is None (SCH-004). For the same stored data the answer is the
        same whether the engine schedules synchronously or asynchronously (SCH-014): what
        a reported store makes matchable is matchable once ``update_connector_output``
        returns, not only after the next ``build_connector_meta``.

        Must never: change state another hook can observe, start a load or pin anything
        (SCH-001).
        """

    @abstractmethod
    def update_state_after_alloc(
        self, request: RequestView, blocks: AllocatedBlocks, num_external_tokens: int
    ) -> None:
        """Learn which blocks the engine allocated for a request.

        When: after each allocation for a request whose match was asked; for an async match,
        once when the blocks for the external tokens are allocated and possibly again after
        the load finished with ``num_external_tokens == 0`` (SCH-009).

        May assume: ``blocks`` are within the physical budget (LAY-012) and cover at least
        the external tokens.

        Must: decide whether to load from ``num_external_tokens`` alone, never from whether
        ``blocks`` is empty (SCH-008); plan loads only into the blocks that cover the external
        tokens (SCH-010); start no second load on the second call (SCH-009).
        """

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ConnectorMetadata:
        """Build the metadata the workers need for this step, and reset per-step state.

        When: exactly once per scheduler step, including steps that schedule nothing
        (SCH-011); under async scheduling possibly before the previous step's output arrived
        (SCH-014).

        Must return: metadata that encodes without pickle (ERR-006) and describes each
        transfer in exactly one step (SCH-013).

        Must never: mutate ``scheduler_output`` (SCH-012), or wait for the previous step's
        output (SCH-014).
        """

    # -- optional, with defaults ------------------------------------------------------------

    def on_new_request(self, request: RequestView) -> None:
        """Observe a request as it is added to the engine.

        When: once per request, before its first ``get_num_new_matched_tokens``.
        Default: does nothing.
        """
        return None

    def request_finished(
        self, request: RequestView, block_ids: tuple[int, ...]
    ) -> tuple[bool, Mapping[str, Any] | None]:
        """Take note that a request finished or was aborted, before its blocks are freed.

        When: exactly once per request that had blocks allocated, whatever the reason it ended
        (SCH-015), including an abort while waiting for remote KV (SCH-021).

        Must return ``(delay_free, kv_transfer_params)``: ``delay_free`` True keeps the blocks
        until the workers report the request in ``finished_sending`` (SCH-016), which the
        connector must then make happen; False lets the engine free them at once, after which
        the connector must not read them (SCH-017). ``kv_transfer_params`` is None or
        JSON-representable data handed to the next engine (SCH-018).

        Default: ``(False, None)``.
        """
        return False, None

    def request_finished_all_groups(
        self, request: RequestView, blocks: AllocatedBlocks
    ) -> tuple[bool, Mapping[str, Any] | None]:
        """``request_finished`` for an engine with several KV-cache groups: ``blocks`` holds
        every group's block ids, null positions included (KVG-006, KVG-004).

        When: instead of ``request_finished``, exactly once per request that had blocks,
        when the engine runs more than one group (vLLM's ``SupportsHMA``).
        Must return what ``request_finished`` returns; a delayed free holds the blocks of
        every group until ``finished_sending`` (KVG-006).
        Default: ``request_finished(request, blocks.block_ids(0))``: a connector that
        declares several groups and stores at finish overrides it.
        """
        return self.request_finished(request, blocks.block_ids(0))

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Consume the aggregated worker output of one executed step.

        When: exactly once per executed step, in step order (SCH-019).
        May assume: ``output`` is the executor's aggregate (EXE clauses).
        Default: does nothing.
        """
        return None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Return the KV-cache events gathered since the last call, each exactly once (EVT-004).

        Default: no events.
        """
        return ()

    def get_finished_count(self) -> int | None:
        """Return how many worker reports complete a request, or None for the world size.

        When: once, when the executor is created (SCH-026, EXE-008).
        Default: None.
        """
        return None

    def set_xfer_handshake_metadata(
        self, metadata: Mapping[int, HandshakeMetadata]
    ) -> None:
        """Receive every worker's handshake metadata, keyed by rank (HSK-002).

        When: once before the first step is scheduled, and again after every wake of a
        sleep-capable connector (HSK-006), before the first step after wake.
        Must: after a second call, publish only the new metadata (for example in the
        ``kv_transfer_params`` it hands to consumers), so that peers re-handshake with the
        restored registrations; the old metadata is invalid.
        Default: does nothing.
        """
        return None

    def bind_block_references(self, references: BlockReferences) -> None:
        """Receive the engine's block references, to keep blocks past their request (SCH-030).

        When: once, after the engine's block pool exists and before the first step.
        May assume: ``references`` stays valid until ``shutdown``.
        Must never: take a reference on a block no request holds; keep a reference once it
        reports no pending work (``has_pending_work``) or after ``shutdown``.
        Default: ignores them.
        """
        return None

    def has_pending_work(self) -> bool:
        """Say whether work is in flight that only a later step can complete (SCH-029).

        When: whenever the engine decides whether to step again, in particular once every
        request has finished; the engine keeps stepping (steps that schedule nothing)
        while it returns True.
        Must: return True only while a transfer or store it started is unreported (a
        background store whose completion arrives in a later ``update_connector_output``,
        a push to a peer that has not yet registered) and turn False within a bounded
        time, also when the peer never answers; hold no block reference (SCH-030) once it
        returns False.
        Default: False.
        """
        return False

    def reset_cache(self) -> bool:
        """Forget every KV the connector could serve, or refuse to (SCH-032).

        When: between two engine steps, never inside another hook, when the engine's user
        resets the prefix cache (vLLM: ``reset_prefix_cache(reset_connector=True)``, a pause
        or sleep that clears the caches), typically after a weight update, so KV computed
        before the call is wrong for the model after it. Requests may still be running or
        waiting for a load, and stores may still be in flight (SCH-033).

        Must return True only when nothing stored before the call (stored, being stored,
        or computed before the call by a request still running and stored later) can be
        matched or loaded by a later ``get_num_new_matched_tokens`` / load, on any rank;
        False when it cannot promise that, and then change nothing. Loads already planned
        before the call may finish (their requests were matched before the reset).
        Must keep every other obligation: no leaked slot, pin or block reference (SCH-030),
        in-flight transfers still reported exactly once (WRK-009).
        Must never: answer True and later match or load KV from before the call (SCH-032);
        block on a transfer (SCH-025).

        Default: False (refuse). A connector that does not implement the hook cannot know
        what it still serves; refusing makes the engine report the reset as failed (SCH-033)
        rather than serve KV computed with the old weights.
        """
        return False

    def shutdown(self) -> None:
        """Release every resource of the scheduler role (SCH-027).

        Must be idempotent and finish within a bounded time.
        Default: does nothing.
        """
        return None
