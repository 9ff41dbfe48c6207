"""One capture/replay API over two implementations: CUDA graphs and a CPU emulator.

Usage, modelled on ``torch.cuda.CUDAGraph``::

    capturer = make_capturer("cuda")            # or "cpu" for the emulator
    graph, out = capturer.capture(lambda: kv.index_select(0, idx))
    idx.copy_(new_idx)                          # per-step state, updated outside the graph
    graph.replay()                              # ``out`` now holds kv[new_idx], in place
    graph.reset()                               # release what the capture allocated

Semantics shared by both implementations (the rules a capturable connector's per-layer hooks
live under, clauses GRA-004, GRA-005 and GRA-006):

* ``capture(fn)`` first runs ``fn`` eagerly ``GraphCapturer.warmup`` times, with all its
  side effects (CUDA: on a side stream, as torch documents), then runs it once under capture.
  Under capture, device work is recorded, not executed: outputs hold no computed values yet
  (the emulator fills them with ``poison_value``), and in-place
  writes to existing tensors have not happened when ``capture`` returns.
* ``replay()`` re-runs the recorded device work, in order, on the same memory. Tensors
  allocated under capture keep their storage until ``CapturedGraph.reset``; ``fn``'s
  outputs are updated in place. Tensors that existed before capture are read and written at
  the same addresses, so their contents changed in place between replays are seen by the next
  replay (GRA-005), while tensors created afresh after capture are invisible to the graph.
  No Python runs at replay: a Python decision taken at capture time repeats at every replay
  (GRA-004).
* A host sync or an op with a data-dependent output shape inside ``fn`` raises
  ``ContractViolation`` for GRA-004 at once, naming the op and the
  Python call site (``file:line`` of the first frame outside torch and this package); see
  ``HOST_SYNC_OPS``, ``HOST_READ_METHODS`` and ``DATA_DEPENDENT_SHAPE_OPS``.
* One capture at a time in the process: a capture inside a capture, a capture while another
  thread captures, and a replay while any thread captures raise ``CaptureStateError``
  (this mirrors CUDA's default, global, capture mode).

Whether replay reproduces eager results byte for byte is what GRA-006 asks of a connector;
the agreement tests run the same patterns on both implementations and compare.
"""

from __future__ import annotations

import torch

from ...protocols.errors import InvalidArgumentError
from ._capture import (
    DATA_DEPENDENT_SHAPE_OPS,
    DEFAULT_WARMUP,
    HOST_READ_METHODS,
    HOST_SYNC_OPS,
    CapturedGraph,
    CaptureStateError,
    GraphCapturer,
)
from ._cuda import CudaCapturer
from ._emulator import EmulatorCapturer

__all__ = [
    "DATA_DEPENDENT_SHAPE_OPS",
    "DEFAULT_WARMUP",
    "HOST_READ_METHODS",
    "HOST_SYNC_OPS",
    "CaptureStateError",
    "CapturedGraph",
    "GraphCapturer",
    "make_capturer",
]


def make_capturer(device: torch.device | str, *, warmup: int = DEFAULT_WARMUP) -> GraphCapturer:
    """Return the capturer for ``device``: CUDA graphs for ``cuda``, the emulator for ``cpu``.

    Args:
        device: ``"cuda"``, ``"cuda:N"``, ``"cpu"`` or a ``torch.device`` of those types.
        warmup: Eager runs of ``fn`` before each capture (>= 0).

    Raises:
        CapabilityError: ``cuda`` was asked for and CUDA is not available.
        InvalidArgumentError: ``device`` is not a device of those types, or ``warmup`` is not a
            non-negative int.
    """
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise InvalidArgumentError(f"warmup must be an int >= 0, got {warmup!r}")
    if isinstance(device, str):
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError) as err:
            raise InvalidArgumentError(
                f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}"
            ) from err
    elif isinstance(device, torch.device):
        dev = device
    else:
        raise InvalidArgumentError(
            f"device must be a str or torch.device, got {type(device).__name__}"
        )
    if dev.type == "cuda":
        return CudaCapturer(dev, warmup)
    if dev.type == "cpu":
        return EmulatorCapturer(dev, warmup)
    raise InvalidArgumentError(
        f"no graph capturer for device type {dev.type!r}: use 'cuda' (CUDA graphs) or 'cpu' "
        "(the emulator)"
    )
