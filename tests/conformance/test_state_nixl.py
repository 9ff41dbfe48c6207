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

from broken_nixl import BROKEN_NIXL_STATE  # noqa: E402

from kvspec.backends.nixl import NixlConnector, NixlLoad, NixlMetadata, NixlWorker  # noqa: E402
from kvspec.conformance.harness import (  # noqa: E402
    HarnessConfig,
    RequestSpec,
    Workload,
    run_disaggregated,
)
from kvspec.protocols import (  # noqa: E402
    CompatibilityError,
    ContractViolation,
    ConvLayout,
    EngineConfigView,
    StateLayout,
    TransferRole,
)

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


@pytest.mark.kvspec_clause("STG-013", "STG-016")
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


class _DSWorker(NixlWorker):
    """A decode engine whose process runs the other conv-state layout (vLLM:
    ``VLLM_SSM_CONV_STATE_LAYOUT=DS``): the conv component's dims are swapped, the bytes
    the same."""

    def register_state_caches(self, state_caches: Any, layouts: Any) -> None:
        def ds(lay: StateLayout) -> StateLayout:
            parts = tuple(attrs.evolve(c, shape=c.shape[::-1]) if c.name == "conv" else c
                          for c in lay.components)
            return attrs.evolve(lay, components=parts, conv_layout=ConvLayout.DS)

        super().register_state_caches(state_caches, {g: ds(v) for g, v in layouts.items()})


class _Pair(NixlConnector):
    """The SD producer's factory for the prefill engine, the DS one for the decode engine."""

    def create_worker(self, config: EngineConfigView, rank: int) -> Any:
        if config.role is TransferRole.CONSUMER:
            return _DSWorker(config, rank)
        return super().create_worker(config, rank)


@pytest.mark.kvspec_clause("STG-010")
def test_a_peer_with_another_conv_layout_is_refused(tmp_path: Path) -> None:
    """SD and DS have the same byte count: only the layouts in the handshake tell them
    apart. The decode engine refuses the producer before it reads a byte."""
    wl = Workload([RequestSpec("a", PROMPT, max_new_tokens=2)], name="conv layouts")
    with pytest.raises(CompatibilityError) as info:
        run_disaggregated(_Pair(), wl, prefill=_cfg(), decode=_cfg(), tmpdir=str(tmp_path))
    assert info.value.clause == "STG-010" and "conv_layout" in info.value.message


@pytest.mark.kvspec_clause("STG-011")
def test_different_tp_sizes_with_state_are_refused(tmp_path: Path) -> None:
    """Prefill at TP 2, decode at TP 1: attention could be read by heads, but the state
    is sharded by rank and no component split is known: refused, never copied."""
    wl = Workload([RequestSpec("a", PROMPT, max_new_tokens=2)], name="state TP sizes")
    with pytest.raises(CompatibilityError) as info:
        run_disaggregated(NixlConnector(), wl, prefill=_cfg(tp_size=2), decode=_cfg(),
                          tmpdir=str(tmp_path))
    assert info.value.clause == "STG-011"


@pytest.mark.kvspec_clause("STG-014")
@pytest.mark.parametrize(("factory", "clause"), BROKEN_NIXL_STATE,
                         ids=[f.__name__ for f, _ in BROKEN_NIXL_STATE])
def test_a_broken_state_hand_off_is_named_by_its_clause(factory: type[NixlConnector], clause: str,
                                                        tmp_path: Path) -> None:
    """Each planted bug is caught by the decode engine's state check, with its clause
    alone."""
    wl = Workload([RequestSpec("a", PROMPT, max_new_tokens=3)], name="broken state hand-off")
    with pytest.raises(ContractViolation) as info:
        run_disaggregated(factory(), wl, prefill=_cfg(), decode=_cfg(), tmpdir=str(tmp_path))
    assert info.value.clause == clause, info.value
