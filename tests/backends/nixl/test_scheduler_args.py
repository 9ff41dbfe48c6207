"""The NIXL scheduler role refuses malformed arguments with typed errors (issue 14, defect 5:
wrong types gave AttributeError/TypeError and num_computed_tokens=-8 matched 16 tokens of
an 8-token hand-off). No NIXL needed: the scheduler role does not import it."""

from __future__ import annotations

from typing import Any

import pytest

from kvspec.backends.nixl import PARAMS_KIND, NixlScheduler
from kvspec.protocols import (
    AllocatedBlocks,
    EngineConfigView,
    InvalidArgumentError,
    InvalidBlockIdError,
    RequestView,
    TransferRole,
)

BS = 4


def _consumer() -> NixlScheduler:
    return NixlScheduler(EngineConfigView(engine_id="decode", role=TransferRole.CONSUMER,
                                          num_layers=2, block_size=BS, num_blocks=16))


def _handed_off(rid: str = "d") -> RequestView:
    return RequestView(rid, tuple(range(1, 10)), kv_transfer_params={
        "kind": PARAMS_KIND, "engine_id": "prefill", "request_id": "p", "blocks": [3, 4],
        "peers": {"0": {}}, "secret": "0f" * 16})


@pytest.mark.parametrize("call", [
    lambda s: s.get_num_new_matched_tokens("d", 0),
    lambda s: s.get_num_new_matched_tokens(_handed_off(), -8),
    lambda s: s.get_num_new_matched_tokens(_handed_off(), 1.5),
    lambda s: s.get_num_new_matched_tokens(_handed_off(), True),
    lambda s: s.get_num_new_matched_tokens(_handed_off(), 10),
    lambda s: s.update_state_after_alloc(None, AllocatedBlocks.single([1]), 8),
    lambda s: s.update_state_after_alloc(_handed_off(), [1, 2], 8),
    lambda s: s.update_state_after_alloc(_handed_off(), AllocatedBlocks.single([1]), -4),
    lambda s: s.request_finished("d", (1,)),
    lambda s: s.request_finished(_handed_off(), 5),
    lambda s: s.build_connector_meta(None),
    lambda s: s.update_connector_output({"finished_recving": ["d"]}),
], ids=["request-str", "computed-negative", "computed-float", "computed-bool",
        "computed-past-prompt", "alloc-request-none", "alloc-blocks-list",
        "alloc-external-negative", "finished-request-str", "finished-blocks-int",
        "meta-none", "output-dict"])
def test_malformed_arguments_fail_typed_and_change_nothing(call: Any) -> None:
    sched = _consumer()
    with pytest.raises((InvalidArgumentError, InvalidBlockIdError)):
        call(sched)
    # the same scheduler still works afterwards
    count, is_async = sched.get_num_new_matched_tokens(_handed_off(), 0)
    assert (count, is_async) == (8, True)


def test_peers_are_forwarded_again_when_a_producer_changes() -> None:
    """Issue 14, defect 3: the scheduler forwarded a producer's peers once per engine id
    forever; a restarted producer (same engine id, new peer information) is forwarded."""
    from kvspec.protocols import SchedulerOutputView

    sched = _consumer()

    def hand_off(rid: str, agent: str) -> dict[str, Any]:
        req = RequestView(rid, tuple(range(1, 10)), kv_transfer_params={
            "kind": PARAMS_KIND, "engine_id": "prefill", "request_id": rid, "blocks": [3, 4],
            "peers": {"0": {"agent_name": agent}}, "secret": "0f" * 16})
        n, _ = sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, AllocatedBlocks.single([1, 2, 3]), n or 0)
        meta = sched.build_connector_meta(SchedulerOutputView(step_id=0))
        return dict(meta.peers)  # type: ignore[attr-defined]

    assert list(hand_off("a", "agent-1")) == ["prefill"]
    assert hand_off("b", "agent-1") == {}  # unchanged: not sent again
    assert list(hand_off("c", "agent-2")) == ["prefill"]  # restarted: sent again
