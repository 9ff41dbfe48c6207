"""The harness configuration the suite gives a connector follows its declaration."""

from __future__ import annotations

from kvspec.conformance.suite._run import config_for, layout_cases
from kvspec.protocols import Capabilities, KVPacking, StrideOrder


def test_first_declared_layout_and_block_size_are_used() -> None:
    caps = Capabilities(accepted_layouts=("HND", "NHD"), block_sizes=(32, 64))
    cfg = config_for(caps)
    assert cfg.order is StrideOrder.LBHNC and cfg.block_size == 32
    assert config_for(caps, block_size=64, order="NHD").block_size == 64  # tests override


def test_undeclared_block_size_keeps_the_harness_default() -> None:
    assert config_for(Capabilities()).block_size == config_for(Capabilities(), order="NHD").block_size


def test_layout_cases_follow_split_kv() -> None:
    assert layout_cases(Capabilities(accepted_layouts=("HND",), accepts_split_kv=False)) == [
        (StrideOrder.LBHNC, KVPacking.CONCAT)]
    assert len(layout_cases(Capabilities())) == 12
