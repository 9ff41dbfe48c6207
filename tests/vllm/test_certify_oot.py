"""Connectors nobody at kvspec wrote, certified as a user runs it (``kvspec conform
vllm:module:Class`` in a subprocess): the wrapper gives every connector the engine state
vLLM gives it, a connector that cannot start gets one result naming its own error, and
kvspec's own gaps are reported as kvspec's errors, never as the connector's clause."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _conform(name: str, tmp: Path, *args: str) -> tuple[int, dict[str, Any], float]:
    exe = Path(sys.executable).with_name("kvspec")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE / "oot"), str(HERE.parents[1])]), "KVSPEC_VLLM_PYTHON": sys.executable}
    start = time.monotonic()
    proc = subprocess.run(
        [str(exe), "conform", f"vllm:oot_connectors:{name}", "--json",
         "--extra", f"shared_storage_path={tmp / 'store'}", *args],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp, check=False)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout), time.monotonic() - start


def _outcomes(report: dict[str, Any]) -> dict[str, str]:
    return {t["key"].split("::")[-1]: t["outcome"] for t in report["tests"]}


def test_a_connector_reading_engine_state_gets_it(tmp_path: Path) -> None:
    """Model name and resolved layout at construction: what vLLM always provides."""
    code, report, _ = _conform("ReadsEngineState", tmp_path, "--", "-k",
                               "test_declaration or test_scenario and single")
    outcome = _outcomes(report)
    assert code == 0, report
    assert outcome["test_engine_starts[vllm:oot_connectors:ReadsEngineState]"] == "pass"
    assert any(k.startswith("test_scenario[") and v == "pass" for k, v in outcome.items())
    caps = report["connectors"][0]["capabilities"]
    assert caps["accepted_layouts"] == ["LBHNC"] and caps["block_sizes"] == [32]  # vLLM-CPU's
    assert (tmp_path / "store").is_dir()  # --extra reached the connector's config


def test_a_connector_that_cannot_start_gets_one_result(tmp_path: Path) -> None:
    code, report, seconds = _conform("NeedsAService", tmp_path)
    assert code == 1
    failed = [t for t in report["tests"] if t["outcome"] == "fail"]
    assert [t["key"].split("::")[-1] for t in failed] == [
        "test_engine_starts[vllm:oot_connectors:NeedsAService]"]
    message = failed[0]["message"]
    assert message.startswith("clause ERR-010 "), message
    assert "NeedsAService.__init__ raised ConnectionRefusedError: cannot reach" in message
    others = [t for t in report["tests"] if t is not failed[0]]
    assert others and all(t["outcome"] == "skip" for t in others)
    assert all("does not start (ConnectionRefusedError" in t["message"] for t in others
               if "capability" not in t["message"])
    assert seconds < 120  # the vLLM import is most of it


def test_kvspecs_own_gap_is_kvspecs_error(tmp_path: Path) -> None:
    code, report, _ = _conform("PlainMetadata", tmp_path, "--", "-k", "hostile_bytes")
    assert code == 1
    (test,) = [t for t in report["tests"] if "hostile_bytes" in t["key"]]
    assert test["outcome"] == "error", test
    assert test["message"].startswith("kvspec error (kvspec's own harness"), test["message"]
    assert "_Opaque cannot be encoded without pickle" in test["message"]
    assert all(row["fail"] == 0 for row in report["clauses"].values())  # no clause blamed
