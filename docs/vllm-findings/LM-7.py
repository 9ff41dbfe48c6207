"""LM-7: LMCacheMPConnector declares vLLM's SupportsHMA, but on a platform without CUDA
lmcache's transfer path takes one KV-cache group only: an engine serving a hybrid model
(sliding-window layers beside full attention) does not start.

vLLM keeps its hybrid KV-cache allocator on for a connector that declares SupportsHMA, so
a hybrid model reaches the connector's register_kv_caches with two KV-cache groups. On
vLLM-CPU, lmcache 0.5.6 takes its engine-driven transfer path, whose register refuses more
than one transfer group with a ValueError; the worker dies and the engine never serves.
This script writes a tiny Llama whose layers alternate sliding-window (64 tokens) and full
attention (dummy weights), checks that an engine without a connector serves it, starts
`lmcache server` (beside this Python) and then an engine with LMCacheMPConnector.

Bug present: the engine with LMCacheMPConnector fails to start with lmcache's "does not
support multiple KV transfer groups" error; the last line is "REPRODUCED: ..." (exit 1).
Bug fixed: the engine starts and generates the reference tokens (or the connector refuses
the hybrid allocator at configuration time so vLLM turns it off); "NOT REPRODUCED: ..."
(exit 0). A failure to set up, or a run past the time limit, prints "ERROR: ..." (exit 2).

Run: python docs/vllm-findings/LM-7.py   (in an environment with vLLM and lmcache; shown
with vllm-cpu 0.32.0 and lmcache 0.5.6, about 110 s on 2 cores)
"""
import gc, json, os, signal, socket, subprocess, sys, tempfile, threading, time

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["LMCACHE_DISABLE_BANNER"] = "1"
LIMIT_S = 300  # the whole script; a hang ends here with ERROR

HYBRID_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
    "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64,
}
PROMPT = [(7 * i + 3) % 500 + 1 for i in range(161)]
MARK = "does not support multiple KV transfer groups"
SERVER = []  # the lmcache server, for the finally and the watchdog


def why(e):
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


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


def serve(model, connector_port, log_path):
    """Start an engine (its own process: vLLM's default layout) and generate once; the
    engine's log goes to log_path, so the worker's error can be read after a failed start."""
    code = f"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt
port = {connector_port!r}
kv = None if port is None else KVTransferConfig(
    kv_connector="LMCacheMPConnector", kv_role="kv_both",
    kv_connector_extra_config={{"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": port}})
llm = LLM(model={model!r}, load_format="dummy", skip_tokenizer_init=True, dtype="float32",
          enforce_eager=True, seed=0, max_model_len=2048, max_num_seqs=4,
          max_num_batched_tokens=256, block_size=32, kv_cache_memory_bytes=16 << 20,
          enable_prefix_caching=False, kv_transfer_config=kv)
out = llm.generate([TokensPrompt(prompt_token_ids={PROMPT!r})],
                   SamplingParams(max_tokens=8, temperature=0.0, detokenize=False,
                                  ignore_eos=True), use_tqdm=False)[0]
print("TOKENS " + json.dumps(list(out.outputs[0].token_ids)), flush=True)
"""
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                              timeout=LIMIT_S - 30, check=False)
    with open(log_path) as f:
        text = f.read()
    tokens = [json.loads(line[7:]) for line in text.splitlines() if line.startswith("TOKENS ")]
    return proc.returncode, (tokens[0] if tokens else None), text


def main(tmp):
    model = os.path.join(tmp, "model")
    os.makedirs(model)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(HYBRID_LLAMA, f)
    rc, ref, text = serve(model, None, os.path.join(tmp, "reference.log"))
    if ref is None:
        sys.stderr.write(text[-3000:])
        return 2, f"ERROR: the hybrid model does not serve without a connector (exit {rc})"
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
    rc, got, text = serve(model, port, os.path.join(tmp, "lmcache-engine.log"))
    if got is None and MARK in text:
        line = next(ln.strip() for ln in text.splitlines() if MARK in ln)
        return 1, (f"REPRODUCED: the hybrid model serves without a connector, but the engine "
                   f"with LMCacheMPConnector did not start (exit {rc}): {line[-160:]}")
    if got is None:
        sys.stderr.write(text[-3000:])
        return 2, f"ERROR: the engine with LMCacheMPConnector failed otherwise (exit {rc})"
    if got != ref:
        return 2, f"ERROR: the engine started but its tokens {got} differ from {ref}"
    return 0, "NOT REPRODUCED: the engine with LMCacheMPConnector served the hybrid model."


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
