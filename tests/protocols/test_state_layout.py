"""State groups' descriptors: KVCacheGroup's state fields and the state index (STG-001,
STG-002), StateLayout's validation and byte addressing (STG-001, LAY-008), the refusal advice
for state groups (KVG-002), and the worker's state registration hook."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvspec.protocols import (
    CapabilityError,
    ConvLayout,
    EngineConfigView,
    GroupKind,
    InvalidArgumentError,
    InvalidBlockIdError,
    KVCacheGroup,
    LayoutMismatchError,
    StateCaching,
    StateComponent,
    StateLayout,
    TransferRole,
    UnsupportedOperationError,
    WorkerConnector,
    check_groups,
)

MAMBA2 = (("conv", (3, 160), torch.float32), ("ssm", (4, 32, 16), torch.float32))


@pytest.mark.kvspec_clause("STG-001")
def test_state_group_defaults_to_running_caching_and_other_kinds_keep_no_state() -> None:
    g = KVCacheGroup(GroupKind.STATE, 512, ("m.0",))
    assert g.state_caching is StateCaching.RUNNING and g.num_scratch_blocks == 0
    a = KVCacheGroup(GroupKind.STATE, 16, ("m.0",), state_caching=StateCaching.ALIGNED,
                     num_scratch_blocks=2)
    assert a.state_caching is StateCaching.ALIGNED
    with pytest.raises(InvalidArgumentError) as e:
        KVCacheGroup(GroupKind.FULL, 16, ("a",), state_caching=StateCaching.RUNNING)
    assert e.value.clause == "STG-001"
    with pytest.raises(InvalidArgumentError):
        KVCacheGroup(GroupKind.FULL, 16, ("a",), num_scratch_blocks=1)
    with pytest.raises(InvalidArgumentError):
        KVCacheGroup(GroupKind.STATE, 16, ("a",), state_caching="align")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        KVCacheGroup(GroupKind.STATE, 16, ("a",), num_scratch_blocks=-1)


@pytest.mark.kvspec_clause("STG-002")
@given(bs=st.integers(1, 64), n=st.integers(0, 3000))
def test_state_index_is_the_block_of_the_boundary_after_exactly_n_tokens(bs: int, n: int) -> None:
    """Block p holds the state after (p+1)*bs tokens (vLLM's align invariant): the state
    after n tokens is at the block whose boundary range (p*bs, (p+1)*bs] holds n."""
    g = KVCacheGroup(GroupKind.STATE, bs, ("m.0",), state_caching=StateCaching.ALIGNED)
    idx = g.state_index(n)
    if n == 0:
        assert idx is None and list(g.needed_blocks(0)) == []
        return
    assert idx is not None and idx * bs < n <= (idx + 1) * bs
    assert list(g.needed_blocks(n)) == [idx]
    # with RUNNING caching the block size is the model's length: always index 0
    assert KVCacheGroup(GroupKind.STATE, 4096, ("m.0",)).state_index(min(n, 4096)) == 0
    with pytest.raises(InvalidArgumentError):
        KVCacheGroup(GroupKind.FULL, bs, ("a",)).state_index(n)


@pytest.mark.kvspec_clause("STG-015")
def test_refusing_a_state_group_never_advises_disabling_the_hybrid_allocator() -> None:
    groups = (KVCacheGroup(GroupKind.FULL, 16, ("a",)), KVCacheGroup(GroupKind.STATE, 16, ("m",)))
    with pytest.raises(CapabilityError) as e:
        check_groups(groups, frozenset({GroupKind.FULL}), 2)
    assert "disable-hybrid-kv-cache-manager for state-space" in e.value.message
    assert "declares GroupKind.STATE" in e.value.message
    with pytest.raises(CapabilityError) as e:
        check_groups(groups, frozenset(GroupKind), 1)
    assert "run the model with one group" not in e.value.message
    # a sliding-window group keeps the old advice
    swa = (KVCacheGroup(GroupKind.FULL, 16, ("a",)),
           KVCacheGroup(GroupKind.SLIDING_WINDOW, 16, ("w",), window=8))
    with pytest.raises(CapabilityError) as e:
        check_groups(swa, frozenset({GroupKind.FULL}), 2)
    assert "--disable-hybrid-kv-cache-manager) or use" in e.value.message


@pytest.mark.kvspec_clause("STG-001")
def test_state_layout_packs_components_at_consecutive_offsets_and_pads_the_page() -> None:
    lay = StateLayout.contiguous(MAMBA2, 10, page_pitch_bytes=32768, conv_layout=ConvLayout.SD)
    assert [c.byte_offset for c in lay.components] == [0, 3 * 160 * 4]
    assert lay.content_bytes == 10112 and lay.page_pitch_bytes == 32768  # vLLM's NemotronH page
    store = torch.zeros(10, 32768, dtype=torch.int8)
    tensor = store[:, :10112].view(10, 1, 1, 10112)  # vLLM's (blocks, 1, 1, content) view
    lay.check_tensor(tensor)
    ssm = lay.component_view(tensor, 3, "ssm")
    assert ssm.shape == (4, 32, 16) and ssm.dtype == torch.float32
    ssm.fill_(2.5)
    raw = lay.block_bytes(tensor, 3)
    assert raw.dtype == torch.uint8 and raw.numel() == 10112
    assert torch.equal(raw[1920:].view(torch.float32), torch.full((4 * 32 * 16,), 2.5))
    assert int(store[3, 10112:].abs().sum()) == 0 and int(store[2].abs().sum()) == 0
    with pytest.raises(InvalidBlockIdError):
        lay.block_bytes(tensor, 10)
    with pytest.raises(InvalidArgumentError):
        lay.component("temporal")


@pytest.mark.kvspec_clause("LAY-008")
def test_state_layout_rejects_a_tensor_it_does_not_describe() -> None:
    lay = StateLayout.contiguous(MAMBA2, 10, page_pitch_bytes=32768)
    store = torch.zeros(10, 32768, dtype=torch.int8)
    bad = [store[:, :10112].view(torch.uint8).float(),  # not bytes
           store[:9, :10112],  # capacity
           store[:, :10000],  # content
           torch.zeros(10, 10112, dtype=torch.int8)]  # pitch
    for t in bad:
        with pytest.raises(LayoutMismatchError):
            lay.check_tensor(t)


@pytest.mark.kvspec_clause("STG-001")
def test_state_layout_is_validated() -> None:
    conv = StateComponent("conv", (3, 4), torch.float16, 0)
    assert conv.nbytes == 24
    with pytest.raises(InvalidArgumentError):
        StateComponent("x", (3, 4), torch.float32, 2)  # misaligned
    with pytest.raises(InvalidArgumentError):
        StateComponent("", (3,), torch.float32, 0)
    with pytest.raises(InvalidArgumentError):
        StateComponent("x", (), torch.float32, 0)
    ssm = StateComponent("ssm", (2,), torch.float32, 20)  # overlaps conv
    with pytest.raises(InvalidArgumentError):
        StateLayout((conv, ssm), 28, 28, 4, 4)
    ok = StateComponent("ssm", (2,), torch.float32, 24)
    StateLayout((conv, ok), 32, 64, 4, 4)
    for kwargs in ({"content_bytes": 30}, {"page_pitch_bytes": 16}, {"block_capacity": 3},
                   {"tp_rank": 1}, {"tp_replicated": 1}, {"conv_layout": "SD"}):
        args = {"components": (conv, ok), "content_bytes": 32, "page_pitch_bytes": 64,
                "num_blocks": 4, "block_capacity": 4, **kwargs}
        with pytest.raises(InvalidArgumentError):
            StateLayout(**args)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        StateLayout((conv, StateComponent("conv", (1,), torch.int8, 24)), 25, 32, 4, 4)


# (peers refusing a differing layout is pending: this checks the comparison only)
def test_same_state_as_compares_meaning_not_placement() -> None:
    a = StateLayout.contiguous(MAMBA2, 10, page_pitch_bytes=32768, conv_layout=ConvLayout.SD)
    b = StateLayout.contiguous(MAMBA2, 99, page_pitch_bytes=10112, conv_layout=ConvLayout.SD,
                               tp_size=1)
    assert a.same_state_as(b)
    ds = StateLayout.contiguous((("conv", (160, 3), torch.float32),) + MAMBA2[1:], 10,
                                conv_layout=ConvLayout.DS)
    assert ds.content_bytes == a.content_bytes and not a.same_state_as(ds)
    assert not a.same_state_as(StateLayout.contiguous(MAMBA2, 10, conv_layout=ConvLayout.DS))
    assert not a.same_state_as(StateLayout.contiguous(MAMBA2, 10, conv_layout=ConvLayout.SD,
                                                      tp_size=2, tp_rank=1))


def test_engine_config_names_state_layers_and_the_worker_hook_defaults_to_refusing() -> None:
    groups = (KVCacheGroup(GroupKind.FULL, 16, ("a0", "a1")),
              KVCacheGroup(GroupKind.STATE, 512, ("m0", "m1")),
              KVCacheGroup(GroupKind.STATE, 512, ("m2",)))
    cfg = EngineConfigView(engine_id="e", role=TransferRole.BOTH, num_layers=2, block_size=16,
                           num_blocks=8, kv_cache_groups=groups)
    assert cfg.state_group_ids == (1, 2) and cfg.state_layer_names == ("m0", "m1", "m2")
    plain = EngineConfigView(engine_id="e", role=TransferRole.BOTH, num_layers=2,
                             block_size=16, num_blocks=8)
    assert plain.state_group_ids == () and plain.state_layer_names == ()

    class Plain(WorkerConnector):
        def register_kv_caches(self, kv_caches, layout):  # type: ignore[no-untyped-def]
            pass

        def bind_connector_metadata(self, metadata):  # type: ignore[no-untyped-def]
            pass

        def clear_connector_metadata(self) -> None:
            pass

        def start_load_kv(self, forward_context):  # type: ignore[no-untyped-def]
            pass

        def wait_for_save(self) -> None:
            pass

        def get_finished(self, finished_req_ids):  # type: ignore[no-untyped-def]
            return None, None

    lay = StateLayout.contiguous(MAMBA2, 4)
    with pytest.raises(UnsupportedOperationError) as e:
        Plain().register_state_caches({"m0": torch.zeros(4, lay.content_bytes,
                                                          dtype=torch.int8)}, {1: lay})
    assert e.value.clause == "STG-001"
    assert math.prod(MAMBA2[1][1]) * 4 + math.prod(MAMBA2[0][1]) * 4 == lay.content_bytes
