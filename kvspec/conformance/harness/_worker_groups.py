"""Worker groups: one rank in the engine's process, or one process per rank.

Process workers talk JSON over pipes (``send_bytes``/``recv_bytes``): the engine never
unpickles what a worker sends (ERR-006), every wait has a timeout (ERR-007), and shutdown
kills a worker that does not exit in time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any, Protocol

import attrs

from kvspec.protocols.wire import Envelope, resolve_type_path
from kvspec.protocols import (
    ConnectorFactory,
    load_factory,
    ConnectorMetadata,
    ConnectorStats,
    ContractViolation,
    HandshakeMetadata,
    HarnessError,
    KVConnectorOutput,
    KVSpecError,
    TransferTimeoutError,
)

from ._resources import Snapshot, snapshot
from ._worker_runtime import WorkerRuntime, decode_meta, encode_meta, open_device
from .config import HarnessConfig
from .._attribution import hide_unless_harness_bug

__all__ = ["InProcessWorkers", "ProcessWorkers", "WorkerDiedError", "WorkerGroup"]
__tracebackhide__ = hide_unless_harness_bug  # authors see their frames, not these

StepResult = tuple[list[KVConnectorOutput], list[dict[str, str]]]


class WorkerDiedError(KVSpecError):
    """A worker process exited without answering (killed, or crashed)."""


class WorkerGroup(Protocol):
    """The engine's view of its worker ranks."""

    def handshakes(self) -> dict[int, HandshakeMetadata | None]:
        """Each rank's handshake metadata (HSK-002)."""
        ...

    def step(self, msg: Mapping[str, Any], meta: ConnectorMetadata) -> StepResult:
        """Run one step on every rank; outputs in rank order and violations observed."""
        ...

    def poison(self, msg: Mapping[str, Any]) -> None:
        """Write the poisons of blocks freed since the last step now, without a step (the
        ``poison_*`` entries of a step message): at the end of a run, so that what a
        transfer writes into them afterwards is seen (WRK-017)."""
        ...

    def sleep(self) -> None:
        """Every rank: ``unregister_kv_caches``, then its KV tensors retired (WRK-018)."""
        ...

    def wake(self) -> dict[int, HandshakeMetadata | None]:
        """Every rank: new KV tensors, ``restore_kv_caches`` (WRK-019); the ranks' handshake
        metadata collected again (HSK-006)."""
        ...

    def shutdown(self) -> None:
        """Shut every rank down, within a bounded time."""
        ...


def _roundtrip(meta: ConnectorMetadata) -> Envelope:
    try:
        envelope = encode_meta(meta)
        decode_meta(type(meta), envelope)
    except KVSpecError:
        raise
    except Exception as e:  # the connector's own codec failed
        raise ContractViolation(
            "ERR-005", observed=f"{type(meta).__name__} failed to encode and decode: {e!r}",
            expected="metadata that decodes from its own encoding",
        ) from e
    return envelope


class InProcessWorkers:
    """TP 1: the single rank runs in the engine's process."""

    def __init__(self, factory: ConnectorFactory, config: HarnessConfig, tmpdir: str) -> None:
        self.runtime = WorkerRuntime(factory, config, 0, tmpdir)
        self.runtime.register()

    def handshakes(self) -> dict[int, HandshakeMetadata | None]:
        """Rank 0's handshake metadata."""
        return {0: self.runtime.connector.get_handshake_metadata()}

    def step(self, msg: Mapping[str, Any], meta: ConnectorMetadata) -> StepResult:
        """Encode and decode the metadata as if it crossed a process, then run the step."""
        decoded = decode_meta(type(meta), _roundtrip(meta))
        out, violations = self.runtime.step(msg, decoded)
        return [out], violations

    def poison(self, msg: Mapping[str, Any]) -> None:
        """Write the poisons now (``WorkerGroup.poison``)."""
        self.runtime.poison(msg)

    def sleep(self) -> None:
        """Unregister and retire the rank's KV tensors (``WorkerRuntime.sleep``)."""
        self.runtime.sleep()

    def wake(self) -> dict[int, HandshakeMetadata | None]:
        """Re-allocate and restore the rank's KV tensors; its handshake metadata again."""
        self.runtime.wake()
        return self.handshakes()

    def shutdown(self) -> None:
        """Shut the rank down."""
        self.runtime.shutdown()


def _import(path: str, what: str) -> Any:
    """The class a harness worker names (the harness's own processes run the factory the
    user named: a path that does not resolve is kvspec's failure)."""
    return resolve_type_path(path, what=what, error=HarnessError, clause=None)


def _send(conn: Connection, obj: Any) -> None:
    conn.send_bytes(json.dumps(obj).encode())


def worker_main(argv: list[str]) -> None:  # pragma: no cover - runs in a worker process
    """What a worker process runs (``python -m kvspec.conformance.harness._worker_process
    IN OUT``, started by ``ProcessWorkers``).

    Reads an init message (factory spec, config, rank, tmpdir, sys.path), then serves step
    and shutdown messages, all JSON, on the two inherited pipe fds.
    """
    conn_in = Connection(int(argv[0]), writable=False)
    conn_out = Connection(int(argv[1]), readable=False)
    try:
        init = json.loads(conn_in.recv_bytes())
        config = HarnessConfig.from_plain(init["config"])
        open_device(config.device)
        before = snapshot()  # what this process holds before the connector exists
        sys.path[:] = init["path"]
        factory = load_factory(init["factory"])
        rt = WorkerRuntime(factory, config, init["rank"], init["tmpdir"])
        rt.register()
        hs = rt.connector.get_handshake_metadata()
        _send(conn_out, {"ready": True, "handshake": hs.encode().decode() if hs else None})
        meta_types: dict[str, type[ConnectorMetadata]] = {}
        while True:
            req = json.loads(conn_in.recv_bytes())
            if req["type"] == "shutdown":
                rt.shutdown()
                _send(conn_out, {"ok": True, "leaked": _leaked_since(before)})
                return
            if req["type"] == "sleep":
                rt.sleep()
                _send(conn_out, {"ok": True})
                continue
            if req["type"] == "wake":
                rt.wake()
                hs = rt.connector.get_handshake_metadata()
                _send(conn_out, {"ok": True, "handshake": hs.encode().decode() if hs else None})
                continue
            if req["type"] == "poison":
                rt.poison(req["msg"])
                _send(conn_out, {"ok": True})
                continue
            envelope = Envelope.from_plain(req["meta"])
            mt = meta_types.get(envelope.type_path) or _import(envelope.type_path,
                                                               "metadata type")
            meta_types[envelope.type_path] = mt
            out, violations = rt.step(req["msg"], decode_meta(mt, envelope))
            custom = {}
            for field in ("stats", "worker_metadata"):
                value = getattr(out, field)
                if value is not None and type(value) is not ConnectorStats:
                    custom[field], bad = _encode_custom(value, field)
                    violations += bad
            _send(conn_out, {"out": out.to_wire(omit_custom=True), "custom": custom,
                             "violations": violations})
    except EOFError:
        return
    except BaseException as e:
        try:
            _send(conn_out, {"error": traceback.format_exc(), "verdict": _verdict(e)})
        except Exception:
            pass


def _verdict(exc: BaseException) -> dict[str, str] | None:
    """What an exception in a worker process means, judged here, where its traceback is:
    the clause it breaks (a ContractViolation, a kvspec error naming a clause, or a
    connector hook that crashed: ERR-010), ``{"harness": ...}`` for kvspec's own failure,
    or None. The parent raises the same verdict an in-process worker would get."""
    try:
        from .._attribution import find_violation, harness_error
    except Exception:  # judged by the parent as a bare worker error
        return None
    own = harness_error(exc)
    if own is not None:
        return {"harness": f"{type(own).__name__}: {own}"}
    found = find_violation(exc)
    if found is None:
        return None
    return {"clause": str(found.clause), "observed": found.observed,
            "expected": found.expected}


def _encode_custom(value: Any, field: str) -> tuple[dict[str, str] | None, list[dict[str, str]]]:
    """A custom stats or worker-metadata value as plain data, by its own ``encode()`` (its
    class decodes it with ``decode``): ``(Envelope.to_plain(), [])``, or ``(None, [violation])``
    for a value without that codec, which cannot cross a process boundary (EVT-009)."""
    cls = type(value)
    encode, decode = getattr(value, "encode", None), getattr(cls, "decode", None)
    if not callable(encode) or not callable(decode):
        return None, [{
            "clause": "EVT-009",
            "observed": f"the worker's {field} is a {cls.__qualname__}, which has no "
            "encode()/decode() codec, so it cannot cross from a worker process",
            "expected": "ConnectorStats, or a value whose encode() returns bytes that its "
            "class's decode() turns back into an equal value (like connector metadata)",
        }]
    data = encode()
    if not isinstance(data, (bytes, bytearray)):
        return None, [{
            "clause": "EVT-009",
            "observed": f"{cls.__qualname__}.encode() returned a {type(data).__name__}",
            "expected": "bytes",
        }]
    return Envelope.of(value, bytes(data)).to_plain(), []


def _decode_custom(entry: Mapping[str, str], types: dict[str, Any]) -> Any:
    """Rebuild what ``_encode_custom`` wrote (the type comes from the harness's own
    worker process, running the factory the user named)."""
    envelope = Envelope.from_plain(dict(entry))
    cls = types.get(envelope.type_path) or _import(envelope.type_path, "custom value type")
    types[envelope.type_path] = cls
    try:
        return cls.decode(envelope.data)
    except Exception as e:
        raise ContractViolation(
            "EVT-009", observed=f"{cls.__qualname__}.decode() failed on what its encode() "
            f"wrote in a worker process: {type(e).__name__}: {e}",
            expected="decode(encode(value)) returns an equal value",
        ) from e


def _leaked_since(before: Snapshot, grace_s: float = 2.0) -> dict[str, list[str]]:
    """What this process holds beyond ``before``, once ``grace_s`` passed without change
    to nothing (threads may take a moment to end)."""
    deadline = time.monotonic() + grace_s
    leaked = snapshot().new_since(before)
    while leaked and time.monotonic() < deadline:
        time.sleep(0.01)
        leaked = snapshot().new_since(before)
    return leaked


class ProcessWorkers:
    """TP > 1: one ``python -m`` process per rank, JSON over two inherited pipe fds."""

    def __init__(self, factory_spec: str, config: HarnessConfig, tmpdir: str) -> None:
        self.config = config
        self.timeout = config.worker_timeout_s
        self.conns: list[tuple[Connection, Connection]] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self._handshakes: dict[int, HandshakeMetadata | None] = {}
        self._custom_types: dict[str, Any] = {}
        try:
            for rank in range(config.tp_size):
                to_child_r, to_child_w = os.pipe()
                from_child_r, from_child_w = os.pipe()
                p = subprocess.Popen(
                    [sys.executable, "-m", "kvspec.conformance.harness._worker_process",
                     str(to_child_r), str(from_child_w)],
                    pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL,
                )
                os.close(to_child_r)
                os.close(from_child_w)
                self.procs.append(p)
                self.conns.append((Connection(from_child_r, writable=False),
                                   Connection(to_child_w, readable=False)))
                _send(self.conns[rank][1], {
                    "factory": factory_spec, "config": config.to_plain(), "rank": rank,
                    "tmpdir": tmpdir, "path": list(sys.path),
                })
            for rank in range(config.tp_size):  # the ranks start side by side
                reply = self._recv(rank, config.worker_start_timeout_s, "start")
                hs = reply["handshake"]
                self._handshakes[rank] = HandshakeMetadata.decode(hs.encode()) if hs else None
        except BaseException:
            self._kill()
            raise

    def _recv(self, rank: int, timeout_s: float | None = None,
              what: str = "answer") -> dict[str, Any]:
        conn = self.conns[rank][0]
        timeout_s = self.timeout if timeout_s is None else timeout_s
        if not conn.poll(timeout_s):
            raise TransferTimeoutError(
                f"worker rank {rank} did not {what} within {timeout_s} s", clause="ERR-007"
            )
        try:
            reply: dict[str, Any] = json.loads(conn.recv_bytes())
        except EOFError:
            code = self.procs[rank].poll()
            raise WorkerDiedError(f"worker rank {rank} died (exit code {code})") from None
        if "error" in reply:
            verdict = reply.get("verdict") or {}
            if "harness" in verdict:
                raise HarnessError(f"worker rank {rank}: {verdict['harness']}\n{reply['error']}")
            if "clause" in verdict:
                raise ContractViolation(verdict["clause"],
                                        observed=f"rank {rank}: {verdict['observed']}",
                                        expected=verdict["expected"], reproduce=reply["error"])
            raise KVSpecError(f"worker rank {rank} raised:\n{reply['error']}")
        return reply

    def handshakes(self) -> dict[int, HandshakeMetadata | None]:
        """Every rank's handshake metadata, decoded defensively (HSK-005)."""
        return dict(self._handshakes)

    def poison(self, msg: Mapping[str, Any]) -> None:
        """Send the poisons to every rank and wait for each to have written them."""
        payload = json.dumps({"type": "poison", "msg": msg}).encode()
        for _, out in self.conns:
            out.send_bytes(payload)
        for rank in range(len(self.conns)):
            self._recv(rank)

    def sleep(self) -> None:
        """Every rank unregisters and retires its KV tensors (``WorkerRuntime.sleep``)."""
        payload = json.dumps({"type": "sleep"}).encode()
        for _, out in self.conns:
            out.send_bytes(payload)
        for rank in range(len(self.conns)):
            self._recv(rank)

    def wake(self) -> dict[int, HandshakeMetadata | None]:
        """Every rank re-allocates and restores; their handshake metadata, collected again
        (HSK-006) and decoded defensively (HSK-005)."""
        payload = json.dumps({"type": "wake"}).encode()
        for _, out in self.conns:
            out.send_bytes(payload)
        for rank in range(len(self.conns)):
            hs = self._recv(rank)["handshake"]
            self._handshakes[rank] = HandshakeMetadata.decode(hs.encode()) if hs else None
        return self.handshakes()

    def step(self, msg: Mapping[str, Any], meta: ConnectorMetadata) -> StepResult:
        """Send the step to every rank, then collect the outputs in rank order."""
        envelope = _roundtrip(meta)
        payload = json.dumps({"type": "step", "msg": msg, "meta": envelope.to_plain()})
        for _, out in self.conns:
            out.send_bytes(payload.encode())
        outputs: list[KVConnectorOutput] = []
        violations: list[dict[str, str]] = []
        for rank in range(len(self.conns)):
            reply = self._recv(rank)
            output = KVConnectorOutput.from_wire(reply["out"])
            custom = {field: _decode_custom(entry, self._custom_types)
                      for field, entry in reply.get("custom", {}).items() if entry}
            outputs.append(attrs.evolve(output, **custom) if custom else output)
            violations += reply["violations"]
        return outputs, violations

    def shutdown(self) -> None:
        """Ask every rank to shut down; kill any that does not within the timeout.

        Raises:
            ContractViolation: a rank's connector failed to shut down (WRK-015).
        """
        errors: list[str] = []
        leaks: list[tuple[int, dict[str, list[str]]]] = []
        alive = [p.poll() is None for p in self.procs]  # a rank already dead is not judged
        try:
            for _, out in self.conns:
                try:
                    _send(out, {"type": "shutdown"})
                except (BrokenPipeError, OSError):
                    pass
            for rank in range(len(self.conns)):
                if not alive[rank]:
                    continue
                try:
                    reply = self._recv(rank)
                    if reply.get("leaked"):
                        leaks.append((rank, reply["leaked"]))
                except WorkerDiedError:
                    pass  # killed from outside, or already crashed and reported at a step
                except KVSpecError as e:
                    errors.append(f"rank {rank}: {e.message}")
        finally:
            self._kill()
        if errors:  # the same failure an in-process worker would raise directly
            raise ContractViolation(
                "WRK-015", observed="shutdown failed in worker processes: " + "; ".join(errors),
                expected="shutdown completes within a bounded time without error",
            )
        for rank, leaked in leaks:
            if "threads" in leaked:
                raise ContractViolation(
                    "WRK-015", observed=f"threads still alive after shutdown in the worker "
                    f"process of rank {rank}: {leaked['threads']}",
                    expected="shutdown releases every thread the connector started",
                )
        for rank, leaked in leaks:
            what = "; ".join(f"{kind}: {', '.join(items[:8])}" for kind, items in leaked.items())
            raise ContractViolation(
                "ERR-009", observed=f"still open after shutdown in the worker process of rank "
                f"{rank}: {what}",
                expected="shutdown releases every file descriptor (file, socket, pipe, shared "
                "memory) and child process the connector opened",
            )

    def _kill(self) -> None:
        for p in self.procs:
            try:
                p.wait(timeout=self.timeout / 10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        for pair in self.conns:
            for conn in pair:
                conn.close()
        self.procs, self.conns = [], []

