"""EX-2: ExampleConnector looks up one prefix length and loads another, so some
hits crash the engine on a missing file.

ExampleConnector decides a hit by the folder of the first (len-2)//bs*bs prompt
tokens but loads from the folder of the first (len-1)//bs*bs tokens. This script
runs one in-process engine (tiny Llama, dummy weights, block size 32, vLLM's
prefix cache off so every hit is the connector's) and sends two prompts: A (40
tokens) stores its first 32 tokens; B (65 tokens, starting with A)
then matches A's 32-token folder, and the load opens a file in the 64-token
folder, which nobody wrote.

Bug present: B raises FileNotFoundError; the last line is "REPRODUCED: ..." and
the exit code is 1.
Bug fixed: B completes (with or without a hit); the last line is
"NOT REPRODUCED: ..." and the exit code is 0. A failure to set the engine up
prints "ERROR: ..." (exit 2).

Run: python docs/vllm-findings/EX-2.py   (in an environment with vLLM)
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
            prompt_b = [(7 * i + 3) % 500 + 1 for i in range(65)]
            prompt_a = prompt_b[:40]
            llm.generate([TokensPrompt(prompt_token_ids=prompt_a)], params, use_tqdm=False)
        except Exception as e:
            return 2, f"ERROR: setting the engine up or prompt A failed: {why(e)}"
        try:
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt_b)], params,
                               use_tqdm=False)[0]
        except Exception as e:
            return 1, (f"REPRODUCED: a 65-token prompt matched the 32-token prefix a 40-token "
                       f"prompt stored, then its load raised {why(e)}")
        del llm
        gc.collect()
        return 0, (f"NOT REPRODUCED: the 65-token prompt completed "
                   f"({out.num_cached_tokens} tokens came from the connector).")


if __name__ == "__main__":
    code, line = main()
    print(line, flush=True)
    os._exit(code)  # skip interpreter teardown so no log line follows the verdict
