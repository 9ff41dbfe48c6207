"""``kvspec bench offload``: throughput of the offload backend's data path.

For each point of a grid (layout order, tokens per block, layers, heads x head size, dtype,
blocks moved) the benchmark allocates KV caches of ``2 * blocks`` blocks in the layout
``KVCacheLayout.contiguous`` gives, fills them with random bytes, builds the backend's
own ``HostPool`` of ``blocks`` slots over them and times
``HostPool.store`` (KV caches to host pool) and ``HostPool.load`` (back) of half of
the blocks, chosen by a fixed random permutation. Each time is compared with the same run's
ceiling: copying the same bytes between two contiguous, pre-written tensors, timed in the
same loop (ceiling, store, load, repeated), so that whatever else the machine does hits all
three alike. A ratio of 1.0 means the backend moves
blocks as fast as a plain ``memcpy`` of the same size.

Separately, ``measure_step_overhead`` times the per-step work outside the copies for a
number of blocks: the scheduler role planning a store or load and building the metadata,
encoding and decoding it, the worker's planning of the job, the scheduler's handling of the
finished job and the events it then hands out (vLLM takes them every step).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvspec.backends.offload import HostPool, OffloadMetadata, OffloadScheduler, OffloadWorker
from kvspec.protocols import (
    AllocatedBlocks,
    EngineConfigView,
    KVConnectorOutput,
    KVCacheLayout,
    KVPacking,
    RequestView,
    SchedulerOutputView,
    StrideOrder,
    TransferRole,
)

from ._table import markdown_table
from ._timing import written_bytes

__all__ = [
    "DTYPES",
    "GPU_TARGET",
    "JUDGED_MIB",
    "JUDGED_REPEATS",
    "OVERHEAD_REPEATS",
    "OffloadGrid",
    "OffloadPoint",
    "OffloadResult",
    "StepOverhead",
    "TARGET_BLOCKS",
    "TargetCheck",
    "check_targets",
    "format_table",
    "machine_info",
    "measure_point",
    "measure_step_overhead",
    "run_offload_bench",
]

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
"""The dtype names the benchmark accepts."""

_MIB = 1 << 20

JUDGED_MIB = 16
"""A copy target is judged only where every point of its family moves at least this many
MiB per copy: below that, per-call costs and caches decide the ratio, not the copy."""

JUDGED_REPEATS = 5
"""A target is judged only on medians of at least this many timed runs."""

GPU_TARGET = 0.85
"""With the KV caches on a GPU: store and load throughput over a pinned-memory copy of the
same bytes, device to host and host to device (every family)."""

TARGET_BLOCKS = 256
"""The per-step work targets are for jobs of this many blocks; a smaller job is not judged."""


@dataclass(frozen=True)
class OffloadPoint:
    """One grid point: the KV caches have ``2 * blocks`` blocks, ``blocks`` of them move.

    Attributes:
        order: Stride order name, e.g. ``"BLNHC"``.
        block_size: Tokens per block.
        layers: Attention layers.
        heads: KV heads.
        head_size: Channels per head of K (and of V).
        dtype: A key of ``DTYPES``.
        blocks: Blocks stored and loaded per measurement.
    """

    order: str
    block_size: int
    layers: int
    heads: int
    head_size: int
    dtype: str
    blocks: int

    @property
    def family(self) -> str:
        """``"block-outermost"`` (orders starting with B, LAY-013) or ``"layer-outermost"``."""
        return "block-outermost" if StrideOrder.parse(self.order).block_outermost else (
            "layer-outermost"
        )

    def layout(self) -> KVCacheLayout:
        """The dense CONCAT layout of this point, with ``2 * blocks`` blocks."""
        return KVCacheLayout.contiguous(
            self.order, KVPacking.CONCAT, DTYPES[self.dtype], self.layers, 2 * self.blocks,
            self.block_size, self.heads, self.head_size,
        )


@dataclass(frozen=True)
class OffloadGrid:
    """The axes of the grid (their product is measured) and the repetition counts.

    Attributes:
        orders: Stride order names.
        block_sizes: Tokens per block.
        layers: Layer counts.
        heads: ``(heads, head_size)`` pairs.
        dtypes: Keys of ``DTYPES``.
        blocks: Blocks moved.
        repeats: Timed repetitions per median.
        warmup: Untimed runs before them.
        seed: Seed of the block permutation and the random bytes.
        device: Where the KV caches are: ``"cpu"`` or ``"cuda[:N]"`` (the pool is then
            pinned host memory and the ceilings are pinned copies each way).
    """

    orders: tuple[str, ...] = ("BLNHC", "LBNHC")
    block_sizes: tuple[int, ...] = (16,)
    layers: tuple[int, ...] = (32,)
    heads: tuple[tuple[int, int], ...] = ((1, 64), (8, 128))
    dtypes: tuple[str, ...] = ("bfloat16",)
    blocks: tuple[int, ...] = (256,)
    repeats: int = 7
    warmup: int = 2
    seed: int = 0
    device: str = "cpu"

    @classmethod
    def quick(cls) -> OffloadGrid:
        """A small grid that runs in seconds (for tests and smoke runs)."""
        return cls(layers=(4,), heads=((1, 64), (2, 64)), blocks=(32,), repeats=3, warmup=1)

    def points(self) -> list[OffloadPoint]:
        """The grid points, orders outermost."""
        return [
            OffloadPoint(o, bs, nl, h, d, dt, nb)
            for o in self.orders for bs in self.block_sizes for nl in self.layers
            for h, d in self.heads for dt in self.dtypes for nb in self.blocks
        ]


@dataclass(frozen=True)
class OffloadResult:
    """The measurement of one grid point. Times are medians in seconds; ratios are the
    ceiling's time over the copy's time (1.0 = as fast as a contiguous copy).

    Attributes:
        point: The grid point.
        path: The pool's copy path, ``"block"``, ``"rows"`` or ``"elements"``.
        bytes_moved: Bytes moved per store (and per load).
        store_s: Median time of one store.
        load_s: Median time of one load.
        ceiling_s: Median time of a contiguous copy of ``bytes_moved`` bytes (on a GPU:
            device to pinned host, the store's ceiling).
        load_ceiling_s: On a GPU, the median time of the pinned host-to-device copy (the
            load's ceiling); None on the host, where ``ceiling_s`` is both.
        device: ``"cpu"`` or the CUDA device the KV caches were on.
    """

    point: OffloadPoint
    path: str
    bytes_moved: int
    store_s: float
    load_s: float
    ceiling_s: float
    load_ceiling_s: float | None = None
    device: str = "cpu"

    @property
    def store_ratio(self) -> float:
        """Store throughput over the ceiling's."""
        return self.ceiling_s / self.store_s

    @property
    def load_ratio(self) -> float:
        """Load throughput over the ceiling's."""
        return (self.load_ceiling_s or self.ceiling_s) / self.load_s

    def gbps(self, seconds: float) -> float:
        """``bytes_moved`` per ``seconds``, in GB/s (10**9 bytes)."""
        return self.bytes_moved / seconds / 1e9

    def as_dict(self) -> dict[str, Any]:
        """A flat JSON-ready dict of the point, the times, ratios and GB/s."""
        out: dict[str, Any] = asdict(self.point)
        out.update(
            family=self.point.family, path=self.path, bytes_moved=self.bytes_moved,
            mib_moved=self.bytes_moved / _MIB, store_s=self.store_s, load_s=self.load_s,
            ceiling_s=self.ceiling_s, store_ratio=self.store_ratio,
            load_ratio=self.load_ratio, store_gbps=self.gbps(self.store_s),
            load_gbps=self.gbps(self.load_s), ceiling_gbps=self.gbps(self.ceiling_s),
            load_ceiling_s=self.load_ceiling_s, device=self.device,
            load_ceiling_gbps=self.gbps(self.load_ceiling_s or self.ceiling_s),
        )
        return out


@dataclass(frozen=True)
class StepOverhead:
    """Median per-step work outside the copies for one job, in microseconds.

    Attributes:
        direction: ``"store"`` or ``"load"``.
        blocks: Blocks in the job.
        schedule_us: Scheduler role. Store: ``request_finished`` (slot placement,
            eviction) and ``build_connector_meta``. Load: ``get_num_new_matched_tokens``
            (the lookup), ``update_state_after_alloc`` (slots, pins) and
            ``build_connector_meta``.
        encode_us: ``OffloadMetadata.encode``.
        decode_us: ``OffloadMetadata.decode`` on the worker.
        plan_us: The worker's planning of the job (range checks, slot runs), the same
            call ``start_load_kv`` makes; the copy builds its index on the worker's
            background thread.
        finish_us: ``update_connector_output`` with the job reported finished (the store's
            blocks become stored; the load's slots unpin).
        events_us: ``take_events`` after the finish: building the store's ``BlockStored``
            events (EVT-005). Counted in ``total_us``: vLLM's scheduler calls
            ``take_events`` every step, whether or not it publishes KV events.
        total_us: Median of the per-repetition sums of the six parts.
    """

    direction: str
    blocks: int
    schedule_us: float
    encode_us: float
    decode_us: float
    plan_us: float
    finish_us: float
    events_us: float
    total_us: float

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields."""
        return asdict(self)

    def line(self) -> str:
        """One human-readable line."""
        return (f"per-step work outside copies, {self.direction} of {self.blocks} blocks: "
                f"{self.total_us:.1f} us (schedule {self.schedule_us:.1f}, encode "
                f"{self.encode_us:.1f}, decode {self.decode_us:.1f}, worker plan "
                f"{self.plan_us:.1f}, finish {self.finish_us:.1f}, events "
                f"{self.events_us:.1f})")


@dataclass(frozen=True)
class TargetCheck:
    """One performance target and its measured value.

    Attributes:
        name: What is measured, e.g. ``"block-outermost store ratio"``.
        measured: The worst measured value (minimum ratio, or the overhead).
        threshold: The target.
        higher_is_better: True for ratios (``measured >= threshold``), False for times.
        not_judged: Why the measured value says nothing about the target (a grid too small,
            too few runs), or None: it is judged.
    """

    name: str
    measured: float | None
    threshold: float
    higher_is_better: bool
    not_judged: str | None = None

    @property
    def judged(self) -> bool:
        """Whether the target is judged: something was measured, on a grid large enough."""
        return self.measured is not None and self.not_judged is None

    @property
    def passed(self) -> bool:
        """Whether the measured value meets the target (False when it is not judged)."""
        if self.measured is None or not self.judged:
            return False
        if self.higher_is_better:
            return self.measured >= self.threshold
        return self.measured < self.threshold

    def line(self) -> str:
        """One line of text: the target, the value and PASS/MISS, or n/a and why."""
        op = ">=" if self.higher_is_better else "<"
        if self.measured is None:
            return f"target {self.name} {op} {self.threshold:g}: not measured in this grid  n/a"
        verdict = ("PASS" if self.passed else "MISS") if self.judged else (
            f"n/a ({self.not_judged})")
        return (f"target {self.name} {op} {self.threshold:g}: measured {self.measured:.3g}  "
                f"{verdict}")


def measure_point(point: OffloadPoint, *, repeats: int, warmup: int, seed: int,
                  device: str = "cpu") -> OffloadResult:
    """Measure one grid point with the backend's ``HostPool`` (see the module doc).

    On ``device="cuda"`` the KV caches are on the GPU and the pool in pinned host memory
    (``HostPool`` pins where CUDA is available); the store is compared with a pinned
    device-to-host copy of the same bytes, the load with the host-to-device copy, and every
    timed run ends with a device synchronize."""
    gen = torch.Generator().manual_seed(seed)
    dev = torch.device(device)
    layout = point.layout()
    storage = written_bytes(layout.span_bytes, gen).to(dev).view(layout.dtype)
    kv = layout.view(storage)
    layer0 = kv[layout.layer_slots[0]]
    pool = HostPool(layer0, layout, point.blocks, 1 << 62)
    pool.host.copy_(written_bytes(pool.host.numel(), gen).view_as(pool.host))
    ids = random.Random(seed).sample(range(layout.num_blocks), point.blocks)
    slots = list(range(point.blocks))
    plan = pool.plan(ids, slots)  # per-step work, measured separately; copies build their index
    nbytes = point.blocks * pool.bytes_per_block
    src, dst = written_bytes(nbytes, gen), written_bytes(nbytes, gen)
    # Interleaved, so that whatever else the machine does hits the three alike.
    ops: dict[str, Callable[[], object]] = {
        "ceiling": lambda: dst.copy_(src), "store": lambda: pool.store(plan),
        "load": lambda: pool.load(plan),
    }
    sync: Callable[[], None] = lambda: None  # noqa: E731
    if dev.type == "cuda":
        src, dst = src.pin_memory(), dst.pin_memory()
        on_dev = src.to(dev)
        # the store's ceiling: device to pinned host; the load's: pinned host to device
        ops["ceiling"] = lambda: dst.copy_(on_dev, non_blocking=True)
        ops["load_ceiling"] = lambda: on_dev.copy_(src, non_blocking=True)
        sync = torch.cuda.synchronize
    times: dict[str, list[float]] = {name: [] for name in ops}
    for rep in range(warmup + repeats):
        for name, op in ops.items():
            sync()
            start = time.perf_counter()
            op()
            sync()
            if rep >= warmup:
                times[name].append(time.perf_counter() - start)
    store_s, load_s, ceiling_s = (statistics.median(times[n]) for n in ("store", "load",
                                                                          "ceiling"))
    load_ceiling_s = statistics.median(times["load_ceiling"]) if "load_ceiling" in times \
        else None
    path = pool.path
    pool.release()
    del kv, layer0, storage, src, dst
    return OffloadResult(point, path, nbytes, store_s, load_s, ceiling_s, load_ceiling_s, device)


def run_offload_bench(
    grid: OffloadGrid, progress: Callable[[int, int, OffloadPoint], None] | None = None
) -> list[OffloadResult]:
    """Measure every point of ``grid``; call ``progress(i, n, point)`` before each."""
    points = grid.points()
    results = []
    for i, point in enumerate(points):
        if progress is not None:
            progress(i, len(points), point)
        results.append(
            measure_point(point, repeats=grid.repeats, warmup=grid.warmup, seed=grid.seed,
                          device=grid.device)
        )
    return results


def _config(blocks: int, block_size: int, layers: int) -> EngineConfigView:
    return EngineConfigView(
        engine_id="bench", role=TransferRole.BOTH, num_layers=layers, block_size=block_size,
        num_blocks=blocks, extra={"offload_slots": blocks, "offload_bytes": 1 << 62},
    )


OVERHEAD_REPEATS = 51
"""Repetitions of ``measure_step_overhead`` in ``kvspec bench offload``: one costs about a
millisecond, and a median of few is at the mercy of one busy moment of the machine."""


def measure_step_overhead(
    blocks: int = 256, *, block_size: int = 16, layers: int = 32,
    repeats: int = OVERHEAD_REPEATS, warmup: int = 5,
) -> tuple[StepOverhead, StepOverhead]:
    """Median per-step work outside the copies for one store job and one load job of
    ``blocks`` blocks, through the backend's own code: the scheduler role, the metadata
    codec and ``OffloadWorker._plan`` (the call ``start_load_kv`` makes), over a
    layer-outermost layout of ``layers`` layers (the "rows" path).

    Each repetition uses a fresh scheduler (built untimed): a request with ``blocks`` full
    computed blocks finishes, so ``request_finished`` plans a store of all of them; the
    store is reported finished; then a second request with the same prompt matches all of
    them and loads them. The engine's ``SchedulerOutputView`` is built before the clock
    starts: it is the engine's (its adapter's) work, not the backend's.
    """
    tokens = tuple(range(blocks * block_size + 1))
    hashes = tuple(hashlib.sha256(f"bench|{i}".encode()).digest() for i in range(blocks))
    writer = RequestView("bench-store", tokens, block_hashes=hashes,
                         num_computed_tokens=blocks * block_size)
    rng = random.Random(0)
    store_ids = tuple(rng.sample(range(2 * blocks), blocks))
    load_ids = AllocatedBlocks.single(rng.sample(range(2 * blocks), blocks + 1))
    config = _config(2 * blocks, block_size, layers)
    layout = KVCacheLayout.contiguous(
        StrideOrder.LBNHC, KVPacking.CONCAT, torch.bfloat16, layers, 2 * blocks, block_size,
        1, 8,
    )
    kv = torch.zeros(layout.span_elems, dtype=layout.dtype)
    pool = HostPool(kv, layout, 2 * blocks, 1 << 62)
    names = ("schedule", "encode", "decode", "plan", "finish", "events")
    times: dict[str, dict[str, list[float]]] = {
        d: {n: [] for n in names} for d in ("store", "load")
    }
    clock = time.perf_counter

    def step(direction: str, rep: int, schedule: Callable[[], object],
             sched: OffloadScheduler, finished: KVConnectorOutput) -> None:
        view = SchedulerOutputView(step_id=rep)
        t0 = clock()
        schedule()
        meta = sched.build_connector_meta(view)
        t1 = clock()
        assert isinstance(meta, OffloadMetadata)
        data = meta.encode()
        t2 = clock()
        decoded = OffloadMetadata.decode(data)
        t3 = clock()
        for job in (*decoded.loads, *decoded.stores):
            OffloadWorker._plan(pool, job)
        t4 = clock()
        sched.update_connector_output(finished)
        t5 = clock()
        sched.take_events()
        t6 = clock()
        if rep >= warmup:
            for name, dt in zip(names, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
                times[direction][name].append(dt * 1e6)

    for rep in range(warmup + repeats):
        sched = OffloadScheduler(config)
        sched.on_new_request(writer)
        step("store", rep, lambda: sched.request_finished(writer, store_ids), sched,
             KVConnectorOutput(finished_sending=frozenset({writer.request_id})))
        reader = RequestView("bench-load", tokens, block_hashes=hashes)
        sched.on_new_request(reader)

        def plan_load() -> None:
            n, _ = sched.get_num_new_matched_tokens(reader, 0)
            assert n == blocks * block_size
            sched.update_state_after_alloc(reader, load_ids, n)

        step("load", rep, plan_load, sched,
             KVConnectorOutput(finished_recving=frozenset({reader.request_id})))
        sched.shutdown()
    pool.release()
    out = []
    for direction, parts in times.items():
        med = {name: statistics.median(v) for name, v in parts.items()}
        totals = [sum(parts[name][i] for name in names) for i in range(repeats)]
        out.append(StepOverhead(direction, blocks, med["schedule"], med["encode"],
                                med["decode"], med["plan"], med["finish"], med["events"],
                                statistics.median(totals)))
    return out[0], out[1]


def check_targets(
    results: Sequence[OffloadResult], overheads: Sequence[StepOverhead], *,
    repeats: int | None = None,
) -> list[TargetCheck]:
    """The targets: block-outermost store and load >= 0.9 of the ceiling,
    layer-outermost >= 0.7 (worst point of the family), on a GPU both >= ``GPU_TARGET`` of
    the pinned copy each way; per-step work < 100 us for each direction of a job of
    ``TARGET_BLOCKS`` blocks.

    A target is not judged (its line says n/a and why, never MISS or PASS) where the grid is
    too small for it to mean anything: a copy target where a point of its family moves less
    than ``JUDGED_MIB`` MiB, a per-step target for a job of fewer than
    ``TARGET_BLOCKS`` blocks, any target when ``repeats`` (the timed runs per median,
    if given) is below ``JUDGED_REPEATS``. The ``--quick`` grid is such a grid.
    """
    few_runs = repeats is not None and repeats < JUDGED_REPEATS

    def why(small: str | None, needs: str) -> str | None:
        parts = [p for p in (small, f"{repeats} runs" if few_runs else None) if p]
        if not parts:
            return None
        return (f"too small to judge: {', '.join(parts)}; judged from {needs}, "
                f"{JUDGED_REPEATS} runs")

    checks = []
    on_gpu = any(r.device != "cpu" for r in results)
    # On a GPU both families are judged against pinned copies each way, at 0.85: the copy
    # engine, not the layout, then bounds a gather into one contiguous transfer.
    targets = (("block-outermost", GPU_TARGET), ("layer-outermost", GPU_TARGET)) if on_gpu \
        else (("block-outermost", 0.9), ("layer-outermost", 0.7))
    for family, threshold in targets:
        rows = [r for r in results if r.point.family == family]
        smallest = min((r.bytes_moved for r in rows), default=0)
        small = f"{smallest / _MIB:.1f} MiB copies" if rows and smallest < JUDGED_MIB * _MIB \
            else None
        for direction in ("store", "load"):
            values = [r.store_ratio if direction == "store" else r.load_ratio for r in rows]
            checks.append(TargetCheck(f"{family} {direction} ratio (min)",
                                      min(values) if values else None, threshold, True,
                                      why(small, f"{JUDGED_MIB} MiB copies")))
    for o in overheads:
        checks.append(TargetCheck(
            f"per-step work outside copies, {o.direction} of {o.blocks} blocks (us)",
            o.total_us, 100.0, False,
            why(f"{o.blocks} blocks" if o.blocks < TARGET_BLOCKS else None,
                f"{TARGET_BLOCKS} blocks"),
        ))
    return checks


_COLUMNS = ("layout", "family", "tok/blk", "layers", "heads x size", "dtype", "blocks",
            "MiB moved", "store ratio", "load ratio", "store GB/s", "load GB/s",
            "ceiling GB/s", "path")


def format_table(results: Sequence[OffloadResult]) -> str:
    """The results as a Markdown table (one row per grid point)."""
    rows = [
        (r.point.order, r.point.family, str(r.point.block_size), str(r.point.layers),
         f"{r.point.heads}x{r.point.head_size}", r.point.dtype, str(r.point.blocks),
         f"{r.bytes_moved / _MIB:.1f}", f"{r.store_ratio:.2f}", f"{r.load_ratio:.2f}",
         f"{r.gbps(r.store_s):.2f}", f"{r.gbps(r.load_s):.2f}",
         f"{r.gbps(r.ceiling_s):.2f}" + (f" / {r.gbps(r.load_ceiling_s):.2f}"
                                          if r.load_ceiling_s else ""),
         r.path)
        for r in results
    ]
    return markdown_table(_COLUMNS, rows)


def machine_info() -> dict[str, Any]:
    """Torch version, CPU count, torch threads, platform and the date (UTC, ISO)."""
    return {
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
