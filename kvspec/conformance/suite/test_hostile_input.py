"""Conformance: what a connector decodes from peers and clients, fed hostile input.

The connector serves a short workload that stores and loads; its real metadata encodings and
``kv_transfer_params`` are then mutated the way a broken or malicious peer or client would
(``._hostile``): truncated, flipped, random, oversized numbers, deep nesting, a pickle
payload. Every input must end in a value or a typed kvspec error, and nothing may be
unpickled.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest

from ...protocols import (
    ConnectorFactory,
    KVSpecError,
    MalformedMetadataError,
    RequestView,
    TransferRole,
)
from ..harness import Engine, RequestSpec, Workload, run_disaggregated
from ..harness.scenarios import SCENARIOS
from . import _hostile
from ._base import ConformanceSuite
from ._harness_runs import config_for
from .._attribution import hide_unless_harness_bug

__all__ = ["TestHostileInput"]
__tracebackhide__ = hide_unless_harness_bug  # authors see their frames, not these

_SLOW_S = 2.0
"""A decode slower than this on a few hundred bytes is reported (a hang in the making)."""


def _metadata_samples(factory: ConnectorFactory, tmp: Path) -> list[Any]:
    """Serve the shared-prefix and full-prompt-hit scenarios; return the non-empty metadata
    the scheduler built (one empty one if all were)."""
    metas: list[Any] = []
    workload = Workload(
        [*SCENARIOS["full-prompt-hit"].requests,
         *(attrs.evolve(r, request_id=f"s-{r.request_id}", arrival_step=r.arrival_step + 30)
           for r in SCENARIOS["shared-prefix"].requests)],
        name="hostile-input-samples",
    )
    cfg = config_for(factory.capabilities, prefix_caching=False)
    with Engine(factory, cfg, tmpdir=str(tmp)) as engine:
        build = engine.scheduler.build_connector_meta

        def recording(out: Any) -> Any:
            meta = build(out)
            metas.append(meta)
            return meta

        engine.scheduler.build_connector_meta = recording  # type: ignore[method-assign,assignment]
        engine.run(workload)
    return [m for m in metas if not getattr(m, "is_empty", False)] or metas[:1]


def _params_samples(factory: ConnectorFactory, tmp: Path) -> list[Mapping[str, Any]]:
    """The ``kv_transfer_params`` a prefill engine hands to a decode engine."""
    workload = Workload([RequestSpec(f"p-{i}", tuple(range(9 * i, 9 * i + 13)),
                                     max_new_tokens=2, arrival_step=i) for i in range(2)],
                        name="hostile-input-params")
    cfg = config_for(factory.capabilities, prefix_caching=False)
    prefill, _ = run_disaggregated(factory, workload, prefill=cfg, decode=cfg, tmpdir=str(tmp))
    return [p for p in prefill.transfer_params.values() if p]


def _name(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"


class TestHostileInput(ConformanceSuite):
    """Decoders of peer and client input end every input in a value or a typed error."""

    @pytest.mark.kvspec_clause("ERR-005", "ERR-006")
    def test_metadata_decoder_rejects_hostile_bytes(self, tmp_path: Path) -> None:
        """Mutations of the connector's own metadata encodings, random bytes, huge numbers,
        deep nesting and a pickle payload: ``decode`` returns metadata or raises
        MalformedMetadataError (ERR-005), and never unpickles (ERR-006)."""
        metas = _metadata_samples(self.factory, tmp_path)
        if not metas:
            pytest.skip("the scheduler built no metadata")
        meta_type = type(metas[0])
        encodings = [m.encode() for m in metas]
        for what, data in _hostile.hostile_bytes(encodings):
            _hostile.reset()
            start = time.monotonic()
            error: BaseException | None = None
            try:
                value = meta_type.decode(data)
            except MalformedMetadataError:
                value = None
            except (KVSpecError, Exception, RecursionError) as e:  # judged below
                value, error = None, e
            elapsed = time.monotonic() - start
            shown = f"{meta_type.__qualname__}.decode({what}, {len(data)} bytes)"
            self.check(
                not _hostile.tripped(), "ERR-006",
                observed=f"{shown} unpickled the bytes: a pickle payload ran code in the "
                "decoding process",
                expected="metadata decoded from a plain-data format (JSON, msgspec, struct), "
                "never by unpickling",
            )
            self.check(
                error is None, "ERR-005",
                observed=f"{shown} raised {_name(error) if error else ''}",
                expected="the decoded metadata, or MalformedMetadataError for bytes that are "
                "not a valid encoding",
            )
            self.check(
                value is None or isinstance(value, meta_type), "ERR-005",
                observed=f"{shown} returned a {type(value).__name__}",
                expected=f"a {meta_type.__qualname__} or MalformedMetadataError",
            )
            self.check(
                elapsed < _SLOW_S, "ERR-005",
                observed=f"{shown} took {elapsed:.1f} s",
                expected=f"a verdict on malformed bytes within {_SLOW_S:.0f} s",
            )

    @pytest.mark.kvspec_clause("ERR-002")
    def test_client_transfer_params_fail_typed(self, tmp_path: Path) -> None:
        """``kv_transfer_params`` come from clients: the connector's own params with each key
        dropped or given a value of another type or range, and unrelated params, reach
        ``on_new_request`` and ``get_num_new_matched_tokens`` of a consumer. Each ends in an answer or a typed
        kvspec error (ERR-002), never in ValueError, KeyError or TypeError."""
        (tmp_path / "pd").mkdir()
        params = _params_samples(self.factory, tmp_path / "pd")
        config = self.engine_config(tmp_path / "consumer", role=TransferRole.CONSUMER,
                                    block_size=4, num_blocks=48)
        scheduler = self.factory.create_scheduler(config)
        try:
            for i, (what, hostile) in enumerate(_hostile.hostile_params(params)):
                try:
                    request = RequestView(f"hostile-{i}", tuple(range(1, 30)),
                                          kv_transfer_params=hostile)
                except KVSpecError:
                    continue  # refused by kvspec before it reaches the connector
                try:
                    scheduler.on_new_request(request)
                    scheduler.get_num_new_matched_tokens(request, 0)
                except KVSpecError:
                    continue  # a typed refusal is what ERR-002 asks for
                except Exception as e:
                    raise self.violation(
                        "ERR-002",
                        observed=f"get_num_new_matched_tokens with {what} raised {_name(e)}",
                        expected="an answer, or a typed kvspec error saying what is wrong "
                        "with the client's kv_transfer_params",
                    ) from e
        finally:
            scheduler.shutdown()
