"""The NIXL backend on a hybrid model (issue 33, KVG-001..KVG-008): a prefill engine hands
every KV-cache group to a decode engine. The hand-off names each group's blocks (the null
block where the producer's window let a position go), the decode engine reads each group's
layers at its ids and never the null block, and a match reaches only as far as every
needed block was handed off. The harness checks every group's loaded bytes."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("nixl")

from kvspec.backends.nixl import NixlConnector, NixlLoad, NixlMetadata, NixlScheduler  # noqa: E402
from kvspec.conformance.harness import (  # noqa: E402
    HarnessConfig,
    RequestSpec,
    Workload,
    run_disaggregated,
)
from kvspec.protocols import (  # noqa: E402
    NULL_BLOCK_ID,
    EngineConfigView,
    GroupKind,
    InvalidArgumentError,
    KVCacheGroup,
    MalformedMetadataError,
    RequestStatus,
    RequestView,
    TransferRole,
)

PROMPT = tuple(range(500, 541))  # 10 full blocks of 4 tokens and one token


def _cfg(**overrides: Any) -> HarnessConfig:
    return HarnessConfig(**{"sliding_window": 8, "prefix_caching": False, **overrides})


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


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "chunk"), [(1, 1, 4), (1, 1, 16), (2, 1, 8)],
                         ids=["tp1-chunks-4", "tp1-chunks-16", "tp2-to-tp1"])
def test_a_prefill_engine_hands_both_groups_to_a_decode_engine(
        prefill_tp: int, decode_tp: int, chunk: int) -> None:
    """The decode engine loads all 40 handed-off tokens: the full group's 10 blocks and
    the window group's last two (what token 40 attends to); the window's earlier
    positions stay null on both sides and are never read (KVG-003, KVG-004, KVG-008)."""
    _Spy.loads = []
    wl = Workload([RequestSpec("r", PROMPT, max_new_tokens=3)], name="hybrid hand-off")
    _, decode = run_disaggregated(
        _Spy(), wl, prefill=_cfg(tp_size=prefill_tp, max_tokens_per_step=chunk),
        decode=_cfg(tp_size=decode_tp))
    assert decode.finished == ("r",) and decode.external_tokens["r"] == 40
    (load,) = [j for j in _Spy.loads if j.local_blocks]
    local_full, local_window = load.local_groups
    remote_full, remote_window = load.remote_groups
    assert local_full == load.local_blocks and remote_full == load.remote_blocks
    assert local_window[:8] == (NULL_BLOCK_ID,) * 8 and NULL_BLOCK_ID not in local_window[8:]
    assert NULL_BLOCK_ID not in remote_window[8:]


def _scheduler(role: TransferRole) -> NixlScheduler:
    groups = (KVCacheGroup(GroupKind.FULL, 4, ("l0",)),
              KVCacheGroup(GroupKind.SLIDING_WINDOW, 4, ("l1",), window=8))
    return NixlScheduler(EngineConfigView(engine_id="e", role=role, num_layers=2,
                                          block_size=4, num_blocks=64, kv_cache_groups=groups))


def _request(params: dict[str, Any], rid: str = "c") -> RequestView:
    return RequestView(request_id=rid, prompt_token_ids=PROMPT, num_computed_tokens=0,
                       status=RequestStatus.WAITING, kv_transfer_params=params)


def _handoff(window: list[int]) -> dict[str, Any]:
    full = list(range(10, 20))
    return {"kind": "kvspec.nixl.handoff", "engine_id": "p", "request_id": "r",
            "blocks": full, "groups": [full, window], "secret": "0" * 32,
            "peers": {"0": {}}}


def test_a_match_reaches_only_as_far_as_the_window_blocks_handed_off() -> None:
    """Blocks 8 and 9 handed off: all 40 tokens. Block 8 null (the producer's window had
    let it go): token 40 attends to it, so the match stops at token 32, whose next token
    needs blocks 6 and 7 (KVG-003). No window block at all: nothing."""
    consumer = _scheduler(TransferRole.CONSUMER)
    whole = [0] * 8 + [30, 31]
    assert consumer.get_num_new_matched_tokens(_request(_handoff(whole)), 0) == (40, True)
    lacks_8 = [0] * 5 + [25, 26, 27] + [0, 31]
    assert consumer.get_num_new_matched_tokens(_request(_handoff(lacks_8)), 0) == (32, True)
    assert consumer.get_num_new_matched_tokens(_request(_handoff([0] * 10)), 0) == (0, False)


def test_a_hand_off_of_another_number_of_groups_is_refused() -> None:
    consumer = _scheduler(TransferRole.CONSUMER)
    one_group = {k: v for k, v in _handoff([0] * 10).items() if k != "groups"}
    with pytest.raises(MalformedMetadataError, match="carries 1 KV-cache group"):
        consumer.get_num_new_matched_tokens(_request(one_group), 0)
    for bad in ([[1, 2]], [list(range(10, 20)), [5] * 10], [list(range(10, 20)), [1]]):
        with pytest.raises(MalformedMetadataError, match="SCH-018"):
            consumer.get_num_new_matched_tokens(_request({**_handoff([0] * 10),
                                                          "groups": bad}), 0)


def test_group_columns_cross_the_wire_and_are_checked() -> None:
    load = NixlLoad("r", "p", (3, 4), (13, 14), "n", "0" * 32,
                    ((3, 4), (5, NULL_BLOCK_ID)), ((13, 14), (NULL_BLOCK_ID, 16)))
    meta = NixlMetadata(loads=(load,))
    assert NixlMetadata.decode(meta.encode()) == meta
    for local, remote in ((((3, 4),), ((13, 14),)), (((3, 4), (5, 5)), ((13, 14), (15, 16))),
                          (((3, 4), (5, 6)), ((13, 14),)), (((7, 8), (5, 6)), ((13, 14), (1, 2)))):
        with pytest.raises(InvalidArgumentError):
            NixlLoad("r", "p", (3, 4), (13, 14), "n", "0" * 32, local, remote)
