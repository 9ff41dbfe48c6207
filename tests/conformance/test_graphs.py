"""Graph capture and replay: the CPU emulator always, CUDA graphs where a GPU is present.

The five patterns of GRA-004/005/006 run on every backend: (a) captured work has not run when
capture returns, (b) in-place updates of a static input between replays are seen, (c) a Python
branch is frozen at capture, (d) host syncs raise GRA-004 naming their call site, (e) what
capture allocated keeps its storage across replays until reset. A KV-connector-like pattern
(a persistent index buffer updated outside the graph) and an agreement test (each pattern on
both backends, compared) complete them.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvspec.conformance.graphs import (
    DATA_DEPENDENT_SHAPE_OPS,
    HOST_READ_METHODS,
    HOST_SYNC_OPS,
    CapturedGraph,
    CaptureStateError,
    EmulatedGraph,
    EmulatorCapturer,
    GraphCapturer,
    make_capturer,
    poison_value,
)
from kvspec.conformance.graphs._capture import translate_capture_error
from kvspec.protocols import CapabilityError, ContractViolation, InvalidArgumentError, KVSpecError

HAS_CUDA = torch.cuda.is_available()
CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")],
)
BACKENDS = ["cpu", CUDA]
needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

THIS_FILE = Path(__file__).name
_SOURCE_LINES = Path(__file__).read_text().splitlines()


def line_of(marker: str) -> int:
    """The line number of the only source line ending with ``# <marker>``."""
    hits = [n for n, text in enumerate(_SOURCE_LINES, 1) if text.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu")


# ---------------------------------------------------------------------------- the API


def test_make_capturer_picks_the_implementation() -> None:
    cap = make_capturer("cpu")
    assert isinstance(cap, EmulatorCapturer) and isinstance(cap, GraphCapturer)
    assert cap.device == torch.device("cpu")
    assert cap.warmup == 3
    assert make_capturer(torch.device("cpu"), warmup=0).warmup == 0
    graph, _ = make_capturer("cpu").capture(lambda: torch.ones(2) * 2)
    assert isinstance(graph, CapturedGraph) and isinstance(graph, EmulatedGraph)


@pytest.mark.skipif(HAS_CUDA, reason="checks the error raised without CUDA")
def test_cuda_without_cuda_is_a_capability_error() -> None:
    with pytest.raises(CapabilityError, match="CUDA is not available"):
        make_capturer("cuda")
    with pytest.raises(CapabilityError, match="CUDA is not available"):
        make_capturer(torch.device("cuda", 0))


@pytest.mark.parametrize(
    ("device", "warmup"),
    [("gpu", 3), ("meta", 3), (3, 3), ("cpu", -1), ("cpu", True), ("cpu", 1.0)],
)
def test_bad_arguments_are_refused(device: object, warmup: object) -> None:
    with pytest.raises(InvalidArgumentError):
        make_capturer(device, warmup=warmup)  # type: ignore[arg-type]


def test_capture_needs_a_callable() -> None:
    with pytest.raises(InvalidArgumentError):
        make_capturer("cpu").capture(42)  # type: ignore[arg-type]


def test_poison_values() -> None:
    assert poison_value(torch.float32) != poison_value(torch.float32)  # NaN
    assert poison_value(torch.int64) == -(2**63)
    assert poison_value(torch.int32) == -(2**31)
    assert poison_value(torch.uint8) == 255
    assert poison_value(torch.bool) is True


def test_rule_tables_name_the_expected_ops() -> None:
    for op in ("aten.nonzero", "aten.masked_select", "aten._unique2", "aten.repeat_interleave"):
        assert op in DATA_DEPENDENT_SHAPE_OPS
    assert "aten._local_scalar_dense" in HOST_SYNC_OPS
    assert HOST_READ_METHODS[torch.Tensor.tolist] == "Tensor.tolist()"


# ---------------------------------------------------------------------------- (a) poison


@pytest.mark.parametrize("device", BACKENDS)
def test_a_captured_work_has_not_run_when_capture_returns(device: str) -> None:
    x = torch.arange(4, dtype=torch.float32, device=device)
    i = torch.arange(4, dtype=torch.int64, device=device)
    target = torch.full((4,), 7.0, device=device)

    def fn() -> tuple[torch.Tensor, torch.Tensor]:
        target.copy_(x * 2 + 1)  # an in-place write to a tensor that existed before capture
        return x * 2 + 1, i * 3 + 1

    # No warm-up, so that the in-place write is still pending after capture; the same kernels
    # run once eagerly on other tensors instead (CUDA loads kernels lazily).
    _ = (x.clone() * 2 + 1, i.clone() * 3 + 1, target.clone().copy_(x))
    sync(device)
    graph, (y, j) = make_capturer(device, warmup=0).capture(fn)
    sync(device)
    assert host(target).tolist() == [7.0] * 4  # the captured copy_ has not run
    if device == "cpu":  # the emulator poisons what captured kernels have not written yet
        assert torch.isnan(y).all()
        assert j.tolist() == [torch.iinfo(torch.int64).min] * 4
    graph.replay()
    sync(device)
    assert host(y).tolist() == [1.0, 3.0, 5.0, 7.0]
    assert host(j).tolist() == [1, 4, 7, 10]
    assert host(target).tolist() == [1.0, 3.0, 5.0, 7.0]


def test_a_warmup_runs_eagerly_before_capture() -> None:
    count = torch.zeros(1)
    graph, _ = make_capturer("cpu", warmup=2).capture(lambda: count.add_(1))
    assert count.item() == 2.0  # two eager warm-up runs; the captured run has not run
    graph.replay()
    assert count.item() == 3.0


# ---------------------------------------------------------------------------- patterns
# Each returns what it observed, on the host, so the agreement test can compare backends.


def pattern_inplace_input(device: str) -> list[torch.Tensor]:
    """(b) static input x, captured y = x * 2; x updated in place between replays."""
    x = torch.tensor([1.0, 2.0, 3.0], device=device)
    graph, y = make_capturer(device).capture(lambda: x * 2)
    seen = []
    for new in ([4.0, 5.0, 6.0], [-1.0, 0.5, 10.0]):
        x.copy_(torch.tensor(new))
        graph.replay()
        sync(device)
        seen.append(host(y).clone())
    x = torch.tensor([100.0, 100.0, 100.0], device=device)  # a fresh tensor: invisible (GRA-005)
    graph.replay()
    sync(device)
    seen.append(host(y).clone())
    return seen


def pattern_frozen_branch(device: str) -> list[torch.Tensor]:
    """(c) fn takes a Python branch and reads a Python int at capture; both stay frozen."""
    x = torch.tensor([1.0, 2.0], device=device)
    config = {"double": True, "offset": 10}

    def fn() -> torch.Tensor:
        if config["double"]:
            return x * 2 + config["offset"]
        return x * 3 - config["offset"]

    graph, y = make_capturer(device).capture(fn)
    config["double"] = False
    config["offset"] = 1000
    x.copy_(torch.tensor([5.0, 6.0]))
    graph.replay()
    sync(device)
    return [host(y).clone()]


def pattern_allocation(device: str) -> list[torch.Tensor]:
    """(e) a tensor allocated in fn keeps its storage and holds the replayed values."""
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], device=device)

    def fn() -> torch.Tensor:
        acc = torch.zeros(4, device=device)
        acc += x
        acc *= 2
        return acc

    graph, acc = make_capturer(device).capture(fn)
    ptr = acc.data_ptr()
    seen = []
    for step in range(3):
        x.add_(step)
        graph.replay()
        sync(device)
        assert acc.data_ptr() == ptr
        seen.append(host(acc).clone())
    return seen


def pattern_kv_gather(device: str) -> list[torch.Tensor]:
    """A capturable connector: persistent int64 index buffers updated outside the graph, a
    captured gather of KV rows into a staging buffer and a captured scatter back."""
    blocks, width = 8, 3
    kv = torch.arange(blocks * width, dtype=torch.float32, device=device).reshape(blocks, width)
    staging = torch.zeros(4, width, device=device)
    idx = torch.zeros(4, dtype=torch.int64, device=device)  # per-step state (GRA-005)
    dst = torch.zeros(4, dtype=torch.int64, device=device)
    slots = torch.arange(4, device=device)

    def hook() -> None:
        staging.index_copy_(0, slots, kv.index_select(0, idx))
        kv.index_copy_(0, dst, staging * 10)

    graph, _ = make_capturer(device).capture(hook)
    kv.copy_(torch.arange(blocks * width, dtype=torch.float32).reshape(blocks, width))  # undo warm-up
    seen = []
    for rows, to in (([1, 3, 5, 7], [0, 2, 4, 6]), ([6, 4, 2, 0], [7, 5, 3, 1])):
        idx.copy_(torch.tensor(rows))
        dst.copy_(torch.tensor(to))
        graph.replay()
        sync(device)
        seen.extend([host(staging).clone(), host(kv).clone()])
    return seen


PATTERNS: dict[str, Callable[[str], list[torch.Tensor]]] = {
    "inplace_input": pattern_inplace_input,
    "frozen_branch": pattern_frozen_branch,
    "allocation": pattern_allocation,
    "kv_gather": pattern_kv_gather,
}


@pytest.mark.parametrize("device", BACKENDS)
def test_b_inplace_input_update_is_seen(device: str) -> None:
    seen = pattern_inplace_input(device)
    assert seen[0].tolist() == [8.0, 10.0, 12.0]
    assert seen[1].tolist() == [-2.0, 1.0, 20.0]
    assert seen[2].tolist() == [-2.0, 1.0, 20.0]  # the rebound name is not the captured buffer


@pytest.mark.parametrize("device", BACKENDS)
def test_c_python_branch_is_frozen_at_capture(device: str) -> None:
    (y,) = pattern_frozen_branch(device)
    assert y.tolist() == [20.0, 22.0]  # x * 2 + 10 with the new x, not x * 3 - 1000


@pytest.mark.parametrize("device", BACKENDS)
def test_e_allocation_persists_across_replays(device: str) -> None:
    seen = pattern_allocation(device)
    assert seen[0].tolist() == [2.0, 4.0, 6.0, 8.0]
    assert seen[1].tolist() == [4.0, 6.0, 8.0, 10.0]
    assert seen[2].tolist() == [8.0, 10.0, 12.0, 14.0]


@pytest.mark.parametrize("device", BACKENDS)
def test_kv_gather_follows_the_index_buffer(device: str) -> None:
    seen = pattern_kv_gather(device)
    base = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    staging1, kv1, staging2, kv2 = seen
    assert torch.equal(staging1, base[[1, 3, 5, 7]])
    expected = base.clone()
    expected[[0, 2, 4, 6]] = base[[1, 3, 5, 7]] * 10
    assert torch.equal(kv1, expected)
    assert torch.equal(staging2, expected[[6, 4, 2, 0]])
    expected2 = expected.clone()
    expected2[[7, 5, 3, 1]] = expected[[6, 4, 2, 0]] * 10
    assert torch.equal(kv2, expected2)


def test_e_reset_releases_the_allocations() -> None:
    x = torch.ones(4)

    def fn() -> torch.Tensor:
        acc = torch.zeros(4)
        acc += x
        return acc

    graph, acc = make_capturer("cpu").capture(fn)
    assert isinstance(graph, EmulatedGraph)
    (owned,) = graph.allocations
    assert owned.data_ptr() == acc.data_ptr()  # the caller's tensor is the graph's storage
    ref = weakref.ref(owned)
    del owned
    gc.collect()
    assert ref() is not None  # the graph keeps it alive
    graph.reset()
    gc.collect()
    assert ref() is None and graph.allocations == ()
    with pytest.raises(CaptureStateError, match="reset"):
        graph.replay()
    graph.reset()  # harmless twice


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_e_reset_releases_cuda_memory() -> None:
    x = torch.ones(1 << 18, device="cuda")  # 1 MiB
    gc.collect()
    before = torch.cuda.memory_allocated()
    graph, acc = make_capturer("cuda").capture(lambda: x * 2)
    graph.replay()
    torch.cuda.synchronize()
    assert acc.sum().item() == 2.0 * (1 << 18)
    assert torch.cuda.memory_allocated() >= before + (1 << 20)
    del acc
    graph.reset()
    gc.collect()
    assert torch.cuda.memory_allocated() <= before


# ---------------------------------------------------------------------------- (d) host syncs


def sync_item(x: torch.Tensor) -> object:
    return x.sum().item()  # SYNC:item


def sync_tolist(x: torch.Tensor) -> object:
    return x.tolist()  # SYNC:tolist


def sync_nonzero(x: torch.Tensor) -> object:
    return torch.nonzero(x)  # SYNC:nonzero


def sync_mask(x: torch.Tensor) -> object:
    return x[x > 1]  # SYNC:mask


def sync_if(x: torch.Tensor) -> object:
    if x[0]:  # SYNC:if
        return x * 2
    return x * 3


def sync_masked_select(x: torch.Tensor) -> object:
    return torch.masked_select(x, x > 1)  # SYNC:masked_select


def sync_unique(x: torch.Tensor) -> object:
    return torch.unique(x)  # SYNC:unique


def sync_repeat_interleave(x: torch.Tensor) -> object:
    return torch.repeat_interleave(x, x.long())  # SYNC:repeat_interleave


def sync_mask_put(x: torch.Tensor) -> object:
    x[x > 1] = torch.zeros(2, device=x.device)  # SYNC:mask_put
    return x


def sync_synchronize(x: torch.Tensor) -> object:
    torch.cuda.synchronize()  # SYNC:synchronize
    return x


def sync_print(x: torch.Tensor) -> object:
    return f"{x}"  # SYNC:print


SYNCS = {
    "item": (sync_item, "Tensor.item()"),
    "tolist": (sync_tolist, "Tensor.tolist()"),
    "nonzero": (sync_nonzero, "aten.nonzero"),
    "mask": (sync_mask, "boolean-mask indexing"),
    "if": (sync_if, "bool(tensor)"),
    "masked_select": (sync_masked_select, "aten.masked_select"),
    "unique": (sync_unique, "aten._unique2"),
    "repeat_interleave": (sync_repeat_interleave, "repeat_interleave"),
    "mask_put": (sync_mask_put, "boolean-mask index_put"),
    "synchronize": (sync_synchronize, "torch.cuda.synchronize()"),
    "print": (sync_print, "format(tensor)"),
}


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("name", list(SYNCS))
def test_d_host_sync_raises_gra004_with_call_site(device: str, name: str) -> None:
    fn, op = SYNCS[name]
    x = torch.tensor([0.0, 1.0, 2.0, 3.0], device=device)
    # On CUDA one eager warm-up run loads the kernels (syncs are fine outside capture); the CPU
    # build has no torch.cuda.synchronize to run eagerly.
    cap = make_capturer(device, warmup=0 if device == "cpu" else 1)
    with pytest.raises(ContractViolation) as info:
        cap.capture(lambda: fn(x))
    err = info.value
    assert err.clause == "GRA-004"
    assert f"{THIS_FILE}:{line_of('SYNC:' + name)}" in str(err)
    assert op in err.observed
    assert "inside a captured region" in err.observed
    # The failed capture left nothing behind: the next one works.
    x = torch.tensor([0.0, 1.0, 2.0, 3.0], device=device)
    graph, y = cap.capture(lambda: x + 1)
    graph.replay()
    sync(device)
    assert host(y).tolist() == [1.0, 2.0, 3.0, 4.0]


def test_d_sync_entry_points_are_restored_after_capture() -> None:
    original = torch.cuda.synchronize
    with pytest.raises(ContractViolation):
        make_capturer("cpu", warmup=0).capture(lambda: torch.cuda.synchronize())
    assert torch.cuda.synchronize is original


@pytest.mark.parametrize("device", BACKENDS)
def test_d_graph_safe_lookalikes_are_accepted(device: str) -> None:
    x = torch.tensor([0.0, 1.0, 2.0, 3.0], device=device)
    mask = x > 1
    reps = torch.tensor([1, 0, 2, 1], device=device)
    rows = torch.tensor([3, 0], device=device)

    def fn() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        y = x.clone()
        y[mask] = -1.0  # a scalar into a mask is masked_fill_: no sync
        z = torch.repeat_interleave(x, reps, output_size=4)  # static with output_size
        w = x[rows]  # an integer index tensor: static shape
        v = torch.where(mask, x, torch.zeros_like(x))
        return y, z, w, v

    graph, (y, z, w, v) = make_capturer(device).capture(fn)
    graph.replay()
    sync(device)
    assert host(y).tolist() == [0.0, 1.0, -1.0, -1.0]
    assert host(z).tolist() == [0.0, 2.0, 2.0, 3.0]
    assert host(w).tolist() == [3.0, 0.0]
    assert host(v).tolist() == [0.0, 0.0, 2.0, 3.0]


def test_d_cuda_capture_errors_are_translated() -> None:
    def offending() -> None:
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")  # CUDAERR

    try:
        try:
            offending()
        except RuntimeError as inner:
            raise RuntimeError("operation failed due to a previous error during capture") from inner
    except RuntimeError as outer:
        violation = translate_capture_error(outer)
    assert violation is not None and violation.clause == "GRA-004"
    assert f"{THIS_FILE}:{line_of('CUDAERR')}" in violation.observed
    assert "operation not permitted when stream is capturing" in violation.observed
    assert translate_capture_error(RuntimeError("shape mismatch")) is None


# ---------------------------------------------------------------------------- capture state


@pytest.mark.parametrize("device", BACKENDS)
def test_nested_capture_is_refused(device: str) -> None:
    cap = make_capturer(device)  # warm-up runs nested() and replays() eagerly, which is fine
    x = torch.ones(2, device=device)
    inner_graph, _ = cap.capture(lambda: x * 2)

    def nested() -> torch.Tensor:
        cap.capture(lambda: x * 2)
        return x

    def replays() -> torch.Tensor:
        inner_graph.replay()
        return x

    with pytest.raises(CaptureStateError, match="this thread"):
        cap.capture(nested)
    with pytest.raises(CaptureStateError, match="this thread"):
        cap.capture(replays)
    inner_graph.replay()  # fine again once no capture runs


def test_capture_across_threads_is_refused() -> None:
    cap = make_capturer("cpu", warmup=0)
    x = torch.ones(2)
    other_graph, _ = cap.capture(lambda: x * 5)
    started, release = threading.Event(), threading.Event()
    results: list[tuple[CapturedGraph, torch.Tensor]] = []

    def slow() -> torch.Tensor:
        started.set()
        release.wait(5)
        return x * 3

    thread = threading.Thread(target=lambda: results.append(cap.capture(slow)))
    thread.start()
    try:
        assert started.wait(5)
        with pytest.raises(CaptureStateError, match="another thread"):
            cap.capture(lambda: x * 2)
        with pytest.raises(CaptureStateError, match="another thread"):
            other_graph.replay()
    finally:
        release.set()
        thread.join(5)
    assert len(results) == 1
    graph, y = results[0]
    graph.replay()
    assert y.tolist() == [3.0, 3.0]


def test_fn_errors_propagate_and_leave_no_capture_behind() -> None:
    cap = make_capturer("cpu", warmup=0)
    x = torch.ones(2, 3)
    with pytest.raises(RuntimeError):
        cap.capture(lambda: x @ x)  # a shape error, reported as eager would
    with pytest.raises(ZeroDivisionError):
        cap.capture(lambda: 1 / 0)
    graph, y = cap.capture(lambda: x.sum(0))
    graph.replay()
    assert y.tolist() == [2.0, 2.0, 2.0]


def test_emulator_refuses_non_strided_tensors() -> None:
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(CapabilityError, match="dense strided"):
        make_capturer("cpu", warmup=0).capture(lambda: sparse * 2)


def test_errors_are_kvspec_errors() -> None:
    for exc in (CaptureStateError, ContractViolation):
        assert issubclass(exc, KVSpecError)


# ---------------------------------------------------------------------------- GRA-006: eager


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "kv": torch.randn(10, 4, 3, generator=g),
        "idx": torch.tensor([3, 1, 7]),
        "dst": torch.tensor([2, 0, 1]),
        "st": torch.zeros(3, 4, 3),
        "acc": torch.zeros(10, 4, 3),
        "m": torch.randn(10, 4, 3, generator=g) > 0,
        "w": torch.randn(3, 5, generator=g),
    }


S = dict[str, torch.Tensor]
EAGER_CASES: dict[str, Callable[[S], object]] = {
    "index_select": lambda s: s["kv"].index_select(0, s["idx"]),
    "index": lambda s: s["kv"][s["idx"], 1:3],
    "index_put_accumulate": lambda s: s["acc"].index_put_((s["idx"],), s["kv"][:3], accumulate=True),
    "setitem_index": lambda s: s["acc"].__setitem__(s["idx"], s["kv"][:3] * 2),
    "index_copy_": lambda s: s["st"].index_copy_(0, s["dst"], s["kv"][s["idx"]]),
    "index_add_": lambda s: s["acc"].index_add_(0, s["idx"], s["kv"][:3]),
    "copy_into_slice": lambda s: s["acc"][2:5].copy_(s["kv"][s["idx"]]),
    "clone_view_select": lambda s: s["kv"].clone().view(10, 12)[:, 3],
    "permute_reshape_narrow": lambda s: s["kv"].permute(2, 0, 1).reshape(3, -1).narrow(1, 5, 7),
    "transpose_reshape_copies": lambda s: s["kv"].transpose(0, 2).reshape(-1) + 0,
    "cat_stack": lambda s: torch.cat([torch.stack([s["kv"][0], s["kv"][1]]), s["kv"][s["idx"]]]),
    "arith": lambda s: (s["kv"] + 1) * s["kv"] - s["kv"] / 2,
    "fill_zero": lambda s: (s["st"].fill_(3.0), s["acc"][1].zero_(), s["acc"]),
    "inplace_chain": lambda s: s["acc"].add_(s["kv"]).mul_(2).sub_(1),
    "write_view_of_new": lambda s: (lambda y: (y[0].fill_(9.0), y)[1])(s["kv"] * 1),
    "masked_fill_where": lambda s: torch.where(s["m"], s["kv"].masked_fill(s["m"], 0.5), -s["kv"]),
    "scatter_gather": lambda s: (
        s["acc"].scatter_(0, s["idx"].view(3, 1, 1).expand(3, 4, 3), s["kv"][:3]),
        s["kv"].gather(0, s["idx"].view(3, 1, 1).expand(3, 4, 3)),
    ),
    "matmul_softmax": lambda s: torch.softmax(s["kv"].reshape(-1, 3) @ s["w"], dim=-1),
    "dtype_roundtrip": lambda s: (s["kv"].to(torch.float16) * 3).to(torch.float32),
    "factories": lambda s: torch.arange(5) * 2 + torch.full((5,), 7) + torch.zeros(5, dtype=torch.long),
    "empty_then_copy": lambda s: torch.empty(10, 4, 3).copy_(s["kv"]).mul_(2),
    "out_argument": lambda s: torch.mul(s["kv"], 3, out=s["acc"]),
    "out_resized": lambda s: torch.add(s["idx"], 1, out=torch.empty(0, dtype=torch.long)),
    "captured_index": lambda s: s["kv"].index_select(0, (s["idx"] + 1) % 10),
    "reductions": lambda s: (s["kv"].sum(0), s["kv"].argmax(0), s["kv"].reshape(10, -1).topk(3, dim=1)),
}


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


@pytest.mark.parametrize("name", list(EAGER_CASES))
def test_emulator_replay_equals_eager(name: str) -> None:
    """GRA-006 on the emulator: replay gives what eager gives, step after step."""
    fn = EAGER_CASES[name]
    eager, captured = _state(), _state()
    graph, out = make_capturer("cpu", warmup=0).capture(lambda: fn(captured))
    for step in range(2):
        if step:
            for s in (eager, captured):
                s["idx"].copy_(torch.tensor([0, 9, 5]))
                s["kv"].mul_(-1)
        expected = _tensors(fn(eager))
        graph.replay()
        got = _tensors(out)
        assert len(got) == len(expected)
        for e, g in zip(expected, got):
            assert e.dtype == g.dtype and e.shape == g.shape and torch.equal(e, g), name
        for key in eager:
            assert torch.equal(eager[key], captured[key]), (name, key)


# ---------------------------------------------------------------------------- agreement


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(PATTERNS))
def test_backends_agree(name: str) -> None:
    on_cpu = PATTERNS[name]("cpu")
    on_cuda = PATTERNS[name]("cuda")
    assert len(on_cpu) == len(on_cuda)
    for a, b in zip(on_cpu, on_cuda):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(EAGER_CASES))
def test_backends_agree_on_eager_cases(name: str) -> None:
    fn = EAGER_CASES[name]
    results = []
    for device in ("cpu", "cuda"):
        state = {k: v.to(device) for k, v in _state().items()}
        with torch.device(device):  # factories inside fn allocate on the device
            # Warm-up runs fn eagerly (cuBLAS and kernels initialise) on both backends alike.
            graph, out = make_capturer(device).capture(lambda: fn(state))
        graph.replay()
        sync(device)
        results.append([host(t) for t in _tensors(out)] + [host(v) for v in state.values()])
    for a, b in zip(*results):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-5), name
