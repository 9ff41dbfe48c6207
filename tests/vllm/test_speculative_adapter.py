"""The adapter under vLLM's deferred finalize, without an engine (issue 49, part 3).

When a drafter runs, vLLM's model runner enters its connector context with
``defer_finalize=True``: after the target forward it calls ``start_load_kv`` and the output
hooks (``get_transfer_results`` -> the kvspec worker's ``build_connector_output``,
``get_block_ids_with_load_errors``, stats, events, worker metadata) with the metadata still
bound; the drafter's layers then run their per-layer hooks once per draft pass; only then
``finalize_kv_connector`` calls ``wait_for_save`` and the clear. These tests drive
``KVSpecConnector``'s worker side with the installed vLLM's own hook driver
(``KVConnectorModelRunnerMixin``, byte-identical in 0.32 and 0.33), so they run on the
engine-free 0.33 lane too, and check that the kvspec worker receives SPD-001's order with
one ``build_connector_output`` per step, that a save completing in ``wait_for_save`` is
reported in the next step's output, exactly once (SPD-004), and that what the adapter keeps
of a step's output for vLLM's later output hooks is never an earlier step's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import attrs
import pytest
import torch

from kvspec.conformance.connectors.null import NullConnector, NullMetadata, NullWorker
from kvspec.protocols import (
    Capabilities,
    EngineConfigView,
    ForwardContextView,
    HookGraphMode,
    KVConnectorOutput,
    WorkerConnector,
    type_path,
)

pytest.importorskip("vllm.v1.worker.kv_connector_model_runner_mixin")

BLOCK = 32
HEADS = 2
HEAD = 64
BLOCKS = 16
TARGET = tuple(f"model.layers.{i}.self_attn.attn" for i in range(2))
DRAFT = ("draft_model.model.layers.0.self_attn.attn",)
LAYERS = TARGET + DRAFT


class DeferredSaveWorker(NullWorker):
    """A worker whose saves are gathered in ``save_kv_layer`` and complete only in
    ``wait_for_save``: each step with saves finishes one send, ``save-<step>``, reported by
    the next ``build_connector_output`` (never before its ``wait_for_save`` ran, SPD-004).
    Each output also names its own step in ``invalid_block_ids``, so a stale output shows.
    It records every hook it receives and the last content each layer saved in a step."""

    def __init__(self, config: EngineConfigView, rank: int) -> None:
        super().__init__(config, rank)
        self.calls: list[tuple[str, str | None]] = []
        self.step = 0
        self._saving: set[str] = set()
        self._done: set[str] = set()
        self.saved: dict[str, float] = {}

    def bind_connector_metadata(self, metadata: Any) -> None:
        self.step += 1
        self.calls.append(("bind_connector_metadata", None))
        super().bind_connector_metadata(metadata)

    def clear_connector_metadata(self) -> None:
        self.calls.append(("clear_connector_metadata", None))
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContextView) -> None:
        self.calls.append(("start_load_kv", None))
        super().start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(("wait_for_layer_load", layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: Any,
                      forward_context: ForwardContextView) -> None:
        self.calls.append(("save_kv_layer", layer_name))
        self._saving.add(f"save-{self.step}")
        self.saved[layer_name] = float(kv_layer[0, 0, 0, 0])  # SPD-002: the last one counts

    def wait_for_save(self) -> None:
        self.calls.append(("wait_for_save", None))
        self._done |= self._saving
        self._saving.clear()

    def build_connector_output(self, finished_req_ids: frozenset[str]) -> KVConnectorOutput:
        self.calls.append(("build_connector_output", None))
        done, self._done = frozenset(self._done), set()
        return KVConnectorOutput(finished_sending=done, invalid_block_ids=frozenset({self.step}))


class DeferredSaveConnector(NullConnector):
    """``DeferredSaveWorker`` behind the null connector's scheduler, with eager per-layer
    hooks (the adapter passes vLLM's per-layer calls on)."""

    @property
    def capabilities(self) -> Capabilities:
        return attrs.evolve(super().capabilities, layer_hooks=HookGraphMode.EAGER)

    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        return DeferredSaveWorker(config, rank)


class _Worker:
    """The worker-side adapter over vLLM-CPU-shaped caches, reached by vLLM's hook driver
    as the process's KV-transfer group."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, v2: bool = False) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from kvspec.vllm.certify import _objects
        from kvspec.vllm.connector import KVSpecConnector

        monkeypatch.setattr(KVSpecConnector, "_rank", staticmethod(lambda: 0))
        model = _objects.ModelShape(len(LAYERS), HEADS, HEAD, torch.float32)
        self.config = _objects.vllm_config(
            connector="KVSpecConnector", module_path="kvspec.vllm.connector",
            role=_objects.TransferRole.BOTH, engine_id="spec", block_size=BLOCK, tp_size=1,
            extra={"kvspec_factory": type_path(DeferredSaveConnector)}, transfer={},
            model=model, cache_layout="LBHNC", num_blocks=BLOCKS)
        kv = _objects.kv_cache_config(BLOCK, BLOCKS, LAYERS, model, "LBHNC")
        self.adapter = KVSpecConnector(self.config, KVConnectorRole.WORKER, kv)
        self.buffer = torch.zeros(len(LAYERS), BLOCKS, HEADS, BLOCK, 2 * HEAD)
        monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", self.adapter)
        caches = {n: self.buffer[i] for i, n in enumerate(LAYERS)}
        if v2:  # model runner V2's connector driver registers the caches itself
            from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

            self.v2 = ActiveKVConnector(self.config, caches)
        else:
            self.adapter.register_kv_caches(caches)
        worker = self.adapter.kvspec_worker
        assert isinstance(worker, DeferredSaveWorker)
        self.worker = worker
        self.step_id = 0

    def _output(self) -> Any:
        from kvspec.vllm._wire import StepWire

        self.step_id += 1
        wire = StepWire(NullMetadata().encode(), type_path(NullMetadata), self.step_id, 8,
                        frozenset())
        return SimpleNamespace(kv_connector_metadata=wire, has_sync_kv_loads=False,
                               finished_req_ids=set())

    def _layers(self, names: tuple[str, ...], value: float) -> None:
        """The per-layer hooks vLLM's attention wrapper calls while metadata is bound."""
        for name in names:
            assert self.adapter.has_connector_metadata()
            self.adapter.wait_for_layer_load(name)
            page = self.buffer[LAYERS.index(name)]
            page.fill_(value)
            self.adapter.save_kv_layer(name, page, None)

    def drafting_step(self, passes: int) -> Any:
        """One step of a model runner with a drafter: vLLM 0.32's ``execute_model`` with
        ``defer_finalize=True``, then the draft passes, then ``finalize_kv_connector``."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        so = self._output()
        with set_forward_context(None, self.config), \
                KVConnectorModelRunnerMixin._get_kv_connector_output(
                    so, defer_finalize=True) as out:
            self._layers(TARGET, 1.0)
        for k in range(passes):  # the drafter: its layers once per draft pass
            self._layers(DRAFT, 10.0 + k)
        KVConnectorModelRunnerMixin.finalize_kv_connector()
        assert not self.adapter.has_connector_metadata()
        return out

    def v2_drafting_step(self, passes: int) -> Any:
        """One step of model runner V2 with a speculator (vLLM 0.33's ``execute_model``:
        ``pre_forward``, the forward, ``finish_forward``, ``post_forward(defer_finalize=
        True)``, the speculator's proposals, ``finalize_step``); on a release whose V2 has
        no deferred finalize, ``post_forward`` finalizes before the drafter runs."""
        from kvspec.vllm._releases import release

        so = self._output()
        self.v2.pre_forward(so)
        self._layers(TARGET, 1.0)
        self.v2.finish_forward()
        defer = release().drafter_outputs_before_save_v2
        out = (self.v2.post_forward(set(), defer_finalize=True) if defer
               else self.v2.post_forward(set()))
        for k in range(passes):
            if self.adapter.has_connector_metadata():  # vLLM's per-layer wrapper's guard
                self._layers(DRAFT, 10.0 + k)
        if defer:
            self.v2.finalize_step()
        return out

    def plain_step(self, forward: bool) -> Any:
        """A step without a drafter (``defer_finalize=False``), or without a forward
        (``kv_connector_no_forward``)."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        so = self._output()
        if not forward:
            return KVConnectorModelRunnerMixin.kv_connector_no_forward(
                so, self.config).kv_connector_output
        with set_forward_context(None, self.config), \
                KVConnectorModelRunnerMixin._get_kv_connector_output(so) as out:
            self._layers(TARGET, 1.0)
        return out


def _pairs(names: tuple[str, ...]) -> list[tuple[str, str | None]]:
    return [(h, n) for n in names for h in ("wait_for_layer_load", "save_kv_layer")]


BIND = ("bind_connector_metadata", None)
LOAD = ("start_load_kv", None)
OUT = ("build_connector_output", None)
SAVE = ("wait_for_save", None)
CLEAR = ("clear_connector_metadata", None)


@pytest.mark.kvspec_clause("SPD-001")
@pytest.mark.kvspec_clause("SPD-002")
def test_a_drafting_step_reaches_the_worker_in_the_speculative_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SPD-001: bind, the target layers, start_load_kv (after the forward: async loads),
    the output hooks once, two draft passes of the draft layer, wait_for_save, clear.
    SPD-002: the draft layer's hooks reach the worker once per pass, and its last save
    holds the last pass's content."""
    w = _Worker(monkeypatch)
    w.drafting_step(passes=2)
    expected = [BIND, *_pairs(TARGET), LOAD, OUT, *_pairs(DRAFT), *_pairs(DRAFT), SAVE, CLEAR]
    assert w.worker.calls == expected, (
        f"SPD-001: the kvspec worker received {w.worker.calls}; expected {expected}")
    assert w.worker.saved[DRAFT[0]] == 11.0 and w.worker.saved[TARGET[0]] == 1.0


@pytest.mark.kvspec_clause("SPD-004")
def test_a_save_completing_in_wait_for_save_is_reported_the_next_step_exactly_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SPD-004: step 1's save completes in its wait_for_save, after its outputs: vLLM's
    output of step 1 does not report it, step 2's does, step 3's (no forward) does not
    again but reports step 2's. Each step's invalid blocks are that step's (nothing the
    adapter kept for the output hooks is an earlier step's)."""
    w = _Worker(monkeypatch)
    first = w.drafting_step(passes=2)
    second = w.drafting_step(passes=1)
    third = w.plain_step(forward=False)
    sent = [set(o.finished_sending or ()) for o in (first, second, third)]
    assert sent == [set(), {"save-1"}, {"save-2"}], (
        f"SPD-004: finished_sending per step {sent}; a save completing in wait_for_save "
        "must be reported by the next step's output, once, never before")
    assert [set(o.invalid_block_ids) for o in (first, second, third)] == [{1}, {2}, {3}]
    assert w.worker.calls.count(OUT) == 3  # one build_connector_output per step
    # The step without a forward keeps the plain order (SPD-001).
    assert w.worker.calls[-5:] == [BIND, LOAD, SAVE, OUT, CLEAR]


@pytest.mark.kvspec_clause("SPD-001")
def test_without_a_drafter_the_order_is_the_plain_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward step without a drafter: wait_for_save before the output hooks (WRK-007,
    WRK-008), and a save is reported in the step whose wait_for_save completed it."""
    w = _Worker(monkeypatch)
    out = w.plain_step(forward=True)
    assert w.worker.calls == [BIND, *_pairs(TARGET), LOAD, SAVE, OUT, CLEAR]
    assert set(out.finished_sending or ()) == {"save-1"}


def test_finalize_without_bound_metadata_calls_no_kvspec_hook(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """DRY-001: vLLM's ``finalize_kv_connector`` after a step whose metadata was never
    bound (a dummy run with a drafter) reaches no kvspec hook."""
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    w = _Worker(monkeypatch)
    KVConnectorModelRunnerMixin.finalize_kv_connector()
    assert w.worker.calls == []


def test_the_release_row_says_what_the_installed_model_runners_do() -> None:
    """``Release.drafter_outputs_before_save_v1`` / ``_v2`` against the installed vLLM's
    two hook drivers: V1's mixin defers its finalize (``defer_finalize``,
    ``finalize_kv_connector``) in every release the table has; V2's ``ActiveKVConnector``
    does from 0.33 (``post_forward(defer_finalize=...)``, ``finalize_step``)."""
    import inspect

    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    from kvspec.vllm._releases import release

    row = release()
    v1 = ("defer_finalize" in inspect.signature(
        KVConnectorModelRunnerMixin._get_kv_connector_output).parameters
        and hasattr(KVConnectorModelRunnerMixin, "finalize_kv_connector"))
    v2 = ("defer_finalize" in inspect.signature(ActiveKVConnector.post_forward).parameters
          and "finalize_step" in vars(ActiveKVConnector))
    assert (row.drafter_outputs_before_save_v1, row.drafter_outputs_before_save_v2) == (v1, v2)


@pytest.mark.kvspec_clause("SPD-001")
def test_model_runner_v2_drives_the_worker_in_its_releases_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Model runner V2's connector driver (``ActiveKVConnector``; V2 itself needs Triton
    and never runs on CPU): from 0.33, SPD-001's order, as V1's; before (0.32), the
    metadata is cleared before the drafter runs, so the draft layers' hooks reach no kvspec
    hook: their KV is never saved (the release row's ``drafter_outputs_before_save_v2``
    is False, and the adapter warns when a V2 engine has a drafter)."""
    from kvspec.vllm._releases import release

    w = _Worker(monkeypatch, v2=True)
    out = w.v2_drafting_step(passes=2)
    if release().drafter_outputs_before_save_v2:
        expected = [BIND, *_pairs(TARGET), LOAD, OUT, *_pairs(DRAFT), *_pairs(DRAFT), SAVE,
                    CLEAR]
        assert not (out.finished_sending or ())  # completed after the outputs: next step
    else:
        expected = [BIND, *_pairs(TARGET), LOAD, SAVE, OUT, CLEAR]
    assert w.worker.calls == expected, (
        f"SPD-001: V2 under vLLM {release().name} gave the worker {w.worker.calls}; "
        f"expected {expected}")


def test_the_adapter_warns_when_vllm_would_not_save_draft_kv(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A drafter on a model runner whose release finalizes before the drafter (V2 before
    0.33): the worker side warns, naming SPD-003; on one that defers it says nothing."""
    import logging

    from kvspec.vllm import connector

    spec_on = SimpleNamespace(speculative_config=object(), use_v2_model_runner=True)
    late = attrs.evolve(connector._RELEASE, drafter_outputs_before_save_v2=True)
    early = attrs.evolve(connector._RELEASE, drafter_outputs_before_save_v2=False)
    with caplog.at_level(logging.WARNING, logger=connector.__name__):
        monkeypatch.setattr(connector, "_RELEASE", late)
        connector._warn_if_draft_kv_unsaved(spec_on, "x")
        assert not caplog.records
        connector._warn_if_draft_kv_unsaved(SimpleNamespace(speculative_config=None), "x")
        monkeypatch.setattr(connector, "_RELEASE", early)
        connector._warn_if_draft_kv_unsaved(spec_on, "x")
    assert len(caplog.records) == 1 and "SPD-003" in caplog.records[0].getMessage()
