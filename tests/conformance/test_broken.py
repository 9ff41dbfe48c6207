"""Every deliberately broken connector fails the suite with the clause it breaks, and only it.

Each variant runs through the real plugin in a subprocess (pytester), exactly as a connector
author would run it: ``pytest --kvspec-conformance=...``. The JSON report must show the
variant's clause failed and no other clause failed.
"""

from __future__ import annotations

import json

import pytest

from kvspec.conformance.connectors.broken import BROKEN_CONNECTORS
from kvspec.conformance.connectors.broken_graphs import BROKEN_GRAPH_CONNECTORS

pytest_plugins = ["pytester"]


@pytest.mark.parametrize(
    ("factory", "clause"), BROKEN_CONNECTORS, ids=[c.__name__ for c, _ in BROKEN_CONNECTORS]
)
def test_broken_connector_is_caught_with_its_clause(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, factory: type, clause: str
) -> None:
    monkeypatch.setenv("KVSPEC_TRANSFER_TIMEOUT_S", "1")
    spec = f"{factory.__module__}:{factory.__qualname__}"
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess(
        f"--kvspec-conformance={spec}", f"--kvspec-report={report}", "-p", "no:cacheprovider",
        "-x", "-k", factory.selection,
    )
    assert result.ret == 1, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines([f"*clause {clause} (*) broken by {factory().name}*"])
    data = json.loads(report.read_text())
    failed = {cid for cid, row in data["clauses"].items() if row["fail"]}
    assert failed == {clause}


@pytest.mark.parametrize(
    ("factory", "clause"), BROKEN_GRAPH_CONNECTORS,
    ids=[c.__name__ for c, _ in BROKEN_GRAPH_CONNECTORS],
)
def test_graph_unsafe_connector_is_caught_on_cpu(
    pytester: pytest.Pytester, factory: type, clause: str
) -> None:
    """Through the CPU graph emulator, with the clause and no other (issue 29608, 26675)."""
    spec = f"{factory.__module__}:{factory.__qualname__}"
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess(
        f"--kvspec-conformance={spec}", f"--kvspec-report={report}", "-p", "no:cacheprovider",
        "-k", "TestGraphModes",
    )
    assert result.ret == 1, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines([f"*clause {clause} (*) broken by {factory().name}*"])
    data = json.loads(report.read_text())
    failed = {cid for cid, row in data["clauses"].items() if row["fail"]}
    assert failed == {clause}


def test_the_good_connectors_pass_the_same_selection(pytester: pytest.Pytester) -> None:
    """The control: the same selection passes for the connectors the variants derive from."""
    result = pytester.runpytest_subprocess(
        "--kvspec-conformance=kvspec.conformance.connectors.shared_storage:SharedStorageConnector",
        "--kvspec-conformance=kvspec.conformance.connectors.null:NullConnector",
        "--kvspec-conformance=kvspec.conformance.connectors.layerwise:LayerwiseStorageConnector",
        "-p", "no:cacheprovider", "-k", "test_scenario or TestGraphModes or TestHostileInput or TestStats",
    )
    assert result.ret == 0, result.stdout.str()[-3000:]
