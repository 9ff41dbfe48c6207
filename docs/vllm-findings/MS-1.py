"""MS-1: MooncakeStoreConnector's shutdown leaves its worker threads running.

The worker role starts a lookup server thread (LookupKeyServer, "process_request"), a
store thread (KVCacheStoreSendingThread) and load threads (KVCacheStoreRecvingThread-N),
each looping forever. Its shutdown (MooncakeStoreWorker.close) closes the store handle but
stops none of them and never closes the lookup server's socket. This script starts
mooncake_master (beside this Python) over TCP, runs one in-process engine (tiny Llama,
dummy weights, block size 32) with MooncakeStoreConnector, serves one request, shuts the
engine down and lists the threads still alive two seconds later.

Bug present: those threads are still alive; the last line is "REPRODUCED: ..." and the
exit code is 1. A second engine in the same process then finds the old lookup server.
Bug fixed: none of them is alive; the last line is "NOT REPRODUCED: ..." (exit 0).
A failure to set up prints "ERROR: ..." (exit 2).

Run: python docs/vllm-findings/MS-1.py   (in an environment with vLLM and
mooncake-transfer-engine-non-cuda)
"""
import json, os, socket, subprocess, sys, tempfile, threading, time

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
}
THREADS = ("process_request", "KVCacheStoreSendingThread", "KVCacheStoreRecvingThread")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(port, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.2)
    return False


def main(tmp):
    rpc, http = free_port(), free_port()
    master = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    server = subprocess.Popen(
        [master, f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
         "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if not wait_for(rpc) or not wait_for(http):
            return 2, "ERROR: mooncake_master did not start"
        with open(os.path.join(tmp, "mooncake.json"), "w") as f:
            json.dump({"metadata_server": f"http://127.0.0.1:{http}/metadata",
                       "master_server_address": f"127.0.0.1:{rpc}", "protocol": "tcp",
                       "device_name": "", "global_segment_size": "64MB",
                       "local_buffer_size": "64MB"}, f)
        os.environ["MOONCAKE_CONFIG_PATH"] = os.path.join(tmp, "mooncake.json")
        os.makedirs(os.path.join(tmp, "model"))
        with open(os.path.join(tmp, "model", "config.json"), "w") as f:
            json.dump(TINY_LLAMA, f)
        try:
            from vllm import LLM, SamplingParams
            from vllm.config import KVTransferConfig
            from vllm.inputs import TokensPrompt
            llm = LLM(
                model=os.path.join(tmp, "model"), load_format="dummy", skip_tokenizer_init=True,
                dtype="float32", enforce_eager=True, seed=0, max_model_len=256, max_num_seqs=4,
                max_num_batched_tokens=256, block_size=32, kv_cache_memory_bytes=64 << 20,
                kv_transfer_config=KVTransferConfig(kv_connector="MooncakeStoreConnector",
                                                    kv_role="kv_both"))
            sp = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False, ignore_eos=True)
            llm.generate([TokensPrompt(prompt_token_ids=list(range(1, 81)))], sp, use_tqdm=False)
            before = [t.name for t in threading.enumerate() if any(n in t.name for n in THREADS)]
            llm.llm_engine.engine_core.shutdown()  # the engine's own shutdown path
        except Exception as e:
            return 2, f"ERROR: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        time.sleep(2.0)
        alive = [t.name for t in threading.enumerate() if any(n in t.name for n in THREADS)]
        if alive:
            return 1, (f"REPRODUCED: after the engine shut down, {len(alive)} connector threads "
                       f"are still running: {', '.join(sorted(alive))}")
        return 0, (f"NOT REPRODUCED: the {len(before)} connector threads "
                   f"({', '.join(sorted(before))}) ended with the engine")
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        code, line = main(tmp)
    print(line, flush=True)
    os._exit(code)  # skip interpreter teardown so no log line follows the verdict
