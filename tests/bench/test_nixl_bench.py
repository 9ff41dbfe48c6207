"""``kvspec bench nixl`` runs and reports what it promises (targets are not asserted)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("nixl")

from kvspec.cli import main  # noqa: E402

pytestmark = pytest.mark.nixl


def test_quick_json_reports_every_point_and_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "nixl", "--quick", "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    rows = data["results"]
    assert [(r["order"], r["page_bytes"]) for r in rows] == [
        ("BLNHC", 4096), ("BLNHC", 65536), ("LBNHC", 4096), ("LBNHC", 65536)]
    for r in rows:
        assert r["connector_s"] > 0 and r["raw_s"] > 0 and r["memcpy_s"] > 0
        assert r["control_us"] > 0 and r["nbytes"] == 32 * 4 * r["page_bytes"]
        per_block = 1 if r["family"] == "block-outermost" else 4  # one per layer and block
        assert r["descriptors"] == 32 * per_block
    assert len(data["targets"]) == 5
    assert all(t.endswith(("PASS", "MISS")) for t in data["targets"])
    assert captured.err.count("\n") >= 6  # one progress line per point
    tp = data["tp"]
    assert [(r["point"]["order"], r["prefill_tp"], r["decode_tp"]) for r in tp] == [
        (order, p, d) for order in ("LBHNC", "LBNHC") for p, d in ((1, 1), (2, 1), (1, 2))]
    for r in tp:
        assert r["seconds"] > 0 and r["nbytes"] == 32 * 2 * 8 * 16 * 2 * 128 * 2
        assert r["reads"] == 2 if (r["prefill_tp"], r["decode_tp"]) != (1, 1) else 1
        # HND: one descriptor per layer and block per READ; NHD (sliced): per token too.
        per_block = 2 if r["point"]["order"] == "LBHNC" or r["reads"] == 1 else 2 * 16
        assert r["descriptors"] == r["reads"] * 32 * per_block
    assert tp[0]["vs_same_tp"] == 1.0


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "nixl", "--quick", "--blocks", "8", "--layers", "2",
                 "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "| layout" in out and "vs raw" in out and "target control-plane" in out
    assert "heterogeneous TP" in out and "| LBHNC  | 2 -> 1" in out
