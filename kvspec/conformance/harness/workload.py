"""Workloads: the requests a harness run serves, as fixed scenarios or hypothesis strategies."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from kvspec.protocols import InvalidArgumentError, freeze_params

if TYPE_CHECKING:  # hypothesis is imported only when strategies are asked for
    from hypothesis.strategies import SearchStrategy

__all__ = ["RequestSpec", "Workload", "scale_request", "workloads"]


def _tokens(value: Any) -> tuple[int, ...]:
    out = tuple(value)
    if not out or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in out):
        raise InvalidArgumentError(f"prompt must be a non-empty sequence of ints >= 0, got {value!r}")
    return out


@attrs.frozen
class RequestSpec:
    """One request of a workload.

    Attributes:
        request_id: Unique id.
        prompt: Prompt token ids.
        max_new_tokens: Tokens to generate (>= 1).
        arrival_step: Step at which the request is added.
        cache_salt: Tenant salt (SCH-020).
        lora_id: LoRA adapter id (SCH-020).
        abort_at_step: Step at which the request is aborted, whatever its state.
        abort_while_loading: Abort the request as soon as it waits for remote KV: right
            after its blocks are allocated, before that step's metadata is built (SCH-021).
        kv_transfer_params: Plain-data parameters from another engine (two-engine mode).
        local_cache_blocks: When the request arrives, the engine's prefix cache keeps at
            most this many of its prompt's full blocks and evicts the rest, as memory
            pressure would: a partial local hit the connector may extend (SCH-007).
    """

    request_id: str
    prompt: tuple[int, ...] = attrs.field(converter=_tokens)
    max_new_tokens: int = 2
    arrival_step: int = 0
    cache_salt: str | None = None
    lora_id: int | None = None
    abort_at_step: int | None = None
    abort_while_loading: bool = False
    kv_transfer_params: Mapping[str, Any] | None = attrs.field(default=None, converter=freeze_params)
    local_cache_blocks: int | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidArgumentError(f"request_id must be a non-empty str, got {self.request_id!r}")
        if self.max_new_tokens < 1 or self.arrival_step < 0:
            raise InvalidArgumentError(
                f"request {self.request_id}: max_new_tokens must be >= 1 and arrival_step >= 0"
            )
        if self.local_cache_blocks is not None and (
            isinstance(self.local_cache_blocks, bool)
            or not isinstance(self.local_cache_blocks, int) or self.local_cache_blocks < 0
        ):
            raise InvalidArgumentError(
                f"request {self.request_id}: local_cache_blocks must be None or an int >= 0, "
                f"got {self.local_cache_blocks!r}"
            )
        if self.abort_at_step is not None and self.abort_at_step < self.arrival_step:
            raise InvalidArgumentError(
                f"request {self.request_id}: abort_at_step precedes arrival_step"
            )

    def describe(self) -> str:
        """A one-line Python expression that rebuilds this request."""
        parts = [f"{self.request_id!r}", f"prompt={list(self.prompt)!r}"]
        for f in attrs.fields(RequestSpec)[2:]:
            v = getattr(self, f.name)
            if v != f.default:
                parts.append(f"{f.name}={dict(v) if isinstance(v, Mapping) else v!r}")
        return f"RequestSpec({', '.join(parts)})"


def _requests(value: Iterable[RequestSpec]) -> tuple[RequestSpec, ...]:
    out = tuple(value)
    for r in out:
        if not isinstance(r, RequestSpec):
            raise InvalidArgumentError(f"a workload holds RequestSpec objects, got {r!r}")
    return out


@attrs.frozen
class Workload:
    """The requests of one run, plus a name for reports."""

    requests: tuple[RequestSpec, ...] = attrs.field(converter=_requests)
    name: str = "workload"

    def __attrs_post_init__(self) -> None:
        ids = [r.request_id for r in self.requests]
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError(f"workload {self.name!r} repeats a request id: {ids}")

    def describe(self) -> str:
        """A Python expression that rebuilds this workload (part of a failure's reproduction
        script)."""
        reqs = ",\n    ".join(r.describe() for r in self.requests)
        return f"Workload(name={self.name!r}, requests=[\n    {reqs},\n])"

    @property
    def seeds(self) -> frozenset[tuple[str | None, int | None]]:
        """The (salt, LoRA) tenants present."""
        return frozenset((r.cache_salt, r.lora_id) for r in self.requests)


def workloads(
    *, max_requests: int = 6, block_size: int = 4, allow_aborts: bool = True,
    max_prompt_blocks: int = 5,
) -> SearchStrategy[Workload]:
    """A hypothesis strategy of workloads: arrivals, lengths, shared prefixes, salts, LoRA
    ids and aborts. Preemptions come from running them on a small block budget."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw: Any) -> Workload:
        bases = draw(st.lists(
            st.lists(st.integers(0, 50), min_size=block_size, max_size=max_prompt_blocks * block_size),
            min_size=1, max_size=3,
        ))
        n = draw(st.integers(1, max_requests))
        reqs = []
        for i in range(n):
            base = draw(st.sampled_from(bases))
            cut = draw(st.integers(1, len(base)))
            tail = draw(st.lists(st.integers(0, 50), max_size=2 * block_size))
            arrival = draw(st.integers(0, 6))
            abort = None
            if allow_aborts and draw(st.integers(0, 5)) == 0:
                abort = arrival + draw(st.integers(0, 8))
            reqs.append(RequestSpec(
                f"req-{i}", tuple(base[:cut] + tail),
                max_new_tokens=draw(st.integers(1, 4)), arrival_step=arrival,
                cache_salt=draw(st.sampled_from([None, None, "tenant-a", "tenant-b"])),
                lora_id=draw(st.sampled_from([None, None, 1])), abort_at_step=abort,
            ))
        return Workload(tuple(reqs), name="generated")

    return build()


def scale_request(spec: RequestSpec, block_size: int, token_scale: int) -> RequestSpec:
    """``spec`` with its prompt scaled from design blocks of ``block_size // token_scale``
    tokens to blocks of ``block_size``: each token of a full design block ``t`` becomes the
    ``token_scale`` tokens ``t*s .. t*s+s-1``, each token after the last full design block
    becomes ``t*s``. Full blocks, shared prefixes (block for block) and the remainder are
    kept, so a workload written for small blocks tests the same traps at any block size."""
    if token_scale == 1:
        return spec
    design = block_size // token_scale
    full = len(spec.prompt) // design * design
    prompt = [t * token_scale + j for t in spec.prompt[:full] for j in range(token_scale)]
    prompt += [t * token_scale for t in spec.prompt[full:]]
    return attrs.evolve(spec, prompt=tuple(prompt))
