"""vLLM's own connectors through kvspec's suite, as a user runs it: ``kvspec conform
vllm:NAME`` in a subprocess, the real plugin, the real harness. The suite must find the
known ExampleConnector bugs, each explained, and must pass what the connector does right."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvspec.vllm.certify._findings import FINDINGS
from kvspec.vllm.certify.report import ConnectorRun, render, unexplained

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "vllm-connectors.md"


def _kvspec(*args: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("kvspec")
    env = {**os.environ, "KVSPEC_VLLM_PYTHON": sys.executable}
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=cwd, check=False)


@pytest.fixture(scope="module")
def example_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A slice of the suite on vLLM's ExampleConnector: the scenarios (chunked prefill,
    preemption, tenants), TP 2 and hostile transfer params."""
    cwd = tmp_path_factory.mktemp("example")
    proc = _kvspec("conform", "vllm:ExampleConnector", "--json", "--",
                   "-k", "test_scenario or (test_tensor_parallel and 2) or "
                   "test_client_transfer_params", cwd=cwd)
    assert proc.returncode == 1, proc.stderr[-3000:]  # failures, not a crash (exit 1)
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


def test_the_suite_finds_exampleconnectors_bugs(example_run: dict[str, Any]) -> None:
    failed = {t["key"]: t["message"] for t in example_run["tests"] if t["outcome"] == "fail"}
    clauses = {m.split(" ")[1] for m in failed.values()}
    assert {"SCH-020", "WRK-013", "ERR-010"} <= clauses, failed
    run = ConnectorRun("ExampleConnector", example_run, 1.0)
    assert unexplained([run]) == []
    assert any("tensor_parallel" in k for k in failed)  # EX-3: ranks share file names


def test_what_exampleconnector_does_right_passes(example_run: dict[str, Any]) -> None:
    passed = {t["key"] for t in example_run["tests"] if t["outcome"] == "pass"}
    for name in ("single", "shared-prefix", "full-prompt-hit", "aborts"):
        for cache in ("local-cache", "no-local-cache"):
            assert ("test_engine.py::TestEngine::test_scenario"
                    f"[vllm:ExampleConnector-{name}-{cache}]") in passed, sorted(passed)
    # kv_transfer_params vLLM's API refuses fail typed in the wrapper (ERR-002), not as a crash
    assert any("test_client_transfer_params" in k for k in passed)


def test_the_page_renders_every_failure_under_its_finding(example_run: dict[str, Any]) -> None:
    page = render([ConnectorRun("ExampleConnector", example_run, 12.0),
                   ConnectorRun("LMCacheConnectorV1", None, 1.0, "lmcache is not installed")],
                  vllm_version="0.32.0", kvspec_version="test")
    assert "UNEXPLAINED" not in page
    for fid in ("EX-1", "EX-3", "EX-4"):
        assert f"#### {fid}: " in page
    assert "| LMCacheConnectorV1 | - |" in page and "Not run: lmcache is not installed" in page
    assert "| ExampleConnector | " in page and "certified, findings: EX-" in page
    # each connector bug names its fix and its standalone vLLM script
    assert "Fix: " in page and "Reproducer: `docs/vllm-findings/EX-1.py`" in page


def test_vllms_nixl_connector_hands_off_through_the_harness(tmp_path: Path) -> None:
    """vLLM's NixlConnector, prefill engine to decode engine (TP 1 and 2), every loaded byte
    checked; and the one bug a client can trigger (NX-1), explained."""
    proc = _kvspec("conform", "vllm:NixlConnector", "--json", "--", "-k",
                   "(test_two_engines and not layout and not heterogeneous) or "
                   "test_client_transfer_params", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    outcome = {t["key"].split("::")[-1]: t["outcome"] for t in report["tests"]}
    assert outcome["test_two_engines[vllm:NixlConnector-1]"] == "pass", outcome
    assert outcome["test_two_engines[vllm:NixlConnector-2]"] == "pass", outcome
    assert report["connectors"][0]["capabilities"]["block_sizes"] == [32]
    run = ConnectorRun("NixlConnector", report, 1.0)
    assert unexplained([run]) == []
    assert [t["message"].split(" ")[1] for t in report["tests"] if t["outcome"] == "fail"] \
        == ["ERR-002"]


def test_an_unexplained_failure_is_flagged() -> None:
    report = {"connectors": [{"capabilities": {}}], "clauses": {},
              "tests": [{"key": "t[vllm:X]", "outcome": "fail",
                         "message": "clause SCH-001 (x) broken by vLLM X: observed: y"}]}
    run = ConnectorRun("X", report, 1.0)
    assert unexplained([run]) == [("X", "t[vllm:X]", report["tests"][0]["message"])]
    assert "#### UNEXPLAINED: `t`" in render([run], vllm_version="v", kvspec_version="k")


def test_a_connector_that_needs_cuda_is_skipped_whole(tmp_path: Path) -> None:
    proc = _kvspec("conform", "vllm:OffloadingConnector", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    tests = report["tests"]
    assert tests and all(t["outcome"] == "skip" for t in tests)
    cuda = [t for t in tests if "cannot run here" in t["message"] and "CUDA" in t["message"]]
    assert len(cuda) > len(tests) // 2  # the rest skip first, on undeclared capabilities
    page = render([ConnectorRun("OffloadingConnector", report, 3.0)], vllm_version="v",
                  kvspec_version="k")
    assert f"All {len(tests)} tests skipped (3 s):" in page and "| clause |" not in page
    assert f"- {len(cuda)} x vLLM OffloadingConnector cannot run here" in page


def test_an_unknown_connector_fails_typed(tmp_path: Path) -> None:
    proc = _kvspec("conform", "vllm:NoSuchConnector", cwd=tmp_path)
    assert proc.returncode != 0
    assert "NoSuchConnector" in proc.stderr and "vLLM registers" in proc.stderr


def test_the_published_page_explains_every_failure() -> None:
    """docs/vllm-connectors.md is generated by ``kvspec vllm-connectors``; what it shows must
    still be explained by the findings kvspec ships."""
    text = PAGE.read_text()
    assert "UNEXPLAINED" not in text
    ids = {f.id for f in FINDINGS}
    shown = {line.split(":")[0].removeprefix("#### ") for line in text.splitlines()
             if line.startswith("#### ")}
    assert shown and shown <= ids


def test_the_published_page_has_a_row_for_every_registered_connector() -> None:
    """17 rows, each certified (the suite ran) or with the reason it cannot run here."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvspec.vllm.certify.report import CONNECTORS

    assert set(CONNECTORS) == set(KVConnectorFactory._registry)
    rows = [line for line in PAGE.read_text().splitlines()
            if line.startswith("| ") and line.split("|")[1].strip() in CONNECTORS]
    assert len(rows) == len(CONNECTORS) == 17
    ran = [r for r in rows if "certified" in r or "does not start" in r]
    assert len(ran) >= 6, rows
    assert all("certified" in r or "cannot run here: " in r or "does not start" in r
               for r in rows), rows


@pytest.mark.needs_engine  # the reproducer runs vLLM alone, in an engine
def test_a_findings_standalone_script_reproduces_it_in_vllm() -> None:
    """The reproducer of EX-4 (cross-tenant KV) against vLLM alone, as the page's runs do."""
    from kvspec.vllm.certify.report import run_reproducer

    got = run_reproducer(ROOT / "docs" / "vllm-findings" / "EX-4.py", python=sys.executable)
    assert got["outcome"] == "reproduced", got
    assert got["line"].startswith("REPRODUCED: the tenant-b request loaded")
    assert "kvspec" not in (ROOT / "docs" / "vllm-findings" / "EX-4.py").read_text().split(
        '"""')[2]  # no kvspec import: maintainers run it with vLLM only


def test_a_hybrid_allocator_connector_runs_the_hybrid_suite(tmp_path: Path) -> None:
    """DecodeBenchConnector declares SupportsHMA: the wrapper plays vLLM's hybrid allocator
    (a SlidingWindowSpec group beside the full one, every group's blocks, the finish with
    all of them) and test_hybrid_model runs, failing with the clause its one-group tests
    fail with (DB-1, explained). ExampleConnector, without SupportsHMA, gets one group."""
    proc = _kvspec("conform", "vllm:DecodeBenchConnector", "--json", "--", "-k",
                   "test_hybrid_model", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    caps = report["connectors"][0]["capabilities"]
    assert caps["kv_cache_groups"] > 1 and "sliding_window" in caps["group_kinds"], caps
    (test,) = report["tests"]
    assert test["outcome"] == "fail" and test["message"].split(" ")[1] == "WRK-013", test
    assert unexplained([ConnectorRun("DecodeBenchConnector", report, 1.0)]) == []
    proc = _kvspec("conform", "vllm:ExampleConnector", "--json", "--", "-k",
                   "test_hybrid_model", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["connectors"][0]["capabilities"]["kv_cache_groups"] == 1
    assert [t["outcome"] for t in report["tests"]] == ["skip"]


SPECULATIVE_PAGE = ROOT / "docs" / "vllm-connectors-speculative.md"


def test_the_speculative_certification_renders_only_its_runs(tmp_path: Path) -> None:
    """``kvspec vllm-connectors --speculative --render-only``: the page of the kept
    speculative runs (``-k TestSpeculative``), titled so, listing only the connectors that
    have one, and leaving the main page's runs alone."""
    from kvspec.vllm.certify.report import (
        SPECULATIVE_DATA,
        SPECULATIVE_SELECTION,
        load_run,
        main,
        save_run,
    )

    assert SPECULATIVE_SELECTION == ("-k", "TestSpeculative")
    kept = load_run("ExampleConnector", ROOT / "docs" / "vllm-connectors-data" / SPECULATIVE_DATA)
    assert kept.report is not None
    assert all("TestSpeculative" in t["key"] for t in kept.report["tests"])
    save_run(kept, tmp_path / SPECULATIVE_DATA)
    out = tmp_path / "page.md"
    assert main(["--speculative", "--render-only", "--data", str(tmp_path),
                 "--out", str(out)]) == 0
    page = out.read_text()
    assert page.startswith("# vLLM's connectors under kvspec's suite, speculative decoding on")
    assert "-k TestSpeculative" in page
    rows = [ln for ln in page.splitlines() if ln.startswith("| ") and " s |" in ln]
    assert [r.split("|")[1].strip() for r in rows] == ["ExampleConnector"], rows


def test_the_published_speculative_page_explains_every_failure() -> None:
    """docs/vllm-connectors-speculative.md (``kvspec vllm-connectors --speculative``): every
    failure it shows is explained by a finding kvspec ships."""
    text = SPECULATIVE_PAGE.read_text()
    assert "UNEXPLAINED" not in text and "speculative decoding on" in text
    ids = {f.id for f in FINDINGS}
    shown = {line.split(":")[0].removeprefix("#### ") for line in text.splitlines()
             if line.startswith("#### ")}
    assert shown <= ids
