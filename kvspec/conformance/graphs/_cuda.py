"""CUDA graphs behind the common API: ``torch.cuda.CUDAGraph`` used as torch documents it.

``capture(fn)`` warms ``fn`` up on a side stream, then captures it on another side stream,
as ``torch.cuda.graph`` does but ending a failed capture itself, into a private memory pool,
with the cyclic garbage collector off, under the same GRA-004 guards as the emulator (they
raise before CUDA sees the illegal call, so the capture ends cleanly). A
CUDA error about stream capture that the guards did not anticipate is turned into the same
``ContractViolation`` with the call site taken from its traceback.

Nothing here touches CUDA until a ``CudaCapturer`` is made.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ...protocols.errors import KVSpecError
from ._capture import (
    CaptureStateError,
    GraphCapturer,
    capture_region,
    CheckingDispatchMode,
    cuda_unavailable,
    ensure_not_capturing,
    host_sync_guard,
    require_callable,
    translate_capture_error,
)

__all__ = ["CudaCapturer", "CudaGraph"]

T = TypeVar("T")


class CudaGraph:
    """A captured ``torch.cuda.CUDAGraph`` (a ``CapturedGraph``).

    Holds the graph, its private memory pool and ``fn``'s outputs until ``reset``, so the
    addresses the graph writes stay allocated to it (GRA-004, GRA-005).
    """

    def __init__(self, graph: Any, pool: Any, device: torch.device, outputs: object) -> None:
        self._graph: Any = graph
        self._pool: Any = pool
        self._device = device
        self._outputs: object = outputs

    def replay(self) -> None:
        """Launch the graph on the current stream of its device (GRA-006).

        Raises:
            CaptureStateError: the graph was reset, or a capture is under way.
        """
        ensure_not_capturing("replay a graph")
        if self._graph is None:
            raise CaptureStateError("this graph was reset; capture it again to replay it")
        with torch.cuda.device(self._device):
            self._graph.replay()

    def reset(self) -> None:
        """Destroy the graph and drop its pool and outputs, so their memory can be freed."""
        if self._graph is not None:
            self._graph.reset()
        self._graph = None
        self._pool = None
        self._outputs = None


def _kvspec_error_in_chain(err: BaseException) -> KVSpecError | None:
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, KVSpecError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


class CudaCapturer(GraphCapturer):
    """The capturer ``make_capturer`` returns for ``cuda``: real CUDA graphs.

    Raises:
        CapabilityError: CUDA is not available.
    """

    def __init__(self, device: torch.device, warmup: int) -> None:
        import torch.cuda  # noqa: F401  (lazily: only a CUDA capturer needs it)

        if not torch.cuda.is_available():
            raise cuda_unavailable()
        index = device.index if device.index is not None else torch.cuda.current_device()
        super().__init__(torch.device("cuda", index), warmup)

    def capture(self, fn: Callable[[], T]) -> tuple[CudaGraph, T]:
        """See ``capture``."""
        require_callable(fn)
        ensure_not_capturing("start a capture")
        with torch.cuda.device(self.device):
            if self.warmup:
                side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(self.warmup):
                        fn()
                torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            pool = torch.cuda.graph_pool_handle()
            # As torch.cuda.graph does, on a side stream, but by hand: torch.cuda.graph's exit
            # ends the capture and only then restores the caller's stream, so when the end
            # fails (a call CUDA refused invalidated the capture) the caller is left on the
            # capture stream and every later capture fails ("a previous error during capture").
            # The cyclic garbage collector stays off while capturing: a graph it destroys
            # (another capture's, in a reference cycle) frees CUDA objects, a call CUDA
            # refuses during a capture, which invalidates this capture (seen on an H100).
            gc.collect()
            torch.cuda.synchronize(self.device)
            capture_stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            capture_stream.wait_stream(torch.cuda.current_stream(self.device))
            failure: BaseException | None = None
            collecting = gc.isenabled()
            gc.disable()
            try:
                with capture_region(), torch.cuda.stream(capture_stream):
                    graph.capture_begin(pool=pool)
                    try:
                        with host_sync_guard(), CheckingDispatchMode():
                            out = fn()
                    except BaseException as err:
                        failure = err
                    try:
                        graph.capture_end()
                    except Exception as err:
                        failure = failure or err
            finally:
                if collecting:
                    gc.enable()
            torch.cuda.current_stream(self.device).wait_stream(capture_stream)
            if failure is not None:
                # Free what the failed capture holds; a capture that never began has
                # nothing to free, and torch then raises, which changes nothing here.
                with contextlib.suppress(RuntimeError):
                    graph.reset()
                # Our own refusal, even if capture_end then failed on top of it.
                ours = _kvspec_error_in_chain(failure)
                if ours is not None:
                    raise ours from None
                violation = translate_capture_error(failure) \
                    if isinstance(failure, Exception) else None
                if violation is None:
                    raise failure
                raise violation from failure
        return CudaGraph(graph, pool, self.device, out), out
