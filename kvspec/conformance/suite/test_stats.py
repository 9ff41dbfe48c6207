"""Conformance: the values ranks report for the executor to reduce, statistics and worker
metadata, combine associatively and without mutating their operands.

The connector serves scenarios that store, load and fail; every non-None value its worker
returned from ``get_kv_connector_stats`` and ``build_connector_worker_meta`` is kept, and
``aggregate`` is checked on ordered triples of them: ``(a+b)+c == a+(b+c)`` (the executor
may group ranks differently, EVT-006, EVT-007) with neither operand changed.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest

from ...protocols import ConnectorFactory
from ..harness import Engine, Workload
from ..harness.scenarios import SCENARIOS
from ._base import ConformanceSuite
from ._harness_runs import config_for
from .._attribution import hide_unless_harness_bug

__all__ = ["TestStats"]
__tracebackhide__ = hide_unless_harness_bug  # authors see their frames, not these

_SAMPLES = 6
"""At most this many values of each kind are combined (120 ordered triples)."""


def _collect(factory: ConnectorFactory, tmp: Path) -> dict[str, list[Any]]:
    """Serve scenarios that store, load and fail; the non-None stats and worker metadata
    the worker returned, in order."""
    seen: dict[str, list[Any]] = {"stats": [], "worker metadata": []}
    requests = []
    for n, name in enumerate(("full-prompt-hit", "shared-prefix", "aborts")):
        requests += [attrs.evolve(r, request_id=f"{name}-{r.request_id}",
                                  arrival_step=r.arrival_step + 40 * n,
                                  abort_at_step=None if r.abort_at_step is None
                                  else r.abort_at_step + 40 * n)
                     for r in SCENARIOS[name].requests]
    cfg = config_for(factory.capabilities, prefix_caching=False)
    with Engine(factory, cfg, tmpdir=str(tmp)) as engine:
        worker = engine.workers.runtime.connector  # type: ignore[attr-defined]
        for kind, hook in (("stats", "get_kv_connector_stats"),
                           ("worker metadata", "build_connector_worker_meta")):
            original = getattr(worker, hook)

            def recording(*args: Any, _orig: Any = original, _kind: str = kind) -> Any:
                value = _orig(*args)
                if value is not None:
                    seen[_kind].append(value)
                return value

            setattr(worker, hook, recording)
        engine.run(Workload(requests, name="stats-samples"))
    return seen


def _same(a: Any, b: Any) -> bool:
    """Equal values; numbers (and counters) equal up to float rounding."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if type(a) is not type(b):
        return False
    counters = getattr(a, "counters", None)
    if isinstance(counters, Mapping):
        return _same(counters, getattr(b, "counters", None))
    if getattr(type(a), "__eq__", None) is not getattr(object, "__eq__", None):
        return bool(a == b)
    if hasattr(a, "__dict__"):
        return _same(vars(a), vars(b))
    return a is b


def _shown(value: Any) -> str:
    return repr(value)[:160]


class TestStats(ConformanceSuite):
    """Statistics and worker metadata reduce associatively, mutating nothing."""

    @pytest.mark.kvspec_clause("EVT-006", "EVT-007")
    def test_stats_and_worker_metadata_reduce_associatively(self, tmp_path: Path) -> None:
        """On ordered triples of the values a run produced, ``aggregate`` groups either
        way to the same value and leaves its operands unchanged."""
        seen = _collect(self.factory, tmp_path)
        if not any(seen.values()):
            pytest.skip("the worker returned neither stats nor worker metadata")
        for kind, clause in (("stats", "EVT-006"), ("worker metadata", "EVT-007")):
            values = seen[kind][:_SAMPLES]
            if not values:
                continue
            while len(values) < 3:
                values.append(values[-1])
            for a, b, c in itertools.permutations(values, 3):
                try:
                    before = [copy.deepcopy(v) for v in (a, b, c)]
                except Exception:  # not copyable: mutation is not checked
                    before = []
                left = a.aggregate(b).aggregate(c)
                right = a.aggregate(b.aggregate(c))
                self.check(
                    _same(left, right), clause,
                    observed=f"{kind} of type {type(a).__qualname__}: (a+b)+c is "
                    f"{_shown(left)} but a+(b+c) is {_shown(right)}, for a={_shown(a)}, "
                    f"b={_shown(b)}, c={_shown(c)}",
                    expected="an associative aggregate (sums, maxima, unions; not means)",
                )
                for old, now in zip(before, (a, b, c)):
                    self.check(
                        _same(old, now), clause,
                        observed=f"aggregate changed an operand: {_shown(old)} became "
                        f"{_shown(now)}",
                        expected="aggregate returns a new value and mutates neither operand",
                    )
