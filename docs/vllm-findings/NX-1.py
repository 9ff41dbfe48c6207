"""NX-1: a client's malformed kv_transfer_params crash NixlConnector's engine.

NixlConnector uses a request's kv_transfer_params, which come from the API client
through the P/D proxy, without checking their types. This script runs one
in-process engine (tiny Llama, dummy weights, block size 32) with NixlConnector
(kv_role "kv_both", host buffer on CPU) and sends a well-formed request, then a
remote-prefill request whose remote_engine_id is a list, then a well-formed one.

Bug present: the malformed request raises TypeError in the scheduler
(on_new_request hashes remote_engine_id); it stays queued and the next well-formed
request fails too (TypeError in the worker's start_load_kv). The last line is
"REPRODUCED: ..." and the exit code is 1. With VLLM_ENABLE_V1_MULTIPROCESSING=1
(vLLM's default layout) the engine core process dies instead and both requests
get EngineDeadError.
Bug fixed: the malformed request is refused with an error other than TypeError
(or served) and the next request is served; the last line is
"NOT REPRODUCED: ..." and the exit code is 0. A failure to set the engine up
prints "ERROR: ..." (exit 2).

Run: python docs/vllm-findings/NX-1.py   (in an environment with vLLM and NIXL)
"""
import gc, json, os, socket, tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process
os.environ["OMP_NUM_THREADS"] = "1"  # NIXL's progress thread polls: leave it a core
os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(s.getsockname()[1])

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
}
BAD = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": ["e0"],
       "remote_request_id": "r0", "remote_host": "127.0.0.1", "remote_port": 5600,
       "remote_block_ids": [0, 1], "tp_size": 1}


def why(e):
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def main():
    with tempfile.TemporaryDirectory() as model:
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(TINY_LLAMA, f)
        try:
            from vllm import LLM, SamplingParams
            from vllm.config import KVTransferConfig
            from vllm.inputs import TokensPrompt
            llm = LLM(
                model=model, load_format="dummy", skip_tokenizer_init=True,
                dtype="float32", enforce_eager=True, seed=0, max_model_len=256,
                max_num_seqs=4, max_num_batched_tokens=256, block_size=32,
                kv_cache_memory_bytes=64 << 20,
                kv_transfer_config=KVTransferConfig(
                    kv_connector="NixlConnector", kv_role="kv_both", kv_buffer_device="cpu"))

            def run(kv_params=None):
                extra = None if kv_params is None else {"kv_transfer_params": kv_params}
                sp = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False,
                                    ignore_eos=True, extra_args=extra)
                prompt = TokensPrompt(prompt_token_ids=list(range(1, 41)))
                return llm.generate([prompt], sp, use_tqdm=False)[0]
            run()
        except Exception as e:
            return 2, f"ERROR: setting the engine up or a well-formed request failed: {why(e)}"
        errors = []
        for kv_params in (BAD, None):
            try:
                run(kv_params)
                errors.append(None)
            except Exception as e:
                errors.append(e)
        bad, good = errors
        del llm
        gc.collect()
        if isinstance(bad, TypeError) or good is not None:
            then = f"failed with {why(good)}" if good else "was served"
            return 1, (f"REPRODUCED: remote_engine_id as a list made the engine raise "
                       f"{why(bad) if bad else 'nothing'}, and the next well-formed request {then}.")
        return 0, (f"NOT REPRODUCED: the malformed request ended in "
                   f"{why(bad) if bad else 'an answer'} and the next request was served.")


if __name__ == "__main__":
    code, line = main()
    print(line, flush=True)
    os._exit(code)  # skip interpreter teardown so no log line follows the verdict
