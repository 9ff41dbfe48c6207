"""EX-3: under tensor parallelism every ExampleConnector rank writes the same files.

ExampleConnector names a file by prompt hash and layer name, not by TP rank. Each
rank holds other KV heads, so the ranks overwrite each other's files and a hit
loads one rank's heads into the other rank's cache. This script runs an engine
with tensor_parallel_size=2 (two worker processes, one core each), vLLM's prefix
cache off, and sends a 98-token prompt twice: the first run computes and stores 96
tokens, the second loads them. It compares the log-probabilities of the 4 greedy
tokens of both runs. The tiny Llama gets random weights in a safetensors file, not
load_format="dummy": the dummy loader seeds every shard alike, both ranks would
hold identical heads, and the overwrite would go unseen.

Bug present: the two runs disagree; the last line is "REPRODUCED: ..." and the
exit code is 1.
Bug fixed: they agree within 1e-3; the last line is "NOT REPRODUCED: ..." and the
exit code is 0. A failure to set the engine up (e.g. no TP=2 here) prints
"ERROR: ..." (exit 2).

Run: python docs/vllm-findings/EX-3.py   (in an environment with vLLM)
"""
import gc, json, os, tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
# vLLM-CPU refuses to auto-bind two TP ranks to one NUMA node: one core per rank.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
}


def why(e):
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def write_random_llama(folder):
    import torch
    from safetensors.torch import save_file
    g, h, m, v = torch.Generator().manual_seed(0), 128, 256, 512
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    for p in ("model.layers.0.", "model.layers.1."):
        shapes.update({p + f"self_attn.{x}_proj.weight": (h, h) for x in "qkvo"})
        shapes.update({p + "mlp.gate_proj.weight": (m, h), p + "mlp.up_proj.weight": (m, h),
                       p + "mlp.down_proj.weight": (h, m), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    weights = {k: torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) / s[1] ** 0.5
               for k, s in shapes.items()}
    save_file(weights, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)


def main():
    with tempfile.TemporaryDirectory() as model, tempfile.TemporaryDirectory() as store:
        try:
            write_random_llama(model)
            from vllm import LLM, SamplingParams
            from vllm.config import KVTransferConfig
            from vllm.inputs import TokensPrompt
            llm = LLM(
                model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                seed=0, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256,
                block_size=32, kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False,
                tensor_parallel_size=2, distributed_executor_backend="mp",
                kv_transfer_config=KVTransferConfig(
                    kv_connector="ExampleConnector", kv_role="kv_both",
                    kv_connector_extra_config={"shared_storage_path": store}))
            params = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False,
                                    ignore_eos=True, logprobs=0)
            prompt = TokensPrompt(prompt_token_ids=[(7 * i + 3) % 500 + 1 for i in range(98)])
            runs = [llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]]
        except Exception as e:
            return 2, f"ERROR: setting the TP=2 engine up or the first run failed: {why(e)}"
        try:
            out = llm.generate([prompt], params, use_tqdm=False)[0]
        except Exception as e:
            return 1, f"REPRODUCED: with TP=2, loading the stored prompt raised {why(e)}"
        runs.append(out.outputs[0])
        del llm
        gc.collect()  # shut the TP workers down before the verdict line
        if out.num_cached_tokens <= 0:
            return 2, "ERROR: the second run got no hit from ExampleConnector; nothing compared."
        lps = [[d[t].logprob for t, d in zip(r.token_ids, r.logprobs)] for r in runs]
        gap = max(abs(a - b) for a, b in zip(*lps))
        if gap > 1e-3 or runs[0].token_ids != runs[1].token_ids:
            return 1, (f"REPRODUCED: with TP=2, the run that loaded {out.num_cached_tokens} stored "
                       f"tokens disagrees with the run that computed them (log-prob gap {gap:.3g}).")
        return 0, (f"NOT REPRODUCED: with TP=2, loading {out.num_cached_tokens} stored tokens "
                   f"gave the log-probabilities computing them did (gap {gap:.3g}).")


if __name__ == "__main__":
    code, line = main()
    print(line, flush=True)
    os._exit(code)  # skip interpreter teardown so no log line follows the verdict
