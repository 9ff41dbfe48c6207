"""The long-prompt offload series' arithmetic: ratios against the other arms and the
targets of issue 32, judged over 2048 prompt tokens and more."""

from __future__ import annotations

import pytest

from kvspec.bench.vllm_long import BLOCK_BYTES, LongArm, LongOptions, LongResult

LENGTHS = (528, 1040, 2064, 4112)


def _result(ours_ms: float, gbps: float) -> LongResult:
    recompute = LongArm("recompute", {n: n / 10 for n in LENGTHS}, 5.0, {}, True)
    example = LongArm("example", {n: 5.0 + n / 40 for n in LENGTHS}, 5.0,
                      {n: (n - 16) for n in LENGTHS}, True)
    ours = LongArm("ours", {n: 5.0 + ours_ms * n / 4096 for n in LENGTHS}, 5.0,
                   {n: (n - 16) for n in LENGTHS}, True,
                   bytes_loaded={n: (n - 16) // 32 * BLOCK_BYTES for n in LENGTHS},
                   load_gbps={n: gbps for n in LENGTHS}, memcpy_gbps={n: 20.0 for n in LENGTHS},
                   cold_memcpy_gbps={n: 10.0 for n in LENGTHS})
    return LongResult(LongOptions(lengths=LENGTHS), recompute, example, ours)


def test_block_is_at_least_64_kib() -> None:
    assert BLOCK_BYTES == 512 << 10


def test_ratios_and_targets() -> None:
    good = _result(ours_ms=20.0, gbps=8.0)
    r = good.ratios()
    assert r["over_floor_vs_example"][4112] == pytest.approx(20.0 * 4112 / 4096 / (4112 / 40))
    assert r["ttft_vs_recompute"][2064] == pytest.approx((5.0 + 20.0 * 2064 / 4096) / 206.4)
    assert r["bandwidth_vs_memcpy"][528] == pytest.approx(0.8)
    assert good.targets_met() == {"over_floor_vs_example": True, "ttft_vs_recompute": True,
                                  "bandwidth_vs_memcpy": True}
    slow = _result(ours_ms=200.0, gbps=5.0)
    assert slow.targets_met() == {"over_floor_vs_example": False, "ttft_vs_recompute": False,
                                  "bandwidth_vs_memcpy": False}
    text = "\n".join(slow.lines())
    assert "NOT met" in text and "4112" in text and "load GB/s" in text
    assert set(slow.as_dict()) == {"options", "arms", "ratios", "targets", "targets_met"}


def test_the_engine_only_arm_gives_the_net_part() -> None:
    """With vLLM's prefix cache hitting the same blocks (no connector), both connectors'
    time over the floor less the engine's is their own part."""
    import attrs

    base = _result(ours_ms=20.0, gbps=8.0)
    engine = LongArm("engine", {n: 5.0 + 10.0 for n in LENGTHS}, 5.0, {}, True)
    with_engine = attrs.evolve(base, engine=engine)
    net = with_engine.net_ms(with_engine.ours)
    assert net[4112] == pytest.approx(20.0 * 4112 / 4096 - 10.0)
    r = with_engine.ratios()["net_vs_example"]
    assert r[4112] == pytest.approx(net[4112] / (4112 / 40 - 10.0))
    assert "net connector part" in "\n".join(with_engine.lines())
    assert "net_vs_example" not in base.ratios()


def test_the_target_is_judged_against_the_cold_memcpy() -> None:
    """The load copies from host slots written a request ago, so its ceiling is the cold
    memcpy (caches evicted first); the warm one (buffers in the CPU caches) gets its own
    ratio and column and judges nothing."""
    import attrs

    base = _result(ours_ms=20.0, gbps=8.0)
    assert base.ratios()["bandwidth_vs_memcpy"][2064] == pytest.approx(8.0 / 10.0)
    assert base.ratios()["bandwidth_vs_warm_memcpy"][2064] == pytest.approx(8.0 / 20.0)
    assert base.targets_met()["bandwidth_vs_memcpy"] is True
    # a warm ceiling the load could never reach changes nothing
    warmer = attrs.evolve(base, ours=attrs.evolve(base.ours, memcpy_gbps={n: 80.0 for n in LENGTHS}))
    assert warmer.targets_met() == base.targets_met()
    # a cold ceiling the load falls short of fails the target
    faster = attrs.evolve(base, ours=attrs.evolve(
        base.ours, cold_memcpy_gbps={n: 12.0 for n in LENGTHS}))
    assert faster.targets_met()["bandwidth_vs_memcpy"] is False
    # without a cold measurement there is nothing to judge: the target is not met
    none = attrs.evolve(base, ours=attrs.evolve(base.ours, cold_memcpy_gbps={}))
    assert none.targets_met()["bandwidth_vs_memcpy"] is False
    text = "\n".join(base.lines())
    assert "cold memcpy GB/s" in text and "warm memcpy GB/s" in text and "no target" in text
    assert "waited for its load" not in text
    waited = attrs.evolve(base, ours=attrs.evolve(
        base.ours, load_wait_ms={2064: 0.25}, load_start_ms={2064: 0.15}))
    text = "\n".join(waited.lines())
    assert "waited for its load 2064: 0.25 ms" in text and "2064: 0.15 ms after" in text
