"""Issue 36, inputs 1-5: numbers a peer or a client sends as text (ranks as JSON keys in
NIXL metadata and in ``kv_transfer_params``, spec versions in peer info, counts in
notifications) are parsed as ASCII digits of bounded length: ``'²'`` (a digit to
``str.isdigit``, not to ``int``) and a 5,000-digit number end in a typed error naming the
clause, never a bare ValueError. No NIXL needed."""

from __future__ import annotations

import json

import pytest

from kvspec.backends.nixl import PARAMS_KIND, NixlMetadata, NixlScheduler
from kvspec.backends.nixl._descriptors import PeerInfo
from kvspec.backends.nixl._worker import _parse_notification
from kvspec.protocols import (
    EngineConfigView,
    MalformedMetadataError,
    RequestView,
    TransferRole,
)

BAD = ["²", "9" * 5000, "-1", "01x", ""]


def _meta(rank: str) -> bytes:
    return json.dumps({"kind": "kvspec.nixl", "version": 4, "loads": [], "sends": {}, "snaps": {},
                       "peers": {"prefill": {rank: {"agent_name": "a"}}}}).encode()


@pytest.mark.parametrize("rank", BAD)
def test_metadata_peer_ranks_are_parsed(rank: str) -> None:
    with pytest.raises(MalformedMetadataError) as err:
        NixlMetadata.decode(_meta(rank))
    assert err.value.clause == "ERR-005" and "[ERR-005]" in str(err.value)
    assert NixlMetadata.decode(_meta("3")).peers == {"prefill": {3: {"agent_name": "a"}}}


@pytest.mark.parametrize("rank", BAD)
def test_handoff_peer_ranks_are_parsed(rank: str) -> None:
    sched = NixlScheduler(EngineConfigView(engine_id="decode", role=TransferRole.CONSUMER,
                                           num_layers=2, block_size=4, num_blocks=16))
    request = RequestView("d", tuple(range(1, 10)), kv_transfer_params={
        "kind": PARAMS_KIND, "engine_id": "prefill", "request_id": "p", "blocks": [3, 4],
        "peers": {rank: {}}, "secret": "0f" * 16})
    with pytest.raises(MalformedMetadataError) as err:
        sched.get_num_new_matched_tokens(request, 0)
    assert err.value.clause == "SCH-018" and "[SCH-018]" in str(err.value)
    assert "peers rank" in str(err.value)


def _info() -> dict[str, object]:
    return {
        "kind": "kvspec.nixl/1", "spec_version": "1.0", "agent_name": "a",
        "agent_metadata": "00", "mem_type": "DRAM", "device_id": 0, "base_address": 4096,
        "nbytes": 4096,
        "layout": {"order": "LBHNC", "packing": "fused", "dtype": "float16", "block_size": 4,
                   "num_layers": 1, "storage_layers": 1, "num_heads": 1,
                   "head_size_k": 1, "head_size_v": 1, "strides": [0, 0, 0, 0, 0]},
        "geometry": {"num_blocks": 1, "block_stride": 16, "region_offsets": [0],
                     "region_nbytes": 16},
    }


@pytest.mark.parametrize("major", BAD)
def test_peer_info_spec_versions_are_parsed(major: str) -> None:
    info = _info()
    PeerInfo.from_json(info)  # the sample is valid
    info["spec_version"] = f"{major}.0"
    with pytest.raises(MalformedMetadataError) as err:
        PeerInfo.from_json(info)
    assert err.value.clause == "HSK-005" and "[HSK-005]" in str(err.value)


@pytest.mark.parametrize("count", ["²", "9" * 5000, "0", "65537", "1 "])
def test_notification_counts_are_parsed(count: str) -> None:
    secret = "0f" * 16
    assert _parse_notification(f"{secret}|2|r".encode()) == ("r", secret, 2)
    assert _parse_notification(f"{secret}|{count}|r".encode()) is None
