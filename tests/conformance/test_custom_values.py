"""Custom stats and worker metadata cross the harness's worker processes by their own codec
and are aggregated across ranks (issue 15: with TP > 1 they were dropped on the way back, so
a connector whose stats did not reduce correctly passed); a custom value without a codec is
reported as EVT-009."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest

from kvspec.conformance.connectors.shared_storage import (
    SharedStorageConnector,
    SharedStorageWorker,
)
from kvspec.conformance.harness import Engine, HarnessConfig, RequestSpec, Workload
from kvspec.protocols import ContractViolation, SupportsAggregate

_SEEN: list[Any] = []


@attrs.frozen
class RankSteps:
    """Per-rank step counts, reduced by union of the ranks' entries."""

    steps: tuple[tuple[int, int], ...]

    def aggregate(self, other: RankSteps) -> RankSteps:
        return RankSteps(tuple(sorted({*self.steps, *other.steps})))

    def encode(self) -> bytes:
        return json.dumps([list(s) for s in self.steps]).encode()

    @classmethod
    def decode(cls, data: bytes) -> RankSteps:
        return cls(tuple((int(r), int(n)) for r, n in json.loads(data)))


class _CountingWorker(SharedStorageWorker):
    steps = 0

    def get_kv_connector_stats(self) -> SupportsAggregate | None:
        self.steps += 1
        return RankSteps(((self._rank, self.steps),))


class CodecConnector(SharedStorageConnector):
    worker_class = _CountingWorker


@attrs.frozen
class _NoCodec:
    n: int

    def aggregate(self, other: _NoCodec) -> _NoCodec:
        return _NoCodec(self.n + other.n)


class _NoCodecWorker(SharedStorageWorker):
    def get_kv_connector_stats(self) -> SupportsAggregate | None:
        return _NoCodec(1)


class NoCodecConnector(SharedStorageConnector):
    worker_class = _NoCodecWorker


def _serve(factory: Any, tmp: Path) -> list[Any]:
    seen: list[Any] = []
    cfg = HarnessConfig(tp_size=2, prefix_caching=False)
    with Engine(factory(), cfg, tmpdir=str(tmp),
                factory_spec=f"{__name__}:{factory.__name__}") as engine:
        update = engine.scheduler.update_connector_output

        def recording(output: Any) -> None:
            if output.stats is not None:
                seen.append(output.stats)
            update(output)

        engine.scheduler.update_connector_output = recording  # type: ignore[method-assign]
        engine.run(Workload([RequestSpec("r", tuple(range(13)), max_new_tokens=2)], name="w"))
    return seen


def test_custom_stats_cross_worker_processes_and_are_aggregated(tmp_path: Path) -> None:
    seen = _serve(CodecConnector, tmp_path)
    assert seen and all(isinstance(s, RankSteps) for s in seen)
    assert {rank for s in seen for rank, _ in s.steps} == {0, 1}  # both ranks, aggregated


def test_custom_stats_without_a_codec_are_reported(tmp_path: Path) -> None:
    with pytest.raises(ContractViolation, match="EVT-009"):
        _serve(NoCodecConnector, tmp_path)
