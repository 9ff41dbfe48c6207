"""``kvspec demo pd``: two engines in two processes hand requests off over NIXL."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("nixl")

from kvspec.cli import main  # noqa: E402
from kvspec.demo.pd import PDOptions, run_pd_demo  # noqa: E402

pytestmark = pytest.mark.nixl


def test_demo_moves_every_prompt_block_over_nixl() -> None:
    options = PDOptions(requests=2, prompt_tokens=33, decode_tokens=2, layers=2, heads=2,
                        head_size=16, block_size=8, timeout_s=60)
    report = run_pd_demo(options)
    assert (report.handed_off, report.finished) == (2, 2)
    assert report.loaded_tokens == 2 * 32  # every full prompt block, none recomputed
    assert report.loaded_bytes == report.loaded_tokens * 2 * 2 * 2 * 16 * 2  # layers, heads, K and V, head size, bf16 bytes
    assert report.verified and report.decode_seconds > 0


def test_demo_cli_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "pd", "--requests", "1", "--prompt-tokens", "17", "--layers", "1",
                 "--heads", "1", "--head-size", "8", "--order", "LBNHC", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)  # the report alone: progress goes to stderr
    assert out["finished"] == 1 and out["loaded_tokens"] == 16
    assert out["options"]["order"] == "LBNHC"
    # The connector author's day, item 8: the demo was silent while its engines started
    # and ran. A line per phase now, with the seconds since the start.
    lines = captured.err.splitlines()
    phases = ["starting the prefill engine (TP 1) and the decode engine (TP 1)",
              "prefill engine ready", "decode engine ready",
              "prefill engine: handed off 1/1 requests", "prefill engine done: handed off 1",
              "decode engine: finished 1/1 requests", "decode engine done: finished 1"]
    for phase in phases:
        assert any(re.match(r"kvspec demo pd: +\d+\.\ds " + re.escape(phase), line)
                   for line in lines), (phase, lines)
    order = [next(i for i, line in enumerate(lines) if phase in line) for phase in phases]
    assert order[0] == 0 and order[-1] == len(lines) - 1
    assert order[3] < order[4] < order[6] and order[5] < order[6]


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_demo_across_tp_sizes(prefill_tp: int, decode_tp: int) -> None:
    """Heterogeneous TP across processes: every decode rank's heads arrive intact (the
    decode model checks every byte it reads) and nothing is recomputed."""
    options = PDOptions(requests=2, prompt_tokens=25, decode_tokens=1, layers=2, heads=4,
                        head_size=8, block_size=8, order="LBHNC", prefill_tp=prefill_tp,
                        decode_tp=decode_tp, timeout_s=60)
    report = run_pd_demo(options)
    assert (report.handed_off, report.finished) == (2, 2)
    assert report.loaded_tokens == 2 * 24
    assert report.loaded_bytes == report.loaded_tokens * 2 * 4 * 2 * 8 * 2  # whole model
    assert "TP %d -> %d" % (prefill_tp, decode_tp) in report.lines()[0]


def test_demo_cli_refuses_a_tp_size_that_does_not_split_the_heads() -> None:
    with pytest.raises(SystemExit, match="does not divide"):
        main(["demo", "pd", "--heads", "4", "--decode-tp", "3"])
