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
from collections.abc import Callable, Iterable, Mapping, Sequence
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

__all__ = ["Call", "RecordingConnector", "Violation", "check_call_order", "check_step_order",
           "read_calls"]

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
        write("create_worker", draft_layers=list(config.draft_layer_names),
              speculative_tokens=config.num_speculative_tokens)
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


_LAYER_HOOKS = ("wait_for_layer_load", "save_kv_layer")


def _check_worker(calls: list[Call], layer_order: list[str], sync_steps: set[int],
                  out: list[Violation], draft: Sequence[str] | None,
                  speculative: bool | None) -> None:
    registered = False
    window: list[Call] | None = None
    segment: Call | None = None  # the last bind: its step's output follows once
    outputs = 0
    drafter = bool(speculative)
    draft_names: list[str] = list(draft or ())
    dummy = False  # the next bind is a dummy run's: no output follows it (DRY-002)
    dummy_window = False

    def close_segment() -> None:
        if segment is not None and not dummy_window and outputs != 1:
            out.append(Violation("WRK-008", f"{outputs} build_connector_output calls for one "
                                 "bound step; expected exactly one", segment.index))

    for c in calls:
        if c.hook == "create_worker":
            if draft is None:
                draft_names = [str(n) for n in c.fields.get("draft_layers", ())]
            if speculative is None:
                drafter = bool(c.fields.get("speculative_tokens"))
        elif c.hook == "register_kv_caches":
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
            window, segment, outputs = [c], c, 0
            dummy_window, dummy = dummy, False
        elif c.hook == "build_dummy_connector_meta":
            dummy = True
        elif c.hook == "clear_connector_metadata":
            if window is None:
                out.append(Violation("WRK-003", "clear without a bind", c.index))
            else:
                _check_window(window, layer_order, sync_steps, out, draft_names,
                              drafter and not dummy_window)
            window = None
        elif c.hook == "handle_preemptions":
            if window is not None:
                out.append(Violation("WRK-012", "handle_preemptions while metadata is bound; "
                                     "expected it before the step's bind", c.index))
        elif c.hook == "build_connector_output":
            # Before the clear (vLLM) or right after it (kvspec's harness): once per step;
            # in a speculative step before wait_for_save (SPD-001).
            if segment is None:
                out.append(Violation("WRK-008", "build_connector_output before any step was "
                                     "bound", c.index))
            outputs += 1
            if window is not None:
                window.append(c)
        elif c.hook in ("start_load_kv", *_LAYER_HOOKS, "wait_for_save"):
            if window is None:
                out.append(Violation("DRY-001", f"{c.hook} with no metadata bound", c.index))
            else:
                window.append(c)
    close_segment()


def _check_window(window: list[Call], layers: list[str], sync_steps: set[int],
                  out: list[Violation], draft: Sequence[str] = (),
                  drafter: bool = False) -> None:
    """Check one bound step's recorded hooks (``check_step_order``), with the violations'
    indexes those of the recorded calls."""
    draft_set = set(draft) if drafter else set()  # a dummy run: every layer once, in order
    starts = [c for c in window if c.hook == "start_load_kv"]
    sync = bool({c.fields.get("step") for c in starts} & sync_steps)
    # a step with a forward has tokens (its per-layer hooks may not run: FULL graphs)
    tokens = starts[0].fields.get("tokens") if starts else None
    found = check_step_order(
        [(c.hook, str(c.fields.get("layer"))) if c.hook in _LAYER_HOOKS else c.hook
         for c in window],
        target_layers=[n for n in layers if n not in draft_set],
        draft_layers=[n for n in layers if n in draft_set] or list(draft),
        draft_passes=None if drafter else 0, sync_load=sync,
        forward=bool(tokens) if isinstance(tokens, int) else None)
    out += [attrs.evolve(v, index=window[v.index].index) for v in found]


_STEP_HOOKS = frozenset({"bind_connector_metadata", "start_load_kv", *_LAYER_HOOKS,
                         "build_connector_output", "wait_for_save",
                         "clear_connector_metadata"})


def check_step_order(calls: Sequence[str | tuple[str, str]], *, target_layers: Sequence[str],
                     draft_layers: Sequence[str] = (), draft_passes: int | None = 0,
                     forward: bool | None = None, sync_load: bool = False) -> list[Violation]:
    """Check the worker hooks of one bound step against the spec's order; return the
    violations (empty when the order is right), each with the clause it breaks and
    ``index`` the position in ``calls``.

    A pure function: no recording, no engine. It checks a hook sequence recorded anywhere
    (a real engine included) against the plain step (docs/spec/state-machines.md: WRK-004,
    WRK-005, WRK-007, WRK-008) or the speculative one (SPD-001: the target layers' hooks,
    the output hooks, then each draft pass's draft-layer hooks, then ``wait_for_save``).

    Args:
        calls: The step's worker hooks in call order: plain hook names
            (``"start_load_kv"``, ``"build_connector_output"``, ``"wait_for_save"``, ...)
            and, for the per-layer hooks, ``(hook, layer_name)`` pairs such as
            ``("save_kv_layer", "model.layers.0.self_attn.attn")``.
            ``bind_connector_metadata`` and ``clear_connector_metadata`` may open and
            close it; other hooks are ignored. ``build_connector_output`` may be left out
            of a plain step (an engine may build the output after the clear), never out of
            a speculative one.
        target_layers: The target model's layers, in layer order.
        draft_layers: The drafter's layers, in layer order (empty: n-gram drafting or no
            drafter).
        draft_passes: 0: no drafter runs (the plain order). ``n >= 1``: a drafter runs
            ``n`` draft passes in a step with a forward (each calls every draft layer's
            hooks once). None: a drafter runs, any number of passes >= 1.
        forward: Whether the step ran a forward (only a step with a forward is
            speculative). None: inferred from the per-layer hooks (a step whose per-layer
            hooks do not run, under FULL graphs, is then checked as a plain one).
        sync_load: The step carries synchronous loads: ``start_load_kv`` must come before
            the first layer's hooks (WRK-004).

    Raises:
        InvalidArgumentError: a malformed call or a negative ``draft_passes``.
    """
    if draft_passes is not None and (isinstance(draft_passes, bool)
                                     or not isinstance(draft_passes, int) or draft_passes < 0):
        raise InvalidArgumentError(f"draft_passes must be None or an int >= 0, got "
                                   f"{draft_passes!r}")
    seq: list[tuple[int, str, str | None]] = []
    for i, c in enumerate(calls):
        if isinstance(c, str):
            hook, layer = c, None
        elif (isinstance(c, tuple) and len(c) == 2 and isinstance(c[0], str)
              and isinstance(c[1], str)):
            hook, layer = c
        else:
            raise InvalidArgumentError(f"calls[{i}] is neither a hook name nor a (hook, "
                                       f"layer) pair: {c!r}")
        if hook in _LAYER_HOOKS and layer is None:
            raise InvalidArgumentError(f"calls[{i}]: {hook} needs its layer: ({hook!r}, "
                                       "layer_name)")
        if hook in _STEP_HOOKS:
            seq.append((i, hook, layer))
    out: list[Violation] = []
    target, draft = list(target_layers), list(draft_layers)
    hooks = [h for _, h, _ in seq]
    at = {h: [k for k, x in enumerate(hooks) if x == h] for h in _STEP_HOOKS}
    per_layer = [k for k, h in enumerate(hooks) if h in _LAYER_HOOKS]
    first = per_layer[0] if per_layer else -1
    index = (lambda k: seq[k][0]) if seq else (lambda k: 0)
    idx0 = seq[0][0] if seq else 0
    for once, clause in (("start_load_kv", "WRK-004"), ("wait_for_save", "WRK-007")):
        if len(at[once]) != 1:
            out.append(Violation(clause, f"{once} called {len(at[once])} times in one bound "
                                 "step; expected once", idx0))
    if len(at["build_connector_output"]) > 1:
        out.append(Violation("WRK-008", f"{len(at['build_connector_output'])} "
                             "build_connector_output calls in one bound step; expected one",
                             index(at["build_connector_output"][1])))
    ran = bool(per_layer) if forward is None else forward
    drafter = draft_passes != 0
    speculative = drafter and ran
    # The per-layer hooks: the target's, each layer's wait then save in layer order, once;
    # then (speculative) the draft layers' once per draft pass.
    got = [(hooks[k], seq[k][2]) for k in per_layer]
    want_target = [(h, n) for n in target for h in _LAYER_HOOKS]
    draft_hooks = [k for k in per_layer if seq[k][2] in set(draft) and seq[k][2] not in
                   set(target)]
    if per_layer:
        if not speculative or not draft:
            if got != want_target:
                out.append(Violation(
                    "WRK-005", f"per-layer hooks ran as {got}; expected each layer's wait "
                    "then save, in layer order, once"
                    + (" (draft layers' hooks in a step checked as one with no drafter)"
                       if draft_hooks and not speculative else ""), index(first)))
        else:
            head = got[: len(want_target)]
            tail = got[len(want_target):]
            unit = [(h, n) for n in draft for h in _LAYER_HOOKS]
            passes, rest = divmod(len(tail), len(unit))
            if head != want_target:
                where = next((k for k, (g, w) in enumerate(zip(head, want_target)) if g != w),
                             min(len(head), len(want_target)))
                clause = ("SPD-001" if where < len(got) and got[where][1] in set(draft)
                          else "WRK-005")
                out.append(Violation(
                    clause, f"per-layer hooks ran as {got}; expected every target layer's "
                    "wait then save in layer order, once, before any draft layer's hook",
                    index(per_layer[min(where, len(per_layer) - 1)])))
            elif any(n not in set(draft) for _, n in tail):
                out.append(Violation(
                    "WRK-005", f"per-layer hooks ran as {got}; expected each target layer's "
                    "hooks once, before the draft passes",
                    index(per_layer[len(want_target)])))
            elif (rest or tail != unit * passes or not passes
                  or (draft_passes is not None and passes != draft_passes)):
                expected = ("" if draft_passes is None else f"{draft_passes} ") + "draft pass"
                out.append(Violation(
                    "SPD-001", f"draft layers' hooks ran as {tail}; expected {expected}(es), "
                    "each every draft layer's wait then save in layer order",
                    index(per_layer[min(len(want_target), len(per_layer) - 1)])))
    if at["start_load_kv"] and per_layer:
        s = at["start_load_kv"][0]
        # the forward's layers: the target's; a speculative step's draft passes come after
        # the output hooks, and a late start precedes them (SPD-001, measured in vLLM 0.32)
        forward_layers = ([k for k in per_layer if k not in set(draft_hooks)]
                          if speculative else per_layer)
        last = forward_layers[-1] if forward_layers else first
        if first < s < last:
            out.append(Violation("WRK-004", "start_load_kv ran between two layers", index(s)))
        if speculative and draft_hooks and s > draft_hooks[0]:
            out.append(Violation("SPD-001", "start_load_kv ran after a draft pass began; in a "
                                 "speculative step it comes before the target's layers or "
                                 "right after them, before the output hooks", index(s)))
        if speculative and at["build_connector_output"] and s > at["build_connector_output"][0]:
            out.append(Violation("SPD-001", "start_load_kv ran after the output hooks; in a "
                                 "speculative step it comes before the target's layers or "
                                 "right after them, before the output hooks", index(s)))
        if sync_load and s > first:
            out.append(Violation("WRK-004", "the step has synchronous loads but "
                                 "start_load_kv ran after the first layer", index(s)))
    save = at["wait_for_save"][0] if at["wait_for_save"] else -1
    if save >= 0 and per_layer and save < per_layer[-1]:
        out.append(Violation("WRK-007", "wait_for_save ran before the last layer's save",
                             index(save)))
    outputs = at["build_connector_output"]
    if speculative:
        if not outputs:
            out.append(Violation("SPD-001", "no build_connector_output in a speculative step: "
                                 "with a drafter the output hooks run after the target "
                                 "layers, before the draft passes and wait_for_save", idx0))
        else:
            o = outputs[0]
            target_done = [k for k in per_layer if seq[k][2] not in set(draft)
                           or seq[k][2] in set(target)]
            if save >= 0 and o > save:
                out.append(Violation("SPD-001", "build_connector_output ran after "
                                     "wait_for_save in a speculative step; with a drafter the "
                                     "output hooks run before the draft passes and "
                                     "wait_for_save", index(o)))
            if target_done and o < target_done[-1]:
                out.append(Violation("SPD-001", "build_connector_output ran before the last "
                                     "target layer's hooks in a speculative step", index(o)))
            if draft_hooks and o > draft_hooks[0]:
                out.append(Violation("SPD-001", "build_connector_output ran after a draft "
                                     "layer's hook; with a drafter the output hooks run "
                                     "before the draft passes", index(o)))
    elif outputs and save >= 0 and outputs[0] < save:
        out.append(Violation("WRK-008", "build_connector_output ran before wait_for_save in "
                             "a step with no drafter" + ("" if ran else " and no forward"),
                             index(outputs[0])))
    return sorted(out, key=lambda v: v.index)


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


def check_call_order(calls: Iterable[Call], *, draft_layers: Sequence[str] | None = None,
                     speculative: bool | None = None) -> list[Violation]:
    """Check recorded calls against docs/spec/state-machines.md and SPD-001; return the
    violations, each with the clause it breaks (empty when the engine followed the spec).

    Each bound step is checked with ``check_step_order``. Whether a drafter runs and its
    layers are read from the recorded ``create_worker`` call (the engine's
    ``EngineConfigView.num_speculative_tokens`` and ``draft_layer_names``) unless given:

    Args:
        calls: Recorded calls (``read_calls``).
        draft_layers: The drafter's layer names, overriding the recorded ones.
        speculative: Whether a drafter runs (any number of draft passes), overriding the
            recorded declaration.
    """
    calls = list(calls)
    out: list[Violation] = []
    sync_steps = _check_scheduler([c for c in calls if c.role == "scheduler"], out)
    ranks = sorted({c.rank for c in calls if c.role == "worker" and c.rank is not None})
    for rank in ranks:
        _check_worker([c for c in calls if c.role == "worker" and c.rank == rank], [],
                      sync_steps, out, draft_layers, speculative)
    return sorted(out, key=lambda v: v.index)
