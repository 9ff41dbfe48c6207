"""The raw-NIXL anchor of ``kvspec bench nixl``: how fast NIXL itself moves KV blocks.

``measure_raw_nixl`` moves ``num_blocks`` blocks of ``num_layers`` pages of
``page_bytes`` with one prepared NIXL READ between two agents (in one process, or with the
producer in a child process), using the minimal descriptor list of two layouts of the same
bytes:

* block-outermost (``[B, L, page]``): one descriptor of ``L * page`` bytes per block;
* layer-outermost (``[L, B, page]``): one descriptor of ``page`` bytes per layer and block.

Remote blocks are a fixed random permutation of the local ones (``shuffle``), so NIXL
cannot merge adjacent descriptors into one large copy. The transfer handle is prepared
once and reposted every round (no notification); a round times the post and the polling
until ``"DONE"``. The same-run ceiling copies the same number of bytes between two
contiguous pre-written tensors. Ceiling and both transfers are timed in the same loop, and
the result holds medians. Nothing is printed.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch

from kvspec.backends.nixl import load_nixl
from kvspec.protocols.errors import InvalidArgumentError, TransferTimeoutError

from ._timing import written_bytes

__all__ = ["RawNixlResult", "measure_raw_nixl"]

_POLL_TIMEOUT: Final = 60.0


@dataclass(frozen=True)
class RawNixlResult:
    """Medians of one ``measure_raw_nixl`` run.

    Attributes:
        num_blocks: Blocks per transfer.
        num_layers: Pages per block.
        page_bytes: Bytes per page.
        nbytes: Bytes per transfer (``num_blocks * num_layers * page_bytes``).
        processes: 1 (both agents in this process) or 2 (producer in a child process).
        shuffled: Whether remote blocks were a random permutation of the local ones.
        memcpy_s: Median time of the same-run copy of ``nbytes`` (the ceiling).
        per_block_s: Median time of the READ with one descriptor per block.
        per_block_descriptors: Descriptors in that transfer.
        per_layer_block_s: Median time of the READ with one descriptor per layer and block.
        per_layer_block_descriptors: Descriptors in that transfer.
        repeats: Timed rounds.
    """

    num_blocks: int
    num_layers: int
    page_bytes: int
    nbytes: int
    processes: int
    shuffled: bool
    memcpy_s: float
    per_block_s: float
    per_block_descriptors: int
    per_layer_block_s: float
    per_layer_block_descriptors: int
    repeats: int

    @property
    def per_block_ratio(self) -> float:
        """Ceiling time over transfer time: 1.0 moves blocks as fast as a memcpy."""
        return self.memcpy_s / self.per_block_s

    @property
    def per_layer_block_ratio(self) -> float:
        """Ceiling time over the per-(layer, block) transfer time."""
        return self.memcpy_s / self.per_layer_block_s

    def to_json(self) -> dict[str, Any]:
        """The fields and both ratios as a JSON-ready dict."""
        return {**asdict(self), "per_block_ratio": self.per_block_ratio,
                "per_layer_block_ratio": self.per_layer_block_ratio}


def _rows(base: int, num_blocks: int, num_layers: int, page: int,
          per_block: bool) -> npt.NDArray[np.uint64]:
    """Slot-major descriptor rows of ``num_blocks`` blocks: ``[B, L, page]`` with one row
    per block, or ``[L, B, page]`` with row ``layer * num_blocks + block`` (the order in
    which NIXL can merge runs of consecutive blocks, as in vLLM's lists)."""
    if per_block:
        starts = np.arange(num_blocks, dtype=np.uint64) * np.uint64(num_layers * page)
        length = num_layers * page
    else:
        starts = np.arange(num_layers * num_blocks, dtype=np.uint64) * np.uint64(page)
        length = page
    rows = np.zeros((starts.size, 3), dtype=np.uint64)
    rows[:, 0] = np.uint64(base) + starts
    rows[:, 1] = length
    return rows


def _indices(blocks: npt.NDArray[np.int64], per_block: int,
             num_blocks: int) -> npt.NDArray[np.int32]:
    slots = np.arange(per_block, dtype=np.int64) * num_blocks
    return (slots[:, None] + blocks[None, :]).reshape(-1).astype(np.int32)


def _run(agent: Any, handle: Any) -> None:
    status = agent.transfer(handle)
    deadline = time.monotonic() + _POLL_TIMEOUT
    while status == "PROC":
        if time.monotonic() > deadline:
            raise TransferTimeoutError(
                f"a raw NIXL READ did not finish within {_POLL_TIMEOUT} s", clause="ERR-007"
            )
        status = agent.check_xfer_state(handle)
    if status != "DONE":
        raise RuntimeError(f"raw NIXL READ ended as {status!r}")


class _Producer:
    """The producer agent: in this process, or a child serving until its stdin closes."""

    def __init__(self, api: Any, nbytes: int, seed: int, two_processes: bool,
                 name: str) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.agent: Any = None
        self.reg: Any = None
        if two_processes:
            rfd, wfd = os.pipe()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvspec.bench._nixl_raw", str(wfd), str(nbytes),
                 str(seed), name],
                pass_fds=(wfd,), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            os.close(wfd)
            with os.fdopen(rfd, "rb") as reader:
                line = reader.readline()
            if not line:
                self.close()
                raise RuntimeError("the raw NIXL producer process died before its handshake")
            obj = json.loads(line)  # plain data: {"metadata": hex, "base": int}
            self.metadata = bytes.fromhex(str(obj["metadata"]))
            self.base = int(obj["base"])
        else:
            self.buffer = written_bytes(nbytes, torch.Generator().manual_seed(seed))
            self.agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
            rows = np.array([[self.buffer.data_ptr(), nbytes, 0]], dtype=np.uint64)
            self.reg = self.agent.register_memory(rows, "DRAM")
            self.metadata = self.agent.get_agent_metadata()
            self.base = self.buffer.data_ptr()

    def close(self) -> None:
        if self.agent is not None and self.reg is not None:
            self.agent.deregister_memory(self.reg)
            self.reg = None
        if self.proc is not None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def measure_raw_nixl(
    num_blocks: int = 256,
    num_layers: int = 32,
    page_bytes: int = 4096,
    *,
    repeats: int = 15,
    warmup: int = 3,
    seed: int = 0,
    two_processes: bool = False,
    shuffle: bool = True,
    verify: bool = True,
    consumer_progress_thread: bool = True,
) -> RawNixlResult:
    """Time one prepared raw NIXL READ of ``num_blocks x num_layers x page_bytes`` bytes at
    both descriptor granularities against the same-run memcpy ceiling (see the module doc).

    ``consumer_progress_thread=False`` runs the reading agent without NIXL's progress
    thread (polling progresses it); NIXL's progress thread busy-polls, so on a small
    machine each agent's thread takes a core from the memcpy and from the other agent.

    Raises:
        InvalidArgumentError: a size or count below 1.
        NixlUnavailableError: nixl is not installed.
        RuntimeError: a transfer failed or moved the wrong bytes (``verify``).
    """
    for name, value in (("num_blocks", num_blocks), ("num_layers", num_layers),
                        ("page_bytes", page_bytes), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise InvalidArgumentError(f"warmup must be an int >= 0, got {warmup!r}")
    api = load_nixl()
    nbytes = num_blocks * num_layers * page_bytes
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    producer = _Producer(api, nbytes, seed, two_processes, f"raw-producer-{tag}")
    consumer = api.nixl_agent(f"raw-consumer-{tag}", api.nixl_agent_config(
        enable_prog_thread=consumer_progress_thread, backends=["UCX"]))
    gen = torch.Generator().manual_seed(seed + 1)
    dst = written_bytes(nbytes, gen)
    reg = consumer.register_memory(
        np.array([[dst.data_ptr(), nbytes, 0]], dtype=np.uint64), "DRAM"
    )
    handles: list[Any] = []
    remote_name: str | None = None
    try:
        loaded = consumer.add_remote_agent(producer.metadata)
        remote_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        local_ids = np.arange(num_blocks, dtype=np.int64)
        remote_ids = (np.random.default_rng(seed).permutation(num_blocks).astype(np.int64)
                      if shuffle else local_ids)
        xfers: dict[bool, Any] = {}
        for per_block in (True, False):
            local = consumer.prep_xfer_dlist(
                "NIXL_INIT_AGENT", _rows(dst.data_ptr(), num_blocks, num_layers, page_bytes,
                                         per_block), "DRAM")
            remote = consumer.prep_xfer_dlist(
                remote_name, _rows(producer.base, num_blocks, num_layers, page_bytes,
                                   per_block), "DRAM")
            handles += [local, remote]
            per = 1 if per_block else num_layers
            xfer = consumer.make_prepped_xfer(
                "READ", local, _indices(local_ids, per, num_blocks), remote,
                _indices(remote_ids, per, num_blocks),
            )
            handles.append(xfer)
            xfers[per_block] = xfer
        if verify:
            _verify(consumer, xfers, dst, producer, nbytes, seed, num_blocks, num_layers,
                    page_bytes, remote_ids)
        src_copy = written_bytes(nbytes, gen)
        dst_copy = written_bytes(nbytes, gen)
        steps: dict[str, Callable[[], object]] = {
            "memcpy": lambda: dst_copy.copy_(src_copy),
            "block": lambda: _run(consumer, xfers[True]),
            "layer_block": lambda: _run(consumer, xfers[False]),
        }
        times: dict[str, list[float]] = {k: [] for k in steps}
        for round_ in range(warmup + repeats):
            for key, step in steps.items():
                start = time.perf_counter()
                step()
                if round_ >= warmup:
                    times[key].append(time.perf_counter() - start)
        del src_copy, dst_copy
        return RawNixlResult(
            num_blocks=num_blocks,
            num_layers=num_layers,
            page_bytes=page_bytes,
            nbytes=nbytes,
            processes=2 if two_processes else 1,
            shuffled=shuffle,
            memcpy_s=statistics.median(times["memcpy"]),
            per_block_s=statistics.median(times["block"]),
            per_block_descriptors=num_blocks,
            per_layer_block_s=statistics.median(times["layer_block"]),
            per_layer_block_descriptors=num_blocks * num_layers,
            repeats=repeats,
        )
    finally:
        for handle in reversed(handles):
            handle.release()
        if remote_name is not None:
            consumer.remove_remote_agent(remote_name)
        consumer.deregister_memory(reg)
        producer.close()


def _verify(consumer: Any, xfers: dict[bool, Any], dst: torch.Tensor, producer: _Producer,
            nbytes: int, seed: int, num_blocks: int, num_layers: int, page: int,
            remote_ids: npt.NDArray[np.int64]) -> None:
    """Run each transfer once and check every byte against the producer's bytes."""
    src = (producer.buffer if producer.proc is None
           else written_bytes(nbytes, torch.Generator().manual_seed(seed)))
    order = torch.from_numpy(remote_ids)
    for per_block, xfer in xfers.items():
        dst.zero_()
        _run(consumer, xfer)
        shape = (num_blocks, num_layers * page) if per_block else (num_layers, num_blocks, page)
        got, want = dst.view(shape), src.view(shape)
        expected = want[order] if per_block else want[:, order]
        if not torch.equal(got, expected):
            raise RuntimeError(
                f"raw NIXL READ ({'per block' if per_block else 'per layer and block'}) "
                f"moved the wrong bytes"
            )


def _serve(fd: int, nbytes: int, seed: int, name: str) -> None:
    """Child-process producer: register seeded random bytes, hand over the agent metadata
    as plain JSON on ``fd``, serve READs until stdin closes."""
    api = load_nixl()
    buffer = written_bytes(nbytes, torch.Generator().manual_seed(seed))
    agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
    reg = agent.register_memory(
        np.array([[buffer.data_ptr(), nbytes, 0]], dtype=np.uint64), "DRAM"
    )
    line = json.dumps({"metadata": agent.get_agent_metadata().hex(),
                       "base": buffer.data_ptr()})
    os.write(fd, line.encode() + b"\n")
    os.close(fd)
    sys.stdin.read()
    agent.deregister_memory(reg)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
