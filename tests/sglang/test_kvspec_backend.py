"""kvspec's own HiCache backend (``hicache:kvspec``, ``kvspec.sglang.backend``) under the STO
suite, plus what the suite cannot see: damage at a known page of the shard file, the
lock deadline, writer-per-shard across processes, eviction, refused layouts."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from kvspec.protocols.errors import InvalidArgumentError, LayoutMismatchError
from kvspec.sglang.suite import HiCacheStorageSuite, backends, have_sglang

needs_sglang = pytest.mark.skipif(not have_sglang(), reason="needs SGLang: run under the "
                                  "environment scripts/sglang_env.sh builds")
ROOT = Path(__file__).resolve().parents[2]


class TestKVSpecBackend(HiCacheStorageSuite):
    """The STO suite on ``hicache:kvspec`` (zero copy)."""

    target = "kvspec"


class TestKVSpecBackendGeneric(HiCacheStorageSuite):
    """The STO suite on kvspec's backend driven through the generic interface."""

    concurrent_s: ClassVar[float] = 3.0  # the CLI run certifies it for 10 s

    target = "kvspec"
    extra_config = {"interface_v1": 0}


def _stored(make: Any, n: int, **config: Any) -> tuple[Any, list[str], list[torch.Tensor]]:
    rig = make(**config)
    keys = [f"p{i}" for i in range(n)]
    src = rig.alloc(n)
    want = rig.fill(src, seed=n)
    assert rig.store(keys, src) == [True] * n
    return rig, keys, want


@needs_sglang
def test_a_page_cut_short_in_the_shard_file_is_a_miss_from_there(tmp_path: Path) -> None:
    with backends("kvspec", tmp_path / "s") as make:
        rig, keys, want = _stored(make, 3)
        store = rig.backend.store
        with store.locked(False, time.monotonic() + 1) as fd:
            slots = [store.find(fd, n) for n in rig.backend._names(keys)]
        cut = sorted(slots)[1]  # inside the page in the middle slot
        os.truncate(store.path, store._data + cut * store.page_bytes + 7)
        intact = [slot < cut for slot in slots]
        lead = intact.index(False)  # pages in key order read up to the first cut one
        got = rig.load(keys, dst := rig.alloc(3))
        assert got == [True] * lead + [False] * (3 - lead)
        assert all(torch.equal(rig.page_bytes(dst, i), want[i]) for i in range(lead))
        os.truncate(store.path, 0)  # an empty file: every call misses, none raises
        assert rig.query(keys) == 0 and rig.load(keys, dst) == [False] * 3
        assert rig.store(keys, rig.alloc(3)) == [True] * 3  # the writer starts a new store


@needs_sglang
def test_a_foreign_header_is_a_miss_and_the_writer_reformats(tmp_path: Path) -> None:
    with backends("kvspec", tmp_path / "s") as make:
        rig, keys, _ = _stored(make, 2)
        with open(rig.backend.store.path, "r+b") as f:
            f.write(b"not a kvspec store")
        assert rig.query(keys) == 0
        assert rig.load(keys, rig.alloc(2)) == [False, False]
        src = rig.alloc(2)
        want = rig.fill(src, seed=9)
        assert rig.store(keys, src) == [True, True] and rig.query(keys) == 2
        dst = rig.alloc(2)
        assert rig.load(keys, dst) == [True, True]
        assert torch.equal(rig.page_bytes(dst, 1), want[1])


@needs_sglang
def test_a_lock_held_elsewhere_costs_a_miss_within_the_deadline(tmp_path: Path) -> None:
    with backends("kvspec", tmp_path / "s", extra_config={"kvspec_timeout_s": 0.2}) as make:
        rig, keys, _ = _stored(make, 2)
        fd = os.open(rig.backend.store.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # another process writing, for ever
            start = time.monotonic()
            assert rig.query(keys) == 0
            assert rig.load(keys, rig.alloc(2)) == [False, False]
            assert rig.store(["new"], rig.alloc(1)) == [False]
            assert time.monotonic() - start < 3 * 0.2 + 1
        finally:
            os.close(fd)
        assert rig.query(keys) == 2
        assert rig.backend._lock.acquire(timeout=1)  # a thread inside the backend, for ever
        try:
            assert rig.query(keys) == 0
        finally:
            rig.backend._lock.release()


@needs_sglang
def test_mla_reader_ranks_do_not_write(tmp_path: Path) -> None:
    with backends("kvspec", tmp_path / "s") as make:
        reader = make(tp_size=2, tp_rank=1, is_mla=True)
        assert reader.store(["k"], reader.alloc(1)) == [False]  # STO-008: rank 0 writes alone


_WRITER = """
import sys, json
from pathlib import Path
from kvspec.sglang import open_backend, HiCacheConfig
rig = open_backend("kvspec", HiCacheConfig(tp_size=2, is_mla=True), Path(sys.argv[1]))
src = rig.alloc(5)
rig.fill(src, seed=11)
print(json.dumps(rig.store([f"x{i}" for i in range(5)], src)))
"""


@needs_sglang
def test_mla_pages_written_by_one_process_are_read_by_another(tmp_path: Path) -> None:
    """Ranks are processes: TP rank 0 stores in a child process, TP rank 1 reads here."""
    out = subprocess.run([sys.executable, "-c", _WRITER, str(tmp_path / "s")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and out.stdout.strip().endswith("[true, true, true, true, true]"), out.stderr[-2000:]
    with backends("kvspec", tmp_path / "s") as make:
        reader = make(tp_size=2, tp_rank=1, is_mla=True)
        keys = [f"x{i}" for i in range(5)]
        assert reader.query(keys) == 5
        dst = reader.alloc(5)
        assert reader.load(keys, dst) == [True] * 5
        want = make(tp_size=2, is_mla=True)
        src = want.alloc(5)
        pages = want.fill(src, seed=11)  # the same seeded bytes the child stored
        assert all(torch.equal(reader.page_bytes(dst, i), pages[i]) for i in range(5))


@needs_sglang
def test_a_full_store_evicts_and_never_answers_wrong_bytes(tmp_path: Path) -> None:
    with backends("kvspec", tmp_path / "s", extra_config={"kvspec_bytes": 8 * 512, "kvspec_ways": 2}) as make:
        rig, keys, want = _stored(make, 40)
        assert rig.backend.store.slots == 8
        found = [k for k in keys if rig.backend.exists(k)]
        assert 0 < len(found) <= 8
        for k in found:
            i = keys.index(k)
            dst = rig.alloc(1)
            assert rig.load([k], dst) == [True]
            assert torch.equal(rig.page_bytes(dst, 0), want[i])


@needs_sglang
@pytest.mark.parametrize(("changes", "error", "clause"), [
    ({"layout": "page_first"}, LayoutMismatchError, "LAY-001"),
    ({"extra_config": {"kvspec_bytes": 100}}, InvalidArgumentError, "ERR-002"),
])
def test_refused_at_registration(tmp_path: Path, changes: dict[str, Any], error: type[Exception],
                                 clause: str) -> None:
    with backends("kvspec", tmp_path / "s") as make:
        with pytest.raises(error) as caught:
            make(**changes)
    assert caught.value.clause == clause  # type: ignore[attr-defined]
