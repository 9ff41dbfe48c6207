"""The example connectors' file store (kvspec.conformance.connectors.storage) and the tiny
connector's metadata: settings through msgspec, typed errors on malformed input."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from kvspec.conformance.connectors.layerwise import LayerwiseSettings
from kvspec.conformance.connectors.storage import (
    BlockFileError,
    KVBlocks,
    StorageSettings,
    block_path,
    check_pairs,
    decode_metadata,
    mark_stored,
    marked_events,
    marker_path,
    read_block_file,
    stored_events,
    unmark,
    write_block_file,
)
from kvspec.conformance.connectors.tiny import TinyCache, TinyCacheMetadata
from kvspec.protocols import (
    EngineConfigView,
    InvalidArgumentError,
    InvalidBlockIdError,
    KVCacheLayout,
    KVPacking,
    MalformedMetadataError,
    RequestView,
    StrideOrder,
    TransferRole,
)


def config(tmp_path: Path, **extra: Any) -> EngineConfigView:
    return EngineConfigView(engine_id="e", role=TransferRole.BOTH, num_layers=2, block_size=4,
                            num_blocks=8, extra={"kvspec.tmpdir": str(tmp_path), **extra})


@pytest.mark.parametrize("extra", [
    {"io_timeout_s": 0}, {"io_timeout_s": -1.0}, {"io_timeout_s": math.inf},
    {"io_timeout_s": math.nan}, {"io_timeout_s": True}, {"io_timeout_s": "1"},
    {"load_delay_s": -0.5}, {"handoff_timeout_s": None}, {"kvspec.tmpdir": ""},
    {"kvspec.tmpdir": 3},
])
def test_settings_refuse_malformed_values(tmp_path: Path, extra: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        StorageSettings.from_config(config(tmp_path, **extra))
    assert e.value.clause in ("ERR-002", "SCH-018")  # SCH-018: the view refuses NaN, inf


def test_settings_read_their_fields(tmp_path: Path) -> None:
    s = StorageSettings.from_config(config(tmp_path, io_timeout_s=2, load_delay_s=0.5,
                                           storage_dir=str(tmp_path / "s"), other="ignored"))
    assert s == StorageSettings(str(tmp_path / "s"), 2.0, 0.5, 30.0)
    assert LayerwiseSettings.from_config(config(tmp_path)).max_blocks_per_step == 64
    for value in (0, True, 1.5, "2"):
        with pytest.raises(InvalidArgumentError):
            LayerwiseSettings.from_config(config(tmp_path, max_blocks_per_step=value))


def test_check_pairs() -> None:
    assert check_pairs(((1, "ab"), (2, "ab")), "x") == ((1, "ab"), (2, "ab"))
    with pytest.raises(InvalidBlockIdError):
        check_pairs(((True, "ab"),), "x")
    for bad in ([(1, "ab")], ((1, "ab"), (1, "cd")), ((1, "AB"),), ((1, "ab", 2),)):
        with pytest.raises(InvalidArgumentError):
            check_pairs(bad, "x")
    with pytest.raises(InvalidArgumentError):
        check_pairs((), "x", non_empty=True)
    with pytest.raises(InvalidArgumentError):
        check_pairs(((1, "ab"), (2, "ab")), "x", unique_keys=True)


class _Wire(msgspec.Struct, forbid_unknown_fields=True):
    n: int


@pytest.mark.parametrize("data", [b"", b"\xff", b'{"\x80": 1}', b'{"n": 1.0}',
                                  b'{"n": 1, "m": 2}', b"[" * 5000, "a str", b'{"n": -1}'])
def test_decode_metadata_fails_typed(data: Any) -> None:
    def build(w: _Wire) -> int:
        if w.n < 0:
            raise InvalidArgumentError("negative")
        return w.n

    with pytest.raises(MalformedMetadataError):
        decode_metadata(data, _Wire, "test metadata", build)
    assert decode_metadata(b'{"n": 3}', _Wire, "test metadata", build) == 3


def test_block_files_round_trip_and_refuse_other_blocks(tmp_path: Path) -> None:
    block = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    path = block_path(str(tmp_path), "ab", 1)
    write_block_file(path, "ab", 1, block)
    data = read_block_file(path, "ab", 1, torch.float32, (2, 3, 4))
    assert torch.equal(data.view(torch.float32).reshape(2, 3, 4), block)
    for key, rank, shape in (("cd", 1, (2, 3, 4)), ("ab", 0, (2, 3, 4)), ("ab", 1, (2, 12))):
        with pytest.raises(BlockFileError):
            read_block_file(path, key, rank, torch.float32, shape)


def test_markers_and_their_events(tmp_path: Path) -> None:
    request = RequestView(request_id="r", prompt_token_ids=tuple(range(12)),
                          block_hashes=(b"\x01", b"\x02", b"\x03"))
    keys = tuple(h.hex() for h in request.block_hashes)
    events = stored_events(request, keys, [0, 1, 2], 4)
    assert [list(e.block_hashes) for e in events] == [[b"\x01", b"\x02", b"\x03"]]
    for key in ("01", "03"):
        Path(block_path(str(tmp_path), key, 0)).write_bytes(b"x")
    marked = mark_stored(str(tmp_path), keys, world_size=1)  # "02" has no file: unmarked
    assert marked == {"01", "03"}
    assert Path(marker_path(str(tmp_path), "01")).exists()
    split = marked_events(events, marked)
    assert [(list(e.block_hashes), e.parent_block_hash) for e in split] == [
        ([b"\x01"], None), ([b"\x03"], b"\x02")]
    assert unmark(str(tmp_path), ["01", "02"]) == ["01"]


def test_kv_blocks_snapshot_and_copy_in() -> None:
    layout = KVCacheLayout.contiguous(StrideOrder.LBHNC, KVPacking.SPLIT, torch.float32, 2, 8,
                                      4, 2, 4)
    view = layout.view(torch.randn(layout.span_elems))
    kv = KVBlocks({"a": view[0], "b": view[1]}, layout)
    snap = kv.snapshot((3, 5))
    assert snap.shape == (2, *kv.shape) and kv.num_blocks == 8
    kv.copy_in(1, snap[0])
    assert torch.equal(kv.snapshot((1,))[0], snap[0])
    with pytest.raises(InvalidBlockIdError):
        kv.check_budget(((8, "ab"),), "loads")


def test_tiny_metadata_round_trips_and_fails_typed() -> None:
    meta = TinyCacheMetadata(loads=((1, "ab"),), saves=((2, "cd"),))
    assert TinyCacheMetadata.decode(meta.encode()) == meta
    for data in (b"", b'{"kind": "other"}', b'{"kind": "tinycache", "loads": [[-1, "ab"]]}',
                 b'{"kind": "tinycache", "loads": [[1, "../x"]]}',
                 b'{"kind": "tinycache", "x": 1}'):
        with pytest.raises(MalformedMetadataError):
            TinyCacheMetadata.decode(data)
    assert TinyCache().name == "tinycache"
