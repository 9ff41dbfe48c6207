"""Every deliberately broken connector fails the suite with the clause it breaks, and only it.

Each variant runs through the real plugin in a subprocess (pytester), exactly as a connector
author would run it: ``pytest --kvspec-conformance=...``. The JSON report must show the
variant's clause failed and no other clause failed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from broken_hybrid import BROKEN_HYBRID
from broken_nixl import BROKEN_NIXL

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
    data = json.loads(report.read_text())
    failed = {cid for cid, row in data["clauses"].items() if row["fail"]}
    assert failed == {clause}
    result.stdout.fnmatch_lines([f"*clause {clause} (*) broken by {factory().name}*"])


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
        "--kvspec-conformance=kvspec.conformance.connectors.broken:EagerSavesConnector",
        "-p", "no:cacheprovider", "-k", "test_scenario or TestGraphModes or TestHostileInput or TestStats or TestFaults",
    )
    assert result.ret == 0, result.stdout.str()[-3000:]



def test_the_state_connectors_pass_the_state_selection(pytester: pytest.Pytester) -> None:
    """The control of the state variants: StateCache, which they derive from, and the offload
    backend pass the selection that catches them."""
    result = pytester.runpytest_subprocess(
        "--kvspec-conformance=kvspec.conformance.connectors.state:StateCache",
        "--kvspec-conformance=kvspec.backends.offload:OffloadConnector",
        "-p", "no:cacheprovider", "-k", "TestStateGroups and repeated_prompt",
    )
    assert result.ret == 0, result.stdout.str()[-3000:]
    result.assert_outcomes(passed=2)

ATTRIBUTION = '''
from kvspec.conformance.connectors.shared_storage import (
    SharedStorageConnector, SharedStorageScheduler, SharedStorageWorker)
from kvspec.protocols import InvalidArgumentError


class _TypedScheduler(SharedStorageScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        raise InvalidArgumentError("no matches today", clause="SCH-004")


class TypedError(SharedStorageConnector):
    scheduler_class = _TypedScheduler


class _CrashingWorker(SharedStorageWorker):
    def get_finished(self, finished_req_ids):
        raise ZeroDivisionError("division by zero")


class WorkerCrash(SharedStorageConnector):
    worker_class = _CrashingWorker


class _AssertingWorker(SharedStorageWorker):
    def get_finished(self, finished_req_ids):
        assert not finished_req_ids, "nothing finishes here"
        return super().get_finished(finished_req_ids)


class WorkerAssert(SharedStorageConnector):
    worker_class = _AssertingWorker
'''


@pytest.mark.parametrize(("name", "clause", "says"), [
    ("TypedError", "SCH-004", "InvalidArgumentError: no matches today"),
    ("WorkerCrash", "ERR-010", "_CrashingWorker.get_finished raised ZeroDivisionError"),
    # issue 35: a bare assert in connector code is a crash like any other
    ("WorkerAssert", "ERR-010", "_AssertingWorker.get_finished raised AssertionError"),
])
def test_a_failure_is_counted_once_against_the_clause_it_names(
    pytester: pytest.Pytester, name: str, clause: str, says: str
) -> None:
    """Issue 15: a KVSpecError naming a clause fails that clause, and a connector's crash
    fails ERR-010 naming the hook; neither fails the 27 other clauses the test is tagged
    with."""
    pytester.makepyfile(attribution=ATTRIBUTION)
    pytester.syspathinsert()
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess(
        f"--kvspec-conformance=attribution:{name}", f"--kvspec-report={report}",
        "-p", "no:cacheprovider", "-x", "-k", "test_scenario and no-local-cache",
    )
    assert result.ret == 1, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines([f"*clause {clause} (*{says}*"])
    data = json.loads(report.read_text())
    assert {cid for cid, row in data["clauses"].items() if row["fail"]} == {clause}


def test_the_report_counts_each_tests_loads(pytester: pytest.Pytester) -> None:
    """Issue 15: a scenario in which the connector loads nothing must show. Each test of
    the JSON report says how many loads the connector started, the tokens it offered for
    them and the tokens it delivered."""
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess(
        "--kvspec-conformance=kvspec.conformance.connectors.shared_storage:SharedStorageConnector",
        f"--kvspec-report={report}", "-p", "no:cacheprovider",
        "-k", "test_scenario and (partial-local-hit or single)",
    )
    assert result.ret == 0, result.stdout.str()[-3000:]
    loads = {t["nodeid"].split("[", 1)[1]: t["loads"]
             for t in json.loads(report.read_text())["tests"]}
    assert len(loads) == 4
    for test, tally in loads.items():
        if "partial-local-hit" in test:
            assert tally["loads"] >= 2 and tally["loaded_tokens"] == tally["matched_tokens"] > 0
        else:  # one request: nothing stored before it arrives
            assert tally == {"engines": 1, "loads": 0, "matched_tokens": 0, "loaded_tokens": 0}


def test_a_byte_bug_outside_the_graphs_is_not_blamed_on_replay(pytester: pytest.Pytester) -> None:
    """GRA-006 is for what a replay changes: a connector whose hooks are not in the graphs
    (no per-layer hooks) and that corrupts loads fails the graph-mode tests with WRK-013,
    the clause it breaks eagerly too."""
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess(
        "--kvspec-conformance=kvspec.conformance.connectors.broken:CorruptLoadConnector",
        f"--kvspec-report={report}", "-p", "no:cacheprovider", "-k", "TestGraphModes",
    )
    assert result.ret == 1, result.stdout.str()[-3000:]
    data = json.loads(report.read_text())
    assert {cid for cid, row in data["clauses"].items() if row["fail"]} == {"WRK-013"}


WRITE_THROUGH = '''
import attrs
from kvspec.backends.offload import OffloadConnector, OffloadWorker


class _Unfenced(OffloadWorker):
    def handle_preemptions(self, preempted_req_ids):
        return None  # the slip: stores of preempted requests go on reading their blocks


def _through(config):
    return attrs.evolve(config, extra={**config.extra, "offload_store": "computed"})


class WriteThrough(OffloadConnector):
    def create_scheduler(self, config):
        return super().create_scheduler(_through(config))

    def create_worker(self, config, rank):
        return super().create_worker(_through(config), rank)


class UnfencedWriteThrough(WriteThrough):
    worker_class = _Unfenced
'''


@pytest.mark.parametrize(("name", "failed"), [("UnfencedWriteThrough", {"WRK-012"}),
                                              ("WriteThrough", set())])
def test_a_connector_without_a_preemption_fence_is_caught_without_the_fault_seam(
    pytester: pytest.Pytester, name: str, failed: set[str]
) -> None:
    """Issue 35: a connector written outside kvspec that stores computed blocks while its
    request runs (the offload backend with ``offload_store="computed"``) and does not
    fence those stores in ``handle_preemptions``. The engine test of a request preempted
    soon after its prompt was computed holds the connector's threads while the engine
    works (``hold_threads``), so the store is in flight when the engine reuses the blocks,
    with no help from the fault seam: WRK-012 and no other clause. With its fence, the
    same connector passes."""
    pytester.makepyfile(writethrough=WRITE_THROUGH)
    pytester.syspathinsert()
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess(
        f"--kvspec-conformance=writethrough:{name}", f"--kvspec-report={report}",
        "-p", "no:cacheprovider", "-k", "test_preempted_while_storing",
    )
    assert result.ret == (1 if failed else 0), result.stdout.str()[-3000:]
    data = json.loads(report.read_text())
    assert {cid for cid, row in data["clauses"].items() if row["fail"]} == failed


@pytest.mark.parametrize(("module", "factory", "clause"),
                         [("broken_hybrid", f, c) for f, c in BROKEN_HYBRID]
                         + [("broken_nixl", f, c) for f, c in BROKEN_NIXL],
                         ids=[c.__name__ for c, _ in (*BROKEN_HYBRID, *BROKEN_NIXL)])
def test_broken_backend_variant_is_caught_with_its_clause(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, module: str, factory: type,
    clause: str,
) -> None:
    """The reference backends with one bug each (tests/conformance/broken_hybrid.py: the
    offload backend on hybrid models; broken_nixl.py: the NIXL backend after a sleep),
    through the real plugin, caught by the suite test each names."""
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (here, os.environ.get(
        "PYTHONPATH")))))
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess(
        f"--kvspec-conformance={module}:{factory.__qualname__}",
        f"--kvspec-report={report}", "-p", "no:cacheprovider", "-x", "-k", factory.selection,
    )
    assert result.ret == 1, result.stdout.str()[-3000:]
    failed = {cid for cid, row in json.loads(report.read_text())["clauses"].items()
              if row["fail"]}
    assert failed == {clause}
    result.stdout.fnmatch_lines([f"*clause {clause} (*) broken by {factory().name}*"])
