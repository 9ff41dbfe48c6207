"""StateCache: a file-backed connector for state-space hybrids (STG), on TinyCache's pattern.

It stores full attention blocks by their prefix hash, as TinyCache does, and beside them the
state of every state layer after exactly ``k * block_size`` tokens, read in ``wait_for_save``
of the step whose last computed token is that boundary (STG-006: under RUNNING caching the next
forward overwrites it in place). A match of N tokens is offered only at a boundary whose state
it holds (STG-003), and loads the attention blocks and the state, into index
``state_index(N)`` of the state group (STG-002), in ``start_load_kv`` (STG-005, STG-009).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated

import msgspec
import torch

from kvspec.protocols import (
    AllocatedBlocks,
    Capabilities,
    ConnectorMetadata,
    EngineConfigView,
    FailureReporting,
    ForwardContextView,
    GroupKind,
    MalformedMetadataError,
    RequestView,
    SchedulerConnector,
    SchedulerOutputView,
    StateLayout,
    WorkerConnector,
)

from .tiny import TinyCache, TinyCacheScheduler, TinyCacheWorker, block_file

__all__ = ["StateCache", "StateCacheMetadata", "StateCacheScheduler", "StateCacheWorker"]

BlockId = Annotated[int, msgspec.Meta(ge=0)]
Key = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]+$")]
Pairs = tuple[tuple[BlockId, Key], ...]


class StateCacheMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True,
                         tag_field="kind", tag="statecache"):
    """Attention blocks and states to load before the step and to save after it."""

    loads: Pairs = ()
    saves: Pairs = ()
    state_loads: Pairs = ()
    state_saves: Pairs = ()

    def encode(self) -> bytes:
        """Plain JSON (ERR-006)."""
        return msgspec.json.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> StateCacheMetadata:
        """MalformedMetadataError for anything ``encode`` did not write (ERR-005)."""
        try:
            return msgspec.json.decode(data, type=cls)
        except (msgspec.MsgspecError, ValueError) as e:
            raise MalformedMetadataError(f"statecache metadata: {e}", clause="ERR-005") from None


def state_key(key: str) -> str:
    """The file key of the state after the block ``key``'s last token."""
    return key + "5"


class StateCacheScheduler(TinyCacheScheduler):
    """TinyCache's matching, cut back to a boundary whose state is stored (STG-003)."""

    def __init__(self, config: EngineConfigView) -> None:
        super().__init__(config)
        self.state_group = config.state_group_ids[0] if config.state_group_ids else None
        self.state_loads: list[tuple[int, str]] = []
        self.state_blocks: dict[str, int] = {}

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """TinyCache's match, cut back to the last block boundary whose state is on disk:
        the state after exactly the matched tokens must exist (STG-003)."""
        n, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if not n or self.state_group is None:
            return n, is_async
        keys = [h.hex() for h in request.block_hashes]
        end = (num_computed_tokens + n) // self.block_size
        while end > num_computed_tokens // self.block_size and not self.on_disk(
                state_key(keys[end - 1])):
            end -= 1
        return max(0, end * self.block_size - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: RequestView, blocks: AllocatedBlocks, num_external_tokens: int
    ) -> None:
        """TinyCache's loads, plus the state after the matched tokens into the request's
        state block (RUNNING caching: the group's only block, index 0, STG-002)."""
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if self.state_group is not None and len(blocks.groups) > self.state_group:
            ids = blocks.block_ids(self.state_group)
            if ids:
                self.state_blocks[request.request_id] = ids[0]  # RUNNING: index 0 (STG-002)
        if num_external_tokens and self.state_group is not None:
            start = self.asked.get(request.request_id, request.num_computed_tokens)
            end = (start + num_external_tokens) // self.block_size
            keys = [h.hex() for h in request.block_hashes]
            self.state_loads.append((self.state_blocks[request.request_id],
                                     state_key(keys[end - 1])))

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ConnectorMetadata:
        """TinyCache's loads and saves, the state loads, and a state save for each request
        whose computed tokens end on a block boundary this step (STG-006)."""
        for new in scheduler_output.scheduled_new_reqs:
            if self.state_group is not None:
                self.state_blocks[new.request_id] = new.blocks.block_ids(self.state_group)[0]
        before = {rid: self.running[rid].computed for rid in self.running}
        tiny = super().build_connector_meta(scheduler_output)
        state_saves = []
        for rid in scheduler_output.num_scheduled_tokens:
            req = self.running[rid]
            k = req.computed // self.block_size
            if (self.state_group is not None and req.computed % self.block_size == 0
                    and 0 < k <= len(req.keys) and before.get(rid, -1) != req.computed):
                key = state_key(req.keys[k - 1])
                if key not in self.stored and key not in self.saving:
                    state_saves.append((self.state_blocks[rid], key))
                    self.saving.add(key)
        loads, self.state_loads = tuple(self.state_loads), []
        assert hasattr(tiny, "loads") and hasattr(tiny, "saves")
        return StateCacheMetadata(loads=tiny.loads, saves=tiny.saves, state_loads=loads,
                                  state_saves=tuple(state_saves))


class StateCacheWorker(TinyCacheWorker):
    """TinyCache's worker, plus the state layers' pages (step-level hooks only, STG-005)."""

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        super().__init__(config, rank)
        from kvspec.protocols import MetadataSlot

        self.slot = MetadataSlot(StateCacheMetadata)  # type: ignore[arg-type]
        self.state: list[tuple[torch.Tensor, StateLayout]] = []

    def register_state_caches(
        self, state_caches: Mapping[str, torch.Tensor], layouts: Mapping[int, StateLayout]
    ) -> None:
        """Keep every state layer's tensor with its group's layout (STG-001)."""
        (layout,) = layouts.values()
        for tensor in state_caches.values():
            layout.check_tensor(tensor)
            self.state.append((tensor, layout))

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        """Attention blocks, then each state into its block (after the zeroing, STG-009)."""
        super().start_load_kv(forward_context)
        meta = self.slot.get("start_load_kv")
        for block_id, key in meta.state_loads:  # type: ignore[attr-defined]
            path = block_file(self.dir, key, self.rank)
            try:
                data = path.read_bytes()
                pages = [layout.block_bytes(t, block_id) for t, layout in self.state]
                if len(data) != sum(p.numel() for p in pages):
                    raise ValueError(f"{path} has {len(data)} bytes, not one state")
                flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                at = 0
                for page in pages:
                    page.copy_(flat[at:at + page.numel()])
                    at += page.numel()
            except (OSError, ValueError):
                self.failed.add(block_id)
                path.unlink(missing_ok=True)

    def wait_for_save(self) -> None:
        """Attention blocks, then the states this step ended on (read in time, STG-006)."""
        super().wait_for_save()
        for block_id, key in self.slot.get("wait_for_save").state_saves:  # type: ignore[attr-defined]
            path = block_file(self.dir, key, self.rank)
            data = b"".join(bytes(layout.block_bytes(t, block_id).cpu().numpy().tobytes())
                            for t, layout in self.state)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)


class StateCache(TinyCache):
    """TinyCache for state-space hybrids: declares full-attention and state groups."""

    @property
    def name(self) -> str:
        """The name reports use."""
        return "statecache"

    @property
    def capabilities(self) -> Capabilities:
        """Full attention and state groups (KVG-002), failed loads as invalid blocks."""
        return Capabilities(failure_reporting=FailureReporting.INVALID_BLOCKS,
                            group_kinds=frozenset({GroupKind.FULL, GroupKind.STATE}),
                            kv_cache_groups=2)

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        """Build the scheduler role."""
        return StateCacheScheduler(config)

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        """Build the worker role of one rank."""
        return StateCacheWorker(config, rank)
