"""One worker rank of the harness engine: KV tensors, the toy forward, and the checks.

:class:`WorkerRuntime` handles plain-data messages (``register``, ``step``, ``shutdown``), so
the same code runs in the engine's process (TP 1) and in worker processes (TP > 1). A step
message carries the encoded connector metadata; the runtime decodes it with the metadata's
own codec, never pickle (ERR-006), and calls the connector's hooks in the order of
docs/spec/state-machines.md, as :func:`kvspec.protocols.plan_forward` says.

The runtime checks what the connector did, at every layer's attention: every token before
the scheduled ones must hold exactly the KV the toy model computes. A wrong byte is
attributed to the clause it breaks (see :meth:`WorkerRuntime._attribute`).
"""

from __future__ import annotations

import base64
import time
from collections.abc import Mapping
from typing import Any

import torch

from kvspec.protocols import (
    ConnectorFactory,
    ConnectorMetadata,
    ForwardContextView,
    ForwardKind,
    GraphMode,
    KVConnectorOutput,
    KVPacking,
    MalformedMetadataError,
    WorkerConnector,
    plan_forward,
)

from ._toymodel import POISON, ToyModel, prefix_hashes
from .config import HarnessConfig

__all__ = ["ALLOC_POISON", "FREED_POISON", "WorkerRuntime"]

FREED_POISON = POISON
"""Written into blocks the engine freed; loading it back proves a read after free."""
ALLOC_POISON = POISON + 2
"""Written into blocks as they are allocated; finding it means nobody wrote the block."""


class WorkerRuntime:
    """A worker rank: owns its KV buffer, runs the toy forward, calls the connector's hooks."""

    def __init__(
        self, factory: ConnectorFactory, config: HarnessConfig, rank: int, tmpdir: str,
        metadata_type: type[ConnectorMetadata] | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.factory = factory
        self.caps = factory.capabilities
        self.layout = config.layout()
        self.buffer = torch.empty(self.layout.span_elems, dtype=self.layout.dtype)
        self.buffer.fill_(ALLOC_POISON)
        view = self.layout.view(self.buffer)
        self.layer_names = tuple(f"model.layers.{i}.attn" for i in range(config.num_layers))
        self.layers = [view[i] for i in range(config.num_layers)]
        hpr = config.heads_per_rank
        self.heads = range(rank * hpr, (rank + 1) * hpr)
        self.model = ToyModel(config.num_layers, config.num_heads, config.head_size, config.head_size)
        self.connector: WorkerConnector = factory.create_worker(config.engine_view(tmpdir), rank)
        self.metadata_type = metadata_type
        self.plan = plan_forward(ForwardKind.REAL, GraphMode.NONE, self.caps.layer_hooks)
        self._closed = False

    # -- messages --------------------------------------------------------------------------

    def register(self) -> None:
        """Register the KV caches with the connector (WRK-001)."""
        self.connector.register_kv_caches(dict(zip(self.layer_names, self.layers)), self.layout)

    def step(self, msg: Mapping[str, Any], meta: ConnectorMetadata) -> tuple[KVConnectorOutput, list[dict[str, str]]]:
        """Run one real step; return the connector output and the violations observed."""
        violations: list[dict[str, str]] = []
        for b in msg["poison_freed"]:
            self._poison(b, FREED_POISON)
        for b in msg["poison_alloc"]:
            self._poison(b, ALLOC_POISON)
        if msg["preempted"]:
            self.connector.handle_preemptions(frozenset(msg["preempted"]))
        reqs = msg["reqs"]
        ctx = ForwardContextView(
            ForwardKind.REAL, msg["step"], sum(r["n"] for r in reqs), self.layer_names
        )
        plan = self.plan
        self.connector.bind_connector_metadata(meta)
        if plan.start_load:
            self.connector.start_load_kv(ctx)
        prepared = [self._prepare(r) for r in reqs]
        # A step that schedules no token runs no layer: only the step-level hooks (WRK-008).
        for layer, name in enumerate(self.layer_names if reqs else ()):
            if plan.layer_hooks.value != "not_called":
                self.connector.wait_for_layer_load(name)
            for r, (hashes, blocks, offs) in zip(reqs, prepared):
                self._check_read(r, hashes, blocks, offs, layer, violations)
                self._write(r, hashes, blocks, offs, layer)
            if plan.layer_hooks.value != "not_called":
                self.connector.save_kv_layer(name, self.layers[layer], ctx)
        if plan.wait_for_save:
            self.connector.wait_for_save()
        self.connector.clear_connector_metadata()
        out = self.connector.build_connector_output(frozenset(msg["finished"]))
        return out, violations

    def idle_output(self, finished: list[str]) -> KVConnectorOutput:
        """Output hooks on a step with no forward on this rank (WRK-008)."""
        return self.connector.build_connector_output(frozenset(finished))

    def shutdown(self) -> None:
        """Shut the connector down twice: it must be idempotent (WRK-015)."""
        if not self._closed:
            self._closed = True
            self.connector.shutdown()
            self.connector.shutdown()

    # -- the toy forward -------------------------------------------------------------------

    def _poison(self, block: int, value: int) -> None:
        for t in self.layers:
            if self.layout.packing is KVPacking.SPLIT:
                t[:, block].fill_(value)
            else:
                t[block].fill_(value)

    def _prepare(self, r: Mapping[str, Any]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        hashes = prefix_hashes(tuple(r["tokens"]), r["seed"])
        end = r["start"] + r["n"]
        pos = torch.arange(end)
        bs = self.config.block_size
        blocks = torch.tensor(r["blocks"], dtype=torch.int64)[pos // bs]
        return hashes[:end], blocks, pos % bs

    def _gather(self, layer: int, blocks: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        t = self.layers[layer]
        if self.layout.packing is KVPacking.SPLIT:
            kv = t[:, blocks, :, offs, :]  # [T, 2, H, D]
            return torch.cat([kv[:, 0], kv[:, 1]], dim=-1)
        return t[blocks, :, offs, :]

    def _expected(self, hashes: list[int], layer: int) -> torch.Tensor:
        return self.model.kv(hashes, layer, self.heads).to(self.layout.dtype)

    def _write(self, r: Mapping[str, Any], hashes: list[int], blocks: torch.Tensor,
               offs: torch.Tensor, layer: int) -> None:
        s, e = r["start"], r["start"] + r["n"]
        vals = self._expected(hashes[s:e], layer)
        t = self.layers[layer]
        if self.layout.packing is KVPacking.SPLIT:
            d = self.config.head_size
            t[0, blocks[s:e], :, offs[s:e], :] = vals[..., :d]
            t[1, blocks[s:e], :, offs[s:e], :] = vals[..., d:]
        else:
            t[blocks[s:e], :, offs[s:e], :] = vals

    def _check_read(self, r: Mapping[str, Any], hashes: list[int], blocks: torch.Tensor,
                    offs: torch.Tensor, layer: int, violations: list[dict[str, str]]) -> None:
        s = r["start"]
        if s == 0 or violations:
            return
        got = self._gather(layer, blocks[:s], offs[:s])
        want = self._expected(hashes[:s], layer)
        if torch.equal(got, want):
            return
        bad = (got != want).flatten(1).any(dim=1).nonzero().flatten()
        p = int(bad[0])
        violations.append(self._attribute(r, hashes, p, layer, got[p], want[p]))

    def _attribute(self, r: Mapping[str, Any], hashes: list[int], pos: int, layer: int,
                   got: torch.Tensor, want: torch.Tensor) -> dict[str, str]:
        bs = self.config.block_size
        block_index, block = pos // bs, r["blocks"][pos // bs]
        ext_a, ext_b = r["ext"]
        where = (f"request {r['id']!r}, token {pos} (block index {block_index}, block id "
                 f"{block}), layer {layer}, rank {self.rank}")
        loaded = ext_a <= pos < ext_b
        if loaded and bool((got == FREED_POISON).all()):
            return {"clause": "SCH-017", "observed": f"{where} was loaded with the poison the "
                    "engine writes into freed blocks: the connector read blocks after "
                    "request_finished returned False", "expected": "no read of a request's "
                    "blocks after request_finished returned False"}
        if loaded and bool((got == ALLOC_POISON).all()):
            clause = "WRK-005" if self.plan.layer_hooks.value == "eager" else "WRK-011"
            return {"clause": clause, "observed": f"{where} was never written although its load "
                    "was reported finished (or its layer's wait returned)", "expected": "a load "
                    "either fills the block before it is used or is reported failed with the "
                    "block in invalid_block_ids"}
        for seed in r.get("other_seeds", ()):
            other = prefix_hashes(tuple(r["tokens"][: pos + 1]), seed)[-1]
            if torch.equal(got, self.model.kv([other], layer, self.heads)[0].to(got.dtype)):
                return {"clause": "SCH-020", "observed": f"{where} holds the KV of the same "
                        "tokens under another cache salt or LoRA id", "expected": "stored KV "
                        "keyed by salt and LoRA identity, never shared across them"}
        if loaded:
            return {"clause": "WRK-013", "observed": f"{where} was loaded with wrong bytes: got "
                    f"{got.flatten()[:6].tolist()}..., expected {want.flatten()[:6].tolist()}...",
                    "expected": "loaded KV byte-identical to the KV saved for the same tokens"}
        return {"clause": "SCH-010", "observed": f"{where} was computed by the engine and later "
                f"overwritten (got {got.flatten()[:6].tolist()}...)", "expected": "a connector "
                "writes only the blocks it was given to load"}


def encode_meta(meta: ConnectorMetadata) -> str:
    """Base64 text of the metadata's own encoding, for plain-data messages."""
    raw = meta.encode()
    if not isinstance(raw, bytes):
        raise MalformedMetadataError(
            f"{type(meta).__name__}.encode() returned {type(raw).__name__}, expected bytes",
            clause="ERR-005",
        )
    return base64.b64encode(raw).decode()


def decode_meta(meta_type: type[ConnectorMetadata], text: str) -> ConnectorMetadata:
    """Decode metadata from :func:`encode_meta`'s text with the connector's own decoder."""
    return meta_type.decode(base64.b64decode(text))


def wait(deadline: float) -> bool:
    """Sleep a little; False once ``deadline`` (a monotonic time) has passed."""
    time.sleep(0.0005)
    return time.monotonic() < deadline
