# --8<-- [start:storage]
"""A KV connector that keeps full prompt blocks in files and loads them on a prefix hit."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import attrs
import msgspec
import torch

from kvspec.protocols import (
    AllocatedBlocks,
    Capabilities,
    ConnectorFactory,
    ConnectorMetadata,
    EngineConfigView,
    FailureReporting,
    ForwardContextView,
    InvalidArgumentError,
    KVCacheLayout,
    KVConnectorOutput,
    KVPacking,
    MalformedMetadataError,
    MetadataSlot,
    RequestView,
    SchedulerConnector,
    SchedulerOutputView,
    WorkerConnector,
)

__all__ = ["TinyCache", "TinyCacheMetadata", "TinyCacheScheduler", "TinyCacheWorker"]


def storage_dir(config: EngineConfigView) -> Path:
    """The directory every process of the engine shares."""
    root = config.extra.get("tinycache.dir") or config.extra.get("kvspec.tmpdir")
    if not root:
        raise InvalidArgumentError("tinycache needs config.extra['tinycache.dir']")
    path = Path(root) / "tinycache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def block_file(root: Path, key: str, rank: int) -> Path:
    """Where rank ``rank`` keeps its share of the block ``key``."""
    return root / f"{key}.rank{rank}"
# --8<-- [end:storage]

# --8<-- [start:metadata]
BlockId = Annotated[int, msgspec.Meta(ge=0)]
Key = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]+$")]  # a block hash in hex: a file name
Pairs = tuple[tuple[BlockId, Key], ...]  # (block id, block key) pairs


class TinyCacheMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True,
                        tag_field="kind", tag="tinycache"):
    """What the workers do in one step: blocks to load before it, blocks to save after it."""

    loads: Pairs = ()
    saves: Pairs = ()

    def encode(self) -> bytes:
        """Plain JSON, never a pickle (ERR-006)."""
        return msgspec.json.encode(self)  # {"kind": "tinycache", "loads": [...], "saves": [...]}

    @classmethod
    def decode(cls, data: bytes) -> TinyCacheMetadata:
        """Rebuild what ``encode`` wrote; MalformedMetadataError for anything else (ERR-005)."""
        try:
            return msgspec.json.decode(data, type=cls)  # checks every type and bound
        except (msgspec.MsgspecError, ValueError) as e:
            raise MalformedMetadataError(f"tinycache metadata: {e}", clause="ERR-005") from None
# --8<-- [end:metadata]

# --8<-- [start:scheduler]
@attrs.define
class _Tracked:
    """What the scheduler role remembers of a running request."""

    keys: tuple[str, ...]          # one key per full block of the request's tokens
    block_ids: list[int]           # the request's blocks, in token order
    computed: int                  # tokens whose KV is in the blocks after the last step


class TinyCacheScheduler(SchedulerConnector):
    """Matches stored prefix blocks, plans their loads, and plans saves of new full blocks."""

    def __init__(self, config: EngineConfigView) -> None:
        self.dir = storage_dir(config)
        self.block_size = config.block_size
        self.world_size = config.world_size
        self.stored: set[str] = set()     # keys every rank has written
        self.saving: set[str] = set()     # keys whose save is planned, not yet seen on disk
        self.asked: dict[str, int] = {}   # request id -> num_computed_tokens of the last ask
        self.loads: list[tuple[int, str]] = []
        self.running: dict[str, _Tracked] = {}

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Stored blocks after the computed ones, one prompt token left to compute."""
        bs = self.block_size
        if num_computed_tokens % bs:
            return 0, False
        keys = [h.hex() for h in request.block_hashes]
        end = num_computed_tokens // bs          # first block the engine does not have
        while end < len(keys) and keys[end] in self.stored:
            end += 1
        while end * bs > request.num_prompt_tokens - 1:   # leave a token to compute (SCH-005)
            end -= 1
        self.asked[request.request_id] = num_computed_tokens
        return max(0, end * bs - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: RequestView, blocks: AllocatedBlocks, num_external_tokens: int
    ) -> None:
        """Plan loads into the blocks that cover the external tokens."""
        if num_external_tokens == 0:
            return
        start = self.asked.get(request.request_id, request.num_computed_tokens)
        first = start // self.block_size
        last = (start + num_external_tokens) // self.block_size
        ids = blocks.block_ids(0)
        keys = [h.hex() for h in request.block_hashes]
        self.loads += [(ids[i], keys[i]) for i in range(first, last)]

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ConnectorMetadata:
        """Hand out the planned loads; plan saves of the blocks this step fills."""
        for key in list(self.saving):      # saves planned in earlier steps, now on disk
            if self.on_disk(key):
                self.saving.discard(key)
                self.stored.add(key)
        for new in scheduler_output.scheduled_new_reqs:
            self.running[new.request_id] = _Tracked(
                keys=tuple(h.hex() for h in new.request.block_hashes),
                block_ids=list(new.blocks.block_ids(0)),
                computed=new.num_computed_tokens,
            )
        for cached in scheduler_output.scheduled_cached_reqs:
            self.running[cached.request_id].block_ids += cached.new_blocks.block_ids(0)
        saves = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            req = self.running[rid]
            req.computed += n
            full = min(req.computed // self.block_size, len(req.keys), len(req.block_ids))
            for i in range(full):
                key = req.keys[i]
                if key not in self.stored and key not in self.saving:
                    saves.append((req.block_ids[i], key))
                    self.saving.add(key)
        meta = TinyCacheMetadata(loads=tuple(self.loads), saves=tuple(saves))
        self.loads = []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """React to failed loads only."""
        if output.invalid_block_ids:   # a load failed: forget blocks whose files are gone
            self.stored = {key for key in self.stored if self.on_disk(key)}

    def on_disk(self, key: str) -> bool:
        """True when every rank wrote the block."""
        return all(block_file(self.dir, key, r).exists() for r in range(self.world_size))

    def request_finished(
        self, request: RequestView, block_ids: tuple[int, ...]
    ) -> tuple[bool, Mapping[str, Any] | None]:
        """Forget the request; its blocks are freed at once."""
        self.running.pop(request.request_id, None)
        self.asked.pop(request.request_id, None)
        return False, None
# --8<-- [end:scheduler]

# --8<-- [start:worker]
class TinyCacheWorker(WorkerConnector):
    """Copies blocks between the KV caches and files: loads before the forward, saves after."""

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        self.dir = storage_dir(config)
        self.rank = rank
        self.slot = MetadataSlot(TinyCacheMetadata)
        self.storages: list[torch.Tensor] = []   # one tensor per distinct layer storage
        self.block_dim = 0
        self.failed: set[int] = set()

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout
    ) -> None:
        """Keep one tensor per distinct layer storage."""
        tensors = list(kv_caches.values())
        layout.check_layer_tensors(tensors)
        first_of_slot: dict[int, torch.Tensor] = {}
        for layer, slot in enumerate(layout.layer_slots):   # shared layers move once
            first_of_slot.setdefault(slot, tensors[layer])
        self.storages = list(first_of_slot.values())
        self.block_dim = 1 if layout.packing is KVPacking.SPLIT else 0

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        """Bind the step's metadata."""
        self.slot.bind(metadata)  # type: ignore[arg-type]  # the slot checks the type

    def clear_connector_metadata(self) -> None:
        """Forget the step's metadata."""
        self.slot.clear()

    def block(self, block_id: int) -> list[torch.Tensor]:
        """Views of one block in every layer storage (no copy)."""
        return [t.select(self.block_dim, block_id) for t in self.storages]

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        """Copy the step's loads in, before the first layer runs."""
        for block_id, key in self.slot.get("start_load_kv").loads:
            path = block_file(self.dir, key, self.rank)
            pages = self.block(block_id)
            try:
                data = bytearray(path.read_bytes())
                flat = torch.frombuffer(data, dtype=torch.uint8) if data else None
                if flat is None or flat.numel() != sum(p.numel() * p.element_size() for p in pages):
                    raise ValueError(f"{path} has {len(data)} bytes, not one block")
                stacked = flat.view(pages[0].dtype).view(len(pages), *pages[0].shape)
                for page, saved in zip(pages, stacked):
                    page.copy_(saved)
            except (OSError, ValueError):
                self.failed.add(block_id)          # reported once, then the engine recomputes
                path.unlink(missing_ok=True)

    def wait_for_save(self) -> None:
        """Write the step's saves, after the last layer wrote its KV."""
        for block_id, key in self.slot.get("wait_for_save").saves:
            path = block_file(self.dir, key, self.rank)
            data = bytes(torch.stack(self.block(block_id)).view(torch.uint8).untyped_storage())
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)                  # readers never see half a block

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        """The blocks whose load failed since the last call."""
        failed, self.failed = frozenset(self.failed), set()
        return failed
# --8<-- [end:worker]

# --8<-- [start:factory]
class TinyCache(ConnectorFactory):
    """The connector: what it declares, and how it builds its roles."""

    @property
    def name(self) -> str:
        """The name reports and errors use."""
        return "tinycache"

    @property
    def capabilities(self) -> Capabilities:
        """Every default, except that failed loads are reported as invalid blocks."""
        return Capabilities(failure_reporting=FailureReporting.INVALID_BLOCKS)

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        """Build the scheduler role."""
        return TinyCacheScheduler(config)

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        """Build the worker role of one rank."""
        return TinyCacheWorker(config, rank)
# --8<-- [end:factory]
