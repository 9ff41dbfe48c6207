"""``kvspec conform hicache:TARGET``: the HiCache storage suite from the command line, re-run
under the SGLang environment when this Python has no SGLang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec.sglang.suite import have_sglang

ROOT = Path(__file__).resolve().parents[2]


def _conform(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvspec", "conform", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


@pytest.mark.skipif(have_sglang(), reason="checks the message of a Python without SGLang")
def test_without_sglang_it_says_how_to_get_it() -> None:
    done = _conform("hicache:file", KVSPEC_SGLANG_PYTHON=sys.executable)
    assert done.returncode == 2
    assert "no Python with SGLang" in done.stderr and "scripts/sglang_env.sh" in done.stderr


def test_hicache_and_connectors_do_not_mix() -> None:
    done = _conform("hicache:file", "kvspec.conformance.connectors.null:NullConnectorFactory")
    assert done.returncode == 2 and "separate commands" in done.stderr


@pytest.mark.skipif(not have_sglang(), reason="needs SGLang: run under the environment "
                    "scripts/sglang_env.sh builds")
def test_conform_hicache_file_names_the_broken_clause(tmp_path: Path) -> None:
    """SGLang's file backend: every STO check passes but the three where ``get`` meets an
    object it cannot read (damaged, or no file descriptor left), which raise (STO-003)."""
    done = _conform("hicache:file", "--report", str(tmp_path / "report.json"))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[STO-003] observed: batch_get raised OSError: Short read" in done.stdout
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 3, failed
    assert sum("test_damaged_object_reads_as_a_miss" in f for f in failed) == 2
    assert sum("test_failed_load_reads_as_a_miss" in f for f in failed) == 1
    assert (tmp_path / "report.json").stat().st_size > 0


def test_page_is_for_hicache_backends_only() -> None:
    done = _conform("kvspec.conformance.connectors.null:NullConnector", "--page", "x.md")
    assert done.returncode == 2 and "--page writes the page of hicache: backends" in done.stderr


@pytest.mark.skipif(not have_sglang(), reason="needs SGLang: run under the environment "
                    "scripts/sglang_env.sh builds")
def test_conform_hicache_json_is_one_report_of_every_backend() -> None:
    done = _conform("hicache:kvspec", "hicache:file", "--json", "--", "-k", "rank_coordinates")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)  # stdout holds the report alone
    assert [c["spec"] for c in report["connectors"]] == ["hicache:kvspec", "hicache:file"]
    assert [t["connector"] for t in report["tests"]] == ["hicache:kvspec"] * 4 + ["hicache:file"] * 4
    assert {t["outcome"] for t in report["tests"]} == {"pass"}
    assert report["clauses"]["STO-007"]["pass"] == 8
