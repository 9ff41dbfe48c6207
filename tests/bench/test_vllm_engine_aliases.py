"""The vLLM engine tooling moved out of ``kvspec.vllm`` (issue 36, item 5); the old public
names stay one release as aliases that warn."""

from __future__ import annotations

import importlib

import pytest

from kvspec.bench import vllm_adapter, vllm_engine


@pytest.mark.parametrize(("old", "new"), [
    ("kvspec.vllm.engine.EngineProcess", vllm_engine.EngineProcess),
    ("kvspec.vllm.engine.EngineError", vllm_engine.EngineError),
    ("kvspec.vllm.engine.vllm_python", vllm_engine.vllm_python),
    ("kvspec.vllm.bench.measure", vllm_adapter.measure),
])
def test_an_old_name_warns_and_is_the_moved_object(old: str, new: object) -> None:
    module, _, name = old.rpartition(".")
    with pytest.warns(DeprecationWarning, match=name):
        assert getattr(importlib.import_module(module), name) is new


def test_the_aliases_hold_no_other_name() -> None:
    with pytest.raises(AttributeError):
        importlib.import_module("kvspec.vllm.engine").run_vllm_bench  # noqa: B018


def test_vllm_python_prefers_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSPEC_VLLM_PYTHON", "/opt/vllm/bin/python")
    assert vllm_engine.vllm_python() == "/opt/vllm/bin/python"
