"""The reference engine: a small, real scheduler, executor and workers that drive a connector.

The engine follows docs/spec/state-machines.md: it matches, allocates, builds metadata every
step (zero-token steps included), runs the toy forward on every rank, aggregates the ranks'
outputs, frees blocks only when the aggregate says so, and observes the connector's side of
every clause it can. A broken clause ends the run with ``ContractViolation`` carrying
the clause, what the connector did, what was expected, and a ``reproduce`` text naming the
configuration, the workload and the step.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import math
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn

import attrs

from kvspec.protocols import (
    AllocatedBlocks,
    CachedRequestView,
    ConnectorFactory,
    ConnectorMetadata,
    ContractViolation,
    Direction,
    DoubleReportError,
    ExecutorConnector,
    InvalidArgumentError,
    InvalidBlockIdError,
    KVCacheEvent,
    KVSpecError,
    KVConnectorOutput,
    NULL_BLOCK_ID,
    NewRequestView,
    ReportError,
    RequestStatus,
    RequestView,
    SchedulerConnector,
    SchedulerOutputView,
    StandardAggregator,
    UnknownRequestError,
    check_transition,
    freeze_params,
    thaw_params,
)

from ._blockpool import BlockPool, block_hashes
from ._resources import Snapshot, snapshot
from ._toymodel import ToyModel, tenant_seed, weights_seed
from ._worker_groups import InProcessWorkers, ProcessWorkers, WorkerGroup
from ._worker_runtime import open_device
from .config import HarnessConfig
from .workload import RequestSpec, Workload, scale_request
from .._attribution import hide_unless_harness_bug

__all__ = ["Engine", "RunResult"]
__tracebackhide__ = hide_unless_harness_bug  # authors see their frames, not these

_TALLY = {"engines": 0, "loads": 0, "matched_tokens": 0, "loaded_tokens": 0}
"""What ran in this process since ``take_load_tally`` was last called: engines
started, loads the connector started, tokens it offered for them, tokens it delivered."""


def take_load_tally() -> dict[str, int]:
    """Return and reset ``_TALLY`` (the conformance report counts each test's loads,
    so a scenario in which a connector loads nothing shows)."""
    out = dict(_TALLY)
    for k in _TALLY:
        _TALLY[k] = 0
    return out

_S = RequestStatus


@attrs.define
class _Req:
    spec: RequestSpec
    tokens: tuple[int, ...]
    seed: int
    hashes: list[bytes]
    status: RequestStatus = _S.WAITING
    num_computed: int = 0  # scheduled, including steps still in flight
    executed: int = 0  # computed by steps whose output was processed
    blocks: list[int] = attrs.Factory(list)
    window: list[int] = attrs.Factory(list)  # the sliding-window group's (hybrid model)
    ext: tuple[int, int] = (0, 0)
    recv_done: bool = False
    aborted: bool = False
    finished_called: bool = False
    delay_send: bool = False
    invalid_named: bool = False
    params: Mapping[str, Any] | None = None
    preemptions: int = 0
    rejecting: int = 0  # draft tokens of the step in flight the target rejects (SPD-005)

    @property
    def rid(self) -> str:
        return self.spec.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.spec.prompt)

    @property
    def target(self) -> int:
        """Tokens whose KV is computed: all but the last generated one."""
        return len(self.tokens) - 1


@attrs.frozen
class RunResult:
    """What one run did, for tests to assert on.

    Attributes:
        steps: Steps executed.
        finished: Requests that finished normally.
        aborted: Requests that were aborted.
        transfer_params: kv_transfer_params returned by request_finished, per request.
        external_tokens: Tokens each request got from the connector (sync and async).
        matched_tokens: Tokens the connector offered each request and the engine allocated
            for (loads started, whether they then succeeded or failed).
        events: KV-cache events taken from the scheduler role.
        preemptions: Number of preemptions.
    """

    steps: int
    finished: tuple[str, ...]
    aborted: tuple[str, ...]
    transfer_params: Mapping[str, Mapping[str, Any] | None]
    external_tokens: Mapping[str, int]
    events: tuple[KVCacheEvent, ...]
    preemptions: int
    matched_tokens: Mapping[str, int] = attrs.field(factory=dict)


LOST_TRANSFER_CAP_S = 1.0
"""Once a connector let an awaited transfer (or its pending work) run past
``transfer_timeout_s`` in one engine, later engines on the same connector class in this
process wait at most this long: a connector that loses every transfer would otherwise
cost every test the whole timeout (minutes over a suite run). Verdicts under the cap say
so."""
_LOST_TRANSFERS: set[str] = set()


def _factory_key(factory: ConnectorFactory) -> str:
    return f"{type(factory).__module__}.{type(factory).__qualname__}"


class Engine:
    """One engine serving workloads through a connector.

    Several engines may live in one process (two-engine mode); threads, file descriptors and
    child processes the connectors leave behind are checked when the last of them shuts
    down, against a snapshot taken before the first of them started (WRK-015, ERR-009).

    Args:
        factory: The connector under test.
        config: Engine configuration; defaults to ``HarnessConfig()``.
        tmpdir: Directory handed to the connector as ``extra['kvspec.tmpdir']``; a fresh
            one is made (and removed at shutdown) when None.
        factory_spec: Import path of the factory for worker processes (TP > 1); derived
            from the factory's class when None.
    """

    _live: list[Engine] = []
    _baseline: Snapshot | None = None

    def __init__(
        self, factory: ConnectorFactory, config: HarnessConfig | None = None, *,
        tmpdir: str | None = None, factory_spec: str | None = None,
    ) -> None:
        config = config or HarnessConfig()
        self._capped = (_factory_key(factory) in _LOST_TRANSFERS
                        and config.transfer_timeout_s > LOST_TRANSFER_CAP_S)
        if self._capped:  # this connector lost a transfer before: no minutes of waiting again
            config = attrs.evolve(config, transfer_timeout_s=LOST_TRANSFER_CAP_S)
        self.config = config
        self.factory = factory
        self.caps = factory.capabilities
        self._own_tmp = tmpdir is None
        self.tmpdir = tmpdir or tempfile.mkdtemp(prefix="kvspec-harness-")
        self.workload: Workload | None = None
        self._closed = False
        # Leaks are judged against the state before the first live engine started.
        open_device(self.config.device)  # the harness's own context, not a leak
        baseline = None if Engine._live else snapshot()
        try:
            self._build(factory, factory_spec)
        except BaseException:
            self._abandon()
            raise
        if baseline is not None:
            Engine._baseline = baseline
        Engine._live.append(self)
        _TALLY["engines"] += 1

    def _abandon(self) -> None:
        """Release what a constructor that failed half-way had built."""
        for release in (getattr(getattr(self, "workers", None), "shutdown", None),
                        getattr(getattr(self, "scheduler", None), "shutdown", None)):
            if release is not None:
                try:
                    release()
                except Exception:  # the constructor's own error is the one to report
                    pass
        if self._own_tmp:
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    def _build(self, factory: ConnectorFactory, factory_spec: str | None) -> None:
        view = self.config.engine_view(self.tmpdir)
        self._window = self.config.sliding_window or 0
        self._state = self.config.state_layers > 0  # a state group (STG): r.window holds it
        self._groups2 = bool(self._window) or self._state  # a second group's block list
        self._zero: list[int] = []  # new attention blocks the workers zero (STG-009)
        if view.kv_cache_groups:  # a hybrid model: refused unless declared (KVG-002)
            self.caps.check_groups(view.kv_cache_groups, connector=repr(factory.name))
        self.scheduler: SchedulerConnector = factory.create_scheduler(view)
        executor = factory.create_executor(view)
        if executor is None:
            executor = StandardAggregator(
                self.config.tp_size, expected_count=self._finished_count()
            )
        self.executor: ExecutorConnector = executor
        declared = getattr(factory, "__kvspec_spec__", None)  # scheme factories (vllm:Name)
        spec = factory_spec or (declared if isinstance(declared, str) else
                                f"{type(factory).__module__}:{type(factory).__qualname__}")
        self._spec = spec
        self.workers: WorkerGroup = (
            InProcessWorkers(factory, self.config, self.tmpdir) if self.config.tp_size == 1
            else ProcessWorkers(spec, self.config, self.tmpdir)
        )
        # The last block is never handed out: padded and dummy tokens write there (DRY-009);
        # nor is block 0, vLLM's null block, when the budget leaves room for it.
        self.pool = BlockPool(self.config.num_blocks - 1, prefix_caching=self.config.prefix_caching,
                              first=1 if self.config.num_blocks > 2 else 0)
        self.references = _ConnectorReferences(self)
        self._pending_since: float | None = None
        self.model = ToyModel(self.config.num_layers, self.config.num_heads,
                              self.config.head_size, self.config.head_size)
        self.requests: dict[str, _Req] = {}
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.remote: dict[str, _Req] = {}
        self.held: dict[str, list[int]] = {}
        self.awaited: dict[tuple[str, Direction], tuple[int, float]] = {}
        self.step_id = -1
        self._poison_freed: list[int] = []
        self._poison_window: list[int] = []  # freed as the window moved (KVG-007)
        self._poison_preempted: list[int] = []
        self._check_freed = False
        self._poison_alloc: list[int] = []
        self._finished_ids: list[str] = []
        self._in_flight: set[str] = set()  # speculative steps awaiting their output
        self._inflight: tuple[list[KVConnectorOutput], list[dict[str, str]],
                              list[dict[str, Any]]] | None = None
        self._sync_loads = False
        self._seeds: set[int] = set()
        self._generation = 0  # the model's weights: changed by each cache reset (SCH-032)
        self._stale_seeds: set[int] = set()  # seeds of the weights before the last reset
        self._history: list[str] = []  # the runs and resets so far, for _reproduce
        self._events: list[KVCacheEvent] = []
        self._external: dict[str, int] = {}
        self._matched: dict[str, int] = {}
        self._preemptions = 0
        self._completed: set[tuple[str, Direction]] = set()
        self._fail_at = dict(self.config.fail_steps)  # step -> the rank it fails on
        self._salvaged: list[KVConnectorOutput] | None = None  # for an executor without defer
        self._cut: set[str] = set()  # requests whose asynchronous match the engine cut to 0
        self._asleep = False
        self.sleeps = 0
        """Sleeps this engine woke from."""
        bind = getattr(self.scheduler, "bind_block_references", None)
        if bind is not None:  # SCH-030: once, after the pool exists, before the first step
            bind(self.references)
        handshakes = self.workers.handshakes()
        if any(h is not None for h in handshakes.values()):
            self.scheduler.set_xfer_handshake_metadata(
                {r: h for r, h in handshakes.items() if h is not None}
            )

    # -- sleep and wake (WRK-018 .. WRK-020, HSK-006) ---------------------------------------

    @property
    def asleep(self) -> bool:
        """True between ``sleep`` and ``wake``."""
        return self._asleep

    def sleep(self, *, abort: bool = False, peers: Iterable[Engine] = (),
              max_steps: int = 500) -> None:
        """Put the engine to sleep mid-serving, as vLLM 0.33 does (level 1).

        Refuses a connector that does not declare ``sleep_mode`` (WRK-020). Then drains:
        with ``abort`` every unfinished request is aborted first (vLLM's ``mode="abort"``),
        otherwise the requests are served to the end (``mode="wait"``); the engine steps
        (``peers`` step too, a decode engine that still reads this one's blocks) until no
        request runs or waits for remote KV, every delayed free and store in flight is
        reported and no step is in flight. Then every rank's ``unregister_kv_caches`` runs
        and its KV tensors are retired (WRK-018); the prefix cache is forgotten with them.
        The scheduler role keeps its state.

        Raises:
            CapabilityError: the connector does not declare ``sleep_mode`` (WRK-020).
            InvalidArgumentError: the engine is already asleep.
        """
        self.caps.check_sleep_mode(repr(self.factory.name))
        if self._asleep:
            raise InvalidArgumentError("sleep() on an engine that is asleep")
        if abort:
            for rid in list(self.requests):
                self.abort(rid)
        others = list(peers)
        steps = 0
        while not self.idle:
            if steps >= max_steps and not self.awaited:
                raise AssertionError(f"harness: the engine did not drain for sleep in "
                                     f"{max_steps} steps ({self.stuck()})")
            self.step()
            for p in others:
                p.step()
            steps += 1
        self._flush_poison()
        self.pool.forget_cached()
        self.workers.sleep()
        self._asleep = True

    def wake(self) -> None:
        """Wake: every rank re-allocates its KV tensors (at new addresses) and calls
        ``restore_kv_caches`` (WRK-019); then every rank's handshake metadata is collected
        again and handed to ``set_xfer_handshake_metadata`` before the next step (HSK-002,
        HSK-006).

        Raises:
            InvalidArgumentError: the engine is not asleep.
        """
        if not self._asleep:
            raise InvalidArgumentError("wake() on an engine that is not asleep")
        handshakes = self.workers.wake()
        self._asleep = False
        self.sleeps += 1
        if any(h is not None for h in handshakes.values()):
            self.scheduler.set_xfer_handshake_metadata(
                {r: h for r, h in handshakes.items() if h is not None}
            )

    def _finished_count(self) -> int | None:
        count = self.scheduler.get_finished_count()
        if count is not None and (isinstance(count, bool) or not isinstance(count, int)
                                  or not 1 <= count <= self.config.tp_size):
            self._violate("EXE-008", f"get_finished_count() returned {count!r}",
                          f"None or an int between 1 and the {self.config.tp_size} ranks")
        return count

    # -- public API ------------------------------------------------------------------------

    def add_request(self, spec: RequestSpec) -> None:
        """Add a request to the waiting queue (its prompt scaled by the config's
        ``token_scale``, see ``scale_request``)."""
        spec = scale_request(spec, self.config.block_size, self.config.token_scale)
        if spec.request_id in self.requests:
            raise InvalidArgumentError(f"request {spec.request_id!r} was already added")
        seed = weights_seed(tenant_seed(spec.cache_salt, spec.lora_id), self._generation)
        self._seeds.add(seed)
        tokens = self.model.generate(spec.prompt, seed, spec.max_new_tokens)
        r = _Req(spec, tokens, seed, block_hashes(tokens, self.config.block_size,
                                                  spec.cache_salt, spec.lora_id))
        self.requests[spec.request_id] = r
        if spec.local_cache_blocks is not None:  # memory pressure evicted the rest
            self._poison_freed += self.pool.evict_beyond(r.hashes, spec.local_cache_blocks)
        self.waiting.append(r)
        self.scheduler.on_new_request(self._view(r))

    def abort(self, request_id: str) -> None:
        """Abort a request in whatever state it is (SCH-015, SCH-021)."""
        r = self.requests[request_id]
        if r.status in (_S.FINISHED, _S.ABORTED) or r.finished_called:
            return
        r.aborted = True
        if r in self.waiting:
            self.waiting.remove(r)
        self._finish(r)

    def reset_cache(self) -> bool:
        """Reset the caches between two steps, as an engine does before a weight update
        (vLLM's ``reset_prefix_cache(reset_connector=True)``), and return whether the reset
        took (SCH-032, SCH-033).

        The connector's ``reset_cache`` is asked first, whatever runs or is in flight; any
        answer but True refuses the reset and changes nothing. On True the engine's own
        prefix cache forgets every block and the model's weights change: from then on the
        same tokens have other KV, so a connector that serves KV from before the reset
        (stored, in flight, or computed before it by a request still running) loads bytes
        the byte checks attribute to SCH-032.

        The harness resets once every request has ended (``run(..., leave_pending=True)``
        leaves their stores and delayed frees in flight): requests that were waiting or
        running across a weight change are not modelled.

        Raises:
            ContractViolation: ``reset_cache`` did not return a bool (SCH-032).
            InvalidArgumentError: a request is still waiting, running or receiving.
        """
        if self.waiting or self.running or self.remote:
            raise InvalidArgumentError(
                "harness: reset_cache is modelled once every request has ended; "
                f"{len(self.waiting)} waiting, {len(self.running)} running, "
                f"{len(self.remote)} receiving")
        ask = getattr(self.scheduler, "reset_cache", None)
        answer = False if ask is None else self._timed("reset_cache", ask)
        if not isinstance(answer, bool):
            self._violate("SCH-032", f"reset_cache() returned {answer!r}",
                          "True (nothing from before the reset is served again) or False "
                          "(the reset refused, nothing changed)")
        self._history.append(f"engine.reset_cache()  # answered {answer!r}")
        if not answer:
            return False
        self.pool.reset_prefix_cache()
        self._stale_seeds |= self._seeds
        self._generation += 1
        return True

    def block_hashes(self, request_id: str) -> tuple[bytes, ...]:
        """The engine's hashes of a request's full blocks (prompt and output), salted by
        its cache salt and LoRA identity: what the connector sees in
        ``RequestView.block_hashes`` and advertises in its KV events (EVT-010)."""
        return tuple(self.requests[request_id].hashes)

    @property
    def cut_requests(self) -> frozenset[str]:
        """The requests whose asynchronous match the engine cut to 0 tokens
        (``HarnessConfig.cut_async_matches``, SCH-034)."""
        return frozenset(self._cut)

    @property
    def idle(self) -> bool:
        """True when no request is unfinished, no transfer awaited, no step in flight and the
        connector has no pending work (SCH-029)."""
        return (not self.waiting and not self.running and not self.remote
                and not self.awaited and self._inflight is None and not self._pending_work())

    def _requests_done(self) -> bool:
        """Every request ended and its output processed; what a finished request still
        holds (a delayed free, a store in flight) may be unreported."""
        return (not self.waiting and not self.running and not self.remote
                and self._inflight is None
                and not any(d is Direction.RECV for _, d in self.awaited))

    def _pending_work(self) -> bool:
        """Ask the connector whether a later step must complete its work (SCH-029); once
        nothing else keeps the engine stepping, it must turn False within
        ``transfer_timeout_s``."""
        ask = getattr(self.scheduler, "has_pending_work", None)
        pending = False if ask is None else ask()
        if not isinstance(pending, bool):
            self._violate("SCH-029", f"has_pending_work() returned {pending!r}", "a bool")
        alone = not (self.waiting or self.running or self.remote or self.awaited)
        if not (pending and alone):
            self._pending_since = None
            if not pending and self.references.held and alone:
                self._violate("SCH-030", "has_pending_work() is False with block references "
                              f"still held on blocks {self.references.held_ids()}",
                              "every reference dropped before the connector reports no "
                              "pending work")
            return pending
        now = time.monotonic()
        if self._pending_since is None:
            self._pending_since = now
        elif now - self._pending_since > self.config.transfer_timeout_s:
            capped = self._lost()
            self._violate("SCH-029", "has_pending_work() still True "
                          f"{now - self._pending_since:.1f} s after the last request ended "
                          f"(step {self.step_id}){capped}", "False within a bounded time once the "
                          f"work ended, failed or timed out (here {self.config.transfer_timeout_s} s)")
        return pending

    def run(self, workload: Workload, *, max_steps: int = 500,
            leave_pending: bool = False) -> RunResult:
        """Serve a workload to completion and return what happened.

        With ``leave_pending``, stop stepping as soon as every request has ended, as an
        engine that steps only while it has requests does (vLLM's in-process ``LLM``):
        stores and delayed frees still unreported stay so until the next ``run``
        (SCH-031), and the end-of-run leak checks wait for a run that drains."""
        self.workload = workload
        self._history.append(f"engine.run({self._described(workload)}"
                             f"{', leave_pending=True' if leave_pending else ''})")
        self._check_freed = True  # what was written into freed blocks since (WRK-017)
        arrivals: dict[int, list[RequestSpec]] = {}
        aborts: dict[int, list[str]] = {}
        for spec in workload.requests:
            arrivals.setdefault(spec.arrival_step, []).append(spec)
            if spec.abort_at_step is not None:
                aborts.setdefault(spec.abort_at_step, []).append(spec.request_id)
        last = max([*arrivals, *aborts, 0])
        for i in itertools.count():
            for spec in arrivals.get(i, ()):
                self.add_request(spec)
            for rid in aborts.get(i, ()):
                self.abort(rid)
            if i > last and (self._requests_done() if leave_pending else self.idle):
                break
            if i >= max_steps and not self.awaited:  # awaited transfers end by their timeout
                raise AssertionError(
                    f"harness: workload {workload.name!r} did not finish in {max_steps} steps "
                    f"({self.stuck()})"
                )
            self.step()
        if leave_pending:
            self._flush_poison()
            return self.result()
        self.drain()
        self._flush_poison()
        if self.references.held:
            self._violate("SCH-030", f"block references still held after the run on blocks "
                          f"{self.references.held_ids()}", "every reference dropped by the time "
                          "the engine is idle")
        leaked = self.pool.check_all_free()
        if leaked:
            raise AssertionError(f"harness bug: blocks {leaked} still referenced after the run")
        return self.result()

    def _flush_poison(self) -> None:
        """Poison the blocks the run's last steps freed now, not at the next step: a
        transfer that writes into them after the run is then seen (WRK-017)."""
        if self._poison_freed or self._poison_window or self._poison_preempted:
            self.workers.poison({
                "step": self.step_id,
                "poison_freed": self._take(self._poison_freed),
                "poison_window": self._take(self._poison_window),
                "poison_preempted": self._take(self._poison_preempted)})

    def result(self) -> RunResult:
        """What the engine did so far."""
        done = list(self.requests.values())
        return RunResult(
            steps=self.step_id + 1,
            finished=tuple(r.rid for r in done if r.status is _S.FINISHED),
            aborted=tuple(r.rid for r in done if r.status is _S.ABORTED),
            transfer_params={r.rid: r.params for r in done},
            external_tokens=dict(self._external),
            matched_tokens=dict(self._matched),
            events=tuple(self._events),
            preemptions=self._preemptions,
        )

    def drain(self) -> None:
        """Step until nothing is in flight (the async pipeline empties)."""
        while self._inflight is not None or self.awaited:
            self.step()

    def shutdown(self) -> None:
        """Shut down every role twice (idempotence, SCH-027, WRK-015) and check for leaks."""
        if self._closed:
            return
        self._closed = True
        try:
            self.workers.shutdown()
            self.scheduler.shutdown()
            self.scheduler.shutdown()
        except KVSpecError:
            raise
        except Exception as e:  # a connector's shutdown raised: same report at any TP size
            raise ContractViolation(
                "WRK-015", observed=f"shutdown raised {type(e).__name__}: {e}",
                expected="shutdown completes within a bounded time without error",
            ) from e
        finally:
            if self in Engine._live:
                Engine._live.remove(self)
            if self._own_tmp:
                shutil.rmtree(self.tmpdir, ignore_errors=True)
        if Engine._live:
            return
        deadline = time.monotonic() + 2.0
        leaked = self._leaked()
        while leaked and time.monotonic() < deadline:
            time.sleep(0.01)
            leaked = self._leaked()
        if "threads" in leaked:
            self._violate("WRK-015", f"threads still alive after shutdown: {leaked['threads']}",
                          "shutdown releases every thread the connector started")
        if leaked:
            what = "; ".join(f"{kind}: {', '.join(items[:8])}" for kind, items in leaked.items())
            self._violate("ERR-009", f"still open after shutdown: {what}",
                          "shutdown releases every file descriptor (file, socket, pipe, shared "
                          "memory) and child process the connector opened")

    @staticmethod
    def _leaked() -> dict[str, list[str]]:
        before = Engine._baseline
        return {} if before is None else snapshot().new_since(before)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.shutdown()
            return
        # The run already failed: that failure is the verdict. What shutting down after it
        # finds (a thread still busy with the failed step) is a consequence, kept as a note.
        try:
            self.shutdown()
        except Exception as e:
            note = getattr(exc, "add_note", None)  # Python >= 3.11
            if note is not None:
                note(f"then, shutting the engine down: {type(e).__name__}: {e}")

    # -- one step --------------------------------------------------------------------------

    def step(self) -> None:
        """Schedule, build metadata, (in async mode: process the previous output), execute."""
        if self._asleep:
            raise InvalidArgumentError("step() on an engine that is asleep: wake() it first")
        self.step_id += 1
        out_view, plans = self._schedule()
        meta = self._build_meta(out_view)
        if self.config.async_scheduling and self._inflight is not None:
            self._process(*self._inflight)
            self._inflight = None
        msg = {
            "step": self.step_id,
            "sync_loads": self._sync_loads,
            "poison_freed": self._take(self._poison_freed),
            "poison_window": self._take(self._poison_window),
            "poison_preempted": self._take(self._poison_preempted),
            "poison_alloc": self._take(self._poison_alloc),
            "zero": self._take(self._zero),
            "check_freed": self._check_freed,
            "preempted": sorted(out_view.preempted_req_ids),
            "finished": sorted(out_view.finished_req_ids),
            "reqs": plans,
            # the blocks of delayed frees: in a speculative step the engine may act on
            # an output as soon as it is built (SPD-004)
            "held": {rid: list(b) for rid, b in self.held.items()} if self.config.speculative
            else {},
        }
        self._check_freed = False
        outputs, violations = self.workers.step(msg, meta)
        if self.step_id in self._fail_at:
            self._fail(outputs, violations)
            self._check_awaited()
            return
        busy = plans or self.awaited or self.waiting or self.running or self.remote
        if self.config.async_scheduling and busy:
            # processed after the next step's metadata is built (SCH-014)
            self._inflight = (outputs, violations, plans)
        else:
            self._process(outputs, violations, plans)
        self._check_awaited()
        if not plans and (self.awaited or self.pool.holding or self._pending_since is not None):
            time.sleep(0.001)  # let the connector's transfers (or held blocks) progress

    def _fail(self, outputs: list[KVConnectorOutput], violations: list[dict[str, str]]) -> None:
        """The step failed on a rank after every rank's connector output was collected
        (``HarnessConfig.fail_steps``), as vLLM 0.33's fault-tolerant executor sees a step
        whose output fetch failed: nothing of the step is aggregated or computed; every
        rank's output is salvaged into the executor (``defer``) to be delivered with the
        next step's aggregate (EXE-013); then every unfinished request is aborted, as
        vLLM's fault handler does before the engine resumes (SCH-015, SCH-021)."""
        if violations:
            v = violations[0]
            self._violate(v["clause"], v["observed"], v["expected"])
        defer = getattr(self.executor, "defer", None)
        if defer is None:  # a custom aggregator that cannot salvage: merged per rank below
            self._salvaged = (outputs if self._salvaged is None else
                              [self._merge_rank(a, b, rank) for rank, (a, b)
                               in enumerate(zip(self._salvaged, outputs))])
        else:
            self._aggregate_errors(lambda: defer(dict(enumerate(outputs))))
        for r in list(self.requests.values()):
            if r.status not in (_S.FINISHED, _S.ABORTED) and not r.finished_called:
                self.abort(r.rid)

    def _merge_rank(self, first: KVConnectorOutput, then: KVConnectorOutput,
                    rank: int) -> KVConnectorOutput:
        """One rank's salvaged output merged into its next one, for an executor without
        ``defer``: the same reports, each once; the salvaged events dropped (EXE-013)."""
        for direction, a, b in ((Direction.SEND, first.finished_sending, then.finished_sending),
                                (Direction.RECV, first.finished_recving, then.finished_recving)):
            if a & b:
                self._violate("WRK-009", f"rank {rank} reports {sorted(a & b)} finished "
                              f"{direction.value}ing in a failed step and again in the next",
                              "each rank reports a request once per direction")
        stats = (first.stats if then.stats is None else then.stats if first.stats is None
                 else first.stats.aggregate(then.stats))
        meta = (first.worker_metadata if then.worker_metadata is None else then.worker_metadata
                if first.worker_metadata is None
                else first.worker_metadata.aggregate(then.worker_metadata))
        return KVConnectorOutput(
            finished_sending=first.finished_sending | then.finished_sending,
            finished_recving=first.finished_recving | then.finished_recving,
            failed_recving=first.failed_recving | then.failed_recving,
            invalid_block_ids=first.invalid_block_ids | then.invalid_block_ids,
            stats=stats, events=then.events, worker_metadata=meta,
            expected_finished_count=then.expected_finished_count
            or first.expected_finished_count)

    @staticmethod
    def _take(items: list[int]) -> list[int]:
        out = sorted(set(items))
        items.clear()
        return out

    def _schedule(self) -> tuple[SchedulerOutputView, list[dict[str, Any]]]:
        budget = self.config.max_tokens_per_step
        if self.pool.holding:
            self.pool.release_held(time.monotonic())
        self._sync_loads = False  # WRK-004: does this step compute a request loaded synchronously?
        new: list[NewRequestView] = []
        cached: list[CachedRequestView] = []
        counts: dict[str, int] = {}
        plans: list[dict[str, Any]] = []
        preempted: list[str] = []
        spec: dict[str, int] = {}  # draft tokens per request (SPD-005)
        self._in_flight.clear()  # speculative steps awaiting their output (async scheduling)

        def plan(r: _Req, start: int, n: int) -> None:
            counts[r.rid] = n
            plans.append({
                "id": r.rid, "tokens": list(r.tokens[: start + n]), "seed": r.seed,
                "blocks": list(r.blocks), "window": list(r.window), "start": start, "n": n,
                "ext": list(r.ext), "loaded_async": r.recv_done,
                "other_seeds": sorted(self._seeds - self._stale_seeds - {r.seed}),
                "stale_seeds": sorted(self._stale_seeds - {r.seed}),
            })

        for r in list(self.running):
            if budget == 0:
                break
            if r not in self.running:
                continue  # preempted earlier in this loop
            k = 0
            if self.config.speculative and r.num_computed >= r.prompt_len:
                if r.num_computed > r.executed:
                    self._in_flight.add(r.rid)
                    continue  # its speculative step is in flight (async scheduling): the
                    # accepted count is not known yet, so nothing is scheduled for it
                k = max(0, min(self.config.speculative_tokens, r.target - r.num_computed - 1,
                               budget - 1))
            n = self._chunk(r, r.num_computed, budget) + k
            if n <= 0:
                continue
            before, before_w = len(r.blocks), len(r.window)
            if not self._grow(r, r.num_computed + n, preempted, counts):
                continue
            start = r.num_computed
            accepted = self._accepted(r, start, k)
            proposed = self._proposals(r, start, k, accepted)
            cached.append(CachedRequestView(
                r.rid, self._blocks(r, before, before_w), start,
                new_token_ids=r.tokens[start : start + 1] + proposed if k
                else r.tokens[start : start + n],
            ))
            plan(r, start, n)
            if k:  # the step writes the proposals' KV; the rejected ones are not the request's
                plans[-1]["tokens"] = list(r.tokens[: start + 1]) + list(proposed)
                plans[-1]["rejected"] = k - accepted
                plans[-1]["epoch"] = r.preemptions
                spec[r.rid] = k
                r.rejecting = k - accepted
            r.num_computed += n  # counted computed now, the rejected subtracted later (SPD-005)
            budget -= n

        for r in list(self.waiting):
            if budget == 0 or preempted:
                break
            if r.recv_done:
                local, ext = r.num_computed, 0
            else:
                local = self._local_hit(r)
                answer = self._match(r, local)
                if answer is None:
                    continue  # SCH-003: deferred, asked again next step
                ext, is_async = answer
                if is_async and self.config.cut_async_matches:
                    # cut to 0 before allocating (vLLM's auxiliary-output cap, a partial
                    # local tail, a replayed window): computed here, alloc told 0 (SCH-034)
                    self._cut.add(r.rid)
                    ext, is_async = 0, False
                if is_async:
                    if not self._admit(r, local, local + ext, local + ext):
                        break
                    # an async match's blocks are not zeroed: every group counts as
                    # loaded (KVG-009, vLLM's get_loaded_kv_cache_group_ids; STG-009)
                    held = set(r.blocks)
                    self._zero = [b for b in self._zero if b not in held]
                    self._to_remote(r, local, ext)
                    continue
            n = self._chunk(r, local + ext, budget)
            if not self._admit(r, local, local + ext + n, local + ext):
                break
            if not r.recv_done:
                r.ext = (local, local + ext)
            if not r.recv_done or self.config.realloc_after_load:
                self._update_after_alloc(r, ext)
            if ext:
                self._external[r.rid] = self._external.get(r.rid, 0) + ext
                self._matched[r.rid] = self._matched.get(r.rid, 0) + ext
                _TALLY["loads"] += 1
                _TALLY["matched_tokens"] += ext
                _TALLY["loaded_tokens"] += ext
                self._sync_loads = True
            self.waiting.remove(r)
            self._transition(r, _S.RUNNING)
            self.running.append(r)
            r.num_computed = r.executed = local + ext
            new.append(NewRequestView(self._view(r), self._blocks(r),
                                      r.num_computed))
            plan(r, r.num_computed, n)
            r.num_computed += n
            budget -= n

        for r in list(self.remote.values()):
            if r.spec.abort_while_loading and not r.finished_called:
                r.aborted = True  # an abort that arrives while the load is in flight (SCH-021)
                self._finish(r)
        out = SchedulerOutputView(
            self.step_id, tuple(new), tuple(cached), counts,
            finished_req_ids=self._finished_ids, preempted_req_ids=preempted,
            spec_decode_tokens=spec,
        )
        self._finished_ids = []
        return out, plans

    # -- scheduling helpers ----------------------------------------------------------------

    def _accepted(self, r: _Req, start: int, k: int) -> int:
        """How many of ``k`` draft tokens proposed at ``start`` the target accepts: seeded
        by ``accept_seed``, the request and the position, so reruns accept the same."""
        if not k:
            return 0
        digest = hashlib.blake2b(f"{self.config.accept_seed}|{r.rid}|{start}".encode(),
                                 digest_size=4).digest()
        return int.from_bytes(digest, "little") % (k + 1)

    @staticmethod
    def _proposals(r: _Req, start: int, k: int, accepted: int) -> tuple[int, ...]:
        """The ``k`` draft tokens after position ``start``: the request's own tokens for the
        ``accepted`` ones, then tokens it never has (rejected, SPD-005)."""
        real = r.tokens[start + 1 : start + 1 + k]
        return real[:accepted] + tuple((t + 1 + j) % 997 for j, t in
                                       enumerate(real[accepted:]))

    @staticmethod
    def _chunk(r: _Req, computed: int, budget: int) -> int:
        """Tokens to schedule: the rest of the prompt (chunked), then one token per step."""
        if computed < r.prompt_len:
            return min(r.prompt_len - computed, budget)
        return min(1, r.target - computed, budget)

    def _local_hit(self, r: _Req) -> int:
        bs = self.config.block_size
        cap = (r.prompt_len - 1) // bs
        hits = self.pool.lookup(r.hashes[:cap])
        return len(hits) * bs

    def _admit(self, r: _Req, local: int, tokens: int, computed: int) -> bool:
        """Take the local hit's blocks and allocate up to ``tokens`` (``computed`` of them
        computed or matched: the window's blocks before them are skipped); False if no
        room."""
        bs = self.config.block_size
        if not r.recv_done:
            hits = self.pool.lookup(r.hashes[: local // bs])
            self.pool.touch(hits)  # before allocating, or the allocation may evict them
            need = max(0, math.ceil(tokens / bs) - len(hits))
            r.window = []
            slots = self._window_slots(r, tokens, computed)
            new = self.pool.allocate(need + len(slots))
            if new is None:
                self.pool.free(hits)  # cached blocks: back to evictable, nothing released
                return False
            r.blocks = hits + new[:need]
        else:
            self._skip_window(r, computed)
            need = max(0, math.ceil(tokens / bs) - len(r.blocks))
            slots = self._window_slots(r, tokens, computed)
            new = self.pool.allocate(need + len(slots))
            if new is None:
                return False
            r.blocks += new[:need]
        self._place_window(r, slots, new[need:])
        self._poison_alloc += new
        if self._state:
            self._zero += new[:need]
        return True

    # -- the sliding-window group of a hybrid model (HarnessConfig.sliding_window) ----------

    def _window_slots(self, r: _Req, tokens: int, computed: int) -> list[int]:
        """Positions of the window group's block list that need a block for ``tokens``
        tokens, ``computed`` of them computed or matched: those from the window of the
        token after them on (KVG-003) that hold the null block or none yet. [] with one
        group."""
        if self._state:  # RUNNING caching: one state block at index 0 (STG-002)
            return [0] if not r.window or r.window[0] == NULL_BLOCK_ID else []
        if not self._window:
            return []
        bs = self.config.block_size
        skip = max(0, computed - self._window + 1) // bs
        return [p for p in range(skip, math.ceil(tokens / bs))
                if p >= len(r.window) or r.window[p] == NULL_BLOCK_ID]

    def _place_window(self, r: _Req, slots: list[int], new: list[int]) -> None:
        """Put ``new`` at ``slots`` of the window group's list; positions before them
        that hold nothing yet hold the null block (KVG-004)."""
        if slots:
            r.window += [NULL_BLOCK_ID] * (slots[-1] + 1 - len(r.window))
            for p, b in zip(slots, new):
                r.window[p] = b

    def _skip_window(self, r: _Req, computed: int) -> None:
        """Free the window group's blocks wholly before the window of the token after
        ``computed`` ones and point their positions at the null block, as vLLM's
        ``remove_skipped_blocks`` does when it allocates (KVG-003, KVG-004)."""
        if not self._window:
            return
        end = min(len(r.window), max(0, computed - self._window + 1) // self.config.block_size)
        gone = [b for b in r.window[:end] if b != NULL_BLOCK_ID]
        if gone:
            r.window[:end] = [NULL_BLOCK_ID] * end
            self._poison_window += self.pool.free(gone)

    def _blocks(self, r: _Req, start: int = 0, start_w: int = 0) -> AllocatedBlocks:
        """The request's blocks, per group, from position ``start`` (``start_w`` in the
        window group)."""
        if not self._groups2:
            return AllocatedBlocks.single(r.blocks[start:])
        return AllocatedBlocks((tuple(r.blocks[start:]), tuple(r.window[start_w:])))

    def _held_blocks(self, r: _Req) -> list[int]:
        """Every block the request holds, in every group (null positions left out)."""
        return r.blocks + [b for b in r.window if b != NULL_BLOCK_ID]

    def _grow(self, r: _Req, tokens: int, preempted: list[str], scheduled: Mapping[str, int]) -> bool:
        """Give a running request blocks for ``tokens``, preempting others if needed."""
        self._skip_window(r, r.num_computed)
        need = max(0, math.ceil(tokens / self.config.block_size) - len(r.blocks))
        slots = self._window_slots(r, tokens, r.num_computed)
        while need + len(slots) > self.pool.num_free:
            # a request whose speculative step is in flight is not preempted: it is not
            # scheduled this step only because its accepted count is not known yet
            victims = [v for v in self.running if v is not r and v.rid not in scheduled
                       and v.rid not in self._in_flight]
            victim = victims[-1] if victims else r
            self._preempt(victim, preempted)
            if victim is r:
                return False
        new = self.pool.allocate(need + len(slots)) or []
        r.blocks += new[:need]
        self._place_window(r, slots, new[need:])
        self._poison_alloc += new
        if self._state:
            self._zero += new[:need]
        return True

    def _preempt(self, r: _Req, preempted: list[str]) -> None:
        self.running.remove(r)
        hold = self.config.preempted_hold_s
        self._poison_preempted += self.pool.free(
            self._held_blocks(r), hold_until=time.monotonic() + hold if hold else None)
        r.window = []
        r.blocks, r.num_computed, r.executed, r.ext, r.recv_done = [], 0, 0, (0, 0), False
        r.rejecting = 0
        r.preemptions += 1
        # Queued again as PREEMPTED, as vLLM 0.32 does, until it runs: connectors read the
        # status (LMCache's MP connector tells a resumed request from a failed load by it).
        self._transition(r, _S.PREEMPTED)
        # First in line, but behind the requests whose loads ended: those hold their blocks
        # while they wait, and a preempted request served before them in a tight pool can
        # take the last free blocks, preempt itself, and do so again every step (livelock).
        at = next((i for i, w in enumerate(self.waiting) if not w.recv_done), len(self.waiting))
        self.waiting.insert(at, r)
        preempted.append(r.rid)
        self._preemptions += 1

    def _to_remote(self, r: _Req, local: int, ext: int) -> None:
        self._matched[r.rid] = self._matched.get(r.rid, 0) + ext
        _TALLY["loads"] += 1
        _TALLY["matched_tokens"] += ext
        r.ext = (local, local + ext)
        r.num_computed = local
        self._update_after_alloc(r, ext)
        self.waiting.remove(r)
        self._transition(r, _S.WAITING_FOR_REMOTE_KV)
        self.remote[r.rid] = r
        self._expect(r.rid, Direction.RECV)

    def _expect(self, rid: str, direction: Direction) -> None:
        self.executor.expect(rid, direction)
        self.awaited[(rid, direction)] = (self.step_id, time.monotonic())

    def _transition(self, r: _Req, new: RequestStatus) -> None:
        check_transition(r.rid, r.status, new)
        r.status = new

    # -- connector calls with checks -------------------------------------------------------

    def _view(self, r: _Req, computed: int | None = None) -> RequestView:
        done = r.num_computed if computed is None else computed
        n_out = max(0, min(done - r.prompt_len + 1, r.spec.max_new_tokens))
        visible = r.prompt_len + n_out
        return RequestView(
            r.rid, r.spec.prompt, output_token_ids=r.tokens[r.prompt_len : visible],
            block_hashes=tuple(r.hashes[: visible // self.config.block_size]),
            cache_salt=r.spec.cache_salt, lora_id=r.spec.lora_id,
            kv_transfer_params=r.spec.kv_transfer_params, status=r.status,
            num_computed_tokens=min(done, visible),
        )

    def _match(self, r: _Req, local: int) -> tuple[int, bool] | None:
        view = self._view(r, local)
        first: object = self._timed("get_num_new_matched_tokens",
                                    self.scheduler.get_num_new_matched_tokens, view, local)
        again: object = self._timed("get_num_new_matched_tokens",
                                    self.scheduler.get_num_new_matched_tokens, view, local)
        if first != again:
            self._violate("SCH-001", f"get_num_new_matched_tokens({r.rid!r}, {local}) answered "
                          f"{first!r} and then {again!r}", "the same answer for the same request, "
                          "and no state change from asking")
        if not (isinstance(first, tuple) and len(first) == 2 and isinstance(first[1], bool)):
            self._violate("SCH-004", f"get_num_new_matched_tokens returned {first!r}",
                          "a tuple (int or None, bool)")
        count, is_async = first
        assert isinstance(is_async, bool)
        if count is None:  # deferred: the flag is ignored, as vLLM's scheduler ignores it
            return None
        room = r.prompt_len - local
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= room:
            self._violate("SCH-004", f"match count {count!r} for {r.rid!r} with {local} computed "
                          f"of {r.prompt_len} prompt tokens", f"an int in [0, {room}]")
        if count == 0 and is_async:
            self._violate("SCH-004", f"get_num_new_matched_tokens({r.rid!r}) returned (0, True)",
                          "load_async False when nothing matched")
        if local + count > r.prompt_len - 1 and not is_async:  # async: backed off at the end
            self._violate("SCH-005", f"{r.rid!r}: {local} computed + {count} synchronously "
                          f"matched tokens cover the whole {r.prompt_len}-token prompt",
                          f"at most {r.prompt_len - 1 - local} matched tokens (one left to "
                          "compute), or an asynchronous load")
        return count, is_async

    def _update_after_alloc(self, r: _Req, ext: int) -> None:
        self._timed("update_state_after_alloc", self.scheduler.update_state_after_alloc,
                    self._view(r, r.ext[0] if not r.recv_done else None),
                    self._blocks(r), ext)

    def _timed(self, hook: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call a scheduler hook; one that takes longer than the budget blocks (SCH-025)."""
        start = time.monotonic()
        result = fn(*args)
        took = time.monotonic() - start
        if took > self.config.hook_budget_s:
            self._violate("SCH-025", f"{hook} took {took:.2f} s",
                          f"scheduler hooks that return within {self.config.hook_budget_s} s, "
                          "never waiting for a transfer")
        return result

    def _build_meta(self, out: SchedulerOutputView) -> ConnectorMetadata:
        before = repr(out)
        meta: object = self._timed("build_connector_meta", self.scheduler.build_connector_meta, out)
        if repr(out) != before:
            self._violate("SCH-012", "build_connector_meta changed the scheduler output",
                          "the scheduler output left untouched")
        if not isinstance(meta, ConnectorMetadata):
            self._violate("ERR-006", f"build_connector_meta returned {type(meta).__name__}, "
                          "which has no encode()/decode()", "metadata that encodes itself to bytes")
        return meta

    def _finish(self, r: _Req) -> None:
        """request_finished, then free now or hold (SCH-015..SCH-018, SCH-021)."""
        if r.finished_called:
            raise AssertionError(f"harness bug: request_finished twice for {r.rid}")
        r.finished_called = True
        self._finished_ids.append(r.rid)
        final = _S.ABORTED if r.aborted else _S.FINISHED
        # The connector sees the request as finished or aborted, as an engine shows it then.
        view = attrs.evolve(self._view(r), status=final)
        all_groups = getattr(self.scheduler, "request_finished_all_groups", None)
        if self._groups2 and all_groups is not None:  # every group's blocks (KVG-006), as
            # vLLM passes them to a connector that supports its hybrid allocator
            answer: object = self._timed("request_finished_all_groups", all_groups,
                                         view, self._blocks(r))
        else:
            answer = self._timed("request_finished", self.scheduler.request_finished,
                                 view, tuple(r.blocks))
        if not (isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], bool)):
            self._violate("SCH-016", f"request_finished({r.rid!r}) returned {answer!r}",
                          "a tuple (bool, params or None)")
        delay, params = answer
        assert isinstance(delay, bool)
        try:
            r.params = freeze_params(params)
        except InvalidArgumentError as e:
            self._violate("SCH-018", f"request_finished({r.rid!r}) returned params: {e.message}",
                          "None or a mapping of JSON-representable values")
        r.delay_send = delay
        if r.rid in self.remote:
            self._transition(r, final)  # blocks stay with the load until finished_recving (SCH-021)
            return
        if r in self.running:
            self.running.remove(r)
        self._transition(r, final)
        self._release(r)

    def _release(self, r: _Req) -> None:
        if r.delay_send:
            self.held[r.rid] = self._held_blocks(r)
            self._expect(r.rid, Direction.SEND)
        else:
            self._poison_freed += self.pool.free(self._held_blocks(r))
        r.blocks, r.window = [], []

    # -- outputs ---------------------------------------------------------------------------

    def _process(self, outputs: list[KVConnectorOutput], violations: list[dict[str, str]],
                 plans: list[dict[str, Any]]) -> None:
        for p in plans:
            r = self.requests[p["id"]]
            rejected = p.get("rejected", 0)
            if "rejected" in p and p.get("epoch") != r.preemptions:
                continue  # a speculative step of before the request's preemption: its
                # accepted count no longer applies (the request restarted from its blocks)
            if r in self.running:
                if rejected and r.rejecting == rejected:  # vLLM subtracts the rejected
                    r.num_computed -= rejected  # draft tokens when the output arrives
                r.rejecting = 0
                r.executed = max(r.executed, p["start"] + p["n"] - rejected)
        if violations:
            v = violations[0]
            self._violate(v["clause"], v["observed"], v["expected"])
        if self._salvaged is not None:  # what a failed step salvaged (no executor defer)
            outputs = [self._merge_rank(a, b, rank)
                       for rank, (a, b) in enumerate(zip(self._salvaged, outputs))]
            self._salvaged = None
        agg: KVConnectorOutput = self._aggregate_errors(lambda: self.executor.aggregate(outputs))
        self._deliver(agg)
        for r in list(self.running):
            self._cache_computed(r)
            if r.executed >= r.target:
                self._finish(r)

    def _aggregate_errors(self, call: Callable[[], Any]) -> Any:
        """Run an executor call (``aggregate``, ``defer``), with its errors turned into the
        clauses the connector broke."""
        try:
            return call()
        except DoubleReportError as e:
            self._violate("WRK-009", e.message, "each rank reports a request once per direction")
        except UnknownRequestError as e:
            if e.direction is Direction.RECV and e.request_id in self._cut and (
                    e.request_id, Direction.RECV) not in self.awaited:
                self._violate("SCH-034", f"{e.message} (the engine had cut its asynchronous "
                              "match to 0 tokens and called update_state_after_alloc with "
                              "num_external_tokens=0)", "no load started and nothing reported "
                              "for a match the engine cut to 0 tokens")
            if (e.request_id, e.direction) in self._completed:
                req = self.requests.get(e.request_id or "")
                hint = ("; if the connector started a second load on the update_state_after_"
                        "alloc call with num_external_tokens=0 that follows a finished load, "
                        "that second load breaks SCH-009" if e.direction is Direction.RECV
                        and req is not None and req.recv_done else "")
                self._violate("WRK-009", f"{e.message} (it had already completed in an earlier "
                              f"step{hint})", "each rank reports a request once per direction")
            self._violate("WRK-010", e.message, "reports only for requests the worker was told about")
        except ReportError as e:
            self._violate(e.clause or "EXE-008", e.message, "consistent reports")

    def _deliver(self, agg: KVConnectorOutput) -> None:
        """Hand one aggregated output to the scheduler role and act on it."""
        if not agg.is_empty():  # SCH-019: engines may skip empty outputs, as vLLM 0.32 does
            self._timed("update_connector_output", self.scheduler.update_connector_output, agg)
        for ev in self.scheduler.take_events():
            if not isinstance(ev, KVCacheEvent.__args__):  # type: ignore[attr-defined]
                self._violate("EVT-005", f"take_events yielded {ev!r}", "KV-cache event objects")
            self._events.append(ev)
        self._apply_invalid(agg.invalid_block_ids)
        self._completed.update((rid, Direction.RECV) for rid in agg.finished_recving)
        self._completed.update((rid, Direction.SEND) for rid in agg.finished_sending)
        for rid in sorted(agg.finished_recving):
            self._recv_done(rid, failed=rid in agg.failed_recving)
        for rid in sorted(agg.finished_sending):
            self.awaited.pop((rid, Direction.SEND), None)
            blocks = self.held.pop(rid, None)
            if blocks is None:
                raise AssertionError(f"harness bug: finished_sending for {rid} with no held blocks")
            self._poison_freed += self.pool.free(blocks)

    def _recv_done(self, rid: str, *, failed: bool) -> None:
        self.awaited.pop((rid, Direction.RECV), None)
        r = self.remote.pop(rid)
        if r.finished_called:  # aborted while loading: release now (SCH-021)
            self._release(r)
            return
        start, end = r.ext  # end already cut at the first invalid block (SCH-024)
        if failed and not r.invalid_named:
            end = start  # a failure that named no block: recompute the whole load
        # An async load may cover the whole prompt; its last token is computed again so
        # that the request can sample, as vLLM does (SCH-005). With a state group that
        # token is applied to the loaded state twice: the workers' state check names it.
        r.num_computed = min(end, r.prompt_len - 1)
        r.recv_done = True
        self._external[rid] = self._external.get(rid, 0) + (end - start)
        _TALLY["loaded_tokens"] += end - start
        r.ext = (start, end)
        # back to WAITING, or to PREEMPTED for a request preempted before (vLLM 0.32)
        self._transition(r, _S.PREEMPTED if r.preemptions else _S.WAITING)
        self.waiting.appendleft(r)

    def _apply_invalid(self, invalid: Iterable[int]) -> None:
        bad = set(invalid)
        if not bad:
            return
        bs = self.config.block_size
        if self._groups2:
            self._violate("KVG-005", f"invalid block ids {sorted(bad)[:8]} reported by a "
                          "connector of an engine with several KV-cache groups",
                          "failed loads reported per request (failed_recving), never as block "
                          "ids, which are unique only within a group")
        for b in bad:
            if not 0 <= b < self.config.num_blocks:
                self._violate("LAY-012", f"invalid block id {b} reported",
                              f"block ids in [0, {self.config.num_blocks})")
            self.pool.uncache(b)
        for r in itertools.chain(self.running, self.remote.values()):
            idx = [i for i, b in enumerate(r.blocks) if b in bad]
            if idx:
                first = idx[0] * bs
                if r.rid in self.remote:
                    r.ext = (r.ext[0], max(r.ext[0], min(r.ext[1], first)))
                    r.invalid_named = True
                else:
                    r.num_computed = min(r.num_computed, first)
                    r.executed = min(r.executed, first)
                    start, end = r.ext  # its load's tokens from ``first`` on: recomputed
                    kept = max(start, min(end, first))
                    if kept < end:  # a failed synchronous load: not counted as loaded
                        self._external[r.rid] -= end - kept
                        r.ext = (start, kept)

    def _cache_computed(self, r: _Req) -> None:
        full = min(r.executed, len(r.tokens)) // self.config.block_size
        for i in range(min(full, len(r.blocks), len(r.hashes))):
            self.pool.cache(r.blocks[i], r.hashes[i])

    def stuck(self) -> str:
        """The requests not finished yet and their states, for a run that ran out of steps
        (a request the connector keeps deferring, SCH-002, waits forever)."""
        left = [f"{r.rid} {r.status.value}" for r in self.requests.values()
                if r.status not in (_S.FINISHED, _S.ABORTED)]
        return "requests not finished: " + (", ".join(left[:8]) or "none")

    def _lost(self) -> str:
        """Note a transfer given up for lost, so later engines on this connector wait only
        ``LOST_TRANSFER_CAP_S``; the text says so when this engine's wait was capped."""
        _LOST_TRANSFERS.add(_factory_key(self.factory))
        return (f" (capped at {LOST_TRANSFER_CAP_S:g} s: this connector lost a transfer in an "
                "earlier test of the session)" if self._capped else "")

    def _check_awaited(self) -> None:
        now = time.monotonic()
        for (rid, direction), (since_step, since) in list(self.awaited.items()):
            if now - since > self.config.transfer_timeout_s and self.step_id - since_step > 3:
                capped = self._lost()
                r = self.requests[rid]
                if direction is Direction.SEND:
                    self._violate("SCH-016", f"request_finished({rid!r}) returned True but no rank "
                                  f"reported finished_sending within {self.config.transfer_timeout_s}"
                                  f" s ({self.step_id - since_step} steps){capped}",
                                  "finished_sending from every rank once the blocks are no longer read")
                clause = "SCH-021" if r.aborted else "SCH-023"
                self._violate(clause, f"{rid!r} ({'aborted while ' if r.aborted else ''}waiting for "
                              f"remote KV) was not reported in finished_recving by every rank within "
                              f"{self.config.transfer_timeout_s} s ({self.step_id - since_step} steps)"
                              f"{capped}",
                              "finished_recving from every rank for every started load, even "
                              "failed or aborted ones")

    def _violate(self, clause: str, observed: str, expected: str) -> NoReturn:
        raise ContractViolation(clause, observed=observed, expected=expected,
                                reproduce=self._reproduce())

    def _reproduce(self) -> str:
        """Python that reruns this engine's workload on a fresh engine with this connector
        and fails at the same step (the tmpdir aside), to paste into a file or a shell."""
        enums: set[str] = set()

        def py(value: Any) -> str:
            if isinstance(value, enum.Enum):
                enums.add(type(value).__name__)
                return f"{type(value).__name__}.{value.name}"
            if isinstance(value, Mapping):
                return repr(thaw_params(value))
            return repr(value)

        cfg = ", ".join(f"{k}={py(v)}" for k, v in attrs.asdict(self.config, recurse=False).items()
                        if v != attrs.fields_dict(HarnessConfig)[k].default)
        runs = self._history if any("reset_cache" in h for h in self._history) else []
        body = "\n    ".join(runs) if runs else f"engine.run({self._described(self.workload)})"
        names = ", ".join(sorted({"load_factory", *enums}))
        return (
            f"# reproduce: fails at step {self.step_id}\n"
            "from kvspec.conformance.harness import Engine, HarnessConfig, RequestSpec, Workload\n"
            f"from kvspec.protocols import {names}\n\n"
            f"factory = load_factory({self._spec!r})\n"
            f"with Engine(factory, HarnessConfig({cfg})) as engine:\n"
            f"    {body}"
        )

    @staticmethod
    def _described(workload: Workload | None) -> str:
        """``workload`` as Python, indented for the body of a ``with`` block."""
        wl = workload.describe() if workload else "Workload([])  # requests added by hand"
        return wl.replace("\n    ", "\n        ").replace("\n])", "\n    ])")

class _ConnectorReferences:
    """The harness's ``BlockReferences``: the connector's references on pool blocks (SCH-030).

    A reference counts in the pool like a request's, so a referenced block is neither
    reallocated nor evicted; a block whose last reference is dropped is poisoned like any
    freed block, so a connector that reads it afterwards is caught (SCH-017)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._held: dict[int, int] = {}

    @property
    def num_blocks(self) -> int:
        return self._engine.pool.num_blocks

    @property
    def held(self) -> bool:
        return bool(self._held)

    def held_ids(self) -> list[int]:
        return sorted(self._held)[:16]

    def _ids(self, block_ids: Iterable[int], what: str) -> list[int]:
        ids = list(block_ids)
        for b in ids:
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.num_blocks:
                raise InvalidBlockIdError(
                    f"BlockReferences.{what}: block id {b!r} is not an int in "
                    f"[0, {self.num_blocks})")
        return ids

    def take(self, block_ids: Iterable[int]) -> None:
        pool = self._engine.pool
        ids = self._ids(block_ids, "take")
        for b in ids:
            if pool.refcount(b) == 0:
                self._engine._violate(
                    "SCH-030", f"BlockReferences.take() on block {b}, which no request holds",
                    "references only on blocks a request holds at the time")
        pool.touch(ids)
        for b in ids:
            self._held[b] = self._held.get(b, 0) + 1

    def drop(self, block_ids: Iterable[int]) -> None:
        ids = self._ids(block_ids, "drop")
        for b in ids:
            if self._held.get(b, 0) == 0:
                self._engine._violate(
                    "SCH-030", f"BlockReferences.drop() on block {b}, which the connector "
                    "holds no reference on", "each reference taken dropped exactly once")
            self._held[b] -= 1
            if self._held[b] == 0:
                del self._held[b]
            self._engine._poison_freed += self._engine.pool.free([b])
