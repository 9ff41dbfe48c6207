"""The connector with a state-space hybrid (STG): a state group beside the attention layers.

The harness plays a hybrid model like vLLM's Mamba/Nemotron-H (``HarnessConfig.state_layers``):
a ``GroupKind.STATE`` group under RUNNING caching (vLLM's ``mamba_cache_mode="none"``, prefix
caching off), one state block per request updated in place every step, registered with
``register_state_caches``; new attention blocks are zeroed after ``handle_preemptions`` and
before binding, as vLLM's V1 runner does. Before every step's forward each worker reads every
running request's state and checks it is the state after exactly its computed tokens, so a
state from a lower boundary (STG-003), one read after a later forward updated it (STG-006), a
state never moved (STG-005) or a full-prompt match whose last token vLLM applies twice
(STG-004) is named by its clause.

Only connectors that declare a state group (``Capabilities.group_kinds`` holds
``GroupKind.STATE``, KVG-002) run these tests; an engine refuses the others. The default
profile runs a repeated prompt (computed in chunks ending on block boundaries, then again,
then its whole blocks alone) and the preemption scenario; ``--kvspec-profile=full`` runs
every scenario, asynchronous scheduling, TP 2 and prefill/decode disaggregation with the
state group.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ...protocols import GroupKind
from ..harness import Engine, RequestSpec, Workload, run_disaggregated
from ..harness.scenarios import SCENARIOS
from ._base import ConformanceSuite
from ._harness_runs import config_for, serve
from .._attribution import hide_unless_harness_bug

__all__ = ["TestStateGroups"]
__tracebackhide__ = hide_unless_harness_bug  # authors see their frames, not these

_STATE = {"state_layers": 2, "prefix_caching": False, "max_tokens_per_step": 8}
"""Two state layers (RUNNING caching needs the engine's prefix cache off), prefill chunks of
two blocks: every chunk ends on a block boundary, where a connector can store the state."""

_PROMPT = tuple(range(300, 330))
"""30 tokens: seven blocks of 4 and two tokens; boundaries at 8, 16 and 24 end a chunk."""

_CONFIG: dict[str, dict[str, int]] = {"preemption": {"num_blocks": 14}}

_REPEATED = (
    Workload([RequestSpec("first", _PROMPT, max_new_tokens=3)], name="state: computed"),
    Workload([RequestSpec("again", _PROMPT, max_new_tokens=3)], name="state: repeated"),
    Workload([RequestSpec("blocks", _PROMPT[:24], max_new_tokens=3)],
             name="state: its whole blocks alone"),
)
"""A prompt computed, then again (a hit loads attention and the state after exactly the
match), then its first six blocks alone: every block and the state after them are stored, so
a match may not cover the whole prompt (STG-004)."""


def _no_state(caps: object) -> bool:
    return GroupKind.STATE not in getattr(caps, "group_kinds", frozenset())


class TestStateGroups(ConformanceSuite):
    """State-space hybrids through the reference engine (STG clauses)."""

    def _skip_without_state(self) -> None:
        if _no_state(self.capabilities):
            pytest.skip("the connector declares no state group (Capabilities.group_kinds): "
                        "engines refuse it for state-space hybrids (KVG-002)")

    @pytest.mark.kvspec_clause("STG-002", "STG-003", "STG-004", "STG-005", "STG-006",
                               "KVG-002")
    def test_repeated_prompt(self, tmp_path: Path) -> None:
        """A prompt computed in chunks ending on block boundaries, then again: whatever the
        connector loads must give the state after exactly the matched tokens (a lower
        boundary's state is STG-003, a state read after a later forward STG-006, a state
        never moved STG-005); then its whole blocks alone, which no match may cover
        entirely (STG-004)."""
        self._skip_without_state()
        cfg = config_for(self.capabilities, **_STATE)
        with Engine(self.factory, cfg, tmpdir=str(tmp_path)) as engine:
            for workload in _REPEATED:
                result = engine.run(workload)
                assert {r.request_id for r in workload.requests} <= set(result.finished)

    @pytest.mark.kvspec_clause("STG-002", "STG-003", "STG-005", "STG-006", "WRK-012")
    @pytest.mark.parametrize("scenario", sorted(SCENARIOS))
    def test_state_scenario(self, scenario: str, kvspec_profile: str,
                            tmp_path: Path) -> None:
        """Each trap scenario with a state group (hits, chunked prefill, preemption, aborts,
        tenants): preemption in the default profile, every scenario in the full one."""
        self._skip_without_state()
        if scenario != "preemption" and kvspec_profile != "full":
            pytest.skip(f"{scenario} with a state group runs in the full profile "
                        "(--kvspec-profile=full)")
        serve(self.factory, SCENARIOS[scenario], tmp_path,
              **{**_STATE, **_CONFIG.get(scenario, {})})

    @pytest.mark.kvspec_clause("STG-002", "STG-003", "STG-004", "STG-006", "SCH-014")
    def test_state_async_scheduling(self, kvspec_profile: str, tmp_path: Path) -> None:
        """Asynchronous scheduling with a state group: the repeated prompt and every
        scenario. Full profile only."""
        self._skip_without_state()
        if kvspec_profile != "full":
            pytest.skip("asynchronous scheduling with a state group runs in the full "
                        "profile (--kvspec-profile=full)")
        cfg = config_for(self.capabilities, async_scheduling=True, **_STATE)
        with Engine(self.factory, cfg, tmpdir=str(tmp_path / "repeated")) as engine:
            for workload in _REPEATED:
                engine.run(workload)
        for name in sorted(SCENARIOS):
            serve(self.factory, SCENARIOS[name], tmp_path / name, async_scheduling=True,
                  **{**_STATE, **_CONFIG.get(name, {})})

    @pytest.mark.kvspec_clause("STG-002", "STG-003", "STG-006", "EXE-001")
    def test_state_tensor_parallel(self, kvspec_profile: str, tmp_path: Path) -> None:
        """TP 2 with a state group: each rank holds its shard of every state (its heads),
        checked on every rank; the repeated prompt (full profile only: it starts worker
        processes)."""
        self._skip_without_state()
        if kvspec_profile != "full":
            pytest.skip("TP 2 with a state group runs in the full profile "
                        "(--kvspec-profile=full)")
        cfg = config_for(self.capabilities, tp_size=2, **_STATE)
        with Engine(self.factory, cfg, tmpdir=str(tmp_path)) as engine:
            for workload in _REPEATED:
                engine.run(workload)

    @pytest.mark.kvspec_clause("STG-002", "STG-003", "SCH-018", "SCH-016")
    def test_state_disaggregated(self, kvspec_profile: str, tmp_path: Path) -> None:
        """A prefill engine hands requests to a decode engine, both with a state group: a
        connector that hands the state off must deliver the state after exactly the tokens
        the decode side matched (one that hands nothing off lets decode recompute). Full
        profile only."""
        self._skip_without_state()
        if kvspec_profile != "full":
            pytest.skip("prefill/decode with a state group runs in the full profile "
                        "(--kvspec-profile=full)")
        wl = Workload([RequestSpec(f"pd-{i}", tuple(range(7 * i, 7 * i + 13 + 4 * i)),
                                   max_new_tokens=3, arrival_step=i) for i in range(3)],
                      name="disaggregated, state group")
        cfg = config_for(self.capabilities, **_STATE)
        _, decode = run_disaggregated(self.factory, wl, prefill=cfg, decode=cfg,
                                      tmpdir=str(tmp_path))
        assert set(decode.finished) == {r.request_id for r in wl.requests}
