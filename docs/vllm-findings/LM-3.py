"""LM-3: LMCacheMPConnector shares stored KV across LoRA adapters.

LMCacheMPConnector keys lookups and stores by the prompt's token ids and cache_salt only;
the LoRA identity is dropped (lmcache's vLLM adapter passes lora_id=None), although vLLM's
own prefix cache puts the adapter's name into its block hashes. So a LoRA request loads the
KV the base model computed for the same tokens. This script builds a tiny Llama with random
weights and a LoRA adapter on its k_proj and v_proj (so K and V differ), then:
  1. on an engine without a connector, sends a 98-token prompt with the adapter (the
     reference) and without it;
  2. starts `lmcache server` (beside this Python) and an engine with LMCacheMPConnector
     (vLLM's prefix cache off, so every cached token is LMCache's), sends the prompt
     without the adapter (LMCache stores 96 tokens of base-model KV), then with it.
Both engines run in vLLM's default multi-process layout (an in-process vLLM-CPU engine
crashes at worker start once LMCache has imported numba).

Bug present: the LoRA request reports 96 cached tokens and its greedy tokens or their
log-probabilities differ from the reference; the last line is "REPRODUCED: ..." and the
exit code is 1.
Bug fixed: the LoRA request gets no cached tokens (while the base prompt, sent again, still
hits) and matches the reference; the last line is "NOT REPRODUCED: ..." (exit 0).
A failure to set up, or a run past the time limit, prints "ERROR: ..." (exit 2).

Run: python docs/vllm-findings/LM-3.py   (in an environment with vLLM and lmcache; shown
with vllm-cpu 0.32.0 and lmcache 0.5.6, about 70 s on 2 cores)
"""
import gc, json, os, signal, socket, subprocess, sys, tempfile, threading, time

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["LMCACHE_DISABLE_BANNER"] = "1"
LIMIT_S = 300  # the whole script (about 70 s on 2 cores); a hang ends here with ERROR

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
}
PROMPT = [(7 * i + 3) % 500 + 1 for i in range(98)]
SERVER = []  # the lmcache server, for the finally and the watchdog


def why(e):
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def gap(a, b):  # largest log-probability difference of two runs' greedy tokens
    return max(abs(x - y) for x, y in zip(a[1], b[1]))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(port, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and SERVER[0].poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.5)
    return False


def stop_server():
    for server in SERVER:  # its own session: end the server and whatever it started
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def write_model_and_adapter(model, adapter):
    import torch
    from safetensors.torch import save_file
    g, h, m, v, r = torch.Generator().manual_seed(0), 128, 256, 512, 8
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    for p in ("model.layers.0.", "model.layers.1."):
        shapes.update({p + f"self_attn.{x}_proj.weight": (h, h) for x in "qkvo"})
        shapes.update({p + "mlp.gate_proj.weight": (m, h), p + "mlp.up_proj.weight": (m, h),
                       p + "mlp.down_proj.weight": (h, m), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    weights = {k: torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) / s[1] ** 0.5
               for k, s in shapes.items()}
    save_file(weights, os.path.join(model, "model.safetensors"))
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)
    lora = {}  # PEFT names; B is non-zero, so the adapter changes K and V
    for layer in (0, 1):
        for proj in ("k_proj", "v_proj"):
            p = f"base_model.model.model.layers.{layer}.self_attn.{proj}."
            lora[p + "lora_A.weight"] = torch.randn(r, h, generator=g) / h ** 0.5
            lora[p + "lora_B.weight"] = torch.randn(h, r, generator=g) / r ** 0.5
    save_file(lora, os.path.join(adapter, "adapter_model.safetensors"))
    with open(os.path.join(adapter, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "base_model_name_or_path": model, "r": r,
                   "lora_alpha": r, "target_modules": ["k_proj", "v_proj"], "bias": "none",
                   "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}, f)


def engine(model, connector_port=None):
    from vllm import LLM
    from vllm.config import KVTransferConfig
    kv = None if connector_port is None else KVTransferConfig(
        kv_connector="LMCacheMPConnector", kv_role="kv_both",
        kv_connector_extra_config={"lmcache.mp.host": "tcp://localhost",
                                   "lmcache.mp.port": connector_port})
    return LLM(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
               seed=0, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256,
               block_size=32, kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False,
               enable_lora=True, max_loras=1, max_lora_rank=8, kv_transfer_config=kv)


def run(llm, lora=None):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, ignore_eos=True,
                            logprobs=0)
    out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False,
                       lora_request=lora)[0]
    o = out.outputs[0]
    return list(o.token_ids), [d[t].logprob for t, d in zip(o.token_ids, o.logprobs)], \
        out.num_cached_tokens or 0


def shut(llm):
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def main(tmp):
    model, adapter = os.path.join(tmp, "model"), os.path.join(tmp, "adapter")
    os.makedirs(model), os.makedirs(adapter)
    try:
        write_model_and_adapter(model, adapter)
        from vllm.lora.request import LoRARequest
        lora = LoRARequest("adapter", 1, adapter)
        llm = engine(model)  # 1. the reference: no connector
        ref_base, ref_lora = run(llm), run(llm, lora)
        shut(llm)
    except Exception as e:
        return 2, f"ERROR: the engine without a connector failed: {why(e)}"
    if ref_base[0] == ref_lora[0] and gap(ref_base, ref_lora) < 1e-3:
        return 2, "ERROR: the LoRA adapter does not change the output; nothing to compare."
    port = free_port()
    log = open(os.path.join(tmp, "lmcache.log"), "w")
    SERVER.append(subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "lmcache"), "server",
         "--supported-transfer-mode", "auto", "--l1-size-gb", "1", "--eviction-policy", "LRU",
         "--chunk-size", "32", "--port", str(port), "--http-port", str(free_port()),
         "--prometheus-port", str(free_port())],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    if not wait_for(port, 180):
        log.close()
        with open(log.name) as f:
            sys.stderr.write(f.read()[-3000:])
        return 2, f"ERROR: lmcache server did not listen on port {port} (its log is above)"
    try:  # 2. LMCache: the base model stores, then the LoRA request looks the prompt up
        llm = engine(model, port)
        base = run(llm)
        time.sleep(2.0)  # let the store land in LMCache before the next lookup
        got = run(llm, lora)
        again = run(llm) if got[2] == 0 else None  # control: does the base prompt still hit?
        shut(llm)
    except Exception as e:
        return 2, f"ERROR: the engine with LMCacheMPConnector failed: {why(e)}"
    if base[0] != ref_base[0] or gap(base, ref_base) > 1e-3:
        return 2, "ERROR: the two engines disagree on the base model's output; nothing compared."
    d = gap(got, ref_lora)
    wrong = got[0] != ref_lora[0] or d > 1e-3
    if got[2] > 0:
        how = (f"differs from the LoRA reference without a connector (tokens {got[0]} vs "
               f"{ref_lora[0]}," if wrong else "happened to match the reference (")
        return 1, (f"REPRODUCED: the LoRA request loaded {got[2]} cached tokens that the base "
                   f"model stored for the same prompt; its output {how} log-prob gap {d:.3g}).")
    if again is None or again[2] == 0:
        return 2, (f"ERROR: no request hit LMCache (base run {base[2]} cached tokens, base again "
                   f"{again and again[2]}); nothing shown.")
    if wrong:
        return 2, (f"ERROR: the LoRA request had no hit yet its output differs from the "
                   f"reference (log-prob gap {d:.3g}).")
    return 0, (f"NOT REPRODUCED: the LoRA request got no cached tokens (the base prompt, sent "
               f"again, hit {again[2]}) and matched the reference (log-prob gap {d:.3g}).")


def watchdog():
    print(f"ERROR: the script ran past its {LIMIT_S} s limit (lmcache or vLLM hung)", flush=True)
    stop_server()
    try:
        import psutil
        for child in psutil.Process().children(recursive=True):
            child.kill()
    finally:
        os._exit(2)


if __name__ == "__main__":
    timer = threading.Timer(LIMIT_S, watchdog)
    timer.daemon = True
    timer.start()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            code, line = main(tmp)
        except Exception as e:  # e.g. no lmcache executable beside this Python
            code, line = 2, f"ERROR: {why(e)}"
        finally:
            stop_server()
    print(line, flush=True)
    os._exit(code)  # skip interpreter teardown so no log line follows the verdict
