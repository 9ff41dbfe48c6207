"""A producer rank in its own process, for the NIXL transport tests.

Usage: ``python _producer.py FD NUM_BLOCKS SEED``. Registers an NHD float16 cache filled
with seeded random bytes, writes its PeerInfo JSON and a newline to file descriptor FD,
then serves reads until its stdin closes (or it is killed).
"""

from __future__ import annotations

import os
import sys

import torch

from kvspec.backends.nixl import NixlEndpoint
from kvspec.protocols import KVCacheLayout, KVPacking
from kvspec.spec import SPEC_VERSION


def producer_layout(num_blocks: int) -> KVCacheLayout:
    return KVCacheLayout.contiguous(
        "NHD", KVPacking.CONCAT, torch.float16, 4, num_blocks, 16, 4, 64
    )


def producer_bytes(layout: KVCacheLayout, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (layout.span_bytes,), dtype=torch.uint8, generator=gen)


def main() -> None:
    fd, num_blocks, seed = (int(a) for a in sys.argv[1:4])
    layout = producer_layout(num_blocks)
    buffer = producer_bytes(layout, seed)
    with NixlEndpoint(f"producer-{os.getpid()}", buffer, layout,
                      spec_version=SPEC_VERSION) as endpoint:
        os.write(fd, endpoint.info.encode() + b"\n")
        os.close(fd)
        sys.stdin.read()


if __name__ == "__main__":
    main()
