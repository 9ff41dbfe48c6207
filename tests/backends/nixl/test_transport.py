"""Tests of the NIXL transport layer (kvspec.backends.nixl): byte-exact READs at both
descriptor granularities, handshake compatibility, faults (removed, stalled and killed
peers, timeouts), notifications and leak-free close. Host memory over NIXL's UCX backend."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch

pytest.importorskip("nixl")

from kvspec.backends.nixl import (  # noqa: E402
    BlockGeometry,
    EndpointClosedError,
    NixlEndpoint,
    NixlError,
    PeerInfo,
    TransferState,
    load_nixl,
)
from kvspec.protocols import (  # noqa: E402
    CompatibilityError,
    HandshakeMetadata,
    InvalidArgumentError,
    InvalidBlockIdError,
    KVCacheLayout,
    KVPacking,
    LayoutMismatchError,
    MalformedMetadataError,
    StrideOrder,
)

from kvspec.spec import SPEC_VERSION  # noqa: E402

pytestmark = pytest.mark.nixl


def _endpoint(name: str, buffer: torch.Tensor, layout: KVCacheLayout,
              **kw: object) -> NixlEndpoint:
    return NixlEndpoint(name, buffer, layout, spec_version=SPEC_VERSION,
                        **kw)  # type: ignore[arg-type]

_names = iter(range(1 << 30))


def _name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_names)}"


def _layout(order: str = "NHD", *, packing: KVPacking = KVPacking.CONCAT,
            dtype: torch.dtype = torch.float16, num_blocks: int = 16, block_size: int = 8,
            num_heads: int = 2, head: int = 32, **kw: object) -> KVCacheLayout:
    return KVCacheLayout.contiguous(order, packing, dtype, 3, num_blocks, block_size,
                                    num_heads, head, **kw)  # type: ignore[arg-type]


def _random_buffer(layout: KVCacheLayout, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (layout.span_bytes,), dtype=torch.uint8, generator=gen)


def _block_bytes(layout: KVCacheLayout, buffer: torch.Tensor, block: int) -> bytes:
    return b"".join(
        buffer[o:o + n].numpy().tobytes() for o, n in layout.block_regions([block])[0]
    )


def _wait_notifications(endpoint: NixlEndpoint, count: int, timeout: float = 5.0
                        ) -> dict[str, list[bytes]]:
    got: dict[str, list[bytes]] = {}
    deadline = time.monotonic() + timeout
    while sum(map(len, got.values())) < count and time.monotonic() < deadline:
        for k, v in endpoint.notifications().items():
            got.setdefault(k, []).extend(v)
        time.sleep(0.002)
    return got


@attrs.define
class Pair:
    producer: NixlEndpoint
    consumer: NixlEndpoint
    src: torch.Tensor
    dst: torch.Tensor
    layout: KVCacheLayout
    peer: str


def _pair(layout: KVCacheLayout, consumer_layout: KVCacheLayout | None = None) -> Pair:
    consumer_layout = consumer_layout or layout
    src = _random_buffer(layout, 1)
    dst = torch.zeros(consumer_layout.span_bytes, dtype=torch.uint8)
    producer = _endpoint(_name("prefill"), src, layout)
    consumer = _endpoint(_name("decode"), dst, consumer_layout)
    return Pair(producer, consumer, src, dst, layout, producer.name)


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = _pair(_layout())
    p.consumer.add_peer(PeerInfo.decode(p.producer.info.encode()))
    yield p
    p.consumer.close()
    p.producer.close()


# ---------------------------------------------------------------------- byte-exact reads

_LAYOUTS = {
    "BLNHC": dict(order="BLNHC"),
    "BHLNC": dict(order="BHLNC"),
    "NHD": dict(order="NHD"),
    "HND": dict(order="HND"),
    "LHBNC": dict(order="LHBNC"),
    "NHD-split": dict(order="NHD", packing=KVPacking.SPLIT),
    "BLNHC-padded": dict(order="BLNHC", page_padding_elems=8),
    "NHD-overallocated": dict(order="NHD", block_capacity=24),
}


@pytest.mark.parametrize("case", sorted(_LAYOUTS))
def test_read_is_byte_exact_at_the_layout_granularity(case: str) -> None:
    layout = _layout(**_LAYOUTS[case])  # type: ignore[arg-type]
    p = _pair(layout)
    try:
        p.consumer.add_peer(p.producer.info)
        expected = 1 if layout.order.block_outermost and case != "BLNHC-padded" else None
        per_block = p.consumer.descriptors_per_block(p.peer)
        assert per_block == layout.regions_per_block
        if expected is not None:
            assert per_block == 1  # LAY-013: one descriptor per block
        else:
            assert per_block > 1
        rng = random.Random(case)
        local = rng.sample(range(layout.num_blocks), 7)
        remote = rng.sample(range(layout.num_blocks), 7)
        t = p.consumer.start_read(p.peer, local, remote, timeout=10, notification=b"r")
        assert p.consumer.wait(t) is TransferState.DONE, t.reason
        assert t.nbytes == 7 * layout.regions_per_block * layout.region_nbytes
        for lb, rb in zip(local, remote):
            assert _block_bytes(layout, p.dst, lb) == _block_bytes(layout, p.src, rb)
        untouched = set(range(layout.num_blocks)) - set(local)
        for lb in untouched:
            assert not any(_block_bytes(layout, p.dst, lb))
        assert p.consumer.resources().transfers == 0
    finally:
        p.consumer.close()
        p.producer.close()


def test_consecutive_blocks_and_many_reads(pair: Pair) -> None:
    transfers = [
        pair.consumer.start_read(pair.peer, [2 * i, 2 * i + 1], [i, i + 1], timeout=10)
        for i in range(8)
    ]
    for t in transfers:
        assert pair.consumer.wait(t) is TransferState.DONE, t.reason
    for t in transfers:
        for lb, rb in zip(t.local_blocks, t.remote_blocks):
            assert _block_bytes(pair.layout, pair.dst, lb) == _block_bytes(pair.layout, pair.src, rb)
    assert pair.consumer.poll_all() == []


def test_nixl_merges_runs_of_consecutive_blocks() -> None:
    layout = _layout("NHD", num_blocks=32)
    src = _random_buffer(layout, 5)
    dst = torch.zeros(layout.span_bytes, dtype=torch.uint8)
    with _endpoint(_name("p"), src, layout) as producer, _endpoint(
        _name("c"), dst, layout, capture_telemetry=True
    ) as consumer:
        consumer.add_peer(producer.info)
        run = consumer.start_read(producer.name, list(range(10)), list(range(20, 30)),
                                  timeout=10)
        assert consumer.wait(run) is TransferState.DONE
        assert run.num_descriptors == 10 * layout.regions_per_block
        assert run.posted_descriptors == layout.regions_per_block  # one per layer
        scattered = consumer.start_read(producer.name, list(range(10)),
                                        list(range(29, 19, -1)), timeout=10)
        assert consumer.wait(scattered) is TransferState.DONE
        assert scattered.posted_descriptors == scattered.num_descriptors
        for lb, rb in zip(range(10), range(29, 19, -1)):
            assert _block_bytes(layout, dst, lb) == _block_bytes(layout, src, rb)


def test_descriptor_rows_follow_the_layout() -> None:
    layout = _layout("HND")
    geometry = BlockGeometry.from_layout(layout)
    rows = geometry.descriptor_rows(1000, 0, geometry.check_runs(None))
    assert rows.shape == (layout.num_blocks * layout.regions_per_block, 3)
    regions = layout.block_regions(range(layout.num_blocks))
    want = [(1000 + regions[b][r][0], regions[b][r][1], 0)
            for r in range(layout.regions_per_block) for b in range(layout.num_blocks)]
    assert [tuple(r) for r in rows.tolist()] == want
    one = BlockGeometry.from_layout(_layout("BLNHC"))
    assert one.regions_per_block == 1
    assert one.region_nbytes == _layout("BLNHC").block_stride_bytes


# ---------------------------------------------------------------------- heterogeneous TP

def test_sliced_descriptors_read_part_of_each_producer_page() -> None:
    # The producer holds 4 heads per page (HND: heads outermost in a page); a consumer rank
    # with 2 heads reads heads 2..3 of each producer page into its whole pages.
    producer_layout = _layout("HND", num_heads=4)
    consumer_layout = _layout("HND", num_heads=2)
    p = _pair(producer_layout, consumer_layout)
    try:
        with pytest.raises(CompatibilityError, match="num_heads"):
            p.consumer.add_peer(p.producer.info)
        half = producer_layout.region_nbytes // 2
        regions = p.producer.geometry.region_offsets
        with pytest.raises(CompatibilityError, match="block descriptors differ"):
            p.consumer.add_peer(p.producer.info,
                                remote_runs=tuple((o, half // 2) for o in regions))
        assert p.consumer.resources().peers == 0
        p.consumer.add_peer(p.producer.info, remote_runs=tuple((o + half, half) for o in regions))
        t = p.consumer.start_read(p.peer, [0, 3], [5, 1], timeout=10)
        assert p.consumer.wait(t) is TransferState.DONE, t.reason
        for lb, rb in zip([0, 3], [5, 1]):
            for (lo, ln), (ro, _) in zip(consumer_layout.block_regions([lb])[0],
                                         producer_layout.block_regions([rb])[0]):
                assert torch.equal(p.dst[lo:lo + ln], p.src[ro + half:ro + half + ln])
    finally:
        p.consumer.close()
        p.producer.close()


def test_bad_runs_are_rejected(pair: Pair) -> None:
    geometry = pair.consumer.geometry
    size, second = geometry.region_nbytes, geometry.region_offsets[1]
    for bad in [(), ((0, 0),), ((0, size + 1),), ((8, 8), (0, 16)), ((0, 8, 1),), "x",
                ((-1, 8),), ((second - 8, 16),), ((size, 8),), ((0, 8),) * 2]:
        with pytest.raises(InvalidArgumentError):
            geometry.check_runs(bad)  # type: ignore[arg-type]
    # Out of order is fine (pair order is the caller's); every byte inside a region.
    assert geometry.check_runs(((second, 8), (0, size))) == ((second, 8), (0, size))


# ---------------------------------------------------------------------- handshake

@pytest.mark.parametrize("field,value", [
    ("dtype", "bfloat16"), ("block_size", 16), ("order", "HND"), ("packing", "SPLIT"),
    ("num_layers", 4), ("head_size_k", 64),
])
def test_layout_mismatch_fails_the_handshake(pair: Pair, field: str, value: object) -> None:
    consumer = _endpoint(_name("decode"), torch.zeros(pair.layout.span_bytes, dtype=torch.uint8),
                            pair.layout)
    try:
        info = pair.producer.info
        bad = attrs.evolve(info, layout=attrs.evolve(info.layout, **{field: value}))
        with pytest.raises(CompatibilityError) as excinfo:
            consumer.add_peer(bad)
        assert excinfo.value.clause == "HSK-003"
        assert field in str(excinfo.value)
        assert consumer.resources().peers == 0
    finally:
        consumer.close()


def test_spec_major_version_mismatch_fails_the_handshake(pair: Pair) -> None:
    consumer = _endpoint(_name("decode"), torch.zeros(pair.layout.span_bytes, dtype=torch.uint8),
                            pair.layout)
    try:
        with pytest.raises(CompatibilityError, match="spec major version") as excinfo:
            consumer.add_peer(attrs.evolve(pair.producer.info, spec_version="99.0"))
        assert excinfo.value.clause == "HSK-003"
        consumer.add_peer(attrs.evolve(
            pair.producer.info, spec_version=pair.producer.info.spec_version.split(".")[0] + ".9"))
    finally:
        consumer.close()


def test_peer_info_is_plain_json_and_round_trips(pair: Pair) -> None:
    data = pair.producer.info.encode()
    obj = json.loads(data)
    assert obj["agent_name"] == pair.producer.name
    assert PeerInfo.decode(data) == pair.producer.info
    assert PeerInfo.from_json(obj) == pair.producer.info
    # It travels as the payload of the engine's handshake metadata (HSK-001, HSK-002).
    meta = HandshakeMetadata(engine_id="prefill", rank=0, spec_version=obj["spec_version"],
                             layout=obj["layout"], payload=obj)
    decoded = HandshakeMetadata.decode(meta.encode())
    assert PeerInfo.from_json(decoded.payload) == pair.producer.info
    assert PeerInfo.from_json(meta.payload) == pair.producer.info


@pytest.mark.parametrize("mutate", [
    lambda o: o.pop("geometry"),
    lambda o: o.update(extra=1),
    lambda o: o.update(kind="other"),
    lambda o: o.update(agent_metadata="zz"),
    lambda o: o.update(mem_type="HBM"),
    lambda o: o.update(nbytes=16),
    lambda o: o.update(base_address=-1),
    lambda o: o.update(spec_version="x"),
    lambda o: o["geometry"].update(region_offsets=[5, 0]),
    lambda o: o["geometry"].update(num_blocks=True),
    lambda o: o["layout"].update(block_size="8"),
    lambda o: o["layout"].pop("dtype"),
])
def test_malformed_peer_info_is_rejected(pair: Pair, mutate: object) -> None:
    obj = json.loads(pair.producer.info.encode())
    mutate(obj)  # type: ignore[operator]
    with pytest.raises(MalformedMetadataError) as excinfo:
        PeerInfo.decode(json.dumps(obj).encode())
    assert excinfo.value.clause == "HSK-005"


def test_bad_peer_bytes_are_rejected() -> None:
    for data in (b"\xff", b"[1]", b"{", "text"):
        with pytest.raises(MalformedMetadataError):
            PeerInfo.decode(data)  # type: ignore[arg-type]


def test_bad_agent_metadata_and_bad_regions_fail_add_peer_without_leaks(pair: Pair) -> None:
    consumer = _endpoint(_name("decode"), torch.zeros(pair.layout.span_bytes, dtype=torch.uint8),
                            pair.layout)
    try:
        info = pair.producer.info
        with pytest.raises(MalformedMetadataError, match="NIXL rejected"):
            consumer.add_peer(attrs.evolve(info, agent_metadata=b"not nixl metadata"))
        with pytest.raises(MalformedMetadataError, match="agent"):
            consumer.add_peer(attrs.evolve(info, agent_name="someone-else"))
        # The described region is not what the peer registered: NIXL refuses to prepare it.
        with pytest.raises(NixlError, match="could not prepare"):
            consumer.add_peer(attrs.evolve(info, base_address=info.base_address + (1 << 40)))
        assert consumer.resources().peers == 0
        assert consumer.resources().remote_dlists == 0
        consumer.add_peer(info)  # and a good handshake still works afterwards
        with pytest.raises(InvalidArgumentError, match="already added"):
            consumer.add_peer(info)
        with pytest.raises(InvalidArgumentError, match="this agent"):
            consumer.add_peer(consumer.info)
    finally:
        consumer.close()


# ---------------------------------------------------------------------- input checks

def test_bad_read_arguments_raise_typed_errors(pair: Pair) -> None:
    c, peer = pair.consumer, pair.peer
    with pytest.raises(InvalidArgumentError, match="unknown peer"):
        c.start_read("nobody", [0], [0], timeout=1)
    with pytest.raises(InvalidArgumentError, match="one to one"):
        c.start_read(peer, [0, 1], [0], timeout=1)
    with pytest.raises(InvalidBlockIdError):
        c.start_read(peer, [0, 0], [1, 2], timeout=1)
    with pytest.raises(InvalidBlockIdError):
        c.start_read(peer, [16], [0], timeout=1)
    with pytest.raises(InvalidBlockIdError):
        c.start_read(peer, [0], [-1], timeout=1)
    with pytest.raises(InvalidBlockIdError):
        c.start_read(peer, ["0"], [1], timeout=1)  # type: ignore[list-item]
    with pytest.raises(InvalidBlockIdError):
        c.start_read(peer, np.zeros((1, 1), dtype=np.int64), [1], timeout=1)
    for bad in ([True], [1.0], [1 << 64], (2, 1 << 70)):  # the fast path refuses them too
        with pytest.raises(InvalidBlockIdError):
            c.start_read(peer, bad, [1] * len(bad), timeout=1)  # type: ignore[arg-type]
    for timeout in (-1, float("inf"), float("nan"), None, True):
        with pytest.raises(InvalidArgumentError, match="timeout"):
            c.start_read(peer, [0], [1], timeout=timeout)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="notification"):
        c.start_read(peer, [0], [1], timeout=1, notification="text")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        c.poll("transfer")  # type: ignore[arg-type]
    other = pair.producer.start_read  # a transfer of another endpoint is refused by poll
    del other
    with pytest.raises(InvalidArgumentError):
        c.send_notification(peer, b"")
    assert c.resources().transfers == 0


def test_constructor_checks_its_arguments() -> None:
    layout = _layout()
    buf = torch.zeros(layout.span_bytes, dtype=torch.uint8)
    with pytest.raises(InvalidArgumentError):
        _endpoint("", buf, layout)
    with pytest.raises(InvalidArgumentError):
        _endpoint("x", buf.numpy(), layout)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        _endpoint("x", buf, "NHD")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="spec_version"):
        NixlEndpoint("x", buf, layout, spec_version="v1")
    with pytest.raises(LayoutMismatchError):
        _endpoint("x", torch.zeros(layout.span_bytes - 1, dtype=torch.uint8), layout)
    with pytest.raises(LayoutMismatchError):
        _endpoint("x", buf[1:], layout)
    with pytest.raises(NixlError, match="not available"):
        _endpoint(_name("x"), buf, layout, backends=("NO_SUCH_BACKEND",))
    # a strided view of a larger buffer is fine: the layout, not the view, says where
    # blocks are
    view = layout.view(torch.zeros(layout.span_elems, dtype=layout.dtype))
    _endpoint(_name("x"), view, layout).close()
    assert StrideOrder.parse("NHD") is layout.order


# ---------------------------------------------------------------------- notifications

def test_notifications_reach_the_producer_once_the_read_completed(pair: Pair) -> None:
    t1 = pair.consumer.start_read(pair.peer, [0], [1], timeout=10, notification=b"req-1")
    t2 = pair.consumer.start_read(pair.peer, [1, 2], [2, 3], timeout=10, notification=b"req-2")
    assert pair.consumer.wait(t1) is TransferState.DONE
    assert pair.consumer.wait(t2) is TransferState.DONE
    got = _wait_notifications(pair.producer, 2)
    assert sorted(got[pair.consumer.name]) == [b"req-1", b"req-2"]
    # An empty read completes at once and still tells the producer.
    t3 = pair.consumer.start_read(pair.peer, [], [], timeout=10, notification=b"req-3")
    assert t3.state is TransferState.DONE
    assert pair.consumer.send_notification(pair.peer, b"req-4")
    got = _wait_notifications(pair.producer, 2)
    assert sorted(got[pair.consumer.name]) == [b"req-3", b"req-4"]
    assert pair.consumer.notifications() == {}


def test_a_reader_without_a_progress_thread_completes_by_polling(pair: Pair) -> None:
    layout = pair.layout
    with _endpoint(_name("c"), torch.zeros(layout.span_bytes, dtype=torch.uint8), layout,
                      progress_thread=False) as reader:
        reader.add_peer(pair.producer.info)
        t = reader.start_read(pair.peer, [4, 5], [6, 7], timeout=10, notification=b"np")
        assert reader.wait(t) is TransferState.DONE, t.reason
        assert _block_bytes(layout, reader._buffer, 4) == _block_bytes(layout, pair.src, 6)
        assert _wait_notifications(pair.producer, 1) == {reader.name: [b"np"]}


# ---------------------------------------------------------------------- faults

@attrs.define
class StalledPeer:
    """A raw NIXL agent without a progress thread: READs it serves never complete."""

    agent: object
    reg: object
    buffer: torch.Tensor
    info: PeerInfo

    def close(self) -> None:
        self.agent.deregister_memory(self.reg)  # type: ignore[attr-defined]


def _stalled_peer(like: NixlEndpoint) -> StalledPeer:
    api = load_nixl()
    name = _name("stalled")
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False,
                                                       backends=["UCX"]))
    buffer = _random_buffer(like.layout, 7)
    rows = np.array([[buffer.data_ptr(), buffer.numel(), 0]], dtype=np.uint64)
    reg = agent.register_memory(rows, "DRAM")
    info = attrs.evolve(like.info, agent_name=name, agent_metadata=agent.get_agent_metadata(),
                        base_address=buffer.data_ptr())
    return StalledPeer(agent, reg, buffer, info)


def test_a_stalled_transfer_fails_at_its_deadline() -> None:
    layout = _layout()
    consumer = _endpoint(_name("decode"), torch.zeros(layout.span_bytes, dtype=torch.uint8),
                            layout)
    stalled = _stalled_peer(consumer)
    try:
        peer = consumer.add_peer(stalled.info)
        start = time.monotonic()
        t = consumer.start_read(peer, [0, 1], [2, 3], timeout=0.3, notification=b"r")
        assert consumer.poll(t) is TransferState.IN_PROGRESS
        assert consumer.resources().transfers == 1
        assert consumer.wait(t) is TransferState.FAILED
        elapsed = time.monotonic() - start
        assert t.timed_out and "deadline" in (t.reason or "")
        assert 0.25 <= elapsed < 2.0
        assert consumer.resources().transfers == 0
        assert consumer.resources().unreleased == 0
        assert consumer.poll(t) is TransferState.FAILED  # stays failed
    finally:
        consumer.close()
        stalled.close()
    assert consumer.resources().total == 0


def test_an_injected_clock_drives_the_deadline() -> None:
    layout = _layout()
    now = [100.0]
    consumer = _endpoint(_name("decode"), torch.zeros(layout.span_bytes, dtype=torch.uint8),
                            layout, clock=lambda: now[0])
    stalled = _stalled_peer(consumer)
    try:
        peer = consumer.add_peer(stalled.info)
        t = consumer.start_read(peer, [0], [0], timeout=5)
        assert consumer.poll(t) is TransferState.IN_PROGRESS
        now[0] += 4.9
        assert consumer.poll(t) is TransferState.IN_PROGRESS
        now[0] += 0.2
        assert consumer.poll_all() == [t]
        assert t.state is TransferState.FAILED and t.timed_out
    finally:
        consumer.close()
        stalled.close()


def test_removing_a_peer_fails_its_transfers_in_flight() -> None:
    layout = _layout()
    consumer = _endpoint(_name("decode"), torch.zeros(layout.span_bytes, dtype=torch.uint8),
                            layout)
    stalled = _stalled_peer(consumer)
    try:
        peer = consumer.add_peer(stalled.info)
        t = consumer.start_read(peer, [0, 1], [0, 1], timeout=30)
        assert consumer.poll(t) is TransferState.IN_PROGRESS
        consumer.remove_peer(peer)
        consumer.remove_peer(peer)  # idempotent
        assert t.state is TransferState.FAILED and not t.timed_out
        assert "removed" in (t.reason or "")
        assert consumer.resources().total == 2  # the registration and the local list
        with pytest.raises(InvalidArgumentError, match="unknown peer"):
            consumer.start_read(peer, [0], [0], timeout=1)
        # The peer can come back (a fresh handshake) and reads work again.
        consumer.add_peer(stalled.info)
    finally:
        consumer.close()
        stalled.close()


def test_close_cancels_transfers_and_releases_everything() -> None:
    layout = _layout()
    consumer = _endpoint(_name("decode"), torch.zeros(layout.span_bytes, dtype=torch.uint8),
                            layout)
    stalled = _stalled_peer(consumer)
    peer = consumer.add_peer(stalled.info, local_runs=((0, 64), (64, 64)),
                             remote_runs=((0, 64), (64, 64)))
    t = consumer.start_read(peer, [3], [4], timeout=30)
    res = consumer.resources()
    assert (res.registrations, res.local_dlists, res.remote_dlists, res.peers,
            res.transfers) == (1, 2, 1, 1, 1)
    consumer.close()
    assert t.state is TransferState.FAILED and "closed" in (t.reason or "")
    assert consumer.resources().total == 0
    consumer.close()  # idempotent
    assert consumer.closed
    with pytest.raises(EndpointClosedError):
        consumer.start_read(peer, [0], [0], timeout=1)
    with pytest.raises(EndpointClosedError):
        consumer.add_peer(stalled.info)
    with pytest.raises(EndpointClosedError):
        consumer.notifications()
    stalled.close()


def test_context_manager_closes(pair: Pair) -> None:
    layout = pair.layout
    with _endpoint(_name("x"), torch.zeros(layout.span_bytes, dtype=torch.uint8),
                      layout) as endpoint:
        endpoint.add_peer(pair.producer.info)
        t = endpoint.start_read(pair.peer, [0], [0], timeout=10)
        assert endpoint.wait(t) is TransferState.DONE
    assert endpoint.resources().total == 0


_PRODUCER = Path(__file__).with_name("_producer.py")


def _spawn_producer(num_blocks: int, seed: int) -> tuple[subprocess.Popen[bytes], PeerInfo]:
    rfd, wfd = os.pipe()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path.cwd()), *sys.path]))
    proc = subprocess.Popen(
        [sys.executable, str(_PRODUCER), str(wfd), str(num_blocks), str(seed)],
        pass_fds=(wfd,), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, env=env,
    )
    os.close(wfd)
    with os.fdopen(rfd, "rb") as reader:
        line = reader.readline()
    if not line:
        proc.kill()
        proc.wait()
        pytest.fail("the producer process died before its handshake")
    return proc, PeerInfo.decode(line.strip())


def test_a_producer_process_killed_mid_transfer_fails_the_read() -> None:
    num_blocks = 512  # 4 layers x 512 blocks x 32 KiB pages: 64 MiB
    proc, info = _spawn_producer(num_blocks, seed=11)
    layout = KVCacheLayout.contiguous("NHD", KVPacking.CONCAT, torch.float16, 4, num_blocks,
                                      16, 4, 64)
    expected = torch.randint(0, 256, (layout.span_bytes,), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(11))
    dst = torch.zeros(layout.span_bytes, dtype=torch.uint8)
    consumer = _endpoint(_name("decode"), dst, layout)
    try:
        peer = consumer.add_peer(info)
        blocks = list(range(num_blocks))
        t = consumer.start_read(peer, blocks, blocks[::-1], timeout=10, notification=b"warm")
        assert consumer.wait(t) is TransferState.DONE, t.reason
        for b in (0, 17, num_blocks - 1):
            assert _block_bytes(layout, dst, b) == _block_bytes(layout, expected,
                                                                num_blocks - 1 - b)
        # Kill the producer while reads are being posted and polled; every read ends
        # (DONE before the kill, FAILED after it) well within its deadline.
        killer = threading.Timer(0.05, proc.kill)
        killer.start()
        start = time.monotonic()
        states = []
        while time.monotonic() - start < 8:
            t = consumer.start_read(peer, blocks, blocks, timeout=5)
            states.append(consumer.wait(t))
            if states[-1] is TransferState.FAILED:
                break
        killer.join()
        assert states[-1] is TransferState.FAILED, states
        assert not t.timed_out, t.reason
        assert time.monotonic() - start < 8
        assert consumer.resources().transfers == 0
        consumer.remove_peer(peer)
        assert consumer.resources().total == 2
    finally:
        consumer.close()
        proc.kill()
        proc.wait()
    assert consumer.resources().total == 0


def test_a_read_from_a_dead_producer_fails_at_once() -> None:
    proc, info = _spawn_producer(8, seed=3)
    layout = KVCacheLayout.contiguous("NHD", KVPacking.CONCAT, torch.float16, 4, 8, 16, 4, 64)
    consumer = _endpoint(_name("decode"), torch.zeros(layout.span_bytes, dtype=torch.uint8),
                            layout)
    try:
        peer = consumer.add_peer(info)
        t = consumer.start_read(peer, [0], [1], timeout=10)
        assert consumer.wait(t) is TransferState.DONE, t.reason
        proc.kill()
        proc.wait()
        start = time.monotonic()
        t = consumer.start_read(peer, [0, 1], [1, 2], timeout=10, notification=b"x")
        assert consumer.wait(t) is TransferState.FAILED
        assert time.monotonic() - start < 9, t.reason
        assert consumer.resources().transfers == 0
    finally:
        consumer.close()
        proc.kill()
        proc.wait()
    assert consumer.resources().total == 0


# ---------------------------------------------------------------------- raw anchor

@pytest.mark.parametrize("two_processes", [False, True])
def test_raw_nixl_anchor_moves_the_right_bytes(two_processes: bool) -> None:
    from kvspec.bench._nixl_raw import measure_raw_nixl

    result = measure_raw_nixl(8, 4, 1024, repeats=2, warmup=1, two_processes=two_processes)
    assert result.nbytes == 8 * 4 * 1024
    assert result.processes == (2 if two_processes else 1)
    assert result.per_block_descriptors == 8 and result.per_layer_block_descriptors == 32
    assert result.memcpy_s > 0 and result.per_block_s > 0 and result.per_layer_block_s > 0
    assert result.to_json()["per_block_ratio"] == result.per_block_ratio
    with pytest.raises(InvalidArgumentError):
        measure_raw_nixl(0)


def test_a_peer_info_naming_another_agent_does_not_cut_off_an_existing_peer(
        pair: Pair) -> None:
    """Issue 14, defect 2: a PeerInfo carrying an existing peer's NIXL metadata under another
    name made add_peer's clean-up unload that peer's agent, so every later READ from it
    failed while kvspec still listed it."""
    with pytest.raises(MalformedMetadataError, match="agent"):
        pair.consumer.add_peer(attrs.evolve(pair.producer.info, agent_name="impostor"))
    assert pair.consumer.peers == (pair.peer,)
    t = pair.consumer.start_read(pair.peer, [0, 1], [2, 3], timeout=10)
    assert pair.consumer.wait(t) is TransferState.DONE
    for local, remote in ((0, 2), (1, 3)):
        assert _block_bytes(pair.layout, pair.dst, local) == \
            _block_bytes(pair.layout, pair.src, remote)


def test_a_peer_claiming_millions_of_blocks_is_refused_before_allocating(pair: Pair) -> None:
    """Issue 14, defect 4: a 1.5 KB PeerInfo claiming 4 million blocks cost the consumer
    1.15 GiB and 4.8 s before NIXL refused it. Claims are bounded first: blocks inside the
    registered region, and at most 8x this endpoint's descriptors."""
    consumer = _endpoint(_name("decode"), torch.zeros(pair.layout.span_bytes, dtype=torch.uint8),
                         pair.layout)
    try:
        info = pair.producer.info
        huge = attrs.evolve(info, geometry=attrs.evolve(info.geometry, num_blocks=4_000_000))
        t0 = time.monotonic()
        with pytest.raises(MalformedMetadataError, match="registered"):
            consumer.add_peer(huge)
        lying = attrs.evolve(huge, nbytes=1 << 50)  # a region to match the claim
        with pytest.raises(MalformedMetadataError, match="at most"):
            consumer.add_peer(lying)
        assert time.monotonic() - t0 < 1.0
        assert consumer.resources().peers == 0 and consumer.resources().remote_dlists == 0
        consumer.add_peer(info)  # an honest peer still works
    finally:
        consumer.close()


def test_progress_keeps_the_notifications_it_takes_in(pair: Pair) -> None:
    """Issue 34: ``progress`` (a consumer's poller) moves NIXL along; the notifications
    that arrive meanwhile are still returned by the next ``notifications``, once."""
    assert pair.consumer.send_notification(pair.peer, b"hello")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not pair.producer._agent.notifs:  # type: ignore[attr-defined]
        pair.consumer.progress()
        pair.producer.progress()  # takes it in and keeps it
        time.sleep(0.005)
    assert pair.producer.notifications() == {pair.consumer.name: [b"hello"]}
    assert pair.producer.notifications() == {}


def test_a_read_in_parts_moves_each_parts_runs_of_its_blocks(pair: Pair) -> None:
    """KVG-008: one READ in two parts, each moving its own runs (the layers of one
    KV-cache group) of its own blocks; nothing else is written."""
    c, peer, layout = pair.consumer, pair.peer, pair.layout
    regions = layout.block_region_offsets(list(range(layout.num_blocks))).tolist()
    half = layout.regions_per_block // 2
    first, second = tuple(range(half)), tuple(range(half, layout.regions_per_block))
    t = c.start_read(peer, [[2, 3], [5]], [[7, 8], [9]], timeout=10, runs=[first, second])
    assert c.wait(t) is TransferState.DONE, t.reason
    assert t.nbytes == (2 * len(first) + len(second)) * layout.region_nbytes
    n = layout.region_nbytes

    def region(buf: torch.Tensor, block: int, r: int) -> bytes:
        return bytes(buf[regions[block][r]: regions[block][r] + n].tolist())

    for local, remote, runs in ((2, 7, first), (3, 8, first), (5, 9, second)):
        for r in range(layout.regions_per_block):
            want = region(pair.src, remote, r) if r in runs else bytes(n)
            assert region(pair.dst, local, r) == want, (local, r)
    for bad in ([(0,)], [(), (1,)], [(0, 0), (1,)], [(0,), (layout.regions_per_block,)]):
        with pytest.raises(InvalidArgumentError):
            c.start_read(peer, [[2], [5]], [[7], [9]], timeout=1, runs=bad)
    with pytest.raises(InvalidArgumentError, match="sequences"):
        c.start_read(peer, [2, 5], [7, 9], timeout=1, runs=[first, second])
