"""Graph capture and replay for capturable connector hooks: CUDA graphs, or a CPU emulator.

``make_capturer`` returns a ``GraphCapturer`` for a device: ``"cuda"`` captures real
``torch.cuda.CUDAGraph`` s, ``"cpu"`` the emulator, which records ATen ops under a
``TorchDispatchMode`` and replays them with the same semantics. Both refuse, inside a captured
region, host syncs and data-dependent shapes (GRA-004), own what the capture allocated until
``CapturedGraph.reset`` and read persistent buffers updated between replays (GRA-005), and
replay exactly the work recorded at capture (GRA-006). See ``kvspec.conformance.graphs.api``.
"""

from __future__ import annotations

from ._cuda import CudaCapturer, CudaGraph
from ._emulator import EmulatedGraph, EmulatorCapturer, poison_value
from .api import (
    DATA_DEPENDENT_SHAPE_OPS,
    DEFAULT_WARMUP,
    HOST_READ_METHODS,
    HOST_SYNC_OPS,
    CapturedGraph,
    CaptureStateError,
    GraphCapturer,
    make_capturer,
)

__all__ = [
    "DATA_DEPENDENT_SHAPE_OPS",
    "DEFAULT_WARMUP",
    "HOST_READ_METHODS",
    "HOST_SYNC_OPS",
    "CaptureStateError",
    "CapturedGraph",
    "CudaCapturer",
    "CudaGraph",
    "EmulatedGraph",
    "EmulatorCapturer",
    "GraphCapturer",
    "make_capturer",
    "poison_value",
]
