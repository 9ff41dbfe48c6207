"""Any vLLM ``KVConnectorBase_V1`` as a kvspec ``ConnectorFactory``, for the suite to certify.

``VllmConnectorFactory("ExampleConnector")`` (a name vLLM's connector factory registers) or
``VllmConnectorFactory("pkg.mod:ClassName")`` (an out-of-tree connector) builds the vLLM
connector's two roles inside kvspec's scheduler and worker roles. Every hook translates
kvspec's views into the real vLLM objects (``Request``, ``KVCacheBlocks``,
``SchedulerOutput``, ``ForwardContext``, ``VllmConfig``) and the answers back; metadata
crosses as MessagePack (``VllmMetadata``), never pickled. The suite names it
``vllm:ExampleConnector`` or ``vllm:pkg.mod:ClassName``.

The wrapper plays vLLM's engine for every connector alike: each role gets a ``VllmConfig``
with a model configuration, the KV-cache layout resolved the way vLLM's engine core resolves
it (the platform's attention backends and the connector's ``get_required_kvcache_layout``)
and a block size the backends take (``_objects.platform_kv``), in vLLM's init order. Where
the wrapper's own code fails (building an engine object, translating a view), it raises
``HarnessError``: the suite reports that as kvspec's error, never as the connector's clause.
What the connector's own code raises stays the connector's.

What the translation cannot carry, by design:

* vLLM's ``handle_preemptions`` takes the step's metadata; kvspec's takes the preempted ids
  before the metadata is bound. The wrapper calls vLLM's when the step's metadata is bound,
  before vLLM's ``bind_connector_metadata``, the order vLLM itself uses.
* Transfer stats, KV-cache events and worker metadata are not translated (they are vLLM
  types only vLLM's own scheduler and loggers read); the wrapper reports none.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib
import os
import random
import socket
import tempfile
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs
import torch

from kvspec.protocols import (
    SPEC_VERSION,
    AllocatedBlocks,
    BlockReferences,
    Capabilities,
    ConnectorMetadata,
    ContractViolation,
    EngineConfigView,
    Envelope,
    ForwardContextView,
    GroupKind,
    HandshakeMetadata,
    HarnessError,
    InvalidArgumentError,
    KVSpecError,
    KVCacheEvent,
    KVCacheLayout,
    KVConnectorOutput,
    MalformedMetadataError,
    RequestView,
    SchedulerConnector,
    SchedulerOutputView,
    TransferRole,
    WorkerConnector,
    thaw_params,
)

from . import _objects
from ._profiles import Profile, profile_for
from ._wire import (VllmMetadata, VllmWorkerMetadata, carry_gap, decode_value, encode_value,
                    loaded_class)

__all__ = ["VllmConnectorFactory"]


@contextlib.contextmanager
def _ours(what: str) -> Iterator[None]:
    """The wrapper's own work (not a call into the connector): an exception other than a
    typed kvspec error becomes ``HarnessError`` naming ``what``, kvspec's fault."""
    try:
        yield
    except KVSpecError:
        raise
    except Exception as e:
        raise HarnessError(f"kvspec's vLLM wrapper failed while {what}: "
                           f"{type(e).__name__}: {e}") from e


def _connector_class(spec: str) -> tuple[str, str | None, type]:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    module, sep, name = spec.rpartition(":")
    if not name or (sep and not module) or not name.isidentifier():
        raise InvalidArgumentError(
            f"bad vLLM connector {spec!r}: expected a name vLLM registers (e.g. "
            "'ExampleConnector') or 'package.module:ClassName'")
    try:
        cls = KVConnectorFactory.get_connector_class(KVTransferConfig(
            kv_connector=name, kv_connector_module_path=module or None, kv_role="kv_both"))
    except Exception as e:
        known = ", ".join(sorted(KVConnectorFactory._registry))
        raise InvalidArgumentError(
            f"vLLM connector {spec!r} cannot be loaded: {type(e).__name__}: {e} (vLLM "
            f"registers: {known}; an out-of-tree one is 'package.module:ClassName')") from e
    return name, module or None, cls


class VllmConnectorFactory:
    """A vLLM connector class as a kvspec connector factory.

    Args:
        connector: A connector name vLLM registers, or ``"package.module:ClassName"``.

    Raises:
        InvalidArgumentError: the connector cannot be found or loaded.
    """

    def __init__(self, connector: str) -> None:
        if not isinstance(connector, str):
            raise InvalidArgumentError(f"connector must be a str, got {type(connector).__name__}")
        self.connector = connector
        self._name, self._module, self.connector_class = _connector_class(connector)
        self.profile: Profile = profile_for(self._name, self.connector_class)
        self._platform: _objects.PlatformKV | None = None
        self._capabilities: Capabilities | None = None
        self._hma = False  # vLLM keeps its hybrid allocator on for this connector's config
        self._sleep = False  # the connector's own supports_sleep_mode (vLLM >= 0.33)

    @property
    def platform(self) -> _objects.PlatformKV:
        """The layout and block size vLLM's engine core resolves for this connector on this
        platform (computed once)."""
        if self._platform is None:
            from kvspec.protocols._loading import connector_extra

            config = EngineConfigView(  # a sample engine: nothing is written to its tmpdir
                engine_id="kvspec-platform", role=TransferRole.BOTH, num_layers=2,
                block_size=32, num_blocks=1,
                extra={**connector_extra(), "kvspec.tmpdir": tempfile.gettempdir()})
            with _ours("resolving the KV-cache layout as vLLM's engine core does"):
                vconf = self._vllm_config(config, None, cache_layout=None)
                names = tuple(_LAYER_NAMES.format(i) for i in range(config.num_layers))
                self._platform = _objects.platform_kv(vconf, _model_shape(config, None), names)
            with _ours("asking vLLM whether the connector's config supports its hybrid "
                       "allocator"):
                from vllm.distributed.kv_transfer.kv_connector.factory import (
                    KVConnectorFactory,
                )

                self._hma = bool(KVConnectorFactory.supports_hma_config(
                    vconf.kv_transfer_config))
            # vLLM >= 0.33: the connector's own answer for this configuration (WRK-020);
            # older releases have no sleep hooks, so no sleep is certified there
            ask = getattr(self.connector_class, "supports_sleep_mode", None)
            with _ours("asking the connector whether it supports vLLM's sleep mode"):
                self._sleep = bool(ask(vconf.kv_transfer_config)) if callable(ask) else False
            # A vLLM worker process runs the platform's worker module first; vLLM-CPU's
            # (cpu_worker) stands in for CUDA events, streams and pinned memory there, and
            # connectors rely on it: every process of the wrapper imports it alike.
            worker_cls = getattr(vconf.parallel_config, "worker_cls", "auto")
            if isinstance(worker_cls, str) and "." in worker_cls:
                with _ours(f"importing the platform's worker module ({worker_cls})"):
                    importlib.import_module(worker_cls.rpartition(".")[0])
        return self._platform

    @property
    def __kvspec_spec__(self) -> str:
        """How worker processes re-create this factory (``load_factory`` accepts it)."""
        return f"vllm:{self.connector}"

    @property
    def unavailable_reason(self) -> str | None:
        """Why the connector cannot run on this machine (the suite skips it), or None."""
        return self.profile.unavailable

    @property
    def name(self) -> str:
        """``vLLM <ClassName>``."""
        return f"vLLM {self.connector_class.__qualname__}"

    @property
    def capabilities(self) -> Capabilities:
        """The declaration of ``profile_for`` (see ``kvspec.vllm.certify._profiles``), in
        the one layout vLLM's engine resolves on this platform and, unless the profile names
        its own, the block size the platform's attention backends take."""
        if self._capabilities is None and self.profile.unavailable:
            return self.profile.capabilities  # it cannot run here: no engine to resolve
        if self._capabilities is None:
            caps, platform = self.profile.capabilities, self.platform
            self._capabilities = attrs.evolve(
                caps, accepted_layouts=(platform.layout,),
                block_sizes=caps.block_sizes or (platform.block_size,),
                sleep_mode=self._sleep, **self._hybrid())
        return self._capabilities

    def _hybrid(self) -> dict[str, Any]:
        """A connector whose config vLLM runs under its hybrid allocator (``SupportsHMA``;
        for ``MultiConnector``, every child's) gets full and sliding-window groups
        (KVG-002), as vLLM gives it; the others one group (vLLM turns the allocator off
        for them)."""
        if not self._hma:
            return {}
        return {"kv_cache_groups": 8,
                "group_kinds": frozenset({GroupKind.FULL, GroupKind.SLIDING_WINDOW})}

    def vllm_config(self, config: EngineConfigView, layout: KVCacheLayout | None = None) -> Any:
        """The ``VllmConfig`` an engine with this kvspec configuration gives the connector
        (with ``layout``, a worker's: its model has the layout's heads and head size), its
        KV-cache layout resolved."""
        return self._vllm_config(config, layout, cache_layout=self.platform.layout)

    def _vllm_config(self, config: EngineConfigView, layout: KVCacheLayout | None,
                     cache_layout: str | None) -> Any:
        extra = {k: thaw_params(v) for k, v in config.extra.items() if not k.startswith("kvspec.")}
        return _objects.vllm_config(
            connector=self._name, module_path=self._module, role=config.role,
            engine_id=config.engine_id, block_size=config.block_size, tp_size=config.tp_size,
            extra={**self.profile.extra(config), **extra}, transfer=self.profile.transfer,
            model=_model_shape(config, layout), cache_layout=cache_layout,
            num_blocks=config.num_blocks)

    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        """vLLM's scheduler role, wrapped."""
        return _VllmScheduler(self, config)

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        """vLLM's worker role for ``rank``, wrapped; built when the caches are registered
        (vLLM's worker role needs the KV-cache shapes at construction)."""
        return _VllmWorker(self, config, rank)

    def create_executor(self, config: EngineConfigView) -> None:
        """None: vLLM connectors use the standard aggregator."""
        return None


_LAYER_NAMES = "model.layers.{}.attn"


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _model_shape(config: EngineConfigView, layout: KVCacheLayout | None) -> _objects.ModelShape:
    """The model both roles are told, as vLLM gives both one ``VllmConfig``: the engine's
    (``extra["kvspec.model"]``, which the harness sets: KV heads over every TP rank, head
    size, dtype), else a worker's from its layout; a bare sample configuration gets one KV
    head of 64 per rank. Connectors key stored KV by the model (LMCache's MP connector
    does), so the two roles must agree."""
    model = config.extra.get("kvspec.model")
    if isinstance(model, Mapping):
        try:
            return _objects.ModelShape(config.num_layers, int(model["num_kv_heads"]),
                                       int(model["head_size"]), _DTYPES[model["dtype"]])
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgumentError(
                f"EngineConfigView.extra['kvspec.model'] is {dict(model)!r}: {e}; expected "
                "num_kv_heads, head_size and dtype") from None
    if layout is None:
        return _objects.ModelShape(config.num_layers, config.tp_size, 64, torch.float32)
    return _objects.ModelShape(config.num_layers, layout.num_heads * config.tp_size,
                               layout.head_size_k, layout.dtype)


def _role(name: str) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    return KVConnectorRole[name]


@contextlib.contextmanager
def _guest() -> Iterator[None]:
    """Undo what building a vLLM connector does to the process it runs in: vLLM writes
    variables into ``os.environ`` (``LD_PRELOAD`` among them) and its NIXL worker pins the
    calling thread to one core. The harness's process is not vLLM's to configure."""
    env = dict(os.environ)
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(env)
        if affinity is not None:
            os.sched_setaffinity(0, affinity)


_RELEASE_TIMEOUT_S = 10.0


def _release(holder: Any) -> None:
    """Shut ``holder._conn`` (a vLLM connector) down and drop it, then collect: what the
    connector holds until collected (a NIXL agent and its sockets) is freed, as an engine
    process exiting after shutdown would free it. The collection runs on its own thread
    and is waited for at most ``_RELEASE_TIMEOUT_S``: a finalizer can block for ever (a
    ZeroMQ context terminating while a socket the connector left open is still in use).

    Raises:
        ContractViolation: WRK-015, when collecting what the connector left did not end.
    """
    conn, holder._conn = holder._conn, None
    conn.shutdown()
    del conn
    done = threading.Event()

    def collect() -> None:
        gc.collect()
        done.set()

    threading.Thread(target=collect, name="kvspec-release-collect", daemon=True).start()
    if not done.wait(_RELEASE_TIMEOUT_S):
        raise ContractViolation(
            "WRK-015", observed="after shutdown, collecting what the connector still held "
            f"did not end in {_RELEASE_TIMEOUT_S:.0f} s (a finalizer blocked: for example a "
            "ZeroMQ context terminating while a socket of a thread the connector left "
            "running is still open)",
            expected="shutdown stops every thread and closes every socket it opened, so "
            "that dropping the connector returns at once")


_SIDE_CHANNEL_PORTS = ("VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_MOONCAKE_BOOTSTRAP_PORT")
"""Environment variables vLLM's connectors read their side-channel port from (NIXL's, also
inside a MultiConnector, and Mooncake's): every scheduler role gets a free port on
127.0.0.1, as two engines on one host must be configured (on one port, the second engine's
NIXL listener never binds and vLLM waits for it without a timeout)."""


def _free_port() -> int:
    """A port free now on 127.0.0.1, below Linux's ephemeral range (32768 and up): the
    connector binds it later, and a port the kernel hands out for outgoing connections
    (ZMQ, gloo, NIXL agents) in between would make that bind fail; vLLM's NIXL scheduler
    then waits for its listener without a timeout."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise HarnessError("kvspec's vLLM wrapper found no free port in 20000-31999 for a "
                       "connector's side channel")


class _ProcessGroup:
    """vLLM's TP group in this process, built by the wrapper for its workers as vLLM's
    worker processes have one, and destroyed when the last of them shuts down (the group
    holds sockets and pipes)."""

    users = 0
    owned = False
    store_file = ""
    tracker_was_running = True

    @classmethod
    def join(cls, vllm_config: Any, config: EngineConfigView, rank: int) -> None:
        """Build the group for this rank (gloo, met through a file in the engine's scratch
        directory, which every rank of an engine shares), or reuse this process's."""
        from vllm.config import set_current_vllm_config
        from vllm.distributed import parallel_state as ps

        if ps.model_parallel_is_initialized():
            have = ps.get_tensor_model_parallel_world_size()
            if have != config.tp_size:
                raise InvalidArgumentError(
                    f"this process already holds a vLLM TP group of size {have}; the engine "
                    f"needs {config.tp_size} (one vLLM parallel state per process)")
        else:
            from multiprocessing import resource_tracker

            tracker: Any = resource_tracker._resource_tracker
            cls.tracker_was_running = tracker._fd is not None
            tmp = config.extra.get("kvspec.tmpdir")
            if not isinstance(tmp, str):
                raise InvalidArgumentError("a vLLM connector with a TP group needs "
                                           "EngineConfigView.extra['kvspec.tmpdir']")
            # The ranks of a TP engine are fresh processes of one harness process; a lone
            # rank needs no peer, and a new name each time (a store file is not reusable).
            # The name is also vLLM's CPU shared-memory group name (VLLM_DIST_IDENT): a
            # group whose ranks died in an earlier test may leave its segment behind, so
            # the ranks of one engine agree on a name no other test's engine has (its
            # scratch directory, fresh per test, and the engine id).
            scope = hashlib.sha256(os.path.abspath(tmp).encode()).hexdigest()[:10]
            name = (f"vllm-tp-{config.engine_id}-{os.getppid()}-{scope}" if config.tp_size > 1
                    else f"vllm-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            os.makedirs(tmp, exist_ok=True)  # torch's FileStore waits for a missing dir
            where = f"file://{tmp}/{name}"
            cls.store_file = os.path.join(tmp, name)
            os.environ["VLLM_DIST_IDENT"] = name  # what vLLM's CPU worker sets first
            with set_current_vllm_config(vllm_config):
                ps.init_distributed_environment(world_size=config.tp_size, rank=rank,
                                                local_rank=rank, backend="gloo",
                                                distributed_init_method=where)
                ps.ensure_model_parallel_initialized(config.tp_size, 1)
            cls.owned = True
        cls.users += 1

    @classmethod
    def leave(cls) -> None:
        """One user fewer; the last one destroys a group the wrapper built."""
        cls.users -= 1
        if cls.users == 0 and cls.owned:
            from vllm.distributed import parallel_state as ps

            cls.owned = False
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()
            with contextlib.suppress(OSError):  # another rank may have removed it
                os.unlink(cls.store_file)
            if not cls.tracker_was_running:
                # vLLM's TP broadcaster's shared memory started Python's resource tracker (a
                # child process) for this group; stop it as the process's exit would
                from multiprocessing import resource_tracker

                tracker: Any = resource_tracker._resource_tracker
                tracker._stop()


class _VllmScheduler(SchedulerConnector):
    def __init__(self, factory: VllmConnectorFactory, config: EngineConfigView) -> None:
        from vllm.config import set_current_vllm_config

        self._factory = factory
        self._conn: Any = None
        self._closed = False
        with _ours("building the scheduler role's VllmConfig and KVCacheConfig"):
            self._vllm_config = factory.vllm_config(config)
            shape = _model_shape(config, None)
            kv_config = _objects.kv_cache_config(
                config.block_size, config.num_blocks,
                tuple(_LAYER_NAMES.format(i) for i in range(config.num_layers)),
                attrs.evolve(shape, num_kv_heads=max(1, shape.num_kv_heads // config.tp_size)),
                factory.platform.layout, config.kv_cache_groups)
            self._groups = config.num_groups
            producer = config.role is TransferRole.PRODUCER
            self._book = _objects.RequestBook(
                config.block_size, factory.profile.producer_params if producer else None)
        with _guest(), set_current_vllm_config(self._vllm_config):
            for env in _SIDE_CHANNEL_PORTS:  # each engine its own, as a deployment gives
                os.environ[env] = str(_free_port())
                os.environ[env.replace("_PORT", "_HOST")] = "127.0.0.1"
            self._conn = factory.connector_class(self._vllm_config, _role("SCHEDULER"), kv_config)

    def _req(self, request: RequestView) -> Any:
        with _ours(f"bringing vLLM's Request {request.request_id!r} up to date"):
            return self._book.get(request)

    def on_new_request(self, request: RequestView) -> None:
        self._conn.on_new_request(self._req(request))

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        count, load_async = self._conn.get_num_new_matched_tokens(
            self._req(request), num_computed_tokens)
        return count, bool(load_async)

    def update_state_after_alloc(
        self, request: RequestView, blocks: AllocatedBlocks, num_external_tokens: int
    ) -> None:
        req = self._req(request)
        with _ours("building vLLM's KVCacheBlocks"):
            vblocks = _objects.vllm_blocks(blocks)
        self._conn.update_state_after_alloc(req, vblocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ConnectorMetadata:
        with _ours("building vLLM's SchedulerOutput"):
            out = _objects.scheduler_output(scheduler_output, self._book, self._groups)
        return VllmMetadata(self._conn.build_connector_meta(out))

    def request_finished(
        self, request: RequestView, block_ids: tuple[int, ...]
    ) -> tuple[bool, Mapping[str, Any] | None]:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

        req = self._req(request)
        if isinstance(self._conn, SupportsHMA):
            delay, params = self._conn.request_finished_all_groups(req, (list(block_ids),))
        else:
            delay, params = self._conn.request_finished(req, list(block_ids))
        self._book.drop(request.request_id)
        return bool(delay), params

    def request_finished_all_groups(
        self, request: RequestView, blocks: AllocatedBlocks
    ) -> tuple[bool, Mapping[str, Any] | None]:
        """vLLM's hybrid allocator's finish: every group's blocks to a ``SupportsHMA``
        connector, as vLLM's scheduler passes them (KVG-006)."""
        if blocks.num_groups == 1:
            return self.request_finished(request, blocks.block_ids(0))
        req = self._req(request)
        delay, params = self._conn.request_finished_all_groups(
            req, tuple(list(g) for g in blocks.groups))
        self._book.drop(request.request_id)
        return bool(delay), params

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        with _ours("building vLLM's KVConnectorOutput"):
            out = _objects.vllm_output(output)
        self._conn.update_connector_output(out)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return ()

    def bind_block_references(self, references: BlockReferences) -> None:
        # vLLM's scheduler binds its cache manager (and so its block pool) right after
        # building it, before the first step: KVConnectorBase_V1.bind_kv_cache_manager
        with _ours("building vLLM's KVCacheManager and BlockPool stand-ins"):
            manager = _objects.KVCacheManagerStandIn(references)
        bind = getattr(self._conn, "bind_kv_cache_manager", None)
        if bind is not None:
            bind(manager)

    def has_pending_work(self) -> bool:
        ask = getattr(self._conn, "has_pending_push_work", None)  # vLLM >= 0.32
        return False if ask is None else bool(ask())

    def reset_cache(self) -> bool:
        """vLLM's scheduler calls the connector's ``reset_cache()`` from
        ``reset_prefix_cache(reset_connector=True)`` and takes any answer but False as a
        reset done, None (the base class's "not implemented") included: so does this
        wrapper, and the harness then checks that nothing from before the reset is served
        (SCH-032), which is what vLLM's user relies on after a weight update. A release
        without the hook never resets the connector: refused."""
        reset = getattr(self._conn, "reset_cache", None)
        return False if reset is None else reset() is not False

    def get_finished_count(self) -> int | None:
        count = self._conn.get_finished_count()
        return None if count is None else int(count)

    def set_xfer_handshake_metadata(self, metadata: Mapping[int, HandshakeMetadata]) -> None:
        plain = {rank: _unwrap_handshake(hs) for rank, hs in metadata.items()}
        if not any(v is not None for v in plain.values()):
            return
        if hasattr(self._conn, "set_xfer_handshake_metadata_pp_aware"):  # vLLM >= 0.32
            self._conn.set_xfer_handshake_metadata_pp_aware(
                {(0, rank): v for rank, v in plain.items()})
        else:
            self._conn.set_xfer_handshake_metadata(plain)

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            if self._conn is not None:
                _release(self)


def _wrap_handshake(value: Any, engine_id: str, rank: int, layout: KVCacheLayout) -> HandshakeMetadata:
    cls = type(value)
    try:
        data = encode_value(value)
    except InvalidArgumentError as e:
        raise carry_gap(e) from e
    return HandshakeMetadata(
        engine_id=engine_id, rank=rank, spec_version=SPEC_VERSION,
        layout={"order": layout.order.value, "packing": layout.packing.value,
                "dtype": str(layout.dtype).removeprefix("torch."), "block_size": layout.block_size},
        payload=Envelope.of(cls, data).to_plain())


def _unwrap_handshake(hs: HandshakeMetadata | None) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

    if hs is None:
        return None
    envelope = Envelope.from_plain(dict(hs.payload), clause="HSK-005")
    return decode_value(envelope.data,
                        loaded_class(envelope.type_path, KVConnectorHandshakeMetadata))


class _VllmWorker(WorkerConnector):
    engine_restores_in_place = True
    """vLLM 0.33's wake maps new memory under the KV tensors' own virtual addresses (cumem)
    and its ``restore_kv_caches`` takes no tensors: the harness keeps the tensors and loses
    their contents, as vLLM does, instead of moving them where a vLLM connector that
    re-registers the addresses it recorded (NixlConnector) could never follow."""

    def __init__(self, factory: VllmConnectorFactory, config: EngineConfigView, rank: int) -> None:
        if not 0 <= rank < config.world_size:
            raise InvalidArgumentError(f"rank {rank} is outside world size {config.world_size}")
        self._factory, self._config, self._rank = factory, config, rank
        self._conn: Any = None
        self._kv: dict[str, torch.Tensor] = {}
        self._layout: KVCacheLayout | None = None
        self._preempted: frozenset[str] = frozenset()
        self._failed: frozenset[str] = frozenset()
        self._in_group = False
        self._closed = False

    def _vllm(self, hook: str) -> Any:
        if self._conn is None:
            when = "after shutdown" if self._closed else "before register_kv_caches"
            raise InvalidArgumentError(f"{hook} {when}: the vLLM worker role lives from "
                                       "register_kv_caches to shutdown", clause="WRK-001")
        return self._conn

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout) -> None:
        from vllm.config import set_current_vllm_config

        with _ours("building the worker role's VllmConfig and KVCacheConfig"):
            vllm_config = self._factory.vllm_config(self._config, layout)
            kv_config = _objects.kv_cache_config(
                layout.block_size, layout.num_blocks, tuple(kv_caches),
                attrs.evolve(_model_shape(self._config, layout), num_kv_heads=layout.num_heads),
                self._factory.platform.layout, self._config.kv_cache_groups)
        with _guest():
            # every vLLM worker runs inside vLLM's parallel state (MooncakeStoreConnector
            # and NIXL's ask it for their TP rank): built for every connector alike
            with _ours("joining vLLM's tensor-parallel process group"):
                _ProcessGroup.join(vllm_config, self._config, self._rank)
            self._in_group = True
            with set_current_vllm_config(vllm_config):
                self._conn = self._factory.connector_class(vllm_config, _role("WORKER"),
                                                           kv_config)
                self._kv, self._layout = dict(kv_caches), layout
                self._conn.register_kv_caches(dict(kv_caches))

    def unregister_kv_caches(self) -> None:
        """The harness's sleep: vLLM 0.33's worker calls the connector's own
        ``unregister_kv_caches`` before the sleep-mode backend frees the KV cache."""
        conn = self._vllm("unregister_kv_caches")
        with _guest():
            conn.unregister_kv_caches()

    def restore_kv_caches(self, kv_caches: Mapping[str, torch.Tensor],
                          layout: KVCacheLayout) -> None:
        """The harness's wake: vLLM 0.33's worker calls the connector's own
        ``restore_kv_caches`` (no arguments: vLLM maps new memory under the tensors it
        registered). The harness restores in place for this wrapper
        (``engine_restores_in_place``); should the tensors still differ, the ones the
        connector registered are swapped for views of the new memory first (``set_``)."""
        conn = self._vllm("restore_kv_caches")
        if layout != self._layout or list(kv_caches) != list(self._kv):
            raise InvalidArgumentError("restore_kv_caches got other layers or another layout "
                                       "than register_kv_caches", clause="WRK-019")
        with _guest():
            for name, tensor in kv_caches.items():
                old = self._kv[name]
                if old.data_ptr() != tensor.data_ptr():
                    old.set_(tensor.untyped_storage(), tensor.storage_offset(),
                             tensor.size(), tensor.stride())
            conn.restore_kv_caches()

    def handle_preemptions(self, preempted_req_ids: frozenset[str]) -> None:
        self._preempted = self._preempted | preempted_req_ids

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        conn = self._vllm("bind_connector_metadata")
        if not isinstance(metadata, VllmMetadata):
            raise InvalidArgumentError(
                f"expected VllmMetadata, got {type(metadata).__name__}", clause="WRK-003")
        if self._preempted:
            self._preempted = frozenset()
            conn.handle_preemptions(metadata.value)
        conn.bind_connector_metadata(metadata.value)

    def clear_connector_metadata(self) -> None:
        self._vllm("clear_connector_metadata").clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        from vllm.forward_context import override_forward_context

        with _ours("building vLLM's ForwardContext"):
            ctx = _objects.forward_context(forward_context, self._kv)
        with override_forward_context(ctx):
            self._vllm("start_load_kv").start_load_kv(ctx)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._vllm("wait_for_layer_load").wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      forward_context: ForwardContextView) -> None:
        from vllm.forward_context import override_forward_context

        with _ours("building vLLM's ForwardContext"):
            ctx = _objects.forward_context(forward_context, self._kv)
            attn = ctx.attn_metadata[layer_name] if ctx.attn_metadata else None
        with override_forward_context(ctx):
            self._vllm("save_kv_layer").save_kv_layer(layer_name, kv_layer, attn)

    def wait_for_save(self) -> None:
        self._vllm("wait_for_save").wait_for_save()

    def get_finished(self, finished_req_ids: frozenset[str]) -> tuple[frozenset[str], frozenset[str]]:
        conn = self._vllm("get_finished")
        results = conn.get_transfer_results(set(finished_req_ids))
        self._failed = frozenset(results.failed_recving)
        return frozenset(results.finished_sending), frozenset(results.finished_recving)

    def get_failed_recving(self) -> frozenset[str]:
        return self._failed

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        return frozenset(self._vllm("get_block_ids_with_load_errors")
                         .get_block_ids_with_load_errors() or ())

    def get_finished_count_override(self) -> int | None:
        return None

    def build_connector_worker_meta(self) -> VllmWorkerMetadata | None:
        build = getattr(self._vllm("build_connector_worker_meta"), "build_connector_worker_meta",
                        None)
        value = None if build is None else build()
        return None if value is None else VllmWorkerMetadata(value)

    def get_handshake_metadata(self) -> HandshakeMetadata | None:
        value = self._vllm("get_handshake_metadata").get_handshake_metadata()
        if value is None or self._layout is None:
            return None
        return _wrap_handshake(value, self._config.engine_id, self._rank, self._layout)

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            if self._conn is not None:
                _release(self)
            if self._in_group:
                self._in_group = False
                _ProcessGroup.leave()
            gc.collect()
