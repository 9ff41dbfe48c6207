"""``kvspec demo pd``: prefill/decode disaggregation over NIXL, two engines, two processes.

A prefill engine (one process) computes each prompt and hands it off through the NIXL
backend (``NixlConnector``); a decode engine (another process)
reads the prompt's blocks over NIXL, then decodes. Each engine is the conformance harness's
engine, so every KV byte the decode engine's model reads, including every loaded block at
every layer, is checked against the value it must hold (WRK-013): a wrong byte stops the
demo with the clause it breaks. The processes exchange only the plain-data
``kv_transfer_params`` (JSON over a pipe, never pickle); NIXL moves the KV itself.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["PDOptions", "PDReport", "run_pd_demo"]


@dataclass(frozen=True)
class PDOptions:
    """What the demo serves.

    Attributes:
        requests: Requests handed from prefill to decode.
        prompt_tokens: Tokens per prompt.
        decode_tokens: Tokens each request decodes after the hand-off.
        layers, heads, head_size, block_size: The toy model and its KV layout.
        order: The KV stride order of both engines.
        prefill_tp, decode_tp: TP sizes of the two engines; they may differ (each decode
            rank then reads its heads from the prefill ranks that hold them).
        timeout_s: Bound on the whole demo.
    """

    requests: int = 8
    prompt_tokens: int = 257
    decode_tokens: int = 4
    layers: int = 8
    heads: int = 4
    head_size: int = 64
    block_size: int = 16
    order: str = "BLNHC"
    prefill_tp: int = 1
    decode_tp: int = 1
    timeout_s: float = 120.0

    def config(self, role: str) -> Any:
        """The harness configuration of the ``"prefill"`` or ``"decode"`` engine."""
        from kvspec.conformance.harness import HarnessConfig
        from kvspec.protocols import StrideOrder, TransferRole

        per_request = -(-self.prompt_tokens // self.block_size) + 1
        return HarnessConfig(
            num_layers=self.layers, num_heads=self.heads, head_size=self.head_size,
            block_size=self.block_size, num_blocks=per_request * self.requests + 8,
            order=StrideOrder.parse(self.order), prefix_caching=False,
            max_tokens_per_step=max(self.prompt_tokens * 2, 64), engine_id=role,
            role=TransferRole.PRODUCER if role == "prefill" else TransferRole.CONSUMER,
            transfer_timeout_s=self.timeout_s,
            tp_size=self.prefill_tp if role == "prefill" else self.decode_tp,
        )


@dataclass(frozen=True)
class PDReport:
    """What the demo measured.

    Attributes:
        options: The options served.
        handed_off: Requests the prefill engine handed off.
        finished: Requests the decode engine finished.
        loaded_tokens: Prompt tokens the decode engine loaded over NIXL (not recomputed).
        loaded_bytes: KV bytes those tokens occupy (every layer, K and V).
        decode_seconds: Wall time of the decode engine from its first request to the end.
        prefill_seconds: Wall time of the prefill engine.
        verified: True: every KV byte the decode model read held its expected value.
    """

    options: PDOptions
    handed_off: int
    finished: int
    loaded_tokens: int
    loaded_bytes: int
    decode_seconds: float
    prefill_seconds: float
    verified: bool

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)

    def lines(self) -> list[str]:
        """The human-readable report."""
        o = self.options
        mib = self.loaded_bytes / (1 << 20)
        return [
            f"kvspec demo pd: {o.requests} requests of {o.prompt_tokens} prompt tokens, "
            f"{o.layers} layers x {o.heads} heads x {o.head_size}, {o.order}, "
            f"{o.block_size} tokens/block, TP {o.prefill_tp} -> {o.decode_tp}",
            f"prefill engine: handed off {self.handed_off} requests in "
            f"{self.prefill_seconds:.2f} s",
            f"decode engine: loaded {self.loaded_tokens} tokens ({mib:.1f} MiB) over NIXL, "
            f"finished {self.finished} requests in {self.decode_seconds:.2f} s "
            f"({mib / max(self.decode_seconds, 1e-9):.1f} MiB/s end to end, compute included)",
            "verified: every KV byte the decode model read matched"
            if self.verified else "verification FAILED",
        ]


def _send(conn: multiprocessing.connection.Connection, obj: Mapping[str, Any]) -> None:
    conn.send_bytes(json.dumps(obj).encode())


def _recv(conn: multiprocessing.connection.Connection) -> dict[str, Any]:
    obj = json.loads(conn.recv_bytes().decode())
    if not isinstance(obj, dict):
        raise ValueError(f"demo peer sent {obj!r}")
    return obj


def _quiet_nixl() -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO lines to stdout


def _prefill(conn: multiprocessing.connection.Connection, raw: dict[str, Any]) -> None:
    _quiet_nixl()
    from kvspec.backends.nixl import NixlConnector
    from kvspec.conformance.harness import Engine, RequestSpec
    from kvspec.protocols import RequestStatus, thaw_params

    options = PDOptions(**raw)
    start = time.monotonic()
    handed: set[str] = set()
    try:
        with Engine(NixlConnector(), options.config("prefill")) as engine:
            _send(conn, {"ready": True})
            for i in range(options.requests):
                prompt = tuple(range(1000 * i, 1000 * i + options.prompt_tokens))
                engine.add_request(RequestSpec(f"req-{i}", prompt, max_new_tokens=1))
            deadline = start + options.timeout_s
            while time.monotonic() < deadline:
                for rid, r in engine.requests.items():
                    if rid not in handed and r.finished_called and (
                        r.status is RequestStatus.FINISHED
                    ):
                        handed.add(rid)
                        _send(conn, {"request_id": rid, "prompt": list(r.spec.prompt),
                                     "params": thaw_params(r.params)})
                if len(handed) == options.requests and engine.idle:
                    break
                engine.step()
            engine.drain()
        _send(conn, {"done": True, "handed_off": len(handed),
                     "seconds": time.monotonic() - start})
    except Exception as e:  # reported to the parent, which prints it
        _send(conn, {"error": f"prefill: {type(e).__name__}: {e}"})


def _decode(conn: multiprocessing.connection.Connection, raw: dict[str, Any]) -> None:
    _quiet_nixl()
    from kvspec.backends.nixl import NixlConnector
    from kvspec.conformance.harness import Engine, RequestSpec
    from kvspec.protocols import RequestStatus

    options = PDOptions(**raw)
    try:
        with Engine(NixlConnector(), options.config("decode")) as engine:
            _send(conn, {"ready": True})
            start: float | None = None
            added = 0
            finished = 0
            done = False
            deadline = time.monotonic() + options.timeout_s
            while time.monotonic() < deadline:
                while conn.poll():
                    msg = _recv(conn)
                    if msg.get("stop"):
                        done = True
                        continue
                    start = start or time.monotonic()
                    engine.add_request(RequestSpec(
                        msg["request_id"], tuple(msg["prompt"]),
                        max_new_tokens=options.decode_tokens, kv_transfer_params=msg["params"],
                    ))
                    added += 1
                if done and engine.idle:
                    break
                engine.step()
                now_finished = sum(1 for r in engine.requests.values()
                                   if r.status is RequestStatus.FINISHED)
                if now_finished != finished:
                    finished = now_finished
                    _send(conn, {"progress": finished})
            engine.drain()
            result = engine.result()
            layout = engine.config.layout()
            per_token = (layout.regions_per_block * layout.region_nbytes // layout.block_size
                         * engine.config.tp_size)  # every rank's heads
            loaded = sum(result.external_tokens.values())
        _send(conn, {"finished": len(result.finished), "loaded_tokens": loaded,
                     "loaded_bytes": loaded * per_token,
                     "seconds": time.monotonic() - (start or time.monotonic())})
    except Exception as e:
        _send(conn, {"error": f"decode: {type(e).__name__}: {e}"})


def run_pd_demo(
    options: PDOptions, progress: Callable[[float, str], None] | None = None
) -> PDReport:
    """Run the two engines in two processes and return what they measured.

    Args:
        options: What to serve.
        progress: Called with the seconds since the start and a line of text as the demo
            goes: the engines starting and ready, the hand-offs, the decode engine's
            finished requests (at most about one line a second for each), each engine done.

    Raises:
        RuntimeError: an engine failed (a contract violation names its clause) or the demo
            ran past ``options.timeout_s``.
    """
    began = time.monotonic()
    last_said: dict[str, float] = {}

    def say(text: str, *, every: str = "", last: bool = True) -> None:
        # ``every``: a kind of repeated line, said at most once a second unless ``last``
        now = time.monotonic()
        if progress is None or (every and not last and now - last_said.get(every, -9) < 1.0):
            return
        if every:
            last_said[every] = now
        progress(now - began, text)

    ctx = multiprocessing.get_context("spawn")
    p_parent, p_child = ctx.Pipe()
    d_parent, d_child = ctx.Pipe()
    raw = asdict(options)
    prefill = ctx.Process(target=_prefill, args=(p_child, raw), name="kvspec-demo-prefill")
    decode = ctx.Process(target=_decode, args=(d_child, raw), name="kvspec-demo-decode")
    say(f"starting the prefill engine (TP {options.prefill_tp}) and the decode engine "
        f"(TP {options.decode_tp}), one process each")
    prefill.start()
    decode.start()
    try:
        deadline = time.monotonic() + options.timeout_s + 30
        p_done: dict[str, Any] | None = None
        d_done: dict[str, Any] | None = None
        handed = 0
        while d_done is None:
            waiting = [d_parent] if p_done is not None else [p_parent, d_parent]
            ready = multiprocessing.connection.wait(
                waiting, max(0.0, deadline - time.monotonic()))
            if not ready or time.monotonic() > deadline:
                engine = "prefill" if p_done is None else "decode"
                raise RuntimeError(f"kvspec demo pd: the {engine} engine did not finish in time")
            for conn in ready:
                msg = _recv(conn)  # type: ignore[arg-type]
                if "error" in msg:
                    raise RuntimeError(msg["error"])
                if conn is p_parent:
                    if msg.get("ready"):
                        say("prefill engine ready")
                    elif msg.get("done"):
                        p_done = msg
                        _send(d_parent, {"stop": True})
                        say(f"prefill engine done: handed off {msg['handed_off']} requests in "
                            f"{float(msg['seconds']):.1f} s")
                    else:
                        _send(d_parent, msg)  # a hand-off: plain data to the decode engine
                        handed += 1
                        say(f"prefill engine: handed off {handed}/{options.requests} requests",
                            every="handed", last=handed == options.requests)
                elif msg.get("ready"):
                    say("decode engine ready")
                elif "progress" in msg:
                    n = int(msg["progress"])
                    say(f"decode engine: finished {n}/{options.requests} requests",
                        every="decoded", last=n == options.requests)
                else:
                    d_done = msg
        assert p_done is not None  # the decode engine stops only once told to
        say(f"decode engine done: finished {d_done['finished']} requests")
        return PDReport(
            options=options, handed_off=int(p_done["handed_off"]),
            finished=int(d_done["finished"]), loaded_tokens=int(d_done["loaded_tokens"]),
            loaded_bytes=int(d_done["loaded_bytes"]), decode_seconds=float(d_done["seconds"]),
            prefill_seconds=float(p_done["seconds"]), verified=True,
        )
    finally:
        for proc in (prefill, decode):
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
