"""The connector under graphs: dummy runs, PIECEWISE and FULL replay, lazy capture.

On CPU the harness captures with the graph emulator of ``kvspec.conformance.graphs``,
which records instead of running and replays without Python, as CUDA graphs do.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ...protocols import CapabilityError, GraphMode, HookGraphMode
from ..harness import Engine, Workload
from ..harness.scenarios import SCENARIOS
from ._base import ConformanceSuite
from ._harness_runs import config_for, serve
from .._attribution import hide_unless_harness_bug

__all__ = ["TestGraphModes"]
__tracebackhide__ = hide_unless_harness_bug  # authors see their frames, not these

_MODES = [GraphMode.NONE, GraphMode.PIECEWISE, GraphMode.FULL]
_WORKLOAD = Workload(
    [*SCENARIOS["full-prompt-hit"].requests, *SCENARIOS["shared-prefix"].requests[:2]],
    name="graphs",
)


class TestGraphModes(ConformanceSuite):
    """Dummy runs and graph capture and replay (DRY and GRA clauses)."""

    @pytest.mark.kvspec_clause("DRY-001", "DRY-002", "DRY-004", "DRY-005", "DRY-006", "DRY-007",
                               "DRY-008", "DRY-009", "GRA-003", "GRA-007", "GRA-009", "GRA-010")
    @pytest.mark.parametrize("mode", [GraphMode.PIECEWISE, GraphMode.FULL], ids=lambda m: m.value)
    def test_capture_at_startup_then_serve(self, mode: GraphMode, tmp_path: Path) -> None:
        """Profile, warm-up and capture runs, then real steps replayed at captured sizes."""
        serve(self.factory, _WORKLOAD, tmp_path, graph_mode=mode, prefix_caching=False)

    @pytest.mark.kvspec_clause("GRA-006", "GRA-004")
    def test_replay_is_equivalent_to_eager(self, tmp_path: Path) -> None:
        """The same workload eager, PIECEWISE and FULL: every block is byte-checked in each
        run, and a connector with synchronous loads loads the same tokens in all three
        (GRA-006). With asynchronous loads, how much is loaded depends on when transfers
        finish, so only the byte checks apply."""
        loaded = {}
        for mode in _MODES:
            result = serve(self.factory, _WORKLOAD, tmp_path / mode.value, graph_mode=mode,
                           prefix_caching=False)
            loaded[mode.value] = dict(result.external_tokens)
        if self.capabilities.async_loads:
            return
        self.check(
            loaded["piecewise"] == loaded["none"] and loaded["full"] == loaded["none"], "GRA-006",
            observed=f"tokens loaded per request: {loaded}",
            expected="the same loads eagerly and under PIECEWISE and FULL replay",
        )

    @pytest.mark.kvspec_clause("GRA-008", "GRA-009", "DRY-005", "SCH-014")
    @pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
    def test_lazy_capture_mid_serving(self, async_scheduling: bool, tmp_path: Path) -> None:
        """Sizes captured the first time they are needed, with other transfers in flight."""
        for name in ("aborts", "full-prompt-hit", "chunked"):
            serve(self.factory, SCENARIOS[name], tmp_path / name, graph_mode=GraphMode.FULL,
                  lazy_capture=True, async_scheduling=async_scheduling, prefix_caching=False,
                  max_tokens_per_step=8 if name == "chunked" else 32)

    @pytest.mark.kvspec_clause("GRA-002")
    @pytest.mark.kvspec_requires("eager_hooks")
    def test_eager_hooks_are_never_captured(self, tmp_path: Path) -> None:
        """FULL is downgraded to PIECEWISE for eager hooks, or refused when strict."""
        cfg = config_for(self.capabilities, graph_mode=GraphMode.FULL, strict_graphs=True)
        with pytest.raises(CapabilityError):
            Engine(self.factory, cfg, tmpdir=str(tmp_path))
        serve(self.factory, SCENARIOS["single"], tmp_path / "downgraded", graph_mode=GraphMode.FULL)

    @pytest.mark.kvspec_clause("GRA-004", "GRA-005", "GRA-006", "DRY-005", "DRY-006")
    @pytest.mark.kvspec_requires("capturable_hooks")
    def test_capturable_hooks_under_full_graphs(self, tmp_path: Path) -> None:
        """Per-layer hooks captured with the connector's dummy metadata and replayed."""
        assert self.capabilities.layer_hooks is HookGraphMode.CAPTURABLE
        for name in ("full-prompt-hit", "tenants", "preemption"):
            serve(self.factory, SCENARIOS[name], tmp_path / name, graph_mode=GraphMode.FULL,
                  prefix_caching=False, num_blocks=13 if name == "preemption" else 48)
