"""kvspec's HiCache backend pieces that need no SGLang: the host pool described as a
``KVCacheLayout`` (a page is a block, its regions in SGLang's flat page order), the
layouts refused with their clause, and the shard file's page store."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvspec.protocols.errors import InvalidArgumentError, LayoutMismatchError
from kvspec.sglang._layout import describe_host_pool
from kvspec.sglang._store import PageStore, digest

L, T, H, D, P = 3, 16, 2, 4, 4  # layers, tokens, heads, head dim, page size


def _pool(layout: str, shape: tuple[int, ...], **extra: object) -> SimpleNamespace:
    buf = torch.arange(torch.Size(shape).numel(), dtype=torch.int32).view(shape)
    return SimpleNamespace(layout=layout, page_size=P, kv_buffer=buf, **extra)


def _flat_page(pool: SimpleNamespace, page: int) -> torch.Tensor:
    """SGLang's get_data_page(page * P, flat=True) for the layouts accepted."""
    b = pool.kv_buffer
    mha = b.dim() == (5 if pool.layout == "layer_first" else 6)  # else MLA: no K/V dim
    if pool.layout == "layer_first":
        tokens = slice(page * P, (page + 1) * P)
        return (b[:, :, tokens] if mha else b[:, tokens]).flatten()
    return (b[:, page:page + 1] if mha else b[page:page + 1]).flatten()


@pytest.mark.parametrize(("layout", "shape", "extra"), [
    ("layer_first", (2, L, T, H, D), {}),
    ("page_first_direct", (2, T // P, L, P, H, D), {}),
    ("layer_first", (L, T, 1, 6), {"kv_lora_rank": 4}),  # MLA
    ("page_first_direct", (T // P, L, P, 1, 6), {"kv_lora_rank": 4}),
])
def test_a_page_is_a_block_in_sglangs_flat_page_order(layout: str, shape: tuple[int, ...],
                                                       extra: dict[str, object]) -> None:
    pool = _pool(layout, shape, **extra)
    desc = describe_host_pool(pool)
    assert desc.num_blocks == T // P and desc.block_size == P
    flat = pool.kv_buffer.reshape(-1).view(torch.uint8)
    for page in range(T // P):
        regions = desc.block_region_offsets([page])[0].tolist()
        got = torch.cat([flat[o:o + desc.region_nbytes] for o in regions])
        assert torch.equal(got, _flat_page(pool, page).view(torch.uint8))


@pytest.mark.parametrize(("layout", "shape", "clause"), [
    ("page_first", (2, T, L, H, D), "LAY-001"),
    ("page_head", (2, T // P, H, P, L, D), "LAY-001"),
    ("page_unified", (2, T, L, H, D), "LAY-001"),
    ("layer_first", (2, L, T - 1, H, D), "LAY-008"),  # not whole pages
    ("layer_first", (L, T, 1, 6), "LAY-008"),  # MLA without kv_lora_rank
])
def test_layouts_kvspec_cannot_state_are_refused(layout: str, shape: tuple[int, ...], clause: str) -> None:
    with pytest.raises(LayoutMismatchError) as caught:
        describe_host_pool(_pool(layout, shape))
    assert caught.value.clause == clause


def _pages(n: int, size: int) -> list[list[memoryview]]:
    return [[memoryview(bytearray([i + 1]) * (size // 2)), memoryview(bytearray([i + 101]) * (size // 2))]
            for i in range(n)]


def test_page_store_round_trip_eviction_and_damage(tmp_path: Path) -> None:
    store = PageStore(tmp_path / "shard", page_bytes=64, capacity_bytes=4 * 64, ways=2, timeout_s=1)
    deadline = time.monotonic() + 5
    names = [digest(f"k{i}", "m|tp0of1") for i in range(10)]
    assert digest("k0", "m|tp1of2") != names[0]  # the rank is in the name
    with store.locked(False, deadline) as fd:
        assert fd is None  # a reader never creates the file
    with store.locked(True, deadline) as fd:
        assert fd is not None and not store.valid(fd)
        store.format(fd)
        pages = _pages(10, 64)
        assert all(store.write(fd, n, p) for n, p in zip(names, pages))
    with store.locked(False, deadline) as fd:
        assert fd is not None and store.valid(fd)
        held = [i for i, n in enumerate(names) if store.find(fd, n) is not None]
        assert 0 < len(held) <= 4 and 9 in held  # the last write stays
        out = [memoryview(bytearray(32)), memoryview(bytearray(32))]
        assert store.read(fd, store.find(fd, names[9]) or 0, out)
        assert bytes(out[0]) == bytes([10]) * 32 and bytes(out[1]) == bytes([110]) * 32
    with open(store.path, "r+b") as f:
        f.truncate(store._data + 10)
    with store.locked(False, deadline) as fd:
        assert fd is not None and not store.read(fd, 0, out)  # a short read is a miss


def test_page_store_refuses_less_than_one_set() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        PageStore(Path("x"), page_bytes=64, capacity_bytes=64, ways=2, timeout_s=1)
    assert caught.value.clause == "ERR-002"
