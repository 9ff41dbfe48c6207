"""Fault injection for the NIXL backend inside a whole decode engine (issue 14): the
producer is gone, or alive but never answers (a hung peer). The decode engine reports the
failed receive, recomputes the blocks (the harness checks every KV byte the model reads),
never hangs, and afterwards its NIXL registrations, peers, threads and file descriptors are
back to their baseline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import attrs
import pytest
import torch

pytest.importorskip("nixl")

from kvspec.backends.nixl import NixlConnector, NixlWorker, PeerInfo  # noqa: E402
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


_SILENT = """
import json, sys
import numpy as np, torch
from kvspec.backends.nixl import load_nixl
api = load_nixl()
agent = api.nixl_agent("silent-" + sys.argv[1], api.nixl_agent_config(
    enable_prog_thread=False, backends=["UCX"]))
buf = torch.zeros(1 << 20, dtype=torch.uint8)
agent.register_memory(np.array([[buf.data_ptr(), buf.numel(), 0]], dtype=np.uint64), "DRAM")
print(json.dumps({"name": agent.name, "meta": agent.get_agent_metadata().hex(),
                  "addr": buf.data_ptr(), "nbytes": buf.numel()}), flush=True)
sys.stdin.read()  # never progresses: reads from it never complete; ends when stdin closes
"""


class _SilentPeer:
    """A NIXL agent in a child process with registered memory that never makes progress:
    reads from it never complete (a hung producer). In its own process, so the sockets it
    accepts are not counted against the engine under test."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _SILENT, str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # NIXL logs to stdout too: the JSON line is ours
            if line.startswith("{"):
                self.info = json.loads(line)
                return
        self.close()
        raise AssertionError("the silent NIXL peer did not start")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.mark.parametrize("fault", ["producer-gone", "producer-hangs"])
def test_the_decode_engine_recomputes_and_releases_everything(fault: str) -> None:
    params = _handed_off()
    threads = set(threading.enumerate())
    fds = _fds()
    silent = None
    if fault == "producer-hangs":  # the same hand-off, served by an agent that never answers
        silent = _SilentPeer()
        info = PeerInfo.from_json(params["peers"]["0"])
        fake = attrs.evolve(info, agent_name=silent.info["name"],
                            agent_metadata=bytes.fromhex(silent.info["meta"]),
                            base_address=silent.info["addr"], nbytes=silent.info["nbytes"])
        params["peers"] = {"0": fake.to_json()}
    start = time.monotonic()
    with Engine(NixlConnector(), attrs.evolve(
            CONFIG, role=TransferRole.CONSUMER, engine_id="decode",
            extra={"nixl_transfer_timeout_s": 0.5})) as decode:
        out = decode.run(Workload([attrs.evolve(SPEC, kv_transfer_params=params)], name="d"))
        worker = decode.workers.runtime.connector  # type: ignore[attr-defined]
        assert isinstance(worker, NixlWorker)
    if silent is not None:
        silent.close()
    assert time.monotonic() - start < 20  # no hang: bounded by the transfer timeout
    assert out.finished == ("r",)
    assert out.external_tokens["r"] == 0  # nothing loaded: all 20 tokens recomputed
    assert worker.endpoint is not None and worker.endpoint.resources().total == 0
    assert set(threading.enumerate()) <= threads
    leaked = {fd: _target(fd) for fd in _fds() - fds}
    assert not leaked, leaked  # before the fix: UCX shared memory and sockets, kept
    # alive by log records that held the exception (and through it the NIXL agent)
