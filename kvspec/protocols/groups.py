"""KV-cache groups: what a hybrid model's engine tells a connector about each block table.

A hybrid model keeps one KV-cache group per kind of layer (KVG-001): full attention, sliding-
window attention, chunked local attention, fixed-size state. Each group has its own block
size, layers and block table, and its own rule for which blocks the next token attends to,
so a match of N tokens needs different blocks of each group (KVG-003, ``needed_blocks``);
positions the group skipped hold the null block, which nobody moves (KVG-004). A connector
declares the kinds it handles (``Capabilities.group_kinds``, ``kv_cache_groups``) and
``check_groups`` refuses it for any other group, by name (KVG-002).

A state group (``GroupKind.STATE``: Mamba, Mamba2, gated delta nets, linear attention) keeps
one fixed-size state per request instead of per-token KV. Its ``state_caching`` says how the
engine keeps it (STG-001): ``RUNNING`` (vLLM's ``mamba_cache_mode="none"``, prefix caching
off) holds one state block per request, updated in place every step, with a block size of the
model's maximum length; ``ALIGNED`` (vLLM's ``"align"``) holds a position-indexed list where
block ``p`` is the state after exactly ``(p + 1) * block_size`` tokens. In both, the state after
``N`` tokens is at index ``ceil(N / block_size) - 1`` (``state_index``, STG-002), and the
group's list may carry ``num_scratch_blocks`` more blocks after it (speculative decoding).
State layers get no per-layer hook (STG-005); their tensors and ``StateLayout`` reach the
worker through ``register_state_caches``.

The rules are read from vLLM 0.32's hybrid allocator (``v1/core/single_type_kv_cache_manager.py``:
each manager's ``find_longest_cache_hit`` and ``get_num_skipped_tokens``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

from .errors import CapabilityError, InvalidArgumentError

__all__ = ["NULL_BLOCK_ID", "GroupKind", "KVCacheGroup", "StateCaching", "check_groups"]

NULL_BLOCK_ID = 0
"""The block id that stands for a position a group skipped (KVG-004): vLLM's shared null
block. Never read or written by a connector; never handed out for KV by the engine."""


class GroupKind(enum.Enum):
    """What the layers of a KV-cache group attend to (KVG-001)."""

    FULL = "full"
    """Full attention: every token attends to every earlier token."""
    SLIDING_WINDOW = "sliding_window"
    """Sliding-window attention of ``window`` tokens: a token attends to itself and the
    ``window - 1`` tokens before it."""
    CHUNKED_LOCAL = "chunked_local"
    """Chunked local attention of ``window`` tokens: a token attends to the earlier tokens
    of its own chunk ``[window * floor(p / window), p]``."""
    STATE = "state"
    """A fixed-size state per request (state-space layers): a match of N tokens needs the
    state after exactly N tokens only, at index ``ceil(N / block_size) - 1`` (STG-002)."""


class StateCaching(enum.Enum):
    """How the engine keeps a state group's states (STG-001)."""

    RUNNING = "running"
    """vLLM's ``mamba_cache_mode="none"`` (prefix caching off): one state block per request,
    updated in place every step; the group's block size is the model's maximum length, so
    the running state is always at index 0. A connector reads the state after N tokens from
    it only between the forward that computed token N and the next step's forward
    (STG-006)."""
    ALIGNED = "aligned"
    """vLLM's ``mamba_cache_mode="align"`` (prefix caching on): block ``p`` of the
    request's list holds the state after exactly ``(p + 1) * block_size`` tokens once the
    step that computed that boundary ran; earlier positions are the null block (KVG-004)."""


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"KVCacheGroup.{name} must be an int >= 1, got {value!r}",
                                   clause="KVG-001")
    return value


def _layer_names(value: object) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)) or not value \
            or not all(isinstance(n, str) and n for n in value):
        raise InvalidArgumentError(
            f"KVCacheGroup.layer_names must be a non-empty tuple of layer names, got {value!r}",
            clause="KVG-001")
    if len(set(value)) != len(value):
        raise InvalidArgumentError(f"KVCacheGroup.layer_names repeats a layer: {value!r}",
                                   clause="KVG-001")
    return tuple(value)


@attrs.frozen
class KVCacheGroup:
    """One KV-cache group of the engine (KVG-001).

    Attributes:
        kind: What its layers attend to.
        block_size: Tokens per block of this group.
        layer_names: Its layers, as the engine names them at registration.
        window: The sliding window (``SLIDING_WINDOW``) or the chunk (``CHUNKED_LOCAL``)
            in tokens; None for ``FULL`` and ``STATE``.
        state_caching: For a ``STATE`` group, how its states are kept (STG-001); None
            given for a state group means ``RUNNING`` (vLLM's default mode). None for every
            other kind.
        num_scratch_blocks: For a ``STATE`` group, the blocks after the state's index that
            the engine keeps for speculative steps (vLLM's ``num_speculative_blocks``);
            a connector never reads or loads them (STG-002). 0 for every other kind.

    Raises:
        InvalidArgumentError: a field out of range, ``window`` given for a kind that has
            none (or missing for one that needs it), or a state field given for a kind that
            is not ``STATE``.
    """

    kind: GroupKind
    block_size: int
    layer_names: tuple[str, ...] = attrs.field(converter=_layer_names)
    window: int | None = None
    state_caching: StateCaching | None = None
    num_scratch_blocks: int = 0

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.kind, GroupKind):
            raise InvalidArgumentError(f"KVCacheGroup.kind must be a GroupKind, got "
                                       f"{self.kind!r}", clause="KVG-001")
        _positive("block_size", self.block_size)
        windowed = self.kind in (GroupKind.SLIDING_WINDOW, GroupKind.CHUNKED_LOCAL)
        if windowed:
            _positive("window", self.window)
        elif self.window is not None:
            raise InvalidArgumentError(
                f"a {self.kind.value} group has no window, got window={self.window!r}",
                clause="KVG-001")
        if isinstance(self.num_scratch_blocks, bool) or not isinstance(
                self.num_scratch_blocks, int) or self.num_scratch_blocks < 0:
            raise InvalidArgumentError(
                f"KVCacheGroup.num_scratch_blocks must be an int >= 0, got "
                f"{self.num_scratch_blocks!r}", clause="STG-001")
        if self.kind is GroupKind.STATE:
            if self.state_caching is None:
                object.__setattr__(self, "state_caching", StateCaching.RUNNING)
            elif not isinstance(self.state_caching, StateCaching):
                raise InvalidArgumentError(
                    f"KVCacheGroup.state_caching must be a StateCaching, got "
                    f"{self.state_caching!r}", clause="STG-001")
        elif self.state_caching is not None or self.num_scratch_blocks:
            raise InvalidArgumentError(
                f"a {self.kind.value} group keeps no state, got state_caching="
                f"{self.state_caching!r}, num_scratch_blocks={self.num_scratch_blocks!r}",
                clause="STG-001")

    def state_index(self, num_tokens: int) -> int | None:
        """The index (into the request's block list of this ``STATE`` group) of the block
        that holds the state after exactly ``num_tokens`` tokens: ``ceil(num_tokens /
        block_size) - 1`` (STG-002), or None for ``num_tokens == 0`` (no state to move).
        Under ``RUNNING`` caching the block size is the model's maximum length, so this
        is 0; under ``ALIGNED`` it is the boundary block, with the running and scratch
        blocks after it (never "the last block").

        Raises:
            InvalidArgumentError: the group is not a ``STATE`` group, or ``num_tokens`` is
                not an int >= 0.
        """
        if self.kind is not GroupKind.STATE:
            raise InvalidArgumentError(
                f"state_index is for STATE groups, this one is {self.kind.value}",
                clause="STG-002")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidArgumentError(f"num_tokens must be an int >= 0, got {num_tokens!r}",
                                       clause="ERR-002")
        return None if num_tokens == 0 else -(-num_tokens // self.block_size) - 1

    def first_needed_token(self, num_tokens: int) -> int:
        """The first token whose KV the token after ``num_tokens`` computed ones attends to
        (KVG-003): 0 for full attention; ``num_tokens - window + 1`` (at least 0) for a
        sliding window; the start of the token's chunk for chunked local attention;
        ``num_tokens`` for a state group, which needs no token's KV but the state after
        them.

        Raises:
            InvalidArgumentError: ``num_tokens`` is not an int >= 0.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise InvalidArgumentError(f"num_tokens must be an int >= 0, got {num_tokens!r}",
                                       clause="ERR-002")
        if self.kind is GroupKind.FULL:
            return 0
        if self.kind is GroupKind.STATE:
            return num_tokens
        assert self.window is not None
        if self.kind is GroupKind.SLIDING_WINDOW:
            return max(0, num_tokens - self.window + 1)
        return num_tokens // self.window * self.window

    def needed_blocks(self, num_tokens: int) -> range:
        """Indices (into the request's block list of this group) of the blocks a match of
        ``num_tokens`` tokens must deliver (KVG-003); every other position below
        ``ceil(num_tokens / block_size)`` may hold the null block (KVG-004). A state group
        needs the one block at index ``ceil(num_tokens / block_size) - 1``, which holds the
        state after exactly the match's tokens (STG-002; ``state_index``), not the list's
        last block; an empty match needs nothing.

        Raises:
            InvalidArgumentError: ``num_tokens`` is not an int >= 0.
        """
        first = self.first_needed_token(num_tokens)
        end = -(-num_tokens // self.block_size)  # blocks holding the match's tokens
        if self.kind is GroupKind.STATE:
            return range(max(0, end - 1), end)
        if first >= num_tokens:  # a window of one token, or the first token of a chunk
            return range(end, end)
        return range(first // self.block_size, end)


def check_groups(groups: Sequence[KVCacheGroup], kinds: frozenset[GroupKind],
                 max_groups: int, *, connector: str = "the connector") -> None:
    """Negotiate an engine's groups with a connector's declaration (KVG-002): every group's
    kind must be among ``kinds`` and there may be at most ``max_groups`` groups
    (``Capabilities.group_kinds`` and ``Capabilities.kv_cache_groups``).

    Raises:
        InvalidArgumentError: ``groups`` is not a non-empty tuple or list of
            ``KVCacheGroup``, or a
            layer is in two groups (KVG-001).
        CapabilityError: a group the connector does not handle, named by index, kind and
            first layer, or more groups than it handles (KVG-002).
    """
    if not isinstance(groups, (tuple, list)) or not groups \
            or not all(isinstance(g, KVCacheGroup) for g in groups):
        raise InvalidArgumentError(
            f"groups must be a non-empty sequence of KVCacheGroup, got {groups!r}",
            clause="KVG-001")
    seen: dict[str, int] = {}
    for index, group in enumerate(groups):
        for name in group.layer_names:
            if name in seen:
                raise InvalidArgumentError(
                    f"layer {name!r} is in groups {seen[name]} and {index}; each layer belongs "
                    "to exactly one KV-cache group", clause="KVG-001")
            seen[name] = index
    for index, group in enumerate(groups):
        if group.kind not in kinds:
            handled = ", ".join(sorted(k.value for k in kinds)) or "none"
            raise CapabilityError(
                f"KV-cache group {index} ({group.kind.value}"
                f"{f' of {group.window} tokens' if group.window else ''}, layers "
                f"{group.layer_names[0]!r}...) is not a kind {connector} handles ({handled}); "
                + ("use a connector that declares GroupKind.STATE (a state group cannot be "
                   "merged into one KV-cache group: vLLM refuses "
                   "--disable-hybrid-kv-cache-manager for state-space models, STG-015)"
                   if group.kind is GroupKind.STATE else
                   "run the model with one KV-cache group (vLLM: "
                   "--disable-hybrid-kv-cache-manager) or use a connector that declares it"),
                clause="KVG-002")
    if len(groups) > max_groups:
        has_state = any(g.kind is GroupKind.STATE for g in groups)
        raise CapabilityError(
            f"the engine has {len(groups)} KV-cache groups and {connector} handles at most "
            f"{max_groups}; "
            + ("use a connector that handles that many groups (a model with state groups "
               "cannot run with one group, STG-015)" if has_state else
               "run the model with one group (vLLM: --disable-hybrid-kv-cache-manager)"),
            clause="KVG-002")
