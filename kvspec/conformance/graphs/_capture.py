"""The machinery both capturers share: the GRA-004 rules, capture state, and the API types.

``CudaCapturer`` (``_cuda``) and ``EmulatorCapturer`` (``_emulator``) subclass
``GraphCapturer`` and use the guards here: one capture at a time in the process
(``capture_region``, ``ensure_not_capturing``), host reads and synchronisation refused in
the capturing thread (``host_sync_guard``), and the ATen-level check of each op
(``check_dispatch``, ``CheckingDispatchMode``). ``kvspec.conformance.graphs.api`` is the
public face: it re-exports the API types and holds ``make_capturer``, which picks a backend.
"""

from __future__ import annotations

import abc
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ...protocols.errors import (
    CapabilityError,
    ContractViolation,
    InvalidArgumentError,
    KVSpecError,
)
from ...protocols.wire import resolve_type_path

__all__ = [
    "DATA_DEPENDENT_SHAPE_OPS",
    "DEFAULT_WARMUP",
    "HOST_READ_METHODS",
    "HOST_SYNC_OPS",
    "CaptureStateError",
    "CapturedGraph",
    "CheckingDispatchMode",
    "GraphCapturer",
    "capture_region",
    "check_dispatch",
    "cuda_unavailable",
    "ensure_not_capturing",
    "host_sync_guard",
    "require_callable",
    "translate_capture_error",
]

T = TypeVar("T")

DEFAULT_WARMUP = 3
"""Eager warm-up runs before each capture by default, on both implementations."""

# --------------------------------------------------------------------------- rules (GRA-004)

DATA_DEPENDENT_SHAPE_OPS: frozenset[str] = frozenset(
    {
        # Always data-dependent: the output size is the number of matching elements.
        "aten.nonzero",
        "aten.nonzero_numpy",
        "aten.argwhere",
        "aten.masked_select",
        "aten.unique",
        "aten._unique",
        "aten._unique2",
        "aten.unique_dim",
        "aten.unique_consecutive",
        "aten.unique_dim_consecutive",
        "aten.bincount",
        # Data-dependent only without ``output_size`` (the .Tensor and .self_Tensor overloads).
        "aten.repeat_interleave",
        # Data-dependent only with a boolean (or uint8) mask among the indices, which is
        # expanded with nonzero(). Exception, as in ATen: index_put_ without accumulate, with a
        # single mask and a one-element value, becomes masked_fill_ and is graph-safe.
        "aten.index",
        "aten._unsafe_index",
        "aten.index_put",
        "aten.index_put_",
        "aten._index_put_impl_",
        "aten._unsafe_index_put",
    }
)
"""ATen ops (overload packets) whose output shape can depend on tensor values (GRA-004).

Under capture they raise ``ContractViolation`` for GRA-004, on both
implementations. ``repeat_interleave`` is refused only without ``output_size``; the indexing ops
only when indexing with a boolean or uint8 mask (``x[mask]``), not with an integer index tensor
(``x[idx]``), which is static-shaped and the way a capturable connector gathers rows.
"""

HOST_SYNC_OPS: frozenset[str] = frozenset(
    {
        "aten._local_scalar_dense",  # .item(), bool(t), int(t), float(t), `if t:`
        "aten.item",
        "aten.is_nonzero",
        "aten.equal",  # torch.equal returns a Python bool
        "aten.allclose",
    }
)
"""ATen ops (overload packets) that return a tensor value to the host (GRA-004)."""

_HOST_READ_NAMES: tuple[tuple[str, str], ...] = (
    ("item", "Tensor.item()"),
    ("tolist", "Tensor.tolist()"),
    ("numpy", "Tensor.numpy()"),
    ("__array__", "numpy.asarray(tensor)"),
    ("__bool__", "bool(tensor) / `if tensor:`"),
    ("__int__", "int(tensor)"),
    ("__float__", "float(tensor)"),
    ("__complex__", "complex(tensor)"),
    ("__index__", "operator.index(tensor)"),
    ("__repr__", "repr(tensor) / printing a tensor"),
    ("__format__", "format(tensor)"),
)

HOST_READ_METHODS: Mapping[object, str] = types.MappingProxyType(
    {getattr(torch.Tensor, attr): label for attr, label in _HOST_READ_NAMES}
)
"""``torch.Tensor`` methods that read tensor values on the host, with how the error names them.

Refused under capture before any ATen op runs (GRA-004). ``tolist`` and ``numpy`` reach no ATen
op on a CPU tensor, so this is the only place they can be caught.
"""

# Synchronisation entry points replaced, while a capture runs, by versions that raise in the
# capturing thread (calls from other threads pass through). Calls through a reference taken
# before the capture (``from torch.cuda import synchronize``) are not seen.
_SYNC_ENTRY_POINTS: tuple[tuple[str, str, str], ...] = (
    ("torch.cuda", "synchronize", "torch.cuda.synchronize()"),
    ("torch.cpu", "synchronize", "torch.cpu.synchronize()"),
    ("torch.accelerator", "synchronize", "torch.accelerator.synchronize()"),
    ("torch.cuda.Stream", "synchronize", "torch.cuda.Stream.synchronize()"),
    ("torch.cuda.Stream", "query", "torch.cuda.Stream.query()"),
    ("torch.cuda.Event", "synchronize", "torch.cuda.Event.synchronize()"),
    ("torch.cuda.Event", "query", "torch.cuda.Event.query()"),
)

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_GRAPHS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class CaptureStateError(KVSpecError, RuntimeError):
    """Capture or replay was asked for in a state that forbids it.

    Raised for a capture inside a capture, a capture while another thread captures, a replay
    while any thread captures (CUDA's global capture mode forbids all three), and a replay after
    ``CapturedGraph.reset``.
    """


# --------------------------------------------------------------------------- the API types


@runtime_checkable
class CapturedGraph(Protocol):
    """A captured region, replayable any number of times until reset (GRA-005, GRA-006)."""

    def replay(self) -> None:
        """Re-run the recorded device work in capture order, on the memory used at capture.

        Outputs of the capture are updated in place; no Python of the captured function runs.

        Raises:
            CaptureStateError: the graph was reset, or a capture is under way.
        """
        ...

    def reset(self) -> None:
        """Release what the capture allocated; the graph cannot be replayed afterwards.

        Tensors still referenced by the caller stay valid as tensors but are no longer updated.
        Calling ``reset`` twice is harmless.
        """
        ...


class GraphCapturer(abc.ABC):
    """Captures a function into a ``CapturedGraph``; made by ``make_capturer``."""

    def __init__(self, device: torch.device, warmup: int) -> None:
        self._device = device
        self._warmup = warmup

    @property
    def device(self) -> torch.device:
        """The device whose work is captured (``cpu`` for the emulator)."""
        return self._device

    @property
    def warmup(self) -> int:
        """How many times ``capture`` runs ``fn`` eagerly before capturing it."""
        return self._warmup

    @abc.abstractmethod
    def capture(self, fn: Callable[[], T]) -> tuple[CapturedGraph, T]:
        """Run ``fn`` ``warmup`` times eagerly, then once under capture.

        Returns the graph and what ``fn`` returned under capture; tensors in it are updated in
        place by every replay. Before the first replay they hold no computed values.

        Raises:
            ContractViolation: ``fn`` synchronised with the host or ran an op with a
                data-dependent output shape under capture (GRA-004); the message names the op
                and its ``file:line``.
            CaptureStateError: a capture is already under way, in this thread or another.
            InvalidArgumentError: ``fn`` is not callable.
        """


# --------------------------------------------------------------------------- shared machinery

_registry_lock = threading.Lock()
_capturing_thread: int | None = None


def ensure_not_capturing(what: str) -> None:
    """Raise ``CaptureStateError`` if any thread is capturing."""
    owner = _capturing_thread
    if owner is None:
        return
    where = "this thread" if owner == threading.get_ident() else "another thread"
    raise CaptureStateError(
        f"cannot {what} while a graph capture is under way in {where}; "
        "captures do not nest and run one at a time in the process"
    )


@contextmanager
def capture_region() -> Iterator[None]:
    """Mark the calling thread as the one capturing, for the duration of the block."""
    global _capturing_thread
    with _registry_lock:
        ensure_not_capturing("start a capture")
        _capturing_thread = threading.get_ident()
    try:
        yield
    finally:
        with _registry_lock:
            _capturing_thread = None


def require_callable(fn: object) -> None:
    if not callable(fn):
        raise InvalidArgumentError(f"capture() needs a callable, got {type(fn).__name__}")


def _is_internal(filename: str) -> bool:
    return filename.startswith(_TORCH_DIR) or filename.startswith(_GRAPHS_DIR)


def _call_site(frame: types.FrameType | None = None) -> str:
    """``file:line`` of the innermost frame outside torch and this package."""
    frame = sys._getframe(1) if frame is None else frame
    while frame is not None:
        if not _is_internal(os.path.abspath(frame.f_code.co_filename)):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown call site>"


def _traceback_site(tb: types.TracebackType | None) -> str:
    """``file:line`` of the innermost traceback entry outside torch and this package."""
    site = "<unknown call site>"
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not _is_internal(os.path.abspath(filename)):
            site = f"{filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return site


def _violation(op: str, site: str) -> ContractViolation:
    return ContractViolation(
        "GRA-004",
        observed=f"{op} at {site} inside a captured region: host sync / data-dependent shape",
        expected="pure device work with static shapes inside captured regions",
    )


def _arg(args: tuple[Any, ...], kwargs: Mapping[str, Any], index: int, name: str) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name)


def _is_mask(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


_INDEX_PUT_OPS = ("aten.index_put", "aten.index_put_", "aten._index_put_impl_", "aten._unsafe_index_put")


def _data_dependent_reason(
    name: str, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> str | None:
    """Why an op of ``DATA_DEPENDENT_SHAPE_OPS`` is data-dependent here, or None."""
    if name == "aten.repeat_interleave":
        if func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None:
            return "repeat_interleave with repeats as a tensor and no output_size"
        return None
    if name in ("aten.index", "aten._unsafe_index"):
        indices = _arg(args, kwargs, 1, "indices") or ()
        if any(_is_mask(i) for i in indices):
            return "boolean-mask indexing, which runs nonzero()"
        return None
    if name in _INDEX_PUT_OPS:
        indices = [i for i in (_arg(args, kwargs, 1, "indices") or ()) if i is not None]
        if not any(_is_mask(i) for i in indices):
            return None
        values = _arg(args, kwargs, 2, "values")
        accumulate = bool(_arg(args, kwargs, 3, "accumulate"))
        as_masked_fill = (
            not accumulate
            and len(indices) == 1
            and isinstance(values, torch.Tensor)
            and values.numel() == 1
        )
        return None if as_masked_fill else "boolean-mask index_put, which runs nonzero()"
    return "output shape depends on tensor values"


def check_dispatch(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> None:
    """Raise the GRA-004 violation if ``func`` is a host sync or data-dependent here."""
    name = str(func.overloadpacket)
    if name in HOST_SYNC_OPS:
        raise _violation(f"{func} (reads a tensor value on the host)", _call_site())
    if name in DATA_DEPENDENT_SHAPE_OPS:
        reason = _data_dependent_reason(name, func, args, kwargs)
        if reason is not None:
            raise _violation(f"{func} ({reason})", _call_site())


class _HostReadGuard(TorchFunctionMode):
    """Refuses the ``HOST_READ_METHODS`` in the capturing thread."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        label = HOST_READ_METHODS.get(func)
        if label is not None:
            raise _violation(label, _call_site())
        return func(*args, **(kwargs or {}))


class CheckingDispatchMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs every op as is after the GRA-004 checks (used around real CUDA capture)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        check_dispatch(func, args, kwargs)
        return func(*args, **kwargs)


def _resolve(path: str) -> Any:
    try:
        return resolve_type_path(path, allow_dotted=True)
    except KVSpecError:
        return None


def _guarded(original: Callable[..., Any], label: str, thread: int) -> Callable[..., Any]:
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == thread:
            raise _violation(label, _call_site())
        return original(*args, **kwargs)

    guarded.__wrapped__ = original  # type: ignore[attr-defined]
    return guarded


@contextmanager
def host_sync_guard() -> Iterator[None]:
    """Refuse host reads and explicit synchronisation in this thread for the block (GRA-004).

    ATen-level checks are the dispatch mode's job (the emulator's recorder, or
    ``CheckingDispatchMode`` around CUDA capture).
    """
    thread = threading.get_ident()
    patched: list[tuple[Any, str, Any]] = []
    try:
        for owner_path, attr, label in _SYNC_ENTRY_POINTS:
            owner = _resolve(owner_path)
            original = getattr(owner, attr, None) if owner is not None else None
            if original is None or not callable(original):
                continue
            setattr(owner, attr, _guarded(original, label, thread))
            patched.append((owner, attr, original))
        with _HostReadGuard():
            yield
    finally:
        for owner, attr, original in reversed(patched):
            setattr(owner, attr, original)


def translate_capture_error(err: BaseException) -> ContractViolation | None:
    """Turn CUDA's own stream-capture error into the GRA-004 violation, with the call site.

    Of the exceptions in ``err``'s chain whose message mentions capture, the innermost (the one
    the others were raised on top of, typically by ``capture_end``) is used; its traceback gives
    the innermost frame outside torch and this package. None if no exception in the chain is
    about capture.
    """
    seen: set[int] = set()
    found: BaseException | None = None
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, RuntimeError) and "captur" in str(current).lower():
            found = current
        current = current.__cause__ or current.__context__
    if found is None:
        return None
    lines = str(found).strip().splitlines()
    detail = lines[0] if lines else type(found).__name__
    return _violation(
        f"a CUDA call not permitted during stream capture ({detail})",
        _traceback_site(found.__traceback__),
    )


def cuda_unavailable() -> CapabilityError:
    return CapabilityError(
        "CUDA is not available (torch.cuda.is_available() is False): CUDA graphs need a CUDA "
        "GPU; use make_capturer('cpu') for the emulator"
    )
