"""vLLM's scheduler objects as kvspec's read-only views, and outputs both ways.

Every function reads plain attributes off the vLLM objects (``Request``,
``KVCacheBlocks``, ``SchedulerOutput``, ``KVConnectorOutput``) without importing vLLM, so
the translation is the same code whatever process it runs in. The views validate what they
are given (ERR-002), so a vLLM object that breaks kvspec's assumptions fails here, typed,
instead of deep inside a connector.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import chain
from operator import ne
from typing import Any

from kvspec.protocols import (
    AllocatedBlocks,
    CachedRequestView,
    InvalidArgumentError,
    KVCacheEvent,
    KVConnectorOutput,
    NewRequestView,
    RequestStatus,
    RequestView,
    SchedulerOutputView,
    SupportsAggregate,
    thaw_params,
)

__all__ = [
    "RequestCache",
    "allocated_blocks",
    "output_from_vllm",
    "plain",
    "request_status",
]

_STATUS = {
    "WAITING_FOR_REMOTE_KVS": RequestStatus.WAITING_FOR_REMOTE_KV,
    "RUNNING": RequestStatus.RUNNING,
    "PREEMPTED": RequestStatus.PREEMPTED,
    "FINISHED_ABORTED": RequestStatus.ABORTED,
}


def request_status(status: object) -> RequestStatus:
    """vLLM's ``RequestStatus`` (by member name) as kvspec's: ``FINISHED_ABORTED`` is
    ABORTED, every other ``FINISHED_*`` is FINISHED, the waiting variants are WAITING."""
    name = getattr(status, "name", str(status))
    found = _STATUS.get(name)
    if found is not None:
        return found
    return RequestStatus.FINISHED if name.startswith("FINISHED") else RequestStatus.WAITING


_NONE: dict[int, AllocatedBlocks] = {}
_INT = frozenset({int})
_STR = frozenset({str})



def _nonneg_ints(values: Iterable[Any]) -> bool:
    """True when every value is an int (not a bool) >= 0: what the views' validators
    accept, checked at C speed."""
    values = tuple(values)
    return set(map(type, values)) <= _INT and (not values or min(values) >= 0)


def allocated_blocks(block_ids: Iterable[Iterable[int]] | None, groups: int) -> AllocatedBlocks:
    """Per-group block ids (vLLM's ``tuple[list[int], ...]``, or None for "no new
    blocks") as ``AllocatedBlocks``. The empty value is immutable and shared."""
    if block_ids is None or not any(block_ids):
        empty = _NONE.get(groups)
        if empty is None:
            empty = _NONE[groups] = AllocatedBlocks(((),) * groups)
        return empty
    return AllocatedBlocks(block_ids)


class RequestCache:
    """The ``RequestView`` of each live vLLM request, rebuilt only when it changed.

    A view copies the prompt and the block hashes; a scheduler calls several hooks per
    request per step, so the adapter keeps the last view per request id and reuses it while
    the request's status, computed tokens, output length and hash count are unchanged.
    """

    def __init__(self) -> None:
        self._views: dict[str, tuple[tuple[Any, ...], RequestView]] = {}
        self._blocks: dict[str, AllocatedBlocks] = {}  # the last allocation, until built

    def blocks(self, request_id: str, block_ids: Iterable[Iterable[int]] | None,
               groups: int) -> AllocatedBlocks:
        """``allocated_blocks``, remembered for the request until the step's scheduler
        output names the same blocks (``scheduler_output`` then checks them no more)."""
        alloc = allocated_blocks(block_ids, groups)
        self._blocks[request_id] = alloc
        return alloc

    def view(self, request: Any) -> RequestView:
        """The view of a vLLM ``Request`` now.

        vLLM may count in-flight tokens of async scheduling in ``num_computed_tokens``
        before they exist; the view caps it at the request's token count.

        Raises:
            InvalidArgumentError: the request breaks a view's validation (ERR-002), e.g. it
                has no prompt token ids (prompt embeddings are not supported).
        """
        rid = request.request_id
        outputs = request.output_token_ids
        hashes = request.block_hashes
        key = (request.status, request.num_computed_tokens, len(outputs), len(hashes),
               id(request))
        cached = self._views.get(rid)
        if cached is not None and cached[0] == key:
            return cached[1]
        prompt = request.prompt_token_ids
        if prompt is None:
            raise InvalidArgumentError(
                f"request {rid!r} has no prompt token ids (prompt embeddings); kvspec "
                "connectors key KV by token ids", clause="ERR-002",
            )
        lora = request.lora_request
        view = RequestView(
            request_id=rid,
            prompt_token_ids=prompt,
            output_token_ids=outputs,
            block_hashes=hashes,
            cache_salt=request.cache_salt,
            lora_id=None if lora is None else lora.lora_int_id,
            kv_transfer_params=request.kv_transfer_params,
            status=request_status(request.status),
            num_computed_tokens=min(request.num_computed_tokens,
                                    len(prompt) + len(outputs)),
        )
        self._views[rid] = (key, view)
        return view

    def last(self, request_id: str) -> RequestView | None:
        """The last view made of a request, if any."""
        cached = self._views.get(request_id)
        return None if cached is None else cached[1]

    def forget(self, request_id: str) -> None:
        """Drop a finished request's view."""
        self._views.pop(request_id, None)
        self._blocks.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._views)

    def scheduler_output(self, so: Any, step_id: int, groups: int) -> SchedulerOutputView:
        """A vLLM ``SchedulerOutput`` as a ``SchedulerOutputView`` of step
        ``step_id``. New requests use the request's last view (block hashes included),
        updated with the step's computed-token count."""
        new = []
        for data in so.scheduled_new_reqs:
            rid = data.req_id
            last = self.last(rid)
            if last is None:
                last = RequestView(request_id=rid, prompt_token_ids=data.prompt_token_ids or (),
                                   num_computed_tokens=data.num_computed_tokens)
            ids = data.block_ids
            alloc = self._blocks.pop(rid, None)  # checked at allocation: the same blocks?
            if alloc is None or len(alloc.groups) != len(ids) or any(
                    map(ne, alloc.groups, map(tuple, ids))):
                alloc = AllocatedBlocks(ids)
            new.append(NewRequestView(last, alloc, data.num_computed_tokens))
        olds = _cached_views(so.scheduled_cached_reqs, groups)
        return SchedulerOutputView(
            step_id=step_id,
            scheduled_new_reqs=new,
            scheduled_cached_reqs=olds,
            num_scheduled_tokens=so.num_scheduled_tokens,
            finished_req_ids=so.finished_req_ids,
            preempted_req_ids=so.preempted_req_ids or (),
        )


def _cached_views(cached: Any, groups: int) -> list[CachedRequestView]:
    """vLLM's ``CachedRequestData`` as one ``CachedRequestView`` per running request.

    The step's columns are checked at once, at C speed, for what the view's validators
    check per request (ERR-002): ids non-empty ``str``, computed-token counts and new token
    ids ints >= 0; new blocks go through ``allocated_blocks`` (ERR-003). The views are
    then built without running those validators again
    (``CachedRequestView._trusted_many``). Columns that fail the bulk check take the view's own constructor, which raises
    its typed error (or, for a malformed vLLM object, fails as vLLM's object does).
    """
    ids: Sequence[str] = cached.req_ids
    n = len(ids)
    tokens = cached.new_token_ids
    computed = cached.num_computed_tokens
    blocks = cached.new_block_ids
    resumed = cached.resumed_req_ids
    try:
        toks: list[tuple[int, ...]] | None = [tuple(t) for t in tokens[:n]]
    except TypeError:
        toks = None
    if toks is None or not (
            len(computed) >= n and len(blocks) >= n and set(map(type, ids)) <= _STR
            and all(ids) and _nonneg_ints(computed[:n])
            and _nonneg_ints(chain.from_iterable(toks))):
        return [CachedRequestView(  # the checking path: raises the typed error
            request_id=rid, new_blocks=allocated_blocks(blocks[i], groups),
            num_computed_tokens=computed[i], new_token_ids=tokens[i] if i < len(tokens) else (),
            resumed_from_preemption=rid in resumed,
        ) for i, rid in enumerate(ids)]
    toks += [()] * (n - len(toks))  # vLLM sends new tokens only with pipeline parallelism
    none = allocated_blocks(None, groups)
    checked = [none if b is None else allocated_blocks(b, groups) for b in blocks[:n]]
    return CachedRequestView._trusted_many(ids, checked, computed, toks, resumed)


def output_from_vllm(
    out: Any,
    stats: SupportsAggregate | None,
    worker_metadata: SupportsAggregate | None,
    events: tuple[KVCacheEvent, ...],
    failed_recving: Iterable[str] = (),
) -> KVConnectorOutput:
    """vLLM's aggregated ``KVConnectorOutput`` as kvspec's, with the stats, worker
    metadata and events the adapter unwrapped from its own wire objects, and the failed
    loads it carried there on releases whose output has none (``failed_recving``). The
    aggregate has no expected-count override: vLLM's aggregator consumed it (EXE-008)."""
    return KVConnectorOutput(
        finished_sending=out.finished_sending or (),
        finished_recving=out.finished_recving or (),
        failed_recving=getattr(out, "failed_recving", None) or failed_recving,
        invalid_block_ids=out.invalid_block_ids or (),
        stats=stats,
        events=events,
        worker_metadata=worker_metadata,
    )


def plain(params: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Frozen kvspec parameters as the plain dict vLLM puts in a request's output."""
    return None if params is None else dict(thaw_params(params))
