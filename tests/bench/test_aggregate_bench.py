"""``kvspec bench aggregate`` runs and reports; the two arms agree on every completion."""

from __future__ import annotations

import json

import pytest

from kvspec.bench.aggregate import AggregatePoint, kvspec_arm, make_trace, run_aggregate_bench
from kvspec.cli import main


def test_trace_reports_every_request_once_per_rank() -> None:
    trace = make_trace(3, 200, seed=1)
    expected = {rid for step in trace.expects for rid, _ in step}
    assert len(expected) == 200
    for rank in range(3):
        seen = [rid for step in trace.reports for s, r in [step[rank]] for rid in s | r]
        assert sorted(seen) == sorted(expected)


def test_kvspec_arm_completes_every_request_once() -> None:
    trace = make_trace(4, 300)
    seconds, completed = kvspec_arm(trace)()
    flat = [rid for step in completed for rid in step]
    assert seconds > 0 and len(flat) == len(set(flat)) == 300


def test_without_vllm_the_command_measures_kvspec_alone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVSPEC_NO_RERUN", "1")
    monkeypatch.setattr("kvspec.bench.aggregate.vllm_arm_factory", lambda: None)
    assert main(["bench", "aggregate", "--ranks", "1,2", "--requests", "100",
                 "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "| ranks | requests |" in out and "n/a" in out
    assert "target kvspec/vLLM <= 1.0 at every point: n/a" in out
    assert main(["bench", "aggregate", "--ranks", "2", "--requests", "100", "--repeats", "1",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["results"][0]["vllm_us_per_step"] is None


def test_results_have_both_arms_when_a_vllm_arm_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in vLLM arm (kvspec's own) shows the comparison path: ratios near 1.
    monkeypatch.setattr("kvspec.bench.aggregate.vllm_arm_factory", lambda: kvspec_arm)
    (result,) = run_aggregate_bench([AggregatePoint(2, 100)], repeats=1)
    assert result.vllm_us is not None and result.ratio is not None


@pytest.mark.parametrize("bad", [["--ranks", "0"], ["--requests", "x"], ["--repeats", "0"]])
def test_bad_arguments_are_usage_errors(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "aggregate", *bad])
    assert exc.value.code == 2
