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
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from ..protocols.errors import ContractViolation
from ._config import HiCacheConfig, HiCacheTarget, parse_target

__all__ = ["HiCacheStorageSuite", "backends", "have_sglang"]

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
        got = rig.load(keys, dst)
        _check(isinstance(got, list) and len(got) == pages, "STO-002",
                                f"the load answered {type(got).__name__} of length "
                                f"{len(got) if isinstance(got, list) else '-'}",
                                f"a list of {pages} entries")
        for i in range(pages):
            hit = got[i] is not None and got[i] is not False
            _check(hit, "STO-004", f"page {i} of {pages} stored but missed on load",
                                    "every stored page is read back")
            same = torch.equal(rig.page_bytes(dst, i), want[i])
            _check(same, "STO-005", f"page {i} came back with other bytes",
                                    "the bytes that were stored, at the host slots asked for (STO-006)")
            _check(not torch.any(rig.page_bytes(src, i)).item(), "STO-006",
                                    f"page {i} was also written into its old host slots",
                                    "a load writes only the host slots it was given")

    @pytest.mark.kvspec_clause("STO-005", "STO-006", "STO-002", "STO-004", "STO-010")
    @pytest.mark.parametrize("layout", _LAYOUTS)
    def test_round_trip_controller_path(self, make: Maker, layout: str) -> None:
        """Pages stored and loaded through the path the controller picks for this backend
        (zero copy or generic) come back byte for byte at the host slots asked for."""
        self._round_trip(make(layout=layout), pages=6)

    @pytest.mark.kvspec_clause("STO-005", "STO-002")
    @pytest.mark.parametrize("layout", _LAYOUTS)
    def test_round_trip_generic_interface(self, make: Maker, layout: str) -> None:
        """``set`` then ``get`` of one flat page returns the same bytes; a missing key is None."""
        rig = make(layout=layout)
        src = rig.alloc(1)
        want = rig.fill(src, seed=7)[0]
        page = rig.host.get_data_page(rig.page_index(src, 0))
        try:
            stored = rig.call("STO-010", "set", "g0", page)
        except ContractViolation as e:  # the controller never calls set on a zero-copy backend
            if rig.zero_copy and isinstance(e.__cause__, NotImplementedError):
                pytest.skip(f"{self.target!r} does not implement get/set (NotImplementedError) and "
                            "SGLang's controller drives it through batch_get_v1/batch_set_v1 only")
            raise
        _check(stored is True, "STO-010", "set answered something other than True", "True")
        out = rig.call("STO-003", "get", "g0", rig.host.get_dummy_flat_data_page())
        _check(out is not None, "STO-004", "get missed a page set just before",
                                "the page")
        _check(torch.equal(out.contiguous().view(torch.uint8), want), "STO-005",
                                "get returned other bytes", "the bytes set")
        miss = rig.call("STO-003", "get", "never-stored", rig.host.get_dummy_flat_data_page())
        _check(miss is None, "STO-003", f"get of a missing key returned {type(miss).__name__}",
                                "None")

    @pytest.mark.kvspec_clause("STO-005", "STO-006", "STO-002")
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
    @pytest.mark.kvspec_clause("STO-003")
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
        got = rig.load(keys, rig.alloc(3))
        hits = 0
        for entry in got:
            if entry is None or entry is False:
                break
            hits += 1
        if shared:
            _check(isinstance(got, list) and len(got) == 3, "STO-002",
                   f"the load after damaging the shared file answered {got!r}", "3 entries")
            return
        _check(hits == 1, "STO-003", f"{hits} leading hits with page 1 {damage}",
                                "1 (page 0, then a miss)")

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
    concurrent_s: ClassVar[float] = 3.0
    """How long ``test_three_threads_at_once`` runs its threads."""

    @pytest.mark.kvspec_clause("STO-011", "STO-009", "STO-012")
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
                got = rig.load(keys[start:n], dst)
                for i in range(batch):
                    hit = isinstance(got, list) and got[i] is not None and got[i] is not False
                    _check(hit, "STO-004", f"page {start + i} counted by batch_exists, then missed",
                           "a counted page loads")
                    _check(torch.equal(rig.page_bytes(dst, i), want[start + i]), "STO-009",
                           f"page {start + i} loaded with other bytes while pages were being stored",
                           "the complete page, never a torn or foreign one")

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


def _check(condition: object, clause: str, observed: str, expected: str) -> None:
    """Raise ``ContractViolation`` of ``clause`` unless ``condition`` holds."""
    if not condition:
        raise ContractViolation(clause, observed=observed, expected=expected)
