"""vLLM's KV-cache group specs as kvspec's KVCacheGroup (kvspec.vllm._groups), on stand-ins
named as vLLM 0.32 names its spec classes (matched along the MRO), and on vLLM's own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvspec.protocols import Capabilities, CapabilityError, GroupKind
from kvspec.vllm._groups import groups_of


class FullAttentionSpec:
    block_size = 16


class MLAAttentionSpec(FullAttentionSpec):
    """A full-attention spec by inheritance, as vLLM's MLA spec is."""


class SlidingWindowSpec:
    block_size = 16
    sliding_window = 128


class ChunkedLocalAttentionSpec:
    block_size = 16
    attention_chunk_size = 256


class MambaSpec:
    block_size = 64


class CrossAttentionSpec(FullAttentionSpec):
    """A full-attention subclass kvspec cannot move: refused before its base matches."""


@dataclass
class Group:
    layer_names: list[str]
    kv_cache_spec: Any
    host_resident: bool = False
    enable_kv_transfer: bool = True


@dataclass
class Config:
    kv_cache_groups: list[Group] = field(default_factory=list)


def test_each_kind_and_its_window() -> None:
    config = Config([Group(["l0"], SlidingWindowSpec()), Group(["l1"], MLAAttentionSpec()),
                     Group(["l2"], ChunkedLocalAttentionSpec()), Group(["l3"], MambaSpec())])
    groups = groups_of(config)
    assert [(g.kind, g.window, g.block_size) for g in groups] == [
        (GroupKind.SLIDING_WINDOW, 128, 16), (GroupKind.FULL, None, 16),
        (GroupKind.CHUNKED_LOCAL, 256, 16), (GroupKind.STATE, None, 64)]
    with pytest.raises(CapabilityError, match=r"group 0 \(sliding_window of 128"):
        Capabilities(kv_cache_groups=4).check_groups(groups)
    Capabilities(kv_cache_groups=4, group_kinds=set(GroupKind)).check_groups(groups)


@pytest.mark.parametrize("group", [
    Group(["x"], CrossAttentionSpec()), Group(["x"], object()),
    Group(["x"], FullAttentionSpec(), host_resident=True),
    Group(["x"], FullAttentionSpec(), enable_kv_transfer=False),
])
def test_groups_kvspec_cannot_move_are_refused_by_name(group: Group) -> None:
    with pytest.raises(CapabilityError, match=r"vLLM KV-cache group 0 \(\w+, layers \('x',\)"):
        groups_of(Config([group]))


def test_vllm_s_own_spec_classes() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec as Full, KVCacheGroupSpec
    from vllm.v1.kv_cache_interface import SlidingWindowSpec as Sliding

    full = Full(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    sliding = Sliding(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32,
                      sliding_window=64)
    config = Config([KVCacheGroupSpec(["a"], sliding), KVCacheGroupSpec(["b"], full)])
    assert [(g.kind, g.window) for g in groups_of(config)] == [
        (GroupKind.SLIDING_WINDOW, 64), (GroupKind.FULL, None)]
