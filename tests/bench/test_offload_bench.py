"""Tests of ``kvspec bench offload`` (kvspec.bench). Speed targets are not asserted here:
they belong to the benchmark's own output."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch

from kvspec.bench._timing import ceiling_seconds, median_seconds, written_bytes
from kvspec.bench.offload import (
    GPU_TARGET,
    OffloadGrid,
    OffloadPoint,
    OffloadResult,
    StepOverhead,
    check_targets,
    measure_point,
    measure_step_overhead,
)
from kvspec.cli import main

_TINY = ["bench", "offload", "--quick", "--blocks", "8", "--layers", "2", "--repeats", "2",
         "--warmup", "1", "--overhead-blocks", "16"]


def test_quick_json_runs_and_reports_positive_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "offload", "--quick", "--json"]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert set(data) >= {"results", "step_overhead_us", "machine", "targets"}
    assert {"torch", "cpu_count", "date"} <= set(data["machine"])
    assert len(data["results"]) == len(OffloadGrid.quick().points())
    for row in data["results"]:
        for key in ("order", "family", "block_size", "layers", "heads", "head_size", "dtype",
                    "blocks", "mib_moved", "path", "store_gbps", "load_gbps", "ceiling_gbps"):
            assert key in row
        assert row["store_ratio"] > 0 and row["load_ratio"] > 0
        assert row["path"] in ("block", "rows", "elements")
        assert row["bytes_moved"] == row["blocks"] * row["layers"] * row["block_size"] * (
            row["heads"] * 2 * row["head_size"] * 2)  # bfloat16, K and V
    assert {r["family"] for r in data["results"]} == {"block-outermost", "layer-outermost"}
    assert [o["direction"] for o in data["step_overhead_us"]] == ["store", "load"]
    for o in data["step_overhead_us"]:
        assert o["blocks"] == 256 and o["total_us"] > 0 and o["events_us"] >= 0
    # the quick grid is too small to judge a target: neither passed nor missed
    assert len(data["targets"]) == 6
    assert all(t["passed"] is None and "too small to judge" in t["not_judged"]
               for t in data["targets"])
    assert err.count("\n") >= len(data["results"])  # one progress line per grid point


def test_table_output_has_columns_and_target_lines(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_TINY, "--orders", "bhlnc,LHBNC", "--heads", "1x8", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    for column in ("layout", "family", "tok/blk", "heads x size", "MiB moved", "store ratio",
                   "load ratio", "store GB/s", "load GB/s", "ceiling GB/s", "path"):
        assert column in out
    assert "BHLNC" in out and "LHBNC" in out
    targets = [line for line in out.splitlines() if line.startswith("target ")]
    assert len(targets) == 6  # 4 ratios, per-step work of a store and of a load
    assert all("n/a (too small to judge" in line for line in targets)  # a tiny grid
    assert not any(line.endswith(("PASS", "MISS")) for line in targets)


def test_quick_run_judges_no_target() -> None:
    """The connector author's day, item 8: ``--quick`` printed six MISS lines on a grid too
    small to mean anything. Its target lines say n/a and why; the exit status is 0."""
    proc = subprocess.run([sys.executable, "-m", "kvspec", "bench", "offload", "--quick"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    targets = [line for line in proc.stdout.splitlines() if line.startswith("target ")]
    assert len(targets) == 6
    assert "MISS" not in proc.stdout and "PASS" not in proc.stdout
    assert all("n/a (too small to judge: " in line and "3 runs" in line for line in targets)
    assert "0.5 MiB copies" in targets[0]
    assert proc.stderr.count("\n") >= len(OffloadGrid.quick().points())  # progress lines


def _result(order: str, blocks: int, layers: int, ratio: float) -> OffloadResult:
    point = OffloadPoint(order, 16, layers, 8, 128, "bfloat16", blocks)
    nbytes = blocks * layers * 16 * 8 * 2 * 128 * 2
    return OffloadResult(point, "block", nbytes, 1.0, 1.0, ratio)


def _overhead(direction: str, blocks: int, total_us: float) -> StepOverhead:
    return StepOverhead(direction, blocks, 1, 1, 1, 1, 1, 1, total_us)


def test_targets_are_judged_only_on_a_grid_large_enough() -> None:
    full = [_result("BLNHC", 256, 32, 0.95), _result("LBNHC", 256, 32, 0.5)]
    steps = [_overhead("store", 256, 80.0), _overhead("load", 256, 150.0)]
    checks = check_targets(full, steps, repeats=7)
    assert [c.line().rsplit(None, 1)[-1] for c in checks] == [
        "PASS", "PASS", "MISS", "MISS", "PASS", "MISS"]
    assert all(c.judged and c.not_judged is None for c in checks)
    assert check_targets(full, steps) == checks  # repeats unknown: judged as measured

    # 4 layers x 32 blocks of 8x128: 8 MiB copies; 3 runs; a 16-block job
    small = [_result("BLNHC", 32, 4, 0.5), _result("LBNHC", 256, 32, 0.5)]
    checks = check_targets(small, [_overhead("store", 16, 500.0)], repeats=3)
    assert not any(c.judged or c.passed for c in checks)
    lines = [c.line() for c in checks]
    assert not any(line.endswith(("PASS", "MISS")) for line in lines)
    assert "n/a (too small to judge: 8.0 MiB copies, 3 runs; judged from 16 MiB copies, " \
           "5 runs)" in lines[0]
    assert "n/a (too small to judge: 3 runs;" in lines[2]  # the family's points are large
    assert "n/a (too small to judge: 16 blocks, 3 runs; judged from 256 blocks, 5 runs)" \
        in lines[4]


def test_written_bytes_fills_every_page_with_random_bytes() -> None:
    gen = torch.Generator().manual_seed(1)
    nbytes = (3 << 20) + 12345  # whole chunks and a tail
    buf = written_bytes(nbytes, gen)
    assert buf.dtype == torch.uint8 and buf.numel() == nbytes
    pages = buf[: nbytes // 4096 * 4096].view(-1, 4096)
    assert bool((pages != 0).any(dim=1).all())  # no page left as zeros
    assert bool((buf[-(nbytes % 4096):] != 0).any())
    assert len(torch.unique(buf[:4096])) > 200  # random, not a constant fill
    assert written_bytes(0, gen).numel() == 0


def test_ceiling_and_median_are_positive_times() -> None:
    gen = torch.Generator().manual_seed(0)
    assert ceiling_seconds(1 << 16, gen, repeats=2, warmup=1) > 0
    calls: list[int] = []
    assert median_seconds(lambda: calls.append(1), repeats=3, warmup=2) >= 0
    assert len(calls) == 5


def test_measure_point_moves_half_the_blocks_through_the_pool() -> None:
    point = OffloadPoint("LBNHC", 4, 2, 1, 8, "float16", 6)
    result = measure_point(point, repeats=1, warmup=0, seed=3)
    assert point.layout().num_blocks == 12
    assert result.path == "rows" and result.point.family == "layer-outermost"
    assert result.bytes_moved == 6 * 2 * 4 * 16 * 2
    assert result.store_ratio > 0 and result.load_ratio > 0


def test_step_overhead_parts_sum_roughly_to_total() -> None:
    store, load = measure_step_overhead(32, layers=2, repeats=2, warmup=0)
    assert (store.direction, load.direction) == ("store", "load")
    for o in (store, load):
        parts = (o.schedule_us, o.encode_us, o.decode_us, o.plan_us, o.finish_us)
        assert o.blocks == 32 and min(parts) > 0
        # the events count too (vLLM takes them every step); a median of sums, not a sum
        assert o.total_us == pytest.approx(sum(parts) + o.events_us, rel=1.0)
        assert o.total_us > sum(parts) / 2
    assert store.events_us > 0  # BlockStored events of the 32 stored blocks
    assert "events" in store.line() and "more" not in store.line()


@pytest.mark.parametrize("bad", [
    ["--heads", "8by128"], ["--heads", "0x64"], ["--orders", "XYZ"], ["--dtype", "int8"],
    ["--blocks", "0"], ["--layers", "a,b"], ["--repeats", "2,3"], ["--warmup", "-1"],
    ["--overhead-repeats", "0"],
])
def test_bad_option_values_are_clean_usage_errors(
    bad: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "offload", *bad])
    assert exc.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_bench_needs_a_benchmark_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench"])
    assert exc.value.code == 2


def test_svg_chart_has_a_bar_label_per_point_and_direction(tmp_path: Any) -> None:
    """The chart (matplotlib, text kept as text): every point's label, a value label per
    bar (store and load per point), the series and the targets in the legend."""
    from xml.etree import ElementTree

    path = tmp_path / "chart.svg"
    assert main([*_TINY, "--svg", str(path)]) == 0
    root = ElementTree.fromstring(path.read_text())
    texts = ["".join(e.itertext()).strip() for e in root.iter("{http://www.w3.org/2000/svg}text")]
    points = OffloadGrid.quick().points()
    values = [t for t in texts if t.replace(".", "", 1).isdigit()]
    assert len(values) >= 2 * len(points)  # one per bar, plus the axis ticks
    assert {"store", "load", "target 0.9", "target 0.7"} <= set(texts)
    assert "Date" not in path.read_text()  # reruns with equal numbers give equal files


def test_svg_without_matplotlib_says_what_to_install(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kvspec.bench._chart as chart

    monkeypatch.setattr(chart, "MISSING", "--svg needs matplotlib")
    assert main([*_TINY, "--svg", str(tmp_path / "c.svg")]) == 2
    assert "--svg needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "c.svg").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measure_point_on_cuda_compares_with_pinned_copies_each_way() -> None:
    point = OffloadPoint("LBNHC", 16, 2, 2, 64, "bfloat16", 32)
    result = measure_point(point, repeats=2, warmup=1, seed=3, device="cuda")
    assert result.device == "cuda" and result.load_ceiling_s is not None
    assert result.store_ratio == result.ceiling_s / result.store_s
    assert result.load_ratio == result.load_ceiling_s / result.load_s
    checks = check_targets([result], [])
    assert {c.threshold for c in checks} == {GPU_TARGET}
