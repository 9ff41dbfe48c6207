"""Configuration of one harness engine."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from kvspec.protocols import (
    EngineConfigView,
    GraphMode,
    GroupKind,
    InvalidArgumentError,
    KVCacheGroup,
    KVCacheLayout,
    KVPacking,
    StateCaching,
    StateLayout,
    StrideOrder,
    TransferRole,
    freeze_params,
)
from kvspec.protocols._loading import EXTRA_ENV, connector_extra

__all__ = ["EXTRA_ENV", "HarnessConfig", "connector_extra"]



_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _order(value: StrideOrder | str) -> StrideOrder:
    return value if isinstance(value, StrideOrder) else StrideOrder.parse(value)


def _sizes(value: Any) -> tuple[int, ...]:
    out = tuple(sorted(set(value)))
    if not out or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in out):
        raise InvalidArgumentError(f"capture_sizes must be ints >= 1, got {value!r}")
    return out


def _fail_steps(value: Any) -> tuple[tuple[int, int], ...]:
    try:
        out = tuple((step, rank) for step, rank in value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"fail_steps must be (step, rank) pairs, got {value!r}") from None
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for pair in out for v in pair):
        raise InvalidArgumentError(f"fail_steps must be pairs of ints >= 0, got {value!r}")
    return out


def _extra(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return freeze_params(value, "extra") or {}


@attrs.frozen
class HarnessConfig:
    """Everything that shapes one harness engine: model, KV layout, parallelism, scheduling.

    Attributes:
        num_layers: Attention layers of the toy model.
        num_heads: KV heads of the whole model; TP ranks hold ``num_heads // tp_size`` each.
        head_size: Channels of K and of V per head.
        block_size: Tokens per block.
        num_blocks: The physical block budget per rank (LAY-003).
        extra_capacity: Blocks the tensors hold beyond the budget (kvcached over-allocation).
        order: Stride order of the KV tensors (LAY-001).
        packing: K/V concatenated or split (LAY-002).
        dtype: Name of the KV dtype: bfloat16, float16 or float32.
        page_padding: Padding elements per page (LAY-004).
        restridable: Whether the tensors may be re-strided (LAY-009).
        tp_size: Tensor-parallel ranks; above 1 the workers are separate processes.
        async_scheduling: Build step N+1's metadata before step N's output arrives (SCH-014).
        prefix_caching: The engine's own prefix cache.
        max_tokens_per_step: Token budget of one step (chunked prefill).
        token_scale: Tokens per token of the suite's workloads, which are written for
            blocks of ``block_size // token_scale`` tokens (4): every token of a full
            design block becomes ``token_scale`` tokens, the tokens after the last full
            block stay single, so a prompt keeps its full blocks, its shared prefixes and
            its remainder at any block size (``scale_request``). ``config_for`` sets it
            for connectors that declare a larger block size.
        realloc_after_load: Call ``update_state_after_alloc`` again, with
            ``num_external_tokens=0``, when a request whose async load finished is scheduled
            (True, the default, as vLLM does; SCH-009 allows both).
        preempted_hold_s: Seconds a preempted request's freed blocks stay poisoned before
            the engine allocates them again (0, the default: at once, as engines do). A
            connector whose transfer reads them after ``handle_preemptions`` returned then
            reads the poison, which the byte checks name (WRK-012), however the blocks
            would have been reused.
        hold_threads: Play a busy machine for the connector's own threads (``ThreadGate``):
            from just before each ``wait_for_save``, every other thread of a worker's
            process is held at its next Python call until the harness waits in a hook (or
            idles), four engine steps or 1 s at most. A save or store that still reads what the
            next step overwrites (its preemption fence, poisoning and per-layer saves come
            first) then reads the new bytes every time, not only when the OS is unlucky
            (WRK-007, WRK-012). False, the default: threads run freely.
        sliding_window: A hybrid model (KVG-001): the odd layers form a second KV-cache
            group, of sliding-window attention over this many tokens, with a block table
            of its own whose out-of-window positions the engine frees and points at the
            null block 0, as vLLM's hybrid allocator does (KVG-003, KVG-004). None (the
            default): one full-attention group. Needs ``num_layers >= 2`` and no local
            prefix cache (``prefix_caching=False``: the hybrid prefix cache is not modelled).
        state_layers: A state-space hybrid (STG): this many state layers form a
            ``GroupKind.STATE`` group beside the attention layers' full-attention group,
            kept with ``RUNNING`` caching (vLLM's ``mamba_cache_mode="none"``): one state
            block per request from the one block pool, updated in place every step, with a
            block size of ``max_model_len`` (STG-001). Each layer's state page (a conv and an
            ssm component, small integers exact in every dtype) is padded to the attention
            page and registered with ``register_state_caches``; the worker reads it before
            every step of a request and writes it back after, and checks what it read
            against the state after exactly the request's computed tokens (STG-002,
            STG-003). With a state group the engine zeroes each step's new attention blocks
            after ``handle_preemptions`` and before binding, as vLLM's V1 runner does
            (STG-009). 0, the default: no state group. Needs ``prefix_caching=False``, no
            sliding window and no drafter.
        fail_steps: ``(step, rank)`` pairs: the engine step ``step`` fails on rank ``rank``
            after every rank's connector output was collected, as a step whose output
            fetch fails in vLLM 0.33 with ``enable_fault_tolerance`` (EXE-013). The engine
            then aggregates nothing for that step: it salvages every rank's output into the
            executor (``StandardAggregator.defer``), delivered with the next step's
            aggregate, and aborts every unfinished request, as vLLM's fault handler does.
        cut_async_matches: Cut every asynchronous match to 0 tokens before allocating:
            the engine calls ``update_state_after_alloc`` with ``num_external_tokens=0``
            and computes the request itself from its local hit, as vLLM's scheduler does
            when its auxiliary-output cap (0.33), a local hit with a partial last block or
            a replayed sliding window cuts the hit (SCH-034). False, the default.
        speculative_tokens: Speculative decoding (SPD): each decoding request is scheduled
            one token plus this many draft tokens (fewer near its end), counted computed
            when scheduled; a seeded number of them (``accept_seed``) is accepted, the
            rest subtracted when the output is processed, as vLLM's scheduler does. The
            KV written at rejected positions is that of the rejected tokens, overwritten
            by a later step (SPD-005). Every step with a forward runs the speculative
            order (SPD-001). 0, the default: no drafter.
        draft_layers: Layers of the drafter (an EAGLE head, an MTP module, a draft
            model), registered after the target's layers and, as in vLLM, in the target's
            full-attention group (SPD-003); 0 is n-gram drafting (no draft KV). Needs
            ``speculative_tokens``.
        draft_passes: Draft passes per speculative step (vLLM: 2 for eagle, eagle3 and
            draft_model with 2 draft tokens, 1 for mtp): each runs the draft layers'
            per-layer hooks (SPD-002). Each pass writes the draft KV of the step's tokens;
            every pass but the last writes provisional values, so that only the content
            after the last pass is right.
        accept_seed: Seed of the acceptance rule: how many of a step's draft tokens the
            target accepts (0 to all of them).
        transfer_timeout_s: How long an awaited transfer may stay unreported before the
            harness calls it lost (SCH-016, SCH-021, SCH-023).
        worker_timeout_s: Bound on every wait for a worker process once it started
            (ERR-007).
        worker_start_timeout_s: Bound on the wait for a worker process to start: spawn the
            interpreter, import the connector's package (vLLM alone takes seconds of CPU
            per process), build the worker role and register the caches (ERR-007). Longer
            than ``worker_timeout_s``, so that a busy machine starting several ranks is not
            mistaken for a connector that hangs.
        hook_budget_s: Longest a scheduler hook may take before the harness calls it
            blocking (SCH-025), and a worker's output hooks (``build_connector_output``:
            ``get_finished`` and the others) before they count as waiting for a transfer
            (WRK-014).
        graph_mode: NONE (eager), PIECEWISE or FULL; resolved against the connector's hook
            declaration (GRA-002) by the workers.
        capture_sizes: Padded token counts captured as graphs; a step is padded to the
            smallest size that fits it, and larger steps run eagerly (GRA-009).
        lazy_capture: Capture each size the first time a step needs it, mid-serving, with
            transfers in flight (GRA-008), instead of at start-up.
        strict_graphs: Refuse FULL graphs for eager hooks instead of downgrading (GRA-002).
        device: Where the KV caches, the toy forward and its graphs live: ``"cpu"`` (the
            default; graphs are emulated) or ``"cuda"`` / ``"cuda:N"`` (real CUDA graphs,
            ``make_capturer("cuda")``). The suite takes it from ``$KVSPEC_DEVICE``.
        engine_id: The engine's id.
        role: Producer, consumer or both.
        extra: Connector configuration passed in ``EngineConfigView.extra``.
    """

    num_layers: int = 2
    num_heads: int = 4
    head_size: int = 4
    block_size: int = 4
    num_blocks: int = 48
    extra_capacity: int = 0
    order: StrideOrder = attrs.field(default=StrideOrder.LBNHC, converter=_order)
    packing: KVPacking = KVPacking.CONCAT
    dtype: str = "bfloat16"
    page_padding: int = 0
    restridable: bool = True
    tp_size: int = 1
    async_scheduling: bool = False
    prefix_caching: bool = True
    max_tokens_per_step: int = 32
    token_scale: int = 1
    realloc_after_load: bool = True
    preempted_hold_s: float = 0.0
    hold_threads: bool = False
    sliding_window: int | None = None
    state_layers: int = 0
    fail_steps: tuple[tuple[int, int], ...] = attrs.field(default=(), converter=_fail_steps)
    cut_async_matches: bool = False
    speculative_tokens: int = 0
    draft_layers: int = 0
    draft_passes: int = 1
    accept_seed: int = 0
    transfer_timeout_s: float = 10.0
    worker_timeout_s: float = 60.0
    worker_start_timeout_s: float = 240.0
    hook_budget_s: float = 2.0
    graph_mode: GraphMode = GraphMode.NONE
    capture_sizes: tuple[int, ...] = attrs.field(default=(8, 32), converter=_sizes)
    lazy_capture: bool = False
    strict_graphs: bool = False
    device: str = "cpu"
    engine_id: str = "engine-0"
    role: TransferRole = TransferRole.BOTH
    extra: Mapping[str, Any] = attrs.field(factory=dict, converter=_extra)

    def __attrs_post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_size", "block_size", "num_blocks",
                     "tp_size", "max_tokens_per_step", "token_scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"HarnessConfig.{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.hold_threads, bool):
            raise InvalidArgumentError(
                f"HarnessConfig.hold_threads must be a bool, got {self.hold_threads!r}")
        for name in ("extra_capacity", "page_padding"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidArgumentError(f"HarnessConfig.{name} must be an int >= 0, got {v!r}")
        if self.block_size % self.token_scale:
            raise InvalidArgumentError(
                f"block_size {self.block_size} is not a multiple of token_scale "
                f"{self.token_scale}")
        if self.num_heads % self.tp_size:
            raise InvalidArgumentError(
                f"num_heads {self.num_heads} is not divisible by tp_size {self.tp_size}"
            )
        if self.dtype not in _DTYPES:
            raise InvalidArgumentError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.packing, KVPacking):
            raise InvalidArgumentError(f"packing must be a KVPacking, got {self.packing!r}")
        if not isinstance(self.role, TransferRole):
            raise InvalidArgumentError(f"role must be a TransferRole, got {self.role!r}")
        if not isinstance(self.graph_mode, GraphMode):
            raise InvalidArgumentError(f"graph_mode must be a GraphMode, got {self.graph_mode!r}")
        hold = self.preempted_hold_s
        if isinstance(hold, bool) or not isinstance(hold, (int, float)) or not 0 <= hold <= 60:
            raise InvalidArgumentError(
                f"HarnessConfig.preempted_hold_s must be seconds in [0, 60], got {hold!r}")
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise InvalidArgumentError(
                f"HarnessConfig.device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.num_blocks < 2:
            raise InvalidArgumentError("num_blocks must be >= 2: the last block pads dummy runs")
        for step, rank in self.fail_steps:
            if rank >= self.tp_size:
                raise InvalidArgumentError(
                    f"fail_steps names rank {rank} of step {step}; expected ranks below "
                    f"tp_size {self.tp_size}")
        if not isinstance(self.cut_async_matches, bool):
            raise InvalidArgumentError(f"HarnessConfig.cut_async_matches must be a bool, got "
                                       f"{self.cut_async_matches!r}")
        for name in ("speculative_tokens", "draft_layers", "accept_seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidArgumentError(f"HarnessConfig.{name} must be an int >= 0, got {v!r}")
        passes = self.draft_passes
        if (isinstance(passes, bool) or not isinstance(passes, int)
                or not 1 <= passes <= max(1, self.speculative_tokens)):
            raise InvalidArgumentError(
                f"HarnessConfig.draft_passes must be an int in [1, speculative_tokens="
                f"{self.speculative_tokens}], got {passes!r}")
        sl = self.state_layers
        if isinstance(sl, bool) or not isinstance(sl, int) or sl < 0 or (sl and (
                self.prefix_caching or self.sliding_window is not None or self.speculative)):
            raise InvalidArgumentError(
                f"HarnessConfig.state_layers must be an int >= 0, above 0 only with "
                f"prefix_caching=False, no sliding_window and no speculative_tokens, got "
                f"{sl!r}")
        if self.draft_layers and not self.speculative_tokens:
            raise InvalidArgumentError("HarnessConfig.draft_layers needs speculative_tokens >= 1")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1
                              or self.num_layers < 2 or self.prefix_caching):
            raise InvalidArgumentError(
                f"HarnessConfig.sliding_window must be None or an int >= 1 with num_layers "
                f">= 2 and prefix_caching=False, got {w!r} ({self.num_layers} layers, "
                f"prefix_caching={self.prefix_caching})")

    @property
    def speculative(self) -> bool:
        """Whether a drafter runs: every step with a forward is a speculative one (SPD-001)."""
        return self.speculative_tokens > 0

    @property
    def total_layers(self) -> int:
        """Registered KV layers: the target's, then the drafter's."""
        return self.num_layers + self.draft_layers

    @property
    def draft_layer_names(self) -> tuple[str, ...]:
        """The drafter's layers' names, as vLLM names a draft model's."""
        return tuple(f"draft_model.model.layers.{j}.self_attn.attn"
                     for j in range(self.draft_layers))

    @property
    def layer_names(self) -> tuple[str, ...]:
        """The layers' names, as the workers register them: the target's, then the
        drafter's."""
        return (tuple(f"model.layers.{i}.attn" for i in range(self.num_layers))
                + self.draft_layer_names)

    def is_draft_layer(self, layer: int) -> bool:
        """Whether layer index ``layer`` is one of the drafter's."""
        return layer >= self.num_layers

    max_model_len = 4096
    """Longest request of the harness: a RUNNING state group's block size (STG-001)."""

    @property
    def state_layer_names(self) -> tuple[str, ...]:
        """The state layers' names (``state_layers``), registered with
        ``register_state_caches`` (STG-001)."""
        return tuple(f"model.layers.{self.num_layers + j}.mixer"
                     for j in range(self.state_layers))

    @property
    def state_heads(self) -> int:
        """State heads of one rank: two per KV head the rank holds (sharded over TP)."""
        return 2 * self.heads_per_rank

    def state_layout(self, tp_rank: int = 0) -> StateLayout:
        """One rank's state layout: a conv component ``(2, state_heads)`` (conv layout SD)
        then an ssm component ``(state_heads, 2)``, in the KV dtype, the page padded to the
        attention page (STG-001, LAY-004)."""
        from kvspec.protocols import ConvLayout

        h = self.state_heads
        page = (self.heads_per_rank * self.block_size * 2 * self.head_size
                * self.torch_dtype.itemsize)
        return StateLayout.contiguous(
            (("conv", (2, h), self.torch_dtype), ("ssm", (h, 2), self.torch_dtype)),
            self.num_blocks, page_pitch_bytes=page,
            block_capacity=self.num_blocks + self.extra_capacity,
            conv_layout=ConvLayout.SD, tp_size=self.tp_size, tp_rank=tp_rank)

    def kv_cache_groups(self) -> tuple[KVCacheGroup, ...]:
        """The model's groups (KVG-001): none (one full group) without ``sliding_window``;
        else the even layers' full-attention group and the odd layers' sliding-window one.
        Draft layers are in the full-attention group, as vLLM groups them (SPD-003). With
        ``state_layers``: every attention layer's full-attention group, then the state
        group (RUNNING caching, block size ``max_model_len``, STG-001)."""
        if self.state_layers:
            return (KVCacheGroup(GroupKind.FULL, self.block_size, self.layer_names),
                    KVCacheGroup(GroupKind.STATE, self.max_model_len, self.state_layer_names,
                                 state_caching=StateCaching.RUNNING))
        if self.sliding_window is None:
            return ()
        names = self.layer_names[: self.num_layers]
        return (KVCacheGroup(GroupKind.FULL, self.block_size,
                             names[0::2] + self.draft_layer_names),
                KVCacheGroup(GroupKind.SLIDING_WINDOW, self.block_size, names[1::2],
                             window=self.sliding_window))

    def group_of_layer(self, layer: int) -> int:
        """The index of the KV-cache group ``layer`` belongs to (0 with one group; draft
        layers are in the full-attention group 0)."""
        if self.sliding_window is None or self.is_draft_layer(layer):
            return 0
        return layer % 2

    @property
    def torch_dtype(self) -> torch.dtype:
        """The KV dtype."""
        return _DTYPES[self.dtype]

    @property
    def pad_block(self) -> int:
        """The block the engine never hands out: padded and dummy tokens write here (DRY-009)."""
        return self.num_blocks - 1

    @property
    def heads_per_rank(self) -> int:
        """KV heads held by each TP rank."""
        return self.num_heads // self.tp_size

    def layout(self) -> KVCacheLayout:
        """The layout descriptor of one rank's KV tensors."""
        return KVCacheLayout.contiguous(
            self.order, self.packing, self.torch_dtype, self.total_layers, self.num_blocks,
            self.block_size, self.heads_per_rank, self.head_size,
            block_capacity=self.num_blocks + self.extra_capacity,
            page_padding_elems=self.page_padding, restridable=self.restridable,
        )

    def engine_view(self, tmpdir: str) -> EngineConfigView:
        """What the connector factory receives: ``extra`` is the user's connector
        configuration (``connector_extra``), then this config's own, then
        ``extra['kvspec.tmpdir']``, ``tmpdir``, and ``extra['kvspec.model']``, the model's
        KV heads (all ranks), head size and dtype, for adapters that must tell every role
        the same model (the vLLM wrapper)."""
        return EngineConfigView(
            engine_id=self.engine_id, role=self.role, num_layers=self.total_layers,
            block_size=self.block_size, num_blocks=self.num_blocks, tp_size=self.tp_size,
            extra={**connector_extra(), **self.extra, "kvspec.tmpdir": tmpdir,
                   "kvspec.model": {"num_kv_heads": self.num_heads, "head_size": self.head_size,
                                    "dtype": self.dtype}},
            async_scheduling=self.async_scheduling, kv_cache_groups=self.kv_cache_groups(),
            draft_layer_names=self.draft_layer_names,
            num_speculative_tokens=self.speculative_tokens,
        )

    def to_plain(self) -> dict[str, Any]:
        """Plain data for worker processes (never pickled, ERR-006)."""
        out: dict[str, Any] = {}
        for f in attrs.fields(HarnessConfig):
            v = getattr(self, f.name)
            if isinstance(v, (StrideOrder, KVPacking, TransferRole, GraphMode)):
                v = v.value
            elif f.name == "capture_sizes":
                v = list(v)
            elif f.name == "fail_steps":
                v = [list(pair) for pair in v]
            elif f.name == "extra":
                v = _plain(v)
            out[f.name] = v
        return out

    @classmethod
    def from_plain(cls, data: Mapping[str, Any]) -> HarnessConfig:
        """Inverse of ``to_plain``."""
        d = dict(data)
        d["packing"] = KVPacking(d["packing"])
        d["role"] = TransferRole(d["role"])
        d["graph_mode"] = GraphMode(d["graph_mode"])
        return cls(**d)


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value
