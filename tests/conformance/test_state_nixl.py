"""The NIXL backend on a state-space hybrid (issue 50): a prefill engine hands each request's
attention blocks and its state after exactly the handed-off tokens to a decode engine. The
harness checks every attention block the decode engine reads and its state before every
step (the toy recurrent state, byte for byte); differing state layouts and TP sizes are
refused by name (STG-010, STG-011); planted bugs are each named by their clause."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

pytest.importorskip("nixl")

from kvspec.backends.nixl import NixlConnector, NixlLoad, NixlMetadata  # noqa: E402
from kvspec.conformance.harness import (  # noqa: E402
    HarnessConfig,
    RequestSpec,
    Workload,
    run_disaggregated,
)
from kvspec.protocols import EngineConfigView  # noqa: E402

PROMPT = tuple(range(300, 322))  # 22 tokens: steps of 8 end on the boundaries 8 and 16


def _cfg(**kw: Any) -> HarnessConfig:
    return HarnessConfig(**{"state_layers": 2, "prefix_caching": False,
                            "max_tokens_per_step": 8, **kw})


class _Spy(NixlConnector):
    """Records the loads the decode engine's scheduler plans."""

    loads: list[NixlLoad] = []

    def create_scheduler(self, config: EngineConfigView) -> Any:
        scheduler = super().create_scheduler(config)
        build = scheduler.build_connector_meta

        def spy(output: Any) -> Any:
            meta = build(output)
            assert isinstance(meta, NixlMetadata)
            _Spy.loads.extend(meta.loads)
            return meta

        scheduler.build_connector_meta = spy  # type: ignore[method-assign]
        return scheduler


@pytest.mark.kvspec_clause("STG-012", "STG-013", "STG-016")
@pytest.mark.parametrize("tp_size", [1, 2])
def test_the_state_is_handed_off_with_the_attention_blocks(tp_size: int, tmp_path: Path) -> None:
    """Every request is matched at exactly the last block boundary a prefill step ended on
    below its last prompt token, loads attention and state, and decodes on them: the
    harness checks each loaded block and the state at every step of the decode engine."""
    _Spy.loads = []
    wl = Workload([RequestSpec("a", PROMPT, max_new_tokens=3),
                   RequestSpec("b", tuple(range(40, 57)), max_new_tokens=2, arrival_step=4)],
                  name="state hand-off")
    prefill, decode = run_disaggregated(_Spy(), wl, prefill=_cfg(tp_size=tp_size),
                                        decode=_cfg(tp_size=tp_size), tmpdir=str(tmp_path))
    assert set(decode.finished) == {"a", "b"}
    assert decode.external_tokens == {"a": 16, "b": 16}
    loads = {j.request_id: j for j in _Spy.loads if j.local_blocks}
    assert set(loads) == {"a", "b"} and all(len(j.local_state) == 1 for j in loads.values())
