"""One vLLM engine in this process, driven by JSON lines on stdin (see
``kvspec.bench.vllm_engine``); vLLM itself is reached through ``kvspec.vllm.offline``.

Run as ``python -m kvspec.bench._vllm_engine_host`` under the vLLM environment's python;
the first line is the engine spec, each later line a command; each answer is one stdout line starting with ``KVSPEC-RESULT`` followed by JSON
(vLLM's own logs go to the same streams and are ignored by the client). The engine is a tiny
Llama with dummy weights written to a temporary directory, vLLM's prefix cache off by
default, run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or vLLM's engine-core
child process with ``"engine_core_process": true``), which is why each engine needs a
process of its own. Commands:

* ``{"op": "generate", "prompts": [[ids...]], "max_tokens": n, "kv_transfer_params":
  [... or null], "batch": false}`` (``batch``: submit all prompts at once instead of one
  at a time) -> tokens, ``num_cached_tokens``, output
  ``kv_transfer_params`` and per-request times;
* ``{"op": "call", "fn": "pkg.mod:function", "args": {...}}`` -> ``function(llm, **args)``,
  which must return JSON-ready data (tests use it to reach into the worker);
* ``{"op": "overhead"}`` -> the adapter's translation time per role;
* ``{"op": "layout"}`` -> the layout the worker-side adapter registered (None without one);
* ``{"op": "exit"}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import traceback
from typing import Any

from ..protocols.errors import HarnessError
from ..protocols.wire import resolve_type_path

MARK = "KVSPEC-RESULT "

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2,
    "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 512,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
}


def _answer(obj: Any) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _model_dir(config: dict[str, Any]) -> str:
    """A directory holding ``config`` as its ``config.json``, one per config."""
    text = json.dumps(config, sort_keys=True)
    # One directory per model config: engines that must agree on the model (a prefill and a
    # decode engine: vLLM's NIXL connector hashes the model path into its compatibility
    # check) get the same path.
    model_dir = os.path.join(tempfile.gettempdir(),
                             "kvspec-vllm-model-" + hashlib.sha256(text.encode()).hexdigest()[:16])
    os.makedirs(model_dir, exist_ok=True)
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return model_dir


def _engine(spec: dict[str, Any]) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # In this process by default; ``"engine_core_process": true`` runs vLLM's default
    # layout, the engine core in a child process (the probes then reach only this one).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("engine_core_process") else "0"
    # "model_dir": a checkpoint written beforehand (config.json and safetensors, e.g. a tiny
    # state-space model with seeded weights), loaded as it is; else the tiny Llama (or its
    # config overrides, "model") with vLLM's dummy weights.
    checkpoint = spec.get("model_dir")
    model_dir = checkpoint or _model_dir({**TINY_LLAMA, **spec.get("model", {})})
    from kvspec.vllm.offline import offline_llm

    engine_args: dict[str, Any] = dict(
        load_format="auto" if checkpoint else "dummy", skip_tokenizer_init=True, enforce_eager=True,
        dtype="float32", max_model_len=spec.get("max_model_len", 512),
        max_num_seqs=spec.get("max_num_seqs", 4),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 512),
        block_size=spec.get("block_size", 32),
        kv_cache_memory_bytes=spec.get("kv_cache_memory_bytes", 64 << 20), seed=0,
        enable_prefix_caching=spec.get("prefix_caching", False),
    )
    if "speculative" in spec:  # vLLM's speculative_config; "draft": the drafter's config.json
        speculative = dict(spec["speculative"])
        if "draft" in speculative:
            speculative["model"] = _model_dir(dict(speculative.pop("draft")))
        engine_args["speculative_config"] = speculative
        engine_args["per_request_spec_decode_metrics"] = "detailed"  # acceptance per request
    if "disable_hma" in spec:  # vLLM's hybrid KV-cache allocator off (True) or forced on
        engine_args["disable_hybrid_kv_cache_manager"] = bool(spec["disable_hma"])
    return offline_llm(model_dir, factory=spec.get("factory"),
                       kv_role=spec.get("kv_role", "kv_both"), engine_id=spec.get("engine_id"),
                       extra=spec.get("extra", {}), vllm_connector=spec.get("vllm_connector"),
                       **engine_args)


def _generate(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    from kvspec.vllm.offline import generate

    return {"results": generate(llm, cmd["prompts"], max_tokens=cmd.get("max_tokens", 8),
                                kv_transfer_params=cmd.get("kv_transfer_params"),
                                batch=bool(cmd.get("batch")),
                                ignore_eos=cmd.get("ignore_eos", True))}


def _overhead() -> dict[str, Any]:
    from kvspec.vllm.connector import KVSpecConnector

    out: dict[str, Any] = {}
    for conn in KVSpecConnector.live():
        role = "scheduler" if conn.kvspec_scheduler is not None else "worker"
        out[role] = conn.adapter_overhead()
    return out


def _layout() -> dict[str, Any] | None:
    from kvspec.vllm.connector import KVSpecConnector

    for conn in KVSpecConnector.live():
        lay = conn.registered_layout
        if lay is not None:
            return {"order": lay.order.name, "packing": lay.packing.name,
                    "opaque_pages": lay.opaque_pages, "num_layers": lay.num_layers,
                    "num_blocks": lay.num_blocks, "block_size": lay.block_size,
                    "page_size_bytes": lay.page_size_bytes,
                    "bytes_per_token": lay.page_size_bytes * lay.num_storage_layers
                    // lay.block_size}
    return None


def main() -> int:
    spec = json.loads(sys.stdin.readline())
    try:
        llm = _engine(spec)
    except Exception as e:
        _answer({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        return 1
    _answer({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "exit":
                _answer({"bye": True})
                break
            if op == "generate":
                _answer(_generate(llm, cmd))
            elif op == "call":
                fn = resolve_type_path(cmd["fn"], what="engine call", error=HarnessError,
                                       clause=None)
                _answer({"value": fn(llm, **cmd.get("args", {}))})
            elif op == "overhead":
                _answer({"value": _overhead()})
            elif op == "layout":
                _answer({"value": _layout()})
            else:
                _answer({"error": f"unknown op {op!r}"})
        except Exception as e:
            _answer({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
