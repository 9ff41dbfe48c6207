"""``kvspec bench nixl``: the NIXL backend's transfers against raw NIXL and a memory copy.

For each point (stride order, page size) the benchmark measures, in one run:

* **raw NIXL** (``measure_raw_nixl``): one prepared READ of the
  same bytes between two agents with the minimal descriptor list of the point's layout
  family (one per block for block-outermost orders, one per layer and block otherwise),
  and the same-run ``memcpy`` of those bytes. The reading agent runs without NIXL's
  progress thread, as the connector's consumer ranks do (the thread busy-polls a core);
* **the connector end to end**: a consumer ``NixlWorker``
  reading ``blocks`` blocks from a producer worker (two agents in this process, KV caches in
  the point's layout, remote blocks a fixed random permutation), from binding the step's
  metadata and ``start_load_kv`` (the load request) until ``get_finished`` reports the
  request received; every moved block is compared byte for byte once;
* **control-plane work per step** (everything but the bytes moving): the consumer
  scheduler's ``get_num_new_matched_tokens``, ``update_state_after_alloc`` and
  ``build_connector_meta``, the metadata's ``encode`` and ``decode``, and the worker's
  ``bind_connector_metadata``, measured directly; plus the connector's time beyond raw
  NIXL's (end to end minus raw, same descriptors).

Ratios are ``raw time / connector time`` (1.0 = as fast as raw NIXL) and ``memcpy time /
connector time``. Nothing here is asserted by tests; the command prints the targets' lines.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import random
import secrets
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvspec.backends.nixl import (
    PARAMS_KIND,
    NixlLoad,
    NixlMetadata,
    NixlScheduler,
    NixlWorker,
)
from kvspec.protocols import (
    AllocatedBlocks,
    EngineConfigView,
    ForwardContextView,
    ForwardKind,
    KVCacheLayout,
    KVPacking,
    RequestView,
    SchedulerOutputView,
    StrideOrder,
    TransferRole,
)

from ._nixl_raw import measure_raw_nixl
from ._table import markdown_table
from ._timing import written_bytes

__all__ = ["NixlPoint", "NixlResult", "check_nixl_targets", "default_points",
           "format_nixl_table", "machine_info", "measure_nixl_point", "run_nixl_bench"]

_MIB = 1 << 20


@dataclass(frozen=True)
class NixlPoint:
    """One point: ``blocks`` blocks of ``layers`` pages of ``heads x head_size`` (bf16, K
    and V concatenated, 16 tokens per block) in stride order ``order``."""

    order: str
    heads: int
    head_size: int
    layers: int = 32
    blocks: int = 256
    block_size: int = 16

    @property
    def page_bytes(self) -> int:
        """Bytes of one layer's page of one block."""
        return self.block_size * self.heads * 2 * self.head_size * 2

    @property
    def family(self) -> str:
        """``"block-outermost"`` or ``"layer-outermost"`` (LAY-013)."""
        return "block-outermost" if StrideOrder.parse(self.order).block_outermost else (
            "layer-outermost"
        )

    def layout(self) -> KVCacheLayout:
        """The dense CONCAT layout of the point (``blocks`` blocks)."""
        return KVCacheLayout.contiguous(self.order, KVPacking.CONCAT, torch.bfloat16,
                                        self.layers, self.blocks, self.block_size,
                                        self.heads, self.head_size)


@dataclass(frozen=True)
class NixlResult:
    """Medians of one point, in seconds (``control_us`` in microseconds).

    Attributes:
        point: The point.
        nbytes: Bytes per transfer.
        connector_s: Load request to finished-receiving report, through the connector.
        raw_s: Raw NIXL, the minimal descriptor list of the point's family.
        raw_other_s: Raw NIXL with the other family's descriptor list (for the 3x target).
        memcpy_s: The same-run copy of the same bytes.
        descriptors: Descriptors per transfer through the connector.
        control_us: Scheduler, metadata and binding work per step, measured directly.
    """

    point: NixlPoint
    nbytes: int
    connector_s: float
    raw_s: float
    raw_other_s: float
    memcpy_s: float
    descriptors: int
    control_us: float

    @property
    def vs_raw(self) -> float:
        """Raw NIXL's time over the connector's (1.0 = as fast as raw NIXL)."""
        return self.raw_s / self.connector_s

    @property
    def vs_memcpy(self) -> float:
        """The memcpy's time over the connector's."""
        return self.memcpy_s / self.connector_s

    @property
    def beyond_raw_us(self) -> float:
        """The connector's time beyond raw NIXL's, in microseconds."""
        return (self.connector_s - self.raw_s) * 1e6

    def as_dict(self) -> dict[str, Any]:
        """A flat JSON-ready dict."""
        out: dict[str, Any] = asdict(self.point)
        out.update(family=self.point.family, page_bytes=self.point.page_bytes,
                   nbytes=self.nbytes, connector_s=self.connector_s, raw_s=self.raw_s,
                   raw_other_s=self.raw_other_s, memcpy_s=self.memcpy_s,
                   descriptors=self.descriptors, control_us=self.control_us,
                   vs_raw=self.vs_raw, vs_memcpy=self.vs_memcpy,
                   beyond_raw_us=self.beyond_raw_us,
                   connector_gbps=self.nbytes / self.connector_s / 1e9)
        return out


def _config(role: TransferRole, engine: str, point: NixlPoint) -> EngineConfigView:
    return EngineConfigView(engine_id=engine, role=role, num_layers=point.layers,
                            block_size=point.block_size, num_blocks=point.blocks,
                            extra={"nixl_transfer_timeout_s": 60.0})


def _worker(role: TransferRole, engine: str, point: NixlPoint, seed: int
            ) -> tuple[NixlWorker, torch.Tensor]:
    layout = point.layout()
    buf = written_bytes(layout.span_bytes, torch.Generator().manual_seed(seed))
    view = layout.view(buf.view(layout.dtype))
    worker = NixlWorker(_config(role, engine, point), 0)
    worker.register_kv_caches(
        {f"l{i}": view[layout.layer_slots[i]] for i in range(point.layers)}, layout)
    return worker, buf


def _control_us(point: NixlPoint, consumer: NixlWorker, peers: dict[int, Any],
                remote: Sequence[int], repeats: int) -> float:
    """Median scheduler + metadata + binding work for one request of ``point.blocks``."""
    bs = point.block_size
    params = {"kind": PARAMS_KIND, "engine_id": "bench-prefill", "request_id": "p",
              "blocks": list(remote), "peers": {"0": peers[0]}, "secret": secrets.token_hex(16)}
    request = RequestView("d", tuple(range(point.blocks * bs + 1)), kv_transfer_params=params)
    blocks = AllocatedBlocks.single(range(point.blocks + 1))
    times = []
    for i in range(repeats):
        sched = NixlScheduler(_config(TransferRole.CONSUMER, "bench-decode",
                                      dataclasses.replace(point, blocks=point.blocks + 1)))
        # peers travel once per engine (again only when they change), not per step
        sched._peers_sent["bench-prefill"] = {0: request.kv_transfer_params["peers"]["0"]}  # type: ignore[index]
        start = time.perf_counter()
        n, _ = sched.get_num_new_matched_tokens(request, 0)
        sched.update_state_after_alloc(request, blocks, n or 0)
        meta = sched.build_connector_meta(SchedulerOutputView(step_id=i))
        decoded = NixlMetadata.decode(meta.encode())
        consumer.bind_connector_metadata(decoded)
        times.append(time.perf_counter() - start)
        consumer._slot.clear()  # not started: nothing to undo
        sched.shutdown()
    return statistics.median(times) * 1e6


def measure_nixl_point(point: NixlPoint, *, repeats: int = 9, warmup: int = 2,
                       seed: int = 0) -> NixlResult:
    """Measure one point (see the module doc).

    Raises:
        RuntimeError: a transfer failed or moved wrong bytes.
    """
    # Like the connector's consumer ranks, the raw reader runs without NIXL's progress
    # thread (polling drives its reads), so both sides of the comparison have the cores.
    raw = measure_raw_nixl(point.blocks, point.layers, point.page_bytes, repeats=repeats,
                           warmup=warmup, seed=seed, verify=False,
                           consumer_progress_thread=False)
    block_outer = point.family == "block-outermost"
    raw_s, raw_other_s = ((raw.per_block_s, raw.per_layer_block_s) if block_outer
                          else (raw.per_layer_block_s, raw.per_block_s))
    producer, src = _worker(TransferRole.PRODUCER, f"bench-prefill-{os.getpid()}", point, seed)
    consumer, dst = _worker(TransferRole.CONSUMER, f"bench-decode-{os.getpid()}", point,
                            seed + 1)
    layout = point.layout()
    try:
        hs = producer.get_handshake_metadata()
        assert hs is not None
        peers = {0: json.loads(hs.encode())["payload"]["peer"]}
        local = list(range(point.blocks))
        remote = random.Random(seed).sample(range(point.blocks), point.blocks)
        ctx = ForwardContextView(ForwardKind.REAL, 0, 1, tuple(f"l{i}" for i in range(point.layers)))
        times: list[float] = []
        descriptors = 0
        first = True
        secret = secrets.token_hex(16)  # a well-formed hand-off secret for the notifications
        for rep in range(warmup + repeats):
            rid = f"d{rep}"
            meta = NixlMetadata(loads=(NixlLoad(rid, "prefill", tuple(local), tuple(remote),
                                                f"p{rep}", secret),),
                                peers={"prefill": peers} if first else {})
            first = False
            start = time.perf_counter()
            consumer.bind_connector_metadata(meta)
            consumer.start_load_kv(ctx)
            consumer.clear_connector_metadata()
            while True:
                _, recving = consumer.get_finished(frozenset())
                if rid in recving:
                    break
            elapsed = time.perf_counter() - start
            if consumer.get_failed_recving():
                raise RuntimeError(f"bench nixl: the READ of {rid} failed")
            if rep == 0:
                for b in (0, point.blocks // 2, point.blocks - 1):
                    want = b"".join(src[o:o + n].numpy().tobytes()
                                    for o, n in layout.block_regions([remote[b]])[0])
                    got = b"".join(dst[o:o + n].numpy().tobytes()
                                   for o, n in layout.block_regions([local[b]])[0])
                    if got != want:
                        raise RuntimeError(f"bench nixl: block {b} moved wrong bytes")
                assert consumer.endpoint is not None
                descriptors = point.blocks * consumer.endpoint.descriptors_per_block()
            if rep >= warmup:
                times.append(elapsed)
            producer.get_finished(frozenset())  # drain the producer's notifications
        control = _control_us(point, consumer, peers, remote, repeats)
    finally:
        consumer.shutdown()
        producer.shutdown()
    return NixlResult(point, raw.nbytes, statistics.median(times), raw_s, raw_other_s,
                      raw.memcpy_s, descriptors, control)


def run_nixl_bench(points: Sequence[NixlPoint], *, repeats: int = 9, warmup: int = 2,
                   progress: Callable[[int, int, NixlPoint], None] | None = None
                   ) -> list[NixlResult]:
    """Measure every point; call ``progress(i, n, point)`` before each."""
    out = []
    for i, point in enumerate(points):
        if progress is not None:
            progress(i, len(points), point)
        out.append(measure_nixl_point(point, repeats=repeats, warmup=warmup))
    return out


def default_points(blocks: int = 256, layers: int = 32) -> list[NixlPoint]:
    """Block- and layer-outermost, 4 KiB (1x64) and 64 KiB (8x128) pages."""
    return [NixlPoint(o, h, d, layers, blocks) for o in ("BLNHC", "LBNHC")
            for h, d in ((1, 64), (8, 128))]


def check_nixl_targets(results: Sequence[NixlResult]) -> list[str]:
    """The issue's targets, one line each: connector >= 0.9 of raw NIXL; descriptors ==
    blocks for block-outermost; block-outermost >= 3x layer-outermost at 4 KiB pages;
    control-plane work <= 200 us per step."""
    lines = []
    worst = min(r.vs_raw for r in results)
    lines.append(f"target connector / raw NIXL >= 0.9: worst {worst:.2f}  "
                 f"{'PASS' if worst >= 0.9 else 'MISS'}")
    for r in results:
        if r.point.family == "block-outermost":
            ok = r.descriptors == r.point.blocks
            lines.append(f"target descriptors per transfer == blocks ({r.point.order}, "
                         f"{r.point.page_bytes // 1024} KiB): {r.descriptors}  "
                         f"{'PASS' if ok else 'MISS'}")
    small = [r for r in results if r.point.page_bytes == 4096]
    bo = [r for r in small if r.point.family == "block-outermost"]
    lo = [r for r in small if r.point.family == "layer-outermost"]
    if bo and lo:
        speedup = lo[0].connector_s / bo[0].connector_s
        lines.append(f"target block-outermost >= 3x layer-outermost at 4 KiB: {speedup:.2f}x  "
                     f"{'PASS' if speedup >= 3 else 'MISS'}")
    control = max(r.control_us for r in results)
    lines.append(f"target control-plane work per step <= 200 us: worst {control:.1f} us  "
                 f"{'PASS' if control <= 200 else 'MISS'}")
    return lines


def format_nixl_table(results: Sequence[NixlResult]) -> str:
    """A Markdown table, one row per point."""
    head = ("layout", "family", "page", "blocks", "layers", "MiB", "descriptors",
            "connector ms", "raw NIXL ms", "other-family raw ms", "memcpy ms", "vs raw",
            "vs memcpy", "beyond raw us", "control us")
    rows = []
    for r in results:
        rows.append((
            r.point.order, r.point.family, f"{r.point.page_bytes // 1024} KiB",
            str(r.point.blocks), str(r.point.layers), f"{r.nbytes / _MIB:.0f}",
            str(r.descriptors), f"{r.connector_s * 1e3:.2f}", f"{r.raw_s * 1e3:.2f}",
            f"{r.raw_other_s * 1e3:.2f}", f"{r.memcpy_s * 1e3:.2f}", f"{r.vs_raw:.2f}",
            f"{r.vs_memcpy:.2f}", f"{r.beyond_raw_us:.0f}", f"{r.control_us:.0f}",
        ))
    return markdown_table(head, rows)


def machine_info() -> dict[str, Any]:
    """Where the numbers come from."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version()}
