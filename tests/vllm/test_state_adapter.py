"""The adapter's translation of vLLM's state groups (issue 50), engine-free: vLLM's own
``MambaSpec`` (0.32 here, 0.33 on the engine-free lane) as kvspec's ``KVCacheGroup`` and
``StateLayout``, and its int8 state views split off the attention layers, as vLLM 0.32
registers them (measured: tests/vllm/test_state_space.py, docs/compatibility.md)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvspec.backends.offload import OffloadConnector
from kvspec.protocols import (
    CapabilityError,
    GroupKind,
    LayoutMismatchError,
    StateCaching,
    check_groups,
)
from kvspec.vllm._groups import groups_of
from kvspec.vllm._layout import StateSpec, describe_state_caches, state_component_names

CONV, SSM = (3, 160), (4, 32, 16)
CONTENT = 3 * 160 * 4 + 4 * 32 * 16 * 4  # 10,112 bytes
PAGE = 32768  # the 32-token fp32 attention page of 2 KV heads x 2*64
BLOCKS = 8


def _mamba(mode: str, block_size: int) -> Any:
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=block_size, shapes=(CONV, SSM),
                     dtypes=(torch.float32, torch.float32), page_size_padded=PAGE,
                     mamba_cache_mode=mode)


def _config(mode: str, block_size: int) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    attention = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64,
                                  dtype=torch.float32)
    return SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=_mamba(mode, block_size),
                        layer_names=["model.layers.0.mixer"]),
        SimpleNamespace(kv_cache_spec=attention, layer_names=["model.layers.1.mixer.attn"]),
    ])


@pytest.mark.parametrize(("mode", "block_size", "caching"), [
    ("none", 512, StateCaching.RUNNING), ("align", 32, StateCaching.ALIGNED)])
def test_mamba_spec_is_a_state_group_with_its_caching_mode(
        mode: str, block_size: int, caching: StateCaching) -> None:
    state, full = groups_of(_config(mode, block_size))
    assert (state.kind, state.block_size, state.state_caching, state.num_scratch_blocks) == (
        GroupKind.STATE, block_size, caching, 0)
    assert full.kind is GroupKind.FULL and full.state_caching is None
    assert state.state_index(96) == (0 if mode == "none" else 2)  # STG-002


def test_a_connector_without_state_is_refused_with_advice_that_works() -> None:
    """STG-015: the refusal names a connector that declares STATE, never the hybrid
    allocator's off switch (vLLM cannot merge a state group with attention)."""
    groups = groups_of(_config("none", 512))
    with pytest.raises(CapabilityError) as e:
        check_groups(groups, frozenset({GroupKind.FULL}), 8, connector="connector 'x'")
    assert "GroupKind.STATE" in e.value.message
    assert "disable-hybrid-kv-cache-manager for state-space" in e.value.message
    check_groups(groups, OffloadConnector().capabilities.group_kinds, 8, connector="offload")


def _vllm_like_caches() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One buffer, aliased from byte 0 by the attention layer ``[B, H, N, 2D]`` fp32 and
    the Mamba layer's int8 ``(B, 1, 1, content)`` view with the padded block stride."""
    buffer = torch.zeros(BLOCKS * PAGE, dtype=torch.int8)
    attention = buffer.view(torch.float32).view(BLOCKS, 2, 32, 128)
    state = torch.as_strided(buffer, (BLOCKS, 1, 1, CONTENT), (PAGE, CONTENT, CONTENT, 1))
    return buffer, {"model.layers.0.mixer": state, "model.layers.1.mixer.attn": attention}


def _spec(page_bytes: int = PAGE) -> StateSpec:
    return StateSpec(layer_names=("model.layers.0.mixer",), shapes=(CONV, SSM),
                     dtypes=(torch.float32, torch.float32), page_bytes=page_bytes,
                     mamba_type="MAMBA2")


def test_state_views_are_described_apart_from_the_attention_layers() -> None:
    buffer, caches = _vllm_like_caches()
    tensors, layouts = describe_state_caches(caches, {0: _spec()}, num_blocks=BLOCKS,
                                             conv_layout="SD", tp_size=1, tp_rank=0)
    assert list(tensors) == ["model.layers.0.mixer"]
    assert tensors["model.layers.0.mixer"] is caches["model.layers.0.mixer"]  # LAY-009
    layout = layouts[0]
    assert [(c.name, c.shape, c.byte_offset) for c in layout.components] == [
        ("conv", CONV, 0), ("ssm", SSM, 1920)]
    assert (layout.content_bytes, layout.page_pitch_bytes, layout.conv_layout.value) == (
        CONTENT, PAGE, "SD")
    # The component views are the bytes vLLM's bind_kv_cache gives the layer: block 3's
    # ssm state starts 3 pages and 1,920 bytes into the shared buffer.
    ssm = layout.component_view(tensors["model.layers.0.mixer"], 3, "ssm")
    ssm.fill_(1.5)
    raw = buffer[3 * PAGE + 1920:3 * PAGE + CONTENT].view(torch.float32)
    assert raw.eq(1.5).all() and buffer[3 * PAGE + CONTENT:4 * PAGE].eq(0).all()


def test_a_state_view_that_breaks_its_spec_is_refused_by_name() -> None:
    _, caches = _vllm_like_caches()
    with pytest.raises(LayoutMismatchError) as e:  # the spec says another pitch
        describe_state_caches(caches, {0: _spec(page_bytes=2 * PAGE)}, num_blocks=BLOCKS,
                              conv_layout="SD", tp_size=1, tp_rank=0)
    assert e.value.clause == "LAY-008" and "model.layers.0.mixer" in e.value.message
    with pytest.raises(LayoutMismatchError):  # a state layer vLLM did not register
        describe_state_caches({}, {0: _spec()}, num_blocks=BLOCKS, conv_layout="SD",
                              tp_size=1, tp_rank=0)


def test_component_names_follow_the_state_kind() -> None:
    assert state_component_names("MAMBA2", 2) == ("conv", "ssm")
    assert state_component_names("GDN_ATTN", 3) == ("conv", "ssm", "extra1")
    assert state_component_names("LINEAR", 1) == ("state0",)
