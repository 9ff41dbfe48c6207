"""KV-cache groups: descriptors (KVG-001), negotiation (KVG-002), the blocks a match needs
per group kind (KVG-003) checked against the attention each kind computes, and vLLM 0.32's
hit rule for sliding windows."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.protocols import (
    NULL_BLOCK_ID,
    Capabilities,
    CapabilityError,
    GroupKind,
    InvalidArgumentError,
    KVCacheGroup,
    check_groups,
)

LAYERS = ("model.layers.0.attn",)


def attended(kind: GroupKind, window: int | None, n: int) -> set[int]:
    """Positions among the n computed tokens that the next token (position n) attends to,
    from the definition of each kind."""
    if kind is GroupKind.FULL:
        return set(range(n))
    assert window is not None
    if kind is GroupKind.SLIDING_WINDOW:
        return {p for p in range(n) if n - p < window}
    return {p for p in range(n) if p // window == n // window}  # same chunk


kinds_with_window = st.sampled_from([GroupKind.SLIDING_WINDOW, GroupKind.CHUNKED_LOCAL])


@given(kind=st.sampled_from(list(GroupKind)), window=st.integers(1, 200),
       block_size=st.integers(1, 64), n=st.integers(0, 2000))
def test_needed_blocks_are_the_blocks_of_the_attended_tokens(
        kind: GroupKind, window: int, block_size: int, n: int) -> None:
    """KVG-003: exactly the blocks holding tokens the next token attends to; a state group
    its last block (the state after token n)."""
    w = window if kind in (GroupKind.SLIDING_WINDOW, GroupKind.CHUNKED_LOCAL) else None
    group = KVCacheGroup(kind, block_size, LAYERS, w)
    needed = group.needed_blocks(n)
    if kind is GroupKind.STATE:
        expected = {(n - 1) // block_size} if n else set()
    else:
        expected = {p // block_size for p in attended(kind, w, n)}
    assert set(needed) == expected
    assert needed.step == 1 and needed.stop == -(-n // block_size)  # contiguous, ends at n


@given(window=st.integers(1, 300), block_size=st.integers(1, 64), k=st.integers(0, 60))
def test_a_sliding_window_hit_needs_vllm_s_contiguous_block_count(
        window: int, block_size: int, k: int) -> None:
    """vLLM 0.32's SlidingWindowManager needs cdiv(window - 1, block_size) contiguous
    blocks ending at the hit (at most all of them) for a hit of k whole blocks."""
    group = KVCacheGroup(GroupKind.SLIDING_WINDOW, block_size, LAYERS, window)
    assert len(group.needed_blocks(k * block_size)) == min(k, -(-(window - 1) // block_size))


def test_worked_examples() -> None:
    sliding = KVCacheGroup(GroupKind.SLIDING_WINDOW, 32, LAYERS, 64)
    assert sliding.first_needed_token(128) == 65
    assert sliding.needed_blocks(128) == range(2, 4)  # tokens 65..127
    assert sliding.needed_blocks(40) == range(0, 2)
    chunked = KVCacheGroup(GroupKind.CHUNKED_LOCAL, 16, LAYERS, 64)
    assert chunked.needed_blocks(64) == range(4, 4)  # a new chunk: nothing before it
    assert chunked.needed_blocks(80) == range(4, 5)
    state = KVCacheGroup(GroupKind.STATE, 16, LAYERS)
    assert state.needed_blocks(48) == range(2, 3) and state.needed_blocks(0) == range(0, 0)
    full = KVCacheGroup(GroupKind.FULL, 16, LAYERS)
    assert full.needed_blocks(33) == range(0, 3)
    assert NULL_BLOCK_ID == 0


@pytest.mark.parametrize(("kind", "window"), [
    (GroupKind.SLIDING_WINDOW, None), (GroupKind.CHUNKED_LOCAL, 0), (GroupKind.FULL, 64),
    (GroupKind.STATE, 8), (GroupKind.SLIDING_WINDOW, True), ("full", None),
])
def test_window_rules_of_each_kind(kind: object, window: object) -> None:
    """KVG-001: a window for the windowed kinds, none for the others."""
    with pytest.raises(InvalidArgumentError):
        KVCacheGroup(kind, 16, LAYERS, window)  # type: ignore[arg-type]


@pytest.mark.parametrize("layers", [(), "model.layers.0", ("a", "a"), ("a", ""), [1]])
def test_layer_names_are_checked(layers: object) -> None:
    with pytest.raises(InvalidArgumentError, match="layer"):
        KVCacheGroup(GroupKind.FULL, 16, layers)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [-1, 1.0, True, "3"])
def test_token_counts_are_checked(n: object) -> None:
    with pytest.raises(InvalidArgumentError):
        KVCacheGroup(GroupKind.FULL, 16, LAYERS).needed_blocks(n)  # type: ignore[arg-type]


HYBRID = (
    KVCacheGroup(GroupKind.FULL, 32, ("model.layers.1.attn", "model.layers.3.attn")),
    KVCacheGroup(GroupKind.SLIDING_WINDOW, 32, ("model.layers.0.attn", "model.layers.2.attn"),
                 64),
)


def test_a_single_group_connector_is_refused_by_name() -> None:
    """KVG-002: the default declaration (full attention, one group) refuses a sliding-window
    group, naming it and saying how to run with one group."""
    with pytest.raises(CapabilityError, match=r"group 1 \(sliding_window of 64 tokens.*"
                                              r"model\.layers\.0\.attn.*hybrid") as info:
        Capabilities().check_groups(HYBRID, connector="offload")
    assert info.value.clause == "KVG-002"
    with pytest.raises(CapabilityError, match="2 KV-cache groups.*at most 1"):
        check_groups(HYBRID[:1] * 1 + (KVCacheGroup(GroupKind.FULL, 16, ("x",)),),
                     frozenset({GroupKind.FULL}), 1)


def test_a_declaration_covering_the_groups_passes() -> None:
    caps = Capabilities(kv_cache_groups=2, group_kinds={"full", GroupKind.SLIDING_WINDOW})
    caps.check_groups(HYBRID)
    assert caps.group_kinds == frozenset({GroupKind.FULL, GroupKind.SLIDING_WINDOW})
    assert Capabilities().group_kinds == frozenset({GroupKind.FULL})


def test_a_layer_in_two_groups_is_refused() -> None:
    """KVG-001: each layer in exactly one group."""
    twice = (KVCacheGroup(GroupKind.FULL, 16, ("a", "b")),
             KVCacheGroup(GroupKind.STATE, 16, ("b",)))
    with pytest.raises(InvalidArgumentError, match="'b' is in groups 0 and 1"):
        check_groups(twice, frozenset(GroupKind), 2)


@pytest.mark.parametrize("groups", [(), "full", None, [object()]])
def test_malformed_groups_are_refused(groups: object) -> None:
    with pytest.raises(InvalidArgumentError):
        check_groups(groups, frozenset(GroupKind), 4)  # type: ignore[arg-type]


@pytest.mark.parametrize("kinds", ["full", set(), {"sliding"}, None, {3}])
def test_group_kinds_are_checked(kinds: object) -> None:
    with pytest.raises(InvalidArgumentError, match="group_kinds"):
        Capabilities(group_kinds=kinds)  # type: ignore[arg-type]
