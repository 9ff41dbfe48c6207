"""Timing helpers of the benchmarks: medians of ``time.perf_counter`` runs and the
pre-written buffers of the memory-copy ceiling."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["ceiling_seconds", "median_seconds", "written_bytes"]

_CHUNK = 1 << 20


def median_seconds(fn: Callable[[], object], *, repeats: int, warmup: int) -> float:
    """The median wall time of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def written_bytes(nbytes: int, generator: torch.Generator) -> torch.Tensor:
    """A ``uint8`` tensor of ``nbytes`` random bytes, every page of it written.

    A fresh allocation reads as shared zero pages until written, which makes copies from
    it look faster than real memory traffic; so the bytes are random (a random 1 MiB chunk
    tiled, then the tail), and every page is touched before anything is timed.
    """
    out = torch.empty(nbytes, dtype=torch.uint8)
    chunk = torch.randint(0, 256, (min(nbytes, _CHUNK),), dtype=torch.uint8, generator=generator)
    whole = nbytes // chunk.numel() * chunk.numel() if nbytes else 0
    if whole:
        out[:whole].view(-1, chunk.numel()).copy_(chunk.expand(whole // chunk.numel(), -1))
    if whole < nbytes:
        out[whole:].copy_(chunk[: nbytes - whole])
    return out


def ceiling_seconds(
    nbytes: int, generator: torch.Generator, *, repeats: int, warmup: int
) -> float:
    """The median time to copy ``nbytes`` between two contiguous, pre-written tensors: the
    ceiling the offload copies are compared with."""
    src = written_bytes(nbytes, generator)
    dst = written_bytes(nbytes, generator)
    seconds = median_seconds(lambda: dst.copy_(src), repeats=repeats, warmup=warmup)
    del src, dst
    return seconds
