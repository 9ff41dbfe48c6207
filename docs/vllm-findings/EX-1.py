"""EX-1: under chunked prefill ExampleConnector stores part of a prompt under the
whole prompt's key, and a later hit crashes the engine.

ExampleConnector stores a new request in the step that first schedules it, using
the blocks allocated so far. Under chunked prefill those blocks cover only the
first chunk, yet the file is named after the whole prompt. This script runs one
in-process engine (tiny Llama, dummy weights, block size 32, vLLM's prefix cache
off, chunked prefill with a 64-token budget) and sends a 130-token prompt twice:
the first run stores 64 rows under the key of its first 128 tokens; the second
run matches those 128 tokens and copies the 64 rows into 128 slots.

Bug present: the second run raises RuntimeError (shape mismatch); the last line
is "REPRODUCED: ..." and the exit code is 1.
Bug fixed: the second run completes; the last line is "NOT REPRODUCED: ..." and
the exit code is 0. A failure to set the engine up prints "ERROR: ..." (exit 2).

Run: python docs/vllm-findings/EX-1.py   (in an environment with vLLM)
"""
import gc, json, os, tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in this process

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
}


def why(e):
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def main():
    with tempfile.TemporaryDirectory() as model, tempfile.TemporaryDirectory() as store:
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(TINY_LLAMA, f)
        try:
            from vllm import LLM, SamplingParams
            from vllm.config import KVTransferConfig
            from vllm.inputs import TokensPrompt
            llm = LLM(
                model=model, load_format="dummy", skip_tokenizer_init=True,
                dtype="float32", enforce_eager=True, seed=0, max_model_len=256,
                max_num_seqs=4, max_num_batched_tokens=64, enable_chunked_prefill=True,
                block_size=32, kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False,
                kv_transfer_config=KVTransferConfig(
                    kv_connector="ExampleConnector", kv_role="kv_both",
                    kv_connector_extra_config={"shared_storage_path": store}))
            params = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False,
                                    ignore_eos=True)
            prompt = TokensPrompt(prompt_token_ids=[(7 * i + 3) % 500 + 1 for i in range(130)])
            llm.generate([prompt], params, use_tqdm=False)  # computed in chunks, stored
        except Exception as e:
            return 2, f"ERROR: setting the engine up or the first run failed: {why(e)}"
        try:
            out = llm.generate([prompt], params, use_tqdm=False)[0]
        except Exception as e:
            return 1, (f"REPRODUCED: the second run of a 130-token prompt prefilled in 64-token "
                       f"chunks hit a partial store and raised {why(e)}")
        del llm
        gc.collect()
        return 0, (f"NOT REPRODUCED: the second run of the chunked 130-token prompt completed "
                   f"({out.num_cached_tokens} tokens came from the connector).")


if __name__ == "__main__":
    code, line = main()
    print(line, flush=True)
    os._exit(code)  # skip interpreter teardown so no log line follows the verdict
