"""EX-4: ExampleConnector shares stored KV across cache salts (and LoRA adapters).

ExampleConnector keys stored KV by the prompt's token ids (and multimodal hashes)
only, so a request with another cache_salt -- the tenant isolation vLLM's own
prefix cache honours -- loads KV another tenant computed. This script runs one
in-process engine (tiny Llama, dummy weights, block size 32, vLLM's prefix cache
off so every cached token is the connector's) and sends the same 98-token prompt
twice: with cache_salt "tenant-a", then with cache_salt "tenant-b". (The LoRA
half of the finding is the same key; it is not exercised here.)

Bug present: the tenant-b request reports 96 cached tokens, i.e. it loaded
tenant-a's KV; the last line is "REPRODUCED: ..." and the exit code is 1.
Bug fixed: the tenant-b request has no cached tokens; the last line is
"NOT REPRODUCED: ..." and the exit code is 0. A failure to set the engine up
prints "ERROR: ..." (exit 2).

Run: python docs/vllm-findings/EX-4.py   (in an environment with vLLM)
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
            tokens = [(7 * i + 3) % 500 + 1 for i in range(98)]
            cached = {salt: llm.generate([TokensPrompt(prompt_token_ids=tokens, cache_salt=salt)],
                                         params, use_tqdm=False)[0].num_cached_tokens
                      for salt in ("tenant-a", "tenant-b")}
        except Exception as e:
            return 2, f"ERROR: setting the engine up or a request failed: {why(e)}"
        del llm
        gc.collect()
        if cached["tenant-b"] > 0:
            return 1, (f"REPRODUCED: the tenant-b request loaded {cached['tenant-b']} tokens of KV "
                       f"that the tenant-a request (same tokens, another cache_salt) stored.")
        return 0, (f"NOT REPRODUCED: the tenant-b request got {cached['tenant-b']} cached tokens "
                   f"(tenant-a: {cached['tenant-a']}).")


if __name__ == "__main__":
    code, line = main()
    print(line, flush=True)
    os._exit(code)  # skip interpreter teardown so no log line follows the verdict
