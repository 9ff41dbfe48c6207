"""The heterogeneous-TP section of ``kvspec bench nixl``: one model's KV moved from a
prefill engine to a decode engine at TP 1 -> 1, 2 -> 1 and 1 -> 2, side by side in one run.

Each configuration has its own NIXL agents (one per rank, all in this process) over KV
caches of the same model in the same stride order; a rank holds ``heads // tp`` heads. A
repeat loads one request of ``blocks`` blocks on every decode rank (binding the step's
metadata and ``start_load_kv`` on each rank in turn, as the ranks' processes would do at
once) and ends when every decode rank reported it received. The configurations take turns
within each repeat, so the ratios ``time at TP 1 -> 1 / time`` compare the same moment of
the machine. The first repeat's bytes are checked head by head on a few blocks.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import secrets
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvspec.backends.nixl import NixlLoad, NixlMetadata, NixlWorker
from kvspec.protocols import (
    EngineConfigView,
    ForwardContextView,
    ForwardKind,
    KVCacheLayout,
    KVPacking,
    StrideOrder,
    TransferRole,
)

from ._timing import written_bytes
from ._table import markdown_table

__all__ = ["TP_PAIRS", "TpPoint", "TpResult", "default_tp_points", "format_tp_table",
           "measure_tp_point"]

TP_PAIRS: tuple[tuple[int, int], ...] = ((1, 1), (2, 1), (1, 2))
"""(prefill TP, decode TP) configurations measured; the first is the reference."""

_MIB = 1 << 20
_ids = itertools.count()


@dataclass(frozen=True)
class TpPoint:
    """One model: ``layers`` pages of ``heads x head_size`` per block (bf16, K and V
    concatenated) in stride order ``order``; ``blocks`` blocks per request."""

    order: str
    heads: int = 8
    head_size: int = 128
    layers: int = 8
    blocks: int = 128
    block_size: int = 16

    def layout(self, tp: int) -> KVCacheLayout:
        """The KV layout of one rank of a TP-``tp`` engine."""
        return KVCacheLayout.contiguous(
            self.order, KVPacking.CONCAT, torch.bfloat16, self.layers, self.blocks,
            self.block_size, self.heads // tp, self.head_size,
        )

    @property
    def model_page_bytes(self) -> int:
        """Bytes of one layer's page of one block, all heads."""
        return self.heads * self.block_size * 2 * self.head_size * 2


@dataclass(frozen=True)
class TpResult:
    """One configuration of one point.

    Attributes:
        point: The model.
        prefill_tp, decode_tp: The engines' TP sizes.
        nbytes: KV bytes one request moves (all heads, all layers).
        seconds: Median time from the first rank's load request to the last rank's report.
        reads: NIXL READs per request, over all decode ranks.
        descriptors: Descriptors per request, over all READs, before NIXL merges runs.
        reference_s: The median at TP 1 -> 1 in the same run.
    """

    point: TpPoint
    prefill_tp: int
    decode_tp: int
    nbytes: int
    seconds: float
    reads: int
    descriptors: int
    reference_s: float

    @property
    def vs_same_tp(self) -> float:
        """Time at TP 1 -> 1 / time here (1.0: heterogeneous TP costs nothing)."""
        return self.reference_s / self.seconds

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, the ratio included."""
        return {**asdict(self), "vs_same_tp": self.vs_same_tp}


def _ranks(role: TransferRole, point: TpPoint, tp: int, seed: int
           ) -> tuple[list[NixlWorker], list[torch.Tensor]]:
    config = EngineConfigView(
        engine_id=f"bench-tp-{role.name.lower()}-{os.getpid()}-{next(_ids)}", role=role,
        num_layers=point.layers, block_size=point.block_size, num_blocks=point.blocks,
        tp_size=tp, extra={"nixl_transfer_timeout_s": 60.0, "nixl_free_timeout_s": 600.0},
    )
    layout = point.layout(tp)
    workers, buffers = [], []
    for rank in range(tp):
        buf = written_bytes(layout.span_bytes, torch.Generator().manual_seed(seed + rank))
        view = layout.view(buf.view(layout.dtype))
        worker = NixlWorker(config, rank)
        worker.register_kv_caches({f"l{i}": view[i] for i in range(point.layers)}, layout)
        workers.append(worker)
        buffers.append(buf)
    return workers, buffers


def _model_block(layout: KVCacheLayout, buffers: Sequence[torch.Tensor], block: int
                 ) -> torch.Tensor:
    """``(layers, heads, tokens, channels)`` bits of one block, every rank's heads."""
    return torch.cat([layout.view(b.view(layout.dtype)).view(torch.int16)[:, block]
                      for b in buffers], dim=1)


@dataclass
class _Config:
    prefill_tp: int
    decode_tp: int
    producers: list[NixlWorker]
    consumers: list[NixlWorker]
    src: list[torch.Tensor]
    dst: list[torch.Tensor]
    peers: dict[int, Any]
    times: list[float]
    descriptors: int = 0
    reads: int = 0

    def shutdown(self) -> None:
        for worker in (*self.consumers, *self.producers):
            worker.shutdown()


def measure_tp_point(point: TpPoint, *, repeats: int = 9, warmup: int = 2, seed: int = 0,
                     pairs: Sequence[tuple[int, int]] = TP_PAIRS) -> list[TpResult]:
    """Measure every configuration of ``pairs`` for ``point`` (see the module doc); the
    first pair is the reference of ``TpResult.vs_same_tp``.

    Raises:
        RuntimeError: a READ failed or moved wrong bytes.
    """
    configs: list[_Config] = []
    try:
        for i, (p_tp, d_tp) in enumerate(pairs):
            producers, src = _ranks(TransferRole.PRODUCER, point, p_tp, seed + 10 * i)
            consumers, dst = _ranks(TransferRole.CONSUMER, point, d_tp, seed + 10 * i + 5)
            peers = {}
            for rank, w in enumerate(producers):
                hs = w.get_handshake_metadata()
                assert hs is not None
                peers[rank] = json.loads(hs.encode())["payload"]["peer"]
            configs.append(_Config(p_tp, d_tp, producers, consumers, src, dst, peers, []))
        local = list(range(point.blocks))
        remote = random.Random(seed).sample(range(point.blocks), point.blocks)
        ctx = ForwardContextView(ForwardKind.REAL, 0, 1,
                                 tuple(f"l{i}" for i in range(point.layers)))
        secret = secrets.token_hex(16)  # a well-formed hand-off secret for the notifications
        for rep in range(warmup + repeats):
            for c in configs:
                rid = f"d{rep}"
                meta = NixlMetadata(
                    loads=(NixlLoad(rid, "prefill", tuple(local), tuple(remote), f"p{rep}",
                                    secret),),
                    peers={"prefill": c.peers} if rep == 0 else {},
                )
                pending = set(range(len(c.consumers)))
                start = time.perf_counter()
                for w in c.consumers:
                    w.bind_connector_metadata(meta)
                    w.start_load_kv(ctx)
                    w.clear_connector_metadata()
                while pending:
                    for rank in list(pending):
                        if rid in c.consumers[rank].get_finished(frozenset())[1]:
                            pending.discard(rank)
                            if c.consumers[rank].get_failed_recving():
                                raise RuntimeError(f"bench nixl tp: the READ of {rid} failed")
                elapsed = time.perf_counter() - start
                if rep >= warmup:
                    c.times.append(elapsed)
                if rep == 0:
                    _verify(point, c, local, remote)
                for w in c.producers:
                    w.get_finished(frozenset())  # drain notifications
    finally:
        for c in configs:
            c.shutdown()
    reference = statistics.median(configs[0].times)
    return [TpResult(point, c.prefill_tp, c.decode_tp, point.model_page_bytes * point.layers
                     * point.blocks, statistics.median(c.times), c.reads, c.descriptors,
                     reference) for c in configs]


def _verify(point: TpPoint, c: _Config, local: list[int], remote: list[int]) -> None:
    p_layout, d_layout = point.layout(c.prefill_tp), point.layout(c.decode_tp)
    for b in (0, point.blocks // 2, point.blocks - 1):
        want = _model_block(p_layout, c.src, remote[b])
        got = _model_block(d_layout, c.dst, local[b])
        if not torch.equal(want, got):
            raise RuntimeError(f"bench nixl tp: block {b} moved wrong bytes at TP "
                               f"{c.prefill_tp} -> {c.decode_tp}")
    for w in c.consumers:
        endpoint = w.endpoint
        assert endpoint is not None
        for peer in endpoint.peers:
            c.reads += 1
            c.descriptors += point.blocks * endpoint.descriptors_per_block(peer)


def default_tp_points(blocks: int = 128, layers: int = 8) -> list[TpPoint]:
    """Head-split (HND) and token-major (NHD) pages of 8 heads x 128 (64 KiB per layer)."""
    return [TpPoint(order, 8, 128, layers, blocks)
            for order in (StrideOrder.LBHNC.name, StrideOrder.LBNHC.name)]


def format_tp_table(results: Sequence[TpResult]) -> str:
    """A Markdown table, one row per configuration."""
    head = ("layout", "TP", "MiB", "READs", "descriptors", "ms", "vs TP 1 -> 1")
    rows = []
    for r in results:
        rows.append((r.point.order, f"{r.prefill_tp} -> {r.decode_tp}",
                     f"{r.nbytes / _MIB:.0f}", str(r.reads), str(r.descriptors),
                     f"{r.seconds * 1e3:.2f}", f"{r.vs_same_tp:.2f}"))
    return markdown_table(head, rows)
