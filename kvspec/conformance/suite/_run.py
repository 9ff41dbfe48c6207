"""Helpers shared by the suite modules that drive the harness engine."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ...protocols import Capabilities, ConnectorFactory, KVPacking, StrideOrder
from ..harness import Engine, HarnessConfig, RunResult, Workload
from .._tracebacks import hide_unless_harness_bug

__all__ = ["TIMEOUT_ENV", "config_for", "layout_cases", "serve"]
__tracebackhide__ = hide_unless_harness_bug  # authors see their frames, not these


TIMEOUT_ENV = "KVSPEC_TRANSFER_TIMEOUT_S"
"""Environment variable: seconds an awaited transfer may stay unreported (default 10)."""


def config_for(caps: Capabilities, **overrides: Any) -> HarnessConfig:
    """A harness configuration in a layout and block size the connector accepts (its first
    preferences).

    The transfer timeout comes from ``$KVSPEC_TRANSFER_TIMEOUT_S`` when set.
    """
    if "order" not in overrides and caps.accepted_layouts:
        overrides["order"] = caps.accepted_layouts[0]
    if "block_size" not in overrides and caps.block_sizes:
        overrides["block_size"] = caps.block_sizes[0]
    if "transfer_timeout_s" not in overrides and os.environ.get(TIMEOUT_ENV):
        overrides["transfer_timeout_s"] = float(os.environ[TIMEOUT_ENV])
    return HarnessConfig(**overrides)


def layout_cases(caps: Capabilities) -> list[tuple[StrideOrder, KVPacking]]:
    """Every (order, packing) the connector declares it accepts."""
    orders = caps.accepted_layouts or tuple(StrideOrder)
    packings = (KVPacking.CONCAT, KVPacking.SPLIT) if caps.accepts_split_kv else (KVPacking.CONCAT,)
    return [(o, p) for o in orders for p in packings]


def serve(factory: ConnectorFactory, workload: Workload, tmpdir: Path | str,
          **overrides: Any) -> RunResult:
    """Run ``workload`` to completion on a fresh engine and shut it down."""
    cfg = config_for(factory.capabilities, **overrides)
    with Engine(factory, cfg, tmpdir=str(tmpdir)) as engine:
        return engine.run(workload)
