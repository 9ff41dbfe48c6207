"""The STO suite catches planted defects, each with its clause and no other, through SGLang's
``dynamic`` loading path (``module:Class``); the unplanted backends pass the same checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvspec.protocols.errors import ContractViolation
from kvspec.sglang.suite import HiCacheStorageSuite, backends, have_sglang

pytestmark = pytest.mark.skipif(not have_sglang(), reason="needs SGLang: run under the "
                                "environment scripts/sglang_env.sh builds")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
V1 = {"interface_v1": 1}

PLANTED: dict[str, tuple[str, str, str, tuple[str, ...], dict[str, Any]]] = {
    # class: (its clause, its unplanted base's suite class, a check that catches it, the
    # check's arguments, the backend's extra configuration)
    "RankBlind": ("STO-007", "TestFile", "test_rank_coordinates_never_alias", ("tp_rank",), {}),
    "NoneResults": ("STO-002", "TestFile", "test_round_trip_controller_path", ("layer_first",), {}),
    "CountsPastHoles": ("STO-001", "TestFile", "test_longest_prefix_across_batches_and_holes", (), {}),
    "RaisesOnMiss": ("STO-003", "TestFile", "test_round_trip_generic_interface", ("layer_first",), {}),
    "GetLooksElsewhere": ("STO-004", "TestFile", "test_round_trip_controller_path", ("layer_first",), {}),
    "OffByOnePage": ("STO-006", "TestZeroCopyFile", "test_round_trip_zero_copy_interface",
                     ("page_first_direct",), V1),
    "LiesAboutFailedSets": ("STO-010", "TestFile", "test_failed_store_is_reported", ("disk-full",), {}),
    "TornWrites": ("STO-009", "TestFile", "test_set_is_atomic_against_a_get", (), {}),
}


@pytest.mark.parametrize("cls", sorted(PLANTED))
def test_planted_defect_is_caught_with_its_clause(tmp_path: Path, cls: str) -> None:
    clause, _, check, args, extra = PLANTED[cls]
    suite = HiCacheStorageSuite()
    with backends(f"sglang_planted:{cls}", tmp_path / "store", extra_config=extra) as make:
        with pytest.raises(ContractViolation) as caught:
            getattr(suite, check)(make, *args)
    assert caught.value.clause == clause, caught.value


@pytest.mark.parametrize(("target", "extra"), [("file", {}), ("kvspec", {}),
                                               ("sglang_planted:ZeroCopyFile", V1)])
def test_the_unplanted_backends_pass_the_same_checks(tmp_path: Path, target: str,
                                                     extra: dict[str, Any]) -> None:
    suite = HiCacheStorageSuite()
    zero_copy = target != "file"
    with backends(target, tmp_path / "store", extra_config=extra) as make:
        for _, _, check, args, _ in PLANTED.values():
            if check == "test_round_trip_zero_copy_interface" and not zero_copy:
                continue
            getattr(suite, check)(make, *args)


@pytest.fixture(scope="module")
def suite_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, tuple[str, str]]]:
    """The whole suite on every planted backend and its bases (tests/sglang/planted_suites.py,
    one pytest session): suite class -> test (with parameters) -> (outcome, broken clause)."""
    out = tmp_path_factory.mktemp("planted") / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(HERE / "planted_suites.py"), "-q",
         "-p", "no:cacheprovider", f"--kvspec-report={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])})
    assert done.returncode in (0, 1) and out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    runs: dict[str, dict[str, tuple[str, str]]] = {}
    for t in json.loads(out.read_text())["tests"]:
        _, cls, test = t["nodeid"].split("::")
        broken = t["message"].split(" ")[1] if t["outcome"] == "fail" else ""
        runs.setdefault(cls, {})[test] = (t["outcome"], broken)
    return runs


@pytest.mark.parametrize("cls", sorted(PLANTED))
def test_the_whole_suite_names_only_the_planted_clause(
    suite_runs: dict[str, dict[str, tuple[str, str]]], cls: str
) -> None:
    """Every check the planted backend fails names its clause, unless its unplanted base
    fails that check with the same clause; and at least one check its base passes fails."""
    clause, base, _, _, _ = PLANTED[cls]
    runs, ref = suite_runs[f"Test{cls}"], suite_runs[base]
    assert runs.keys() == ref.keys()
    other = {t: c for t, (o, c) in runs.items()
             if o in ("fail", "error") and c != clause and ref[t] != (o, c)}
    assert not other, f"{cls} broke other clauses: {other}"
    new = [t for t, (o, c) in runs.items() if o == "fail" and c == clause and ref[t][0] != "fail"]
    assert new, f"{cls} ({clause}) was not caught: {runs}"


def test_the_unplanted_bases_fail_only_sglangs_short_read_bug(
    suite_runs: dict[str, dict[str, tuple[str, str]]]
) -> None:
    """SGLang's file backend (and its zero-copy variant) fail only the STO-003 checks that
    hit ``HiCacheFile.get`` raising on an unreadable object; the fault checks ran (no skip)."""
    for base in ("TestFile", "TestZeroCopyFile"):
        failed = {t: c for t, (o, c) in suite_runs[base].items() if o != "pass" and o != "skip"}
        assert failed == {"test_damaged_object_reads_as_a_miss[truncated]": "STO-003",
                          "test_damaged_object_reads_as_a_miss[empty]": "STO-003",
                          "test_failed_load_reads_as_a_miss": "STO-003"}, (base, failed)
        for fault in ("no-fd", "disk-full"):
            assert suite_runs[base][f"test_failed_store_is_reported[{fault}]"] == ("pass", "")
