"""Record the hook calls an engine makes into a connector, and check them against the spec.

For engine developers and for kvspec itself: wrap any connector in
``RecordingConnector``, run it in a real engine, and ``check_call_order`` says
where the engine's calls break the order of docs/spec/state-machines.md, clause by clause.
The recorder appends one JSON line per hook call to a file, so the scheduler and the
workers may live in different processes; it changes nothing the connector sees or returns.

Configured without arguments (engines build factories with no-argument constructors) from
``KVSPEC_RECORD_INNER`` (the wrapped connector's ``"pkg.module:Factory"``) and
``KVSPEC_RECORD_PATH`` (the JSON-lines file), or with explicit arguments.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from kvspec.protocols import (
    AllocatedBlocks,
    Capabilities,
    ConnectorFactory,
    ConnectorMetadata,
    EngineConfigView,
    ExecutorConnector,
    ForwardContextView,
    InvalidArgumentError,
    KVCacheEvent,
    KVCacheLayout,
    KVConnectorOutput,
    RequestView,
    SchedulerConnector,
    SchedulerOutputView,
    WorkerConnector,
    load_factory,
)
from kvspec.protocols.metadata import HandshakeMetadata

__all__ = ["Call", "RecordingConnector", "Violation", "check_call_order", "read_calls"]

_LOCK = threading.Lock()


def _writer(path: Path, role: str, rank: int | None) -> Callable[..., None]:
    def write(hook: str, **fields: Any) -> None:
        line = json.dumps({"t": time.monotonic_ns(), "pid": os.getpid(), "role": role,
                           "rank": rank, "hook": hook, **fields}, sort_keys=True)
        with _LOCK, path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
    return write


class _RecordingScheduler(SchedulerConnector):
    def __init__(self, inner: SchedulerConnector, write: Callable[..., None]) -> None:
        self._inner, self._w = inner, write

    def on_new_request(self, request: RequestView) -> None:
        self._w("on_new_request", req=request.request_id)
        self._inner.on_new_request(request)

    def get_num_new_matched_tokens(self, request: RequestView,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        count, is_async = self._inner.get_num_new_matched_tokens(request, num_computed_tokens)
        self._w("get_num_new_matched_tokens", req=request.request_id,
                computed=num_computed_tokens, count=count, load_async=is_async)
        return count, is_async

    def update_state_after_alloc(self, request: RequestView, blocks: AllocatedBlocks,
                                 num_external_tokens: int) -> None:
        self._w("update_state_after_alloc", req=request.request_id,
                external=num_external_tokens, blocks=len(blocks.block_ids(0)))
        self._inner.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ConnectorMetadata:
        self._w("build_connector_meta", step=scheduler_output.step_id,
                new=sorted(r.request_id for r in scheduler_output.scheduled_new_reqs),
                tokens=scheduler_output.total_num_scheduled_tokens,
                finished=sorted(scheduler_output.finished_req_ids),
                preempted=sorted(scheduler_output.preempted_req_ids))
        return self._inner.build_connector_meta(scheduler_output)

    def request_finished(self, request: RequestView,
                         block_ids: tuple[int, ...]) -> tuple[bool, Mapping[str, Any] | None]:
        delay, params = self._inner.request_finished(request, block_ids)
        self._w("request_finished", req=request.request_id, status=request.status.value,
                delay_free=delay)
        return delay, params

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._w("update_connector_output", sending=sorted(output.finished_sending),
                recving=sorted(output.finished_recving), failed=sorted(output.failed_recving))
        self._inner.update_connector_output(output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._inner.take_events()

    def get_finished_count(self) -> int | None:
        self._w("get_finished_count")
        return self._inner.get_finished_count()

    def set_xfer_handshake_metadata(self, metadata: Mapping[int, HandshakeMetadata]) -> None:
        self._w("set_xfer_handshake_metadata", ranks=sorted(metadata))
        self._inner.set_xfer_handshake_metadata(metadata)

    def shutdown(self) -> None:
        self._w("shutdown")
        self._inner.shutdown()


class _RecordingWorker(WorkerConnector):
    def __init__(self, inner: WorkerConnector, write: Callable[..., None]) -> None:
        self._inner, self._w = inner, write

    def register_kv_caches(self, kv_caches: Mapping[str, Any], layout: KVCacheLayout) -> None:
        self._w("register_kv_caches", layers=list(kv_caches), order=layout.order.name,
                opaque_pages=layout.opaque_pages)
        self._inner.register_kv_caches(kv_caches, layout)

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        self._w("bind_connector_metadata")
        self._inner.bind_connector_metadata(metadata)

    def clear_connector_metadata(self) -> None:
        self._w("clear_connector_metadata")
        self._inner.clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        self._w("start_load_kv", step=forward_context.step_id, tokens=forward_context.num_tokens)
        self._inner.start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._w("wait_for_layer_load", layer=layer_name)
        self._inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any,
                      forward_context: ForwardContextView) -> None:
        self._w("save_kv_layer", layer=layer_name, step=forward_context.step_id)
        self._inner.save_kv_layer(layer_name, kv_layer, forward_context)

    def wait_for_save(self) -> None:
        self._w("wait_for_save")
        self._inner.wait_for_save()

    def handle_preemptions(self, preempted_req_ids: frozenset[str]) -> None:
        self._w("handle_preemptions", reqs=sorted(preempted_req_ids))
        self._inner.handle_preemptions(preempted_req_ids)

    def build_connector_output(self, finished_req_ids: frozenset[str]) -> KVConnectorOutput:
        out = self._inner.build_connector_output(finished_req_ids)
        self._w("build_connector_output", finished=sorted(finished_req_ids),
                sending=sorted(out.finished_sending), recving=sorted(out.finished_recving),
                failed=sorted(out.failed_recving))
        return out

    def build_dummy_connector_meta(self, forward_context: ForwardContextView) -> ConnectorMetadata:
        self._w("build_dummy_connector_meta", kind=forward_context.kind.value)
        return self._inner.build_dummy_connector_meta(forward_context)

    def get_handshake_metadata(self) -> HandshakeMetadata | None:
        self._w("get_handshake_metadata")
        return self._inner.get_handshake_metadata()

    def shutdown(self) -> None:
        self._w("shutdown")
        self._inner.shutdown()


class RecordingConnector(ConnectorFactory):
    """A connector that records every hook call into ``path`` and otherwise is ``inner``.

    Args:
        inner: The connector to wrap (a spec, class or factory); default
            ``$KVSPEC_RECORD_INNER``.
        path: The JSON-lines file calls are appended to; default ``$KVSPEC_RECORD_PATH``.

    Raises:
        InvalidArgumentError: neither the argument nor the environment variable is set.
    """

    def __init__(self, inner: str | ConnectorFactory | None = None,
                 path: str | os.PathLike[str] | None = None) -> None:
        spec = inner if inner is not None else os.environ.get("KVSPEC_RECORD_INNER")
        where = path if path is not None else os.environ.get("KVSPEC_RECORD_PATH")
        if not spec or not where:
            raise InvalidArgumentError(
                "RecordingConnector needs the wrapped connector and a file: pass them, or set "
                "KVSPEC_RECORD_INNER='pkg.mod:Factory' and KVSPEC_RECORD_PATH=/path/calls.jsonl",
                clause="ERR-002",
            )
        self._inner = load_factory(spec)
        self._path = Path(where)

    @property
    def name(self) -> str:
        """``recording(<inner name>)``."""
        return f"recording({self._inner.name})"

    @property
    def capabilities(self) -> Capabilities:
        """The wrapped connector's."""
        return self._inner.capabilities

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        """The wrapped scheduler role, recorded."""
        write = _writer(self._path, "scheduler", None)
        write("create_scheduler")
        return _RecordingScheduler(self._inner.create_scheduler(config), write)

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        """The wrapped worker role of ``rank``, recorded."""
        write = _writer(self._path, "worker", rank)
        write("create_worker")
        return _RecordingWorker(self._inner.create_worker(config, rank), write)

    def create_executor(self, config: EngineConfigView) -> ExecutorConnector | None:
        """The wrapped connector's executor, if any."""
        return self._inner.create_executor(config)


# ------------------------------------------------------------------------------ checking


@attrs.frozen
class Call:
    """One recorded hook call."""

    index: int
    role: str
    rank: int | None
    hook: str
    fields: Mapping[str, Any]


@attrs.frozen
class Violation:
    """A place where recorded calls break the spec's order."""

    clause: str
    message: str
    index: int


def read_calls(path: str | os.PathLike[str]) -> list[Call]:
    """The calls recorded in ``path``, in file order.

    Raises:
        InvalidArgumentError: a line is not a recorded call.
    """
    calls = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines()):
        try:
            rec = json.loads(line)
            calls.append(Call(i, rec.pop("role"), rec.pop("rank"), rec.pop("hook"), rec))
        except (ValueError, KeyError, AttributeError) as e:
            raise InvalidArgumentError(f"{path}:{i + 1} is not a recorded call: {e}") from e
    return calls


def _check_worker(calls: list[Call], layer_order: list[str], sync_steps: set[int],
                  out: list[Violation]) -> None:
    registered = False
    window: list[Call] | None = None
    segment: Call | None = None  # the last bind: its step's output follows once
    outputs = 0

    def close_segment() -> None:
        if segment is not None and outputs != 1:
            out.append(Violation("WRK-008", f"{outputs} build_connector_output calls for one "
                                 "bound step; expected exactly one", segment.index))

    for c in calls:
        if c.hook == "register_kv_caches":
            if registered:
                out.append(Violation("WRK-001", "register_kv_caches called twice", c.index))
            registered = True
            layer_order[:] = list(c.fields.get("layers", []))
        elif c.hook == "shutdown":
            if window is not None:
                out.append(Violation("WRK-015", "shutdown while metadata is bound", c.index))
        elif c.hook == "bind_connector_metadata":
            if not registered:
                out.append(Violation("WRK-001", "metadata bound before register_kv_caches",
                                     c.index))
            if window is not None:
                out.append(Violation("WRK-003", "metadata bound twice without a clear",
                                     c.index))
            close_segment()
            window, segment, outputs = [], c, 0
        elif c.hook == "clear_connector_metadata":
            if window is None:
                out.append(Violation("WRK-003", "clear without a bind", c.index))
            else:
                _check_window(window, layer_order, sync_steps, out)
            window = None
        elif c.hook == "handle_preemptions":
            if window is not None:
                out.append(Violation("WRK-012", "handle_preemptions while metadata is bound; "
                                     "expected it before the step's bind", c.index))
        elif c.hook == "build_connector_output":
            # Before the clear (vLLM) or right after it (kvspec's harness): once per step.
            if segment is None:
                out.append(Violation("WRK-008", "build_connector_output before any step was "
                                     "bound", c.index))
            outputs += 1
        elif c.hook in ("start_load_kv", "wait_for_layer_load", "save_kv_layer",
                        "wait_for_save"):
            if window is None:
                out.append(Violation("DRY-001", f"{c.hook} with no metadata bound", c.index))
            else:
                window.append(c)
    close_segment()


def _check_window(window: list[Call], layers: list[str], sync_steps: set[int],
                  out: list[Violation]) -> None:
    hooks = [c.hook for c in window]
    for once, clause in (("start_load_kv", "WRK-004"), ("wait_for_save", "WRK-007")):
        if hooks.count(once) != 1:
            out.append(Violation(clause, f"{once} called {hooks.count(once)} times in one "
                                 "bound step; expected once", window[0].index))
    per_layer = [c for c in window if c.hook in ("wait_for_layer_load", "save_kv_layer")]
    expected = [(h, name) for name in layers for h in ("wait_for_layer_load", "save_kv_layer")]
    got = [(c.hook, c.fields.get("layer")) for c in per_layer]
    if per_layer and got != expected:
        out.append(Violation("WRK-005", f"per-layer hooks ran as {got}; expected each layer's "
                             "wait then save, in layer order", per_layer[0].index))
    if "start_load_kv" in hooks and per_layer:
        at = hooks.index("start_load_kv")
        first = hooks.index(per_layer[0].hook)
        last = max(i for i, h in enumerate(hooks) if h in ("wait_for_layer_load",
                                                           "save_kv_layer"))
        step = window[at].fields.get("step")
        if first < at < last:
            out.append(Violation("WRK-004", "start_load_kv ran between two layers",
                                 window[at].index))
        if step in sync_steps and at > first:
            out.append(Violation("WRK-004", f"step {step} has synchronous loads but "
                                 "start_load_kv ran after the first layer", window[at].index))
    if "wait_for_save" in hooks and per_layer and hooks.index("wait_for_save") < first_index(
            hooks, ("wait_for_layer_load", "save_kv_layer"), last=True):
        out.append(Violation("WRK-007", "wait_for_save ran before the last layer's save",
                             window[hooks.index("wait_for_save")].index))


def first_index(hooks: list[str], names: tuple[str, ...], *, last: bool = False) -> int:
    """The first (or last) position of any of ``names`` in ``hooks``, -1 if none."""
    found = [i for i, h in enumerate(hooks) if h in names]
    return (found[-1] if last else found[0]) if found else -1


def _check_scheduler(calls: list[Call], out: list[Violation]) -> set[int]:
    """Check the scheduler's calls; return the steps that carry synchronous loads."""
    seen: set[str] = set()
    matched: dict[str, tuple[int | None, bool]] = {}
    finished: set[str] = set()
    sync_pending: set[str] = set()
    sync_steps: set[int] = set()
    next_step = 0
    builds = outputs = 0
    for c in calls:
        rid = str(c.fields.get("req"))
        if c.hook == "on_new_request":
            if rid in seen:
                out.append(Violation("SCH-015", f"on_new_request twice for {rid!r}", c.index))
            seen.add(rid)
        elif c.hook == "get_num_new_matched_tokens":
            if rid not in seen:
                out.append(Violation("SCH-001", f"{rid!r} matched before on_new_request",
                                     c.index))
            matched[rid] = (c.fields.get("count"), bool(c.fields.get("load_async")))
        elif c.hook == "update_state_after_alloc":
            if rid not in matched:
                out.append(Violation("SCH-008", f"update_state_after_alloc for {rid!r}, "
                                     "which was never matched", c.index))
            elif c.fields.get("external") and not matched[rid][1]:
                sync_pending.add(rid)
        elif c.hook == "build_connector_meta":
            step = c.fields.get("step")
            if step != next_step:
                out.append(Violation("SCH-011", f"build_connector_meta for step {step}; "
                                     f"expected step {next_step}", c.index))
            step = step if isinstance(step, int) else next_step
            next_step = step + 1
            builds += 1
            if sync_pending & set(c.fields.get("new", [])):
                sync_steps.add(step)
                sync_pending -= set(c.fields.get("new", []))
        elif c.hook == "update_connector_output":
            outputs += 1
            if outputs > builds:
                out.append(Violation("SCH-019", "more outputs than built steps", c.index))
        elif c.hook == "request_finished":
            if rid in finished:
                out.append(Violation("SCH-015", f"request_finished twice for {rid!r}",
                                     c.index))
            finished.add(rid)
    return sync_steps


def check_call_order(calls: Iterable[Call]) -> list[Violation]:
    """Check recorded calls against docs/spec/state-machines.md; return the violations,
    each with the clause it breaks (empty when the engine followed the spec)."""
    calls = list(calls)
    out: list[Violation] = []
    sync_steps = _check_scheduler([c for c in calls if c.role == "scheduler"], out)
    ranks = sorted({c.rank for c in calls if c.role == "worker" and c.rank is not None})
    for rank in ranks:
        _check_worker([c for c in calls if c.role == "worker" and c.rank == rank], [],
                      sync_steps, out)
    return sorted(out, key=lambda v: v.index)
