"""The HiCache storage suite: clause-tagged pytest checks of one SGLang storage backend.

Subclass ``HiCacheStorageSuite`` in a test module and set ``target`` (``"file"``,
``"nixl"``, ``"pkg.module:Class"``) and, if the backend needs it, ``extra_config``; pytest
then runs every check against that backend, each created as SGLang's controller creates
it (``kvspec.sglang.open_backend``). A broken clause fails with ``ContractViolation``
naming it. Without SGLang every test skips. SGLang is imported only when a test runs.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from ..protocols.errors import ContractViolation
from ._config import HiCacheConfig, HiCacheTarget, parse_target
from ._faults import FAULTS, inject_fault

__all__ = ["FAULTS", "HiCacheStorageSuite", "backends", "have_sglang", "inject_fault"]

_LAYOUTS = ("layer_first", "page_first_direct")
Maker = Callable[..., Any]


def have_sglang() -> bool:
    """Whether SGLang is importable here (a directory named ``sglang`` on ``sys.path``, such
    as kvspec's ``tests/sglang``, is a namespace package, not SGLang)."""
    spec = importlib.util.find_spec("sglang")
    return spec is not None and spec.origin is not None


@contextlib.contextmanager
def backends(target: str, storage_dir: Path, *, extra_config: Mapping[str, Any] | None = None,
             deadline_s: float = 30.0) -> Iterator[Maker]:
    """``make(**config)`` creates a ``StorageRig`` of ``target`` on ``storage_dir`` (created
    here); every rig made is closed on exit."""
    from ._loader import StorageRig

    parsed: HiCacheTarget = parse_target(target)
    rigs: list[StorageRig] = []

    def make(**changes: Any) -> StorageRig:
        config = HiCacheConfig(extra_config=dict(extra_config or {})).evolve(**changes)
        rigs.append(StorageRig(parsed, config, storage_dir, deadline_s=deadline_s))
        return rigs[-1]

    storage_dir.mkdir(parents=True, exist_ok=True)
    try:
        yield make
    finally:
        for rig in rigs:
            rig.close()


def _keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:05d}" for i in range(n)]


def _object_files(root: Path) -> dict[Path, float]:
    return {p: p.stat().st_mtime for p in root.rglob("*") if p.is_file()}


class HiCacheStorageSuite:
    """Base class of a HiCache storage backend's conformance tests (STO clauses).

    Attributes:
        target: The backend under test, as ``kvspec.sglang.parse_target`` reads it.
        extra_config: The backend's extra configuration (SGLang's
            ``--hicache-storage-backend-extra-config``).
        deadline_s: The longest one backend call may take before it breaks STO-012.
    """

    target: ClassVar[str] = "file"
    extra_config: ClassVar[Mapping[str, Any]] = {}
    deadline_s: ClassVar[float] = 30.0

    @pytest.fixture
    def make(self, tmp_path: Path) -> Iterator[Maker]:
        """A factory of backends on one shared storage directory: ``make(**config)``; each
        is closed at teardown."""
        if not have_sglang():
            if os.environ.get("KVSPEC_REQUIRE_SGLANG") == "1":
                pytest.fail("KVSPEC_REQUIRE_SGLANG=1 but SGLang cannot be imported here")
            pytest.skip("needs SGLang: run under the environment scripts/sglang_env.sh builds")
        with backends(self.target, tmp_path / "store", extra_config=self.extra_config,
                      deadline_s=self.deadline_s) as make:
            yield make

    # -- round trips ---------------------------------------------------------------------------
    def _round_trip(self, rig: Any, pages: int) -> None:
        keys = _keys("rt", pages)
        src = rig.alloc(pages)
        want = rig.fill(src, seed=pages)
        stored = rig.store(keys, src)
        ok = all(stored) if isinstance(stored, list) else stored
        _check(ok is True or ok == 1, "STO-010", f"the store answered {stored!r}",
                                "every page stored (True)")
        rig.clear(src)
        dst = rig.alloc(pages)
        before = rig.snapshot()
        hits = _hits(rig.load(keys, dst), pages, "the load")
        for i, hit in enumerate(hits):
            if not hit:
                raise ContractViolation(_lost(rig, keys[i]),
                                        observed=f"page {i} of {pages}, reported stored, missed on load",
                                        expected="every stored page is read back")
        _check_loaded(rig, dst, want, hits, before, "STO-005", "the round trip")

    @pytest.mark.kvspec_clause("STO-005", "STO-006", "STO-002", "STO-004", "STO-010")
    @pytest.mark.parametrize("layout", _LAYOUTS)
    def test_round_trip_controller_path(self, make: Maker, layout: str) -> None:
        """Pages stored and loaded through the path the controller picks for this backend
        (zero copy or generic) come back byte for byte at the host slots asked for."""
        self._round_trip(make(layout=layout), pages=6)

    @pytest.mark.kvspec_clause("STO-005", "STO-002", "STO-003", "STO-004", "STO-010")
    @pytest.mark.parametrize("layout", _LAYOUTS)
    def test_round_trip_generic_interface(self, make: Maker, layout: str) -> None:
        """``set`` then ``get`` of one flat page returns the same bytes; a missing key is None."""
        rig = make(layout=layout)
        src = rig.alloc(1)
        want = rig.fill(src, seed=7)[0]
        page = rig.host.get_data_page(rig.page_index(src, 0))
        try:
            done = rig.call("STO-010", "set", "g0", page)
        except ContractViolation as e:
            if rig.zero_copy and isinstance(e.__cause__, NotImplementedError):
                pytest.skip(f"{self.target!r} does not implement the generic set "
                            f"({e.__cause__}); SGLang's controller drives it zero copy")
            raise
        _check(done is True, "STO-010",
                                "set answered something other than True", "True")
        out = rig.call("STO-003", "get", "g0", rig.host.get_dummy_flat_data_page())
        _check(out is not None, _lost(rig, "g0"), "get missed a page set just before",
                                "the page")
        _check(torch.equal(out.contiguous().view(torch.uint8), want), "STO-005",
                                "get returned other bytes", "the bytes set")
        miss = rig.call("STO-003", "get", "never-stored", rig.host.get_dummy_flat_data_page())
        _check(miss is None, "STO-003", f"get of a missing key returned {type(miss).__name__}",
                                "None")

    @pytest.mark.kvspec_clause("STO-005", "STO-006", "STO-002", "STO-004", "STO-010")
    @pytest.mark.parametrize("layout", _LAYOUTS)
    def test_round_trip_zero_copy_interface(self, make: Maker, layout: str) -> None:
        """``batch_set_v1`` / ``batch_get_v1`` round trip (backends the controller drives
        through the zero-copy path)."""
        rig = make(layout=layout)
        if not rig.zero_copy:
            pytest.skip(f"SGLang's controller drives {self.target!r} through batch_get/batch_set, "
                        "not batch_get_v1/batch_set_v1 (set interface_v1 for a dynamic backend)")
        self._round_trip(rig, pages=6)

    # -- prefix answers --------------------------------------------------------------------
    @pytest.mark.kvspec_clause("STO-001")
    def test_longest_prefix_across_batches_and_holes(self, make: Maker) -> None:
        """300 pages (three controller batches of at most 128) with a hole at page 200: the
        hit query finds 200, each batch answers its own prefix, and a hole at 5 stops at 5."""
        rig = make()
        keys = _keys("px", 300)
        src = rig.alloc(len(keys))
        rig.fill(src, seed=1)
        present = [i for i in range(len(keys)) if i != 200]
        for start in range(0, len(present), 128):
            part = present[start:start + 128]
            idx = torch.cat([src[i * rig.config.page_size:(i + 1) * rig.config.page_size] for i in part])
            rig.store([keys[i] for i in part], idx)
        expected = {"all 300 keys": (keys, 200), "keys 0-127": (keys[:128], 128),
                    "keys 128-255": (keys[128:256], 72), "keys 201-299": (keys[201:], 99),
                    "a fresh key first": (["px-missing", *keys[:10]], 0)}
        for what, (ks, n) in expected.items():
            got = rig.query(ks)
            _check(got == n, "STO-001", f"the hit query over {what} found {got}",
                                    f"{n} (the longest stored prefix)")
        rig2 = make()
        ks = _keys("hole", 12)
        idx = rig2.alloc(12)
        rig2.fill(idx, seed=2)
        rig2.store(ks[:5], idx[:5 * rig2.config.page_size])
        rig2.store(ks[6:], idx[6 * rig2.config.page_size:])
        got = rig2.query(ks)
        _check(got == 5, "STO-001", f"found {got} with page 5 missing", "5")

    # -- bad objects ------------------------------------------------------------------------
    @pytest.mark.kvspec_clause("STO-003", "STO-002", "STO-004")
    @pytest.mark.parametrize("damage", ["truncated", "empty"])
    def test_damaged_object_reads_as_a_miss(self, make: Maker, tmp_path: Path, damage: str) -> None:
        """The object of page 1 of 3 is cut short on disk: loading reads page 0 and then a
        miss, never an exception (SGLang's controller loses its thread to one)."""
        rig = make()
        store = tmp_path / "store"
        keys = _keys("bad", 3)
        src = rig.alloc(3)
        rig.fill(src, seed=3)
        empty = _object_files(store)
        rig.store(keys[:1], src[:rig.config.page_size])
        before = _object_files(store)
        rig.store(keys[1:2], src[rig.config.page_size:2 * rig.config.page_size])
        new = [p for p, t in _object_files(store).items() if before.get(p) != t]
        if len(new) != 1:
            pytest.skip(f"{self.target!r} wrote {len(new)} files under its storage directory for "
                        "one page; the suite damages only one-file-per-page stores")
        # A file that page 0's store wrote too holds several pages: the damage reaches pages
        # the suite cannot name, so only "no exception, one entry per key" is checked.
        shared = empty.get(new[0]) != before.get(new[0])
        rig.store(keys[2:], src[2 * rig.config.page_size:])
        size = new[0].stat().st_size
        os.truncate(new[0], size // 2 if damage == "truncated" else 0)
        hits = _hits(rig.load(keys, rig.alloc(3)), 3, f"the load with page 1 {damage}")
        if shared:  # the damage reached pages the suite cannot name: one entry per key only
            return
        lead = hits.index(False) if False in hits else 3
        if lead == 0:
            raise ContractViolation(_lost(rig, keys[0]), observed=f"page 0, intact, missed with "
                                    f"page 1 {damage}", expected="page 0 is read back")
        _check(lead == 1, "STO-003", f"{lead} leading hits with page 1 {damage}",
                                "1 (page 0, then a miss)")

    # -- injected faults ---------------------------------------------------------------------
    fault_geometry: ClassVar[Mapping[str, Any]] = {"num_layers": 4, "num_heads": 4, "head_dim": 32}
    """The rank geometry of the fault checks: 8 KiB pages. Real pages are larger than the C
    library's 4 KiB stream buffer, below which ``numpy.tofile`` (SGLang's ``file`` backend
    writes with it) loses a failed write and leaves an empty object."""

    def inject_fault(self, kind: str) -> AbstractContextManager[None]:
        """The fault ``kind`` (``no-fd``, ``disk-full``: ``kvspec.sglang.suite.FAULTS``) held
        for the body. Override it for a backend the process-wide defaults cannot reach (one
        that keeps its files open or talks to a service): stop the service, cut the link."""
        return inject_fault(kind)

    @pytest.mark.kvspec_clause("STO-010", "STO-004", "STO-003", "STO-002")
    @pytest.mark.parametrize("fault", FAULTS)
    def test_failed_store_is_reported(self, make: Maker, fault: str) -> None:
        """Six pages stored while every store fails (``no-fd``: no file descriptor can be
        opened; ``disk-full``: no byte can be written): each page the answer reports stored
        must read back, with its bytes. The fault lifted, the same pages stored again: the
        same holds (a backend must not remember a failed page as stored)."""
        rig = make(**self.fault_geometry)
        keys = _keys(f"ff-{fault}-", 6)
        src = rig.alloc(len(keys))
        want = rig.fill(src, seed=11)
        with self.inject_fault(fault):
            answer = rig.store(keys, src)
        claimed = _claimed(answer, len(keys), f"the store while {fault}")
        self._read_back(rig, keys, want, claimed, f"after a store while {fault}")
        if all(claimed):
            pytest.skip(f"the injected fault ({fault}) did not reach {self.target!r}: every page "
                        "was stored and reads back (override inject_fault with its own fault)")
        answer = rig.store(keys, src)
        claimed = _claimed(answer, len(keys), f"the store after the {fault} fault was lifted")
        self._read_back(rig, keys, want, claimed, f"after the {fault} fault was lifted")

    def _read_back(self, rig: Any, keys: Sequence[str], want: Sequence[torch.Tensor],
                   claimed: Sequence[bool], what: str) -> None:
        """Load each key alone: a page claimed stored must hit with its bytes (else
        STO-004 / STO-010); any hit must bring its bytes (a failed store's remains that
        read as a hit: STO-003)."""
        dst = rig.alloc(1)
        for i, key in enumerate(keys):
            rig.clear(dst)
            before = rig.snapshot()
            hits = _hits(rig.load([key], dst), 1, what)
            if hits[0]:
                _check_loaded(rig, dst, [want[i]], hits, before,
                              "STO-005" if claimed[i] else "STO-003", f"page {i} {what}")
            elif claimed[i]:
                raise ContractViolation(_lost(rig, key), observed=f"page {i} {what}: reported "
                                        "stored, missed on load",
                                        expected="a page reported stored reads back")

    @pytest.mark.kvspec_clause("STO-003", "STO-002")
    def test_failed_load_reads_as_a_miss(self, make: Maker) -> None:
        """Four stored pages loaded while no file descriptor can be opened (``no-fd``): the
        load misses (or hits with the right bytes), never raises."""
        rig = make(**self.fault_geometry)
        keys = _keys("lf", 4)
        src = rig.alloc(len(keys))
        want = rig.fill(src, seed=12)
        rig.store(keys, src)
        dst = rig.alloc(len(keys))
        before = rig.snapshot()
        with self.inject_fault("no-fd"):
            answer = rig.load(keys, dst)
        hits = _hits(answer, len(keys), "the load while no file descriptor was left")
        _check_loaded(rig, dst, want, hits, before, "STO-003",
                      "the load while no file descriptor was left")
        if all(hits):
            pytest.skip(f"the injected fault (no-fd) did not reach {self.target!r}: every page "
                        "loaded (override inject_fault with its own fault)")

    # -- ranks ---------------------------------------------------------------------------------
    @pytest.mark.kvspec_clause("STO-007")
    @pytest.mark.parametrize("other", ["tp_rank", "pp_rank", "attn_cp_rank", "model_name"])
    def test_rank_coordinates_never_alias(self, make: Maker, other: str) -> None:
        """What TP rank 0 of 2 stores is invisible to a rank that differs in one coordinate."""
        base: dict[str, Any] = {"tp_size": 2, "pp_size": 2, "attn_cp_size": 2}
        writer = make(**base)
        keys = _keys("rank", 4)
        src = writer.alloc(4)
        writer.fill(src, seed=4)
        writer.store(keys, src)
        change = {"model_name": "another-model"} if other == "model_name" else {other: 1}
        reader = make(**base, **change)
        got = reader.query(keys)
        _check(got == 0, "STO-007", f"a reader with {change} found {got} of the "
                                "writer's pages", "0: ranks never share objects")

    @pytest.mark.kvspec_clause("STO-008")
    def test_mla_ranks_read_the_writers_pages(self, make: Maker) -> None:
        """With MLA, only TP rank 0 writes, and TP rank 1 reads what it wrote."""
        writer = make(tp_size=2, is_mla=True)
        reader = make(tp_size=2, tp_rank=1, is_mla=True)
        from ._loader import make_storage_config

        cfg = make_storage_config(reader.config, reader.target, Path("."))
        _check(not cfg.is_storage_writer, "STO-008",
                                "TP rank 1 of an MLA model is a storage writer", "rank 0 writes alone")
        keys = _keys("mla", 3)
        src = writer.alloc(3)
        writer.fill(src, seed=5)
        writer.store(keys, src)
        got = reader.query(keys)
        _check(got == 3, "STO-008", f"TP rank 1 found {got} of 3 pages rank 0 wrote",
                                "3: MLA KV is shared by every rank of the shard")

    # -- the controller's threads -------------------------------------------------------------
    concurrent_s: ClassVar[float] = 10.0
    """How long ``test_three_threads_at_once`` runs its threads: 10 s by default, as
    ``kvspec conform hicache:...`` certifies a backend; a subclass may shorten it."""

    @pytest.mark.kvspec_clause("STO-011", "STO-009", "STO-012", "STO-004", "STO-006", "STO-002")
    def test_three_threads_at_once(self, make: Maker) -> None:
        """A backup thread stores new pages while a hit-query thread and a prefetch thread
        read the pages stored so far, for ``concurrent_s`` seconds: no call hangs, every
        page counted as stored loads complete, with its own bytes."""
        rig = make()
        page, batch = rig.config.page_size, 8
        src = rig.alloc(96)
        want = rig.fill(src, seed=8)
        keys = _keys("cc", 96)
        stored = [0]  # pages the backup thread has stored, in order
        errors: list[BaseException] = []
        stop = threading.Event()

        def backup() -> None:
            for start in range(0, len(keys), batch):
                if stop.is_set():
                    return
                rig.store(keys[start:start + batch], src[start * page:(start + batch) * page])
                stored[0] = start + batch

        def hit_query() -> None:
            while not stop.is_set():
                floor = stored[0]
                got = rig.query(keys)
                _check(got >= floor, "STO-011", f"the hit query found {got} pages while "
                       f"{floor} were stored before it began", f"at least {floor}")

        def prefetch() -> None:
            dst = rig.alloc(batch)
            while not stop.is_set():
                n = rig.query(keys) // batch * batch
                if n == 0:
                    continue
                start = n - batch
                before = rig.snapshot()
                hits = _hits(rig.load(keys[start:n], dst), batch, "a prefetch")
                for i, hit in enumerate(hits):
                    _check(hit, "STO-004", f"page {start + i} counted by batch_exists, then missed",
                           "a counted page loads")
                _check_loaded(rig, dst, want[start:n], hits, before, "STO-009",
                              f"pages {start}-{n - 1} loaded while pages were being stored")

        def guard(fn: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                try:
                    fn()
                except BaseException as e:
                    errors.append(e)
                    stop.set()
            return run

        threads = [threading.Thread(target=guard(f), daemon=True) for f in (backup, hit_query, prefetch)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.concurrent_s
        while time.monotonic() < deadline and not stop.is_set():
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(self.deadline_s * 2)
        _check(not any(t.is_alive() for t in threads), "STO-011",
               "a controller thread was still inside the backend after the run", "no deadlock")
        if errors:
            raise errors[0]

    atomic_pages: ClassVar[int] = 12
    """How many pages ``test_set_is_atomic_against_a_get`` stores under a reader."""

    @pytest.mark.kvspec_clause("STO-009", "STO-006", "STO-002")
    def test_set_is_atomic_against_a_get(self, make: Maker) -> None:
        """Each page is stored by one thread while this one loads its key again and again
        until the store returns: every load that hits brings the complete page."""
        rig = make()
        keys = _keys("at", self.atomic_pages)
        src = rig.alloc(len(keys))
        want = rig.fill(src, seed=10)
        dst = rig.alloc(1)
        page = rig.config.page_size
        for i, key in enumerate(keys):
            errors: list[BaseException] = []

            def store(i: int = i, key: str = key) -> None:
                try:
                    rig.store([key], src[i * page:(i + 1) * page])
                except BaseException as e:  # handed to this thread
                    errors.append(e)

            writer = threading.Thread(target=store, name="kvspec-hicache-backup", daemon=True)
            rig.clear(dst)
            writer.start()
            polls = 0
            while writer.is_alive() or polls == 0:
                before = rig.snapshot()
                hits = _hits(rig.load([key], dst), 1, f"a load of page {i} while it was stored")
                _check_loaded(rig, dst, [want[i]], hits, before, "STO-009",
                              f"page {i} loaded while it was being stored")
                polls += 1
            writer.join(self.deadline_s)
            if errors:
                raise errors[0]

    # -- resources and time ------------------------------------------------------------------
    @pytest.mark.kvspec_clause("STO-013", "STO-012")
    def test_nothing_left_open_after_close(self, make: Maker, tmp_path: Path) -> None:
        """Create, use and close a backend: no file descriptor or thread it opened remains;
        every call, creation included, returned within the deadline."""
        from ._loader import StorageRig, build_host_pool

        config = HiCacheConfig(extra_config=dict(self.extra_config))
        host = build_host_pool(config)
        gc.collect()
        fds, threads = set(os.listdir("/proc/self/fd")), set(threading.enumerate())
        start = time.monotonic()
        rig = StorageRig(parse_target(self.target), config, tmp_path / "store",
                         host=host, deadline_s=self.deadline_s)
        keys = _keys("fd", 8)
        src = rig.alloc(8)
        rig.fill(src, seed=6)
        rig.store(keys, src)
        rig.query(keys)
        rig.load(keys, rig.alloc(8))
        rig.close()
        del rig
        gc.collect()
        elapsed = time.monotonic() - start
        left_fds = sorted(set(os.listdir("/proc/self/fd")) - fds)
        left = [os.readlink(f"/proc/self/fd/{fd}") for fd in left_fds if os.path.exists(f"/proc/self/fd/{fd}")]
        alive = [t.name for t in set(threading.enumerate()) - threads if t.is_alive()]
        _check(not left, "STO-013", f"open after close: {left}", "no file descriptor")
        _check(not alive, "STO-013", f"threads after close: {alive}", "no thread")
        _check(elapsed < 6 * self.deadline_s, "STO-012",
                                f"the whole cycle took {elapsed:.1f} s", "bounded calls")


def _hits(answer: Any, n: int, what: str) -> list[bool]:
    """Whether each of the ``n`` keys of a load hit; STO-002 unless the answer is one entry
    per key."""
    _check(isinstance(answer, list) and len(answer) == n, "STO-002",
           f"{what} answered {type(answer).__name__}"
           + (f" of length {len(answer)}" if isinstance(answer, list) else ""),
           f"a list of {n} entries")
    return [entry is not None and entry is not False for entry in answer]


def _claimed(answer: Any, n: int, what: str) -> list[bool]:
    """The pages a store's answer reports stored: a list (zero copy, one bool per key,
    STO-002) or one bool for the batch (generic)."""
    if isinstance(answer, list):
        _check(len(answer) == n, "STO-002", f"{what} answered {len(answer)} entries",
               f"one per key ({n})")
        return [entry is True for entry in answer]
    return [answer is True] * n


def _lost(rig: Any, key: str) -> str:
    """The clause a page reported stored and then missed breaks: STO-004 when
    ``batch_exists`` counts it (exists, cannot be read), else STO-010 (never stored)."""
    return "STO-004" if rig.query([key]) == 1 else "STO-010"


def _check_loaded(rig: Any, dst: Any, want: Sequence[torch.Tensor], hits: Sequence[bool],
                  before: torch.Tensor, wrong: str, what: str) -> None:
    """Every page a load hit holds its own bytes, and the load wrote no host page outside
    ``dst``. A page with another page's bytes, or a write elsewhere, is STO-006 (the page
    landed at other host slots); other bytes with neither is ``wrong``."""
    outside = sorted(rig.pages_changed(before) - rig.page_slots(dst))
    for i, hit in enumerate(hits):
        if not hit:
            continue
        got = rig.page_bytes(dst, i)
        if torch.equal(got, want[i]):
            continue
        other = next((j for j, w in enumerate(want) if j != i and torch.equal(got, w)), None)
        if other is not None or outside:
            seen = f"page {other}'s bytes" if other is not None else "other bytes"
            raise ContractViolation("STO-006", observed=f"{what}: page {i} came back with {seen}"
                                    + (f"; the load wrote host pages at token slots {outside[:4]}, "
                                       "outside those it was given" if outside else ""),
                                    expected="page i at host_indices[i * page_size:(i + 1) * page_size]")
        raise ContractViolation(wrong, observed=f"{what}: page {i} came back with other bytes",
                                expected="the complete page that was stored")
    _check(not outside, "STO-006", f"{what}: the load wrote host pages at token slots "
           f"{outside[:4]}, outside those it was given", "a load writes only its host slots")


def _check(condition: object, clause: str, observed: str, expected: str) -> None:
    """Raise ``ContractViolation`` of ``clause`` unless ``condition`` holds."""
    if not condition:
        raise ContractViolation(clause, observed=observed, expected=expected)
