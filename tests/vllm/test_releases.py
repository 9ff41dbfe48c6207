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


@pytest.mark.parametrize("declared", ["0.32", "0.33"])
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
