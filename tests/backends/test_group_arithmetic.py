"""Properties of what the reference backends share about KV-cache groups
(``kvspec.backends._groups``) and of the offload pool's grouped copies: arithmetic over
blocks, checked against brute force (issue 33, KVG-003, KVG-004, KVG-008)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.backends._groups import whole_prefix
from kvspec.backends.offload._pool import HostPool
from kvspec.protocols import NULL_BLOCK_ID, GroupKind, KVCacheGroup, KVCacheLayout, KVPacking


@settings(max_examples=200, deadline=None)
@given(bs=st.integers(1, 8), window=st.integers(1, 40), start=st.integers(0, 6),
       n=st.integers(0, 12), lacking=st.sets(st.integers(0, 20), max_size=8))
def test_whole_prefix_is_the_longest_match_whose_needed_blocks_are_all_there(
        bs: int, window: int, start: int, n: int, lacking: set[int]) -> None:
    groups = (KVCacheGroup(GroupKind.FULL, bs, ("a",)),
              KVCacheGroup(GroupKind.SLIDING_WINDOW, bs, ("b",), window=window))
    got = whole_prefix(groups, 0, start, n, bs, lambda g, i: g == 1 and i in lacking)

    def ok(m: int) -> bool:
        needed = groups[1].needed_blocks((start + m) * bs)
        return not any(i in lacking for i in needed if i >= start)

    assert got == max((m for m in range(n + 1) if m == 0 or ok(m)), default=0)
    assert got == 0 or ok(got)
    assert all(not ok(m) for m in range(got + 1, n + 1))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_grouped_copies_move_each_groups_ids_and_never_the_null_block(data: st.DataObject) -> None:
    """Two storages, each shared by a layer of each group (vLLM's hybrid allocator): any
    positions, any null positions in the second group, any slots. A store then a load into
    other blocks moves exactly those blocks of both storages; block 0 is never read (its
    poison never reaches the pool) nor written; no other block changes."""
    storage = torch.randn(2, 16, 2, 4, 8)
    layout = KVCacheLayout.from_tensor(storage, packing=KVPacking.CONCAT, num_blocks=16,
                                       num_heads=2, head_size_k=4,
                                       shared_layers=((0, 1), (2, 3)))
    slots = layout.layer_slots
    pool = HostPool(storage, layout, 6, 1 << 20,
                    [frozenset({slots[0], slots[2]}), frozenset({slots[1], slots[3]})])
    ids = data.draw(st.lists(st.integers(1, 15), min_size=2, max_size=6, unique=True))
    n = len(ids) // 2
    full, window = ids[:n], ids[n:2 * n]
    nulls = data.draw(st.sets(st.integers(0, n - 1)))
    window = [NULL_BLOCK_ID if i in nulls else b for i, b in enumerate(window)]
    pos_slots = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n, unique=True))
    storage[:, NULL_BLOCK_ID] = float("nan")
    before = storage.clone()
    pool.store(pool.plan(full, pos_slots, columns=(full, window)))
    assert not pool.host.view(torch.float32).isnan().any()
    free = [b for b in range(1, 16) if b not in ids]
    targets = data.draw(st.permutations(free).map(lambda p: p[:2 * n]))
    t_full = targets[:n]
    t_window = [NULL_BLOCK_ID if w == NULL_BLOCK_ID else t for w, t in zip(window, targets[n:])]
    pool.load(pool.plan(t_full, pos_slots, columns=(t_full, t_window)))
    for src, dst in [*zip(full, t_full), *((w, t) for w, t in zip(window, t_window)
                                           if w != NULL_BLOCK_ID)]:
        assert torch.equal(storage[:, dst], before[:, src])
    moved = set(t_full) | {t for t in t_window if t != NULL_BLOCK_ID}
    untouched = [b for b in range(16) if b not in moved]
    assert torch.equal(storage[:, untouched].nan_to_num(7.0), before[:, untouched].nan_to_num(7.0))
