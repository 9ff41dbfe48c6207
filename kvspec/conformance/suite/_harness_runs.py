"""Running the harness engine for the suite modules: its configuration for a connector, a
workload served on a fresh engine, and why an engine does not start."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

from ...protocols import Capabilities, ConnectorFactory, KVPacking, StrideOrder
from ..harness import Engine, HarnessConfig, RunResult, Workload
from .._attribution import hide_unless_harness_bug

__all__ = ["DEVICE_ENV", "TIMEOUT_ENV", "config_for", "layout_cases", "serve", "start_engine", "startup_failure"]
__tracebackhide__ = hide_unless_harness_bug  # authors see their frames, not these


TIMEOUT_ENV = "KVSPEC_TRANSFER_TIMEOUT_S"
"""Environment variable: seconds an awaited transfer may stay unreported (default 10)."""
DEVICE_ENV = "KVSPEC_DEVICE"
"""Environment variable: the harness's device, ``cpu`` (default) or ``cuda[:N]``: KV caches,
forwards and real CUDA graphs on the GPU (``HarnessConfig.device``)."""


def config_for(caps: Capabilities, **overrides: Any) -> HarnessConfig:
    """A harness configuration in a layout and block size the connector accepts (its first
    preferences). At a declared block size larger than the harness's 4 tokens, the
    workloads' prompts, the step token budget and the capture sizes scale with it
    (``HarnessConfig.token_scale``), so the suite loses no hit to the larger block.

    The transfer timeout comes from ``$KVSPEC_TRANSFER_TIMEOUT_S`` when set, the device
    from ``$KVSPEC_DEVICE``.
    """
    if "order" not in overrides and caps.accepted_layouts:
        overrides["order"] = caps.accepted_layouts[0]
    if "block_size" not in overrides and caps.block_sizes:
        overrides["block_size"] = caps.block_sizes[0]
        # the suite's workloads are written for blocks of 4 tokens: scale them, and the
        # token budgets, so the connector sees as many full blocks, hits and chunks
        # (the suite's token counts, here or in the test's overrides, are design tokens)
        defaults = HarnessConfig()
        scale = overrides["block_size"] // defaults.block_size
        if scale > 1 and overrides["block_size"] % defaults.block_size == 0:
            overrides["token_scale"] = scale
            overrides["max_tokens_per_step"] = scale * overrides.get(
                "max_tokens_per_step", defaults.max_tokens_per_step)
            overrides["capture_sizes"] = tuple(scale * s for s in overrides.get(
                "capture_sizes", defaults.capture_sizes))
    if "transfer_timeout_s" not in overrides and os.environ.get(TIMEOUT_ENV):
        overrides["transfer_timeout_s"] = float(os.environ[TIMEOUT_ENV])
    if "device" not in overrides and os.environ.get(DEVICE_ENV):
        overrides["device"] = os.environ[DEVICE_ENV]
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


def start_engine(factory: ConnectorFactory) -> None:
    """Start an engine on ``factory`` in its first layout and block size (build every
    role, register the KV caches, exchange handshakes) and shut it down again."""
    with tempfile.TemporaryDirectory(prefix="kvspec-start-") as tmp:
        # a constructor that fails releases what it built (Engine._abandon)
        Engine(factory, config_for(factory.capabilities), tmpdir=tmp).shutdown()


_STARTS: dict[tuple[str, str], tuple[ConnectorFactory, str | None]] = {}


def startup_failure(factory: ConnectorFactory) -> str | None:
    """Why an engine on ``factory`` cannot be built (``ExceptionType: message``): a role's
    construction, the KV caches' registration or the handshakes raised; None when it
    starts (a fault at its shutdown, a leak, is left to the tests that check it). Tried
    once per connector and process: a connector that cannot start gets one clear result,
    not one failure per test."""
    key = (f"{type(factory).__module__}.{type(factory).__qualname__}",
           str(getattr(factory, "__kvspec_spec__", None) or factory.name))
    if key not in _STARTS:
        why: str | None = None
        with tempfile.TemporaryDirectory(prefix="kvspec-start-") as tmp:
            try:
                engine = Engine(factory, config_for(factory.capabilities), tmpdir=tmp)
            except Exception as e:  # reported, with its traceback, by test_engine_starts
                first = (str(e).strip().splitlines() or [""])[0][:300]
                why = f"{type(e).__name__}: {first}" if first else type(e).__name__
            else:  # it started: what its shutdown does wrong is other tests' verdict
                with contextlib.suppress(Exception):
                    engine.shutdown()
        _STARTS[key] = (factory, why)
    return _STARTS[key][1]
