"""The harness on a device: ``HarnessConfig.device`` / ``$KVSPEC_DEVICE`` / ``--device``.

On CPU: the option is checked and carried everywhere. On a CUDA GPU (``gpu`` tests): KV
caches, forwards and real CUDA graphs on the device, every block byte-checked, and the
harness's own CUDA context never counted as the connector's leak (ERR-009).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvspec.backends.offload import LayerwiseOffloadConnector, OffloadConnector
from kvspec.bench.graphs import run_graphs_bench
from kvspec.cli import main
from kvspec.conformance.connectors.layerwise import LayerwiseStorageConnector
from kvspec.conformance.harness import Engine, HarnessConfig
from kvspec.conformance.harness.scenarios import SCENARIOS
from kvspec.conformance.suite._harness_runs import DEVICE_ENV, config_for
from kvspec.protocols import (
    Capabilities,
    CapabilityError,
    ConnectorFactory,
    GraphMode,
    InvalidArgumentError,
)

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "CPU", "meta", "", 0])
def test_a_bad_device_is_refused(device: object) -> None:
    with pytest.raises(InvalidArgumentError, match="device"):
        HarnessConfig(device=device)  # type: ignore[arg-type]


def test_the_device_travels_to_worker_processes() -> None:
    cfg = HarnessConfig(device="cuda:1")
    assert HarnessConfig.from_plain(cfg.to_plain()).device == "cuda:1"


def test_the_suite_takes_the_device_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    assert config_for(Capabilities()).device == "cpu"
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    assert config_for(Capabilities()).device == "cuda"
    assert config_for(Capabilities(), device="cpu").device == "cpu"  # a test's own wins


@pytest.mark.skipif(HAS_CUDA, reason="checks the error raised without CUDA")
def test_cuda_without_cuda_is_a_capability_error(tmp_path: Path) -> None:
    with pytest.raises(CapabilityError, match="CUDA is not available"):
        Engine(OffloadConnector(), HarnessConfig(device="cuda"), tmpdir=str(tmp_path))


@pytest.mark.parametrize("argv", [
    ["conform", "--device", "gpu"], ["bench", "offload", "--device", "cuda:"],
    ["bench", "graphs", "--device", "tpu"],
])
def test_the_cli_refuses_a_bad_device(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "expected cpu, cuda or cuda:N" in capsys.readouterr().err


@pytest.mark.skipif(HAS_CUDA, reason="checks the error raised without CUDA")
@pytest.mark.parametrize("bench", ["offload", "graphs"])
def test_benches_on_cuda_without_cuda_say_so(bench: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", bench, "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_bench_graphs_runs_every_mode(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "graphs", "--layers", "2", "--heads", "2x8", "--tokens", "16",
                 "--blocks", "8", "--repeats", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["result"]
    assert set(result["seconds"]) == {"full", "piecewise", "none"}
    assert all(v > 0 for v in result["seconds"].values())
    assert result["downgrade_ratio"] == pytest.approx(
        result["seconds"]["piecewise"] / result["seconds"]["full"])


# ---------------------------------------------------------------------------- on a GPU

CONNECTORS: list[ConnectorFactory] = [LayerwiseOffloadConnector(), LayerwiseStorageConnector()]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", [GraphMode.NONE, GraphMode.PIECEWISE, GraphMode.FULL],
                         ids=lambda m: m.value)
@pytest.mark.parametrize("factory", CONNECTORS, ids=lambda f: f.name)
@pytest.mark.parametrize("lazy", [False, True], ids=["startup", "lazy"])
def test_serving_on_cuda_moves_every_block_exactly(
    factory: ConnectorFactory, mode: GraphMode, lazy: bool, tmp_path: Path,
) -> None:
    """Hits, chunked prefill and aborts on the GPU, captured at start-up or mid-serving:
    the harness byte-checks every token each attention reads, so a run without a violation
    moved every loaded block exactly."""
    for name in ("full-prompt-hit", "chunked", "aborts"):
        cfg = config_for(factory.capabilities, device="cuda", graph_mode=mode, lazy_capture=lazy,
                         prefix_caching=False, max_tokens_per_step=8 if name == "chunked" else 32)
        with Engine(factory, cfg, tmpdir=str(tmp_path / name)) as engine:
            result = engine.run(SCENARIOS[name])
        if name == "full-prompt-hit":
            assert sum(result.external_tokens.values()) > 0  # something was loaded


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_tp2_workers_on_cuda_are_not_blamed_for_the_harness_context(tmp_path: Path) -> None:
    """Each worker process opens its CUDA context (driver files, an eventfd, pipes) for the
    harness's KV caches: that is the harness's, not a leak of the connector (ERR-009)."""
    cfg = config_for(OffloadConnector().capabilities, device="cuda", tp_size=2,
                     prefix_caching=False)
    with Engine(OffloadConnector(), cfg, tmpdir=str(tmp_path)) as engine:
        engine.run(SCENARIOS["full-prompt-hit"])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_bench_graphs_on_cuda_reports_every_mode() -> None:
    result = run_graphs_bench(device="cuda", layers=2, heads=2, head_size=16, tokens=32,
                              blocks=16, repeats=3, warmup=1)
    assert result.device == "cuda" and all(v > 0 for v in result.seconds.values())
