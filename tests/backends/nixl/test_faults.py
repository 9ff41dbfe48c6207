"""Fault injection for the NIXL backend inside a whole decode engine (issue 14): the
producer is gone, or alive but never answers (a hung peer). The decode engine reports the
failed receive, recomputes the blocks (the harness checks every KV byte the model reads),
never hangs, and afterwards its NIXL registrations, peers, threads and file descriptors are
back to their baseline."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import attrs
import numpy as np
import pytest
import torch

pytest.importorskip("nixl")

from kvspec.backends.nixl import NixlConnector, NixlWorker, PeerInfo, load_nixl  # noqa: E402
from kvspec.conformance.harness import (  # noqa: E402
    Engine,
    HarnessConfig,
    RequestSpec,
    Workload,
)
from kvspec.protocols import TransferRole  # noqa: E402

pytestmark = pytest.mark.nixl

SPEC = RequestSpec("r", tuple(range(23)), max_new_tokens=2)
CONFIG = HarnessConfig(prefix_caching=False)


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else set()


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def _handed_off() -> dict[str, Any]:
    """A real hand-off from a prefill engine that is shut down afterwards (no consumer
    reads while it runs: it frees at its free timeout)."""
    with Engine(NixlConnector(), attrs.evolve(
            CONFIG, role=TransferRole.PRODUCER, engine_id="prefill",
            extra={"nixl_free_timeout_s": 0.2})) as prefill:
        result = prefill.run(Workload([attrs.evolve(SPEC, max_new_tokens=1)], name="p"))
    params = result.transfer_params["r"]
    assert params is not None
    return dict(params)


class _SilentPeer:
    """A NIXL agent in this process with registered memory that never makes progress:
    reads from it never complete (a hung producer)."""

    def __init__(self) -> None:
        api = load_nixl()
        self.agent: Any = api.nixl_agent(f"silent-{os.getpid()}", api.nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"]))
        self.buf = torch.zeros(1 << 20, dtype=torch.uint8)
        self.reg = self.agent.register_memory(
            np.array([[self.buf.data_ptr(), self.buf.numel(), 0]], dtype=np.uint64), "DRAM")

    def close(self) -> None:
        self.agent.deregister_memory(self.reg)
        self.agent = self.reg = None


@pytest.mark.parametrize("fault", ["producer-gone", "producer-hangs"])
def test_the_decode_engine_recomputes_and_releases_everything(fault: str) -> None:
    params = _handed_off()
    threads = set(threading.enumerate())
    fds = _fds()
    silent = None
    if fault == "producer-hangs":  # the same hand-off, served by an agent that never answers
        silent = _SilentPeer()
        info = PeerInfo.from_json(params["peers"]["0"])
        fake = attrs.evolve(info, agent_name=silent.agent.name,
                            agent_metadata=silent.agent.get_agent_metadata(),
                            base_address=silent.buf.data_ptr(), nbytes=silent.buf.numel())
        params["peers"] = {"0": fake.to_json()}
    start = time.monotonic()
    with Engine(NixlConnector(), attrs.evolve(
            CONFIG, role=TransferRole.CONSUMER, engine_id="decode",
            extra={"nixl_transfer_timeout_s": 0.5})) as decode:
        out = decode.run(Workload([attrs.evolve(SPEC, kv_transfer_params=params)], name="d"))
        worker = decode.workers.runtime.connector  # type: ignore[attr-defined]
        assert isinstance(worker, NixlWorker)
    if silent is not None:  # its end of the connection is this process's too
        silent.close()
    assert time.monotonic() - start < 20  # no hang: bounded by the transfer timeout
    assert out.finished == ("r",)
    assert out.external_tokens["r"] == 0  # nothing loaded: all 20 tokens recomputed
    assert worker.endpoint is not None and worker.endpoint.resources().total == 0
    assert set(threading.enumerate()) <= threads
    leaked = {fd: _target(fd) for fd in _fds() - fds}
    assert not leaked, leaked  # before the fix: UCX shared memory and sockets, kept
    # alive by log records that held the exception (and through it the NIXL agent)
