"""EX-5: ExampleConnector gives a one-token prompt a negative match count.

For a prompt of n tokens ExampleConnector matches (n-2)//bs*bs tokens: -bs for
n = 1. The folder it checks for that (the empty prefix) exists as soon as any
prompt of at most bs+1 tokens was stored. This script runs one in-process engine
(tiny Llama, dummy weights, block size 32, vLLM's prefix cache off) and sends a
20-token prompt (it stores the empty prefix), then a one-token prompt, for which
get_num_new_matched_tokens returns -32; vLLM's scheduler adds that to the
request's computed tokens (in vLLM 0.32 the model runner then raises IndexError).

Bug present: the one-token request raises, or reports a negative number of cached
tokens; the last line is "REPRODUCED: ..." and the exit code is 1.
Bug fixed: the one-token request completes with no negative count; the last line
is "NOT REPRODUCED: ..." and the exit code is 0. A failure to set the engine up
prints "ERROR: ..." (exit 2).

Run: python docs/vllm-findings/EX-5.py   (in an environment with vLLM)
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
                max_num_seqs=4, max_num_batched_tokens=256, block_size=32,
                kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False,
                kv_transfer_config=KVTransferConfig(
                    kv_connector="ExampleConnector", kv_role="kv_both",
                    kv_connector_extra_config={"shared_storage_path": store}))
            params = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False,
                                    ignore_eos=True)
            llm.generate([TokensPrompt(prompt_token_ids=list(range(1, 21)))], params,
                         use_tqdm=False)  # stores the empty prefix
        except Exception as e:
            return 2, f"ERROR: setting the engine up or the 20-token prompt failed: {why(e)}"
        try:
            out = llm.generate([TokensPrompt(prompt_token_ids=[42])], params, use_tqdm=False)[0]
        except Exception as e:
            return 1, (f"REPRODUCED: after a 20-token prompt stored the empty prefix, a one-token "
                       f"prompt made the engine raise {why(e)}")
        del llm
        gc.collect()
        if out.num_cached_tokens < 0 or len(out.outputs[0].token_ids) != 4:
            return 1, (f"REPRODUCED: a one-token prompt reported {out.num_cached_tokens} cached "
                       f"tokens and {len(out.outputs[0].token_ids)} of 4 output tokens.")
        return 0, (f"NOT REPRODUCED: the one-token prompt completed with "
                   f"{out.num_cached_tokens} cached tokens.")


if __name__ == "__main__":
    code, line = main()
    print(line, flush=True)
    os._exit(code)  # skip interpreter teardown so no log line follows the verdict
