"""``kvspec bench graphs``: what a connector's per-layer hooks cost when graphs are downgraded.

A connector whose per-layer hooks are capturable (``HookGraphMode.CAPTURABLE``) lets the
engine capture the whole forward, hooks included, in one FULL graph. A connector whose hooks
must run eagerly forces PIECEWISE graphs: the engine replays one graph per layer's non-
attention part and runs attention and the hooks eagerly between them (GRA-002, GRA-003). The
benchmark times one padding step of the harness's toy model (``WorkerRuntime.padding_step``:
the connector's dummy metadata bound, ``start_load_kv``, the forward, ``wait_for_save``) with
the same connector, the capturable-hooks offload backend (``offload-layerwise``), in three
modes, interleaved run by run so that whatever else the machine does hits all alike:

* ``full``: the forward replayed as one graph, the hooks inside it;
* ``piecewise``: the hooks and attention eager, one graph per layer's MLP;
* ``eager``: nothing captured.

The ratio ``piecewise / full`` is what the downgrade costs per step. On ``cpu`` the graphs are
the emulator's (``make_capturer("cpu")``), which records and replays without Python but does
not remove launches: the ratio means something on ``cuda`` only.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvspec.backends.offload import LayerwiseOffloadConnector
from kvspec.conformance.harness import HarnessConfig
from kvspec.conformance.harness._worker_runtime import WorkerRuntime
from kvspec.protocols import GraphMode

__all__ = ["GraphsResult", "MODES", "run_graphs_bench"]

MODES = (GraphMode.FULL, GraphMode.PIECEWISE, GraphMode.NONE)
"""The arms, in the order each round runs them."""


@dataclass(frozen=True)
class GraphsResult:
    """Median seconds of one padding step per mode, and the shape measured.

    Attributes:
        device: ``"cpu"`` or the CUDA device.
        layers: Layers of the toy model.
        heads: KV heads.
        head_size: Channels per head.
        tokens: Tokens of the step (the captured size).
        blocks: KV blocks of the cache (attention reads all of them).
        repeats: Timed rounds.
        seconds: Mode value (``full``, ``piecewise``, ``none``) -> median seconds per step.
    """

    device: str
    layers: int
    heads: int
    head_size: int
    tokens: int
    blocks: int
    repeats: int
    seconds: dict[str, float]

    @property
    def downgrade_ratio(self) -> float:
        """PIECEWISE step time over FULL: what eager hooks cost (> 1 is slower)."""
        return self.seconds["piecewise"] / self.seconds["full"]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields and the ratio."""
        return {**asdict(self), "downgrade_ratio": self.downgrade_ratio}

    def lines(self) -> list[str]:
        """Human-readable lines: one per mode, then the ratio."""
        out = [f"one padding step of {self.tokens} tokens, {self.layers} layers, "
               f"{self.heads}x{self.head_size} heads, {self.blocks} blocks, on {self.device} "
               f"(medians of {self.repeats}):"]
        for mode in MODES:
            out.append(f"  {mode.value:>9}: {self.seconds[mode.value] * 1e6:10.1f} us")
        out.append(f"piecewise / full = {self.downgrade_ratio:.2f}x")
        return out


def run_graphs_bench(
    *, device: str = "cpu", layers: int = 32, heads: int = 8, head_size: int = 128,
    tokens: int = 256, blocks: int = 256, block_size: int = 16, repeats: int = 50,
    warmup: int = 5,
) -> GraphsResult:
    """Build one harness worker per mode (the offload-layerwise connector, registered and
    captured at ``tokens``), then time ``warmup + repeats`` rounds, each one padding step per
    mode, with a device synchronize around every timed step."""
    factory = LayerwiseOffloadConnector()
    sync: Callable[[], None] = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    times: dict[str, list[float]] = {m.value: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="kvspec-bench-graphs-") as tmp:
        runtimes = {}
        try:
            for mode in MODES:
                cfg = HarnessConfig(
                    num_layers=layers, num_heads=heads, head_size=head_size,
                    block_size=block_size, num_blocks=blocks, dtype="bfloat16",
                    max_tokens_per_step=tokens, capture_sizes=(tokens,), graph_mode=mode,
                    prefix_caching=False, device=device, engine_id=f"bench-{mode.value}",
                    extra={"offload_slots": 8},  # padding steps store nothing
                )
                rt = WorkerRuntime(factory, cfg, 0, tmp)
                runtimes[mode.value] = rt
                rt.register()
            for rnd in range(warmup + repeats):
                for name, rt in runtimes.items():
                    sync()
                    start = time.perf_counter()
                    rt.padding_step(tokens)
                    sync()
                    if rnd >= warmup:
                        times[name].append(time.perf_counter() - start)
        finally:
            for rt in runtimes.values():
                rt.shutdown()
    return GraphsResult(device, layers, heads, head_size, tokens, blocks, repeats,
                        {k: statistics.median(v) for k, v in times.items()})
