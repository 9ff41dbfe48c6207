"""A CPU emulator of CUDA-graph capture and replay, on torch's dispatch machinery.

Every ATen op that ``fn`` runs under capture reaches ``_Recorder``, a
``TorchDispatchMode``, which sorts it:

* **GRA-004 refusals** — host syncs and data-dependent shapes — raise at once (the rules in ``_capture``).
* **Views and other metadata-only ops** (``view``, ``slice``, ``select``, ``permute``,
  ``as_strided``, ``_unsafe_view``, ``detach``, ``alias``, ``lift_fresh``, in-place views such as
  ``t_``/``squeeze_``/``resize_``/``set_``, and ops returning no tensor) execute for real: they
  run no kernel, and later ops must see the real aliasing.
* **Uninitialised allocations** (``empty``, ``empty_like``, ``empty_strided``, ``new_empty``...)
  allocate a poisoned tensor and record nothing: no kernel runs for them on a GPU either.
* **Every other op** is recorded, not executed. Its output metadata comes from running it on
  ``meta`` copies of its arguments (which also checks shapes and dtypes as eager would); new
  outputs are real tensors of that shape, dtype and strides, owned by the graph and filled with
  ``poison_value``; outputs that alias a mutated argument (``add_``, ``copy_``,
  ``index_copy_``, ``out=``) are that argument, left unmodified.

Replay calls each recorded op again, outside any mode, on the same tensors (aliases taken at
capture, so later ``set_``/``t_`` on a Python object do not move the graph), and copies each
new result into the tensor allocated at capture. Factory ops replay by recomputing: ``zeros``
refills zeros, ``arange`` recomputes, random ops draw fresh numbers, as on a real graph.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ...protocols.errors import CapabilityError
from ._capture import (
    CaptureStateError,
    GraphCapturer,
    capture_region,
    check_dispatch,
    ensure_not_capturing,
    host_sync_guard,
    require_callable,
)

__all__ = ["EmulatedGraph", "EmulatorCapturer", "poison_value"]

T = TypeVar("T")

aten = torch.ops.aten

_UNINITIALISED_ALLOCATIONS = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_like.default,
        aten.empty_strided.default,
        aten.empty_permuted.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
    }
)
# Ops that alias an input without saying so in their schema.
_UNANNOTATED_VIEWS = frozenset({aten._unsafe_view.default})


def poison_value(dtype: torch.dtype) -> float | int | bool | complex | None:
    """The value the emulator fills captured outputs with before the first replay (GRA-006).

    NaN for floating dtypes (``nan+nanj`` for complex), the minimum for signed integers, the
    maximum for unsigned integers, ``True`` for bool; None for dtypes it leaves as allocated
    (quantised and sub-byte types). A value that is still poison after replay was never written
    by the graph: the connector read a result that the captured work does not produce, so its
    replay cannot equal its eager run (GRA-006). It also marks what a hook reads before the
    captured kernels ran, such as outputs inspected right after capture (GRA-004).
    """
    if dtype == torch.bool:
        return True
    if dtype.is_complex:
        return complex(float("nan"), float("nan"))
    if dtype.is_floating_point:
        return float("nan")
    try:
        info = torch.iinfo(dtype)
    except TypeError:
        return None
    return info.max if not dtype.is_signed else info.min


def _poison(t: torch.Tensor) -> torch.Tensor:
    value = poison_value(t.dtype)
    if value is not None and t.numel() > 0:
        t.fill_(value)
    return t


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to the tensors in an op argument (a tensor, or a list/tuple of them)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def _require_strided(func: torch._ops.OpOverload, t: torch.Tensor) -> None:
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        raise CapabilityError(
            f"the graph emulator handles dense strided tensors only; {func} got a tensor with "
            f"layout {t.layout}{' (quantized)' if t.is_quantized else ''}"
            f"{' (nested)' if t.is_nested else ''}: capture it on CUDA"
        )


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for v in value:
            found = _first_tensor(v)
            if found is not None:
                return found
    return None


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, torch.device):
        return torch.device("meta")
    if isinstance(value, torch.Generator):
        return None
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    return value


def _meta_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: _to_meta(v) for k, v in kwargs.items()}
    if out.get("pin_memory"):
        out["pin_memory"] = False
    return out


def _output_device(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.device:
    explicit = kwargs.get("device")
    if isinstance(explicit, torch.device):
        return explicit
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.device):
            return value
    for value in (*args, *kwargs.values()):
        found = _first_tensor(value)
        if found is not None:
            return found.device
    return torch.get_default_device()


def _allocate_like(meta: Any, device: torch.device) -> Any:
    """Real, poisoned tensors with ``meta``'s shape, strides and dtype (recursively)."""
    if isinstance(meta, torch.Tensor):
        t = torch.empty_strided(meta.size(), meta.stride(), dtype=meta.dtype, device=device)
        return _poison(t)
    if isinstance(meta, (list, tuple)):
        return [_allocate_like(m, device) for m in meta]
    return meta


def _copy_into(target: Any, result: Any) -> None:
    if isinstance(target, torch.Tensor):
        target.copy_(result)
    elif isinstance(target, list):
        for t, r in zip(target, result):
            _copy_into(t, r)


def _as_items(func: torch._ops.OpOverload, result: Any) -> list[Any]:
    n = len(func._schema.returns)
    if n == 0:
        return []
    if n == 1:
        return [result]
    return list(result)


def _pack(func: torch._ops.OpOverload, items: list[Any]) -> Any:
    n = len(func._schema.returns)
    if n == 0:
        return None
    if n == 1:
        return items[0]
    return tuple(items)


class _Record:
    """One recorded op: call it again, then copy its new outputs into the captured tensors."""

    __slots__ = ("args", "func", "kwargs", "outputs")

    def __init__(
        self,
        func: torch._ops.OpOverload,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        outputs: list[tuple[int, Any]],
    ) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.outputs = outputs

    def run(self) -> None:
        result = self.func(*self.args, **self.kwargs)
        if self.outputs:
            items = _as_items(self.func, result)
            for index, target in self.outputs:
                _copy_into(target, items[index])


def _freeze(t: torch.Tensor) -> torch.Tensor:
    # A new tensor object on the same storage, with today's sizes and strides: what the graph
    # reads and writes stays fixed even if the caller later calls set_/t_/squeeze_ on ``t``.
    alias: torch.Tensor = aten.alias.default(t)
    return alias


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records ``fn``'s ATen ops instead of running them (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.records: list[_Record] = []
        self.allocations: list[torch.Tensor] = []

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        check_dispatch(func, args, kwargs)
        for value in (*args, *kwargs.values()):
            _map_tensors(value, lambda t: _require_strided(func, t))
        with torch._C.DisableTorchFunction():
            return self._handle(func, args, kwargs)

    def _handle(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        schema = func._schema
        if (
            func.is_view
            or func in _UNANNOTATED_VIEWS
            or torch.Tag.inplace_view in func.tags
            or (schema.returns and not any("Tensor" in str(r.type) for r in schema.returns))
        ):
            # No kernel runs for these; run them now so that aliasing and metadata are real.
            return func(*args, **kwargs)
        device = _output_device(args, kwargs)
        if func in _UNINITIALISED_ALLOCATIONS:
            out = _allocate_like(func(*_to_meta(args), **_meta_kwargs(kwargs)), device)
            self._own(out)
            return out

        # The value of each written argument, by alias set, for the outputs that alias it.
        written: dict[frozenset[str], Any] = {}
        for position, argument in enumerate(schema.arguments):
            info = argument.alias_info
            if info is not None and info.is_write:
                positional = position < len(args) and not argument.kwarg_only
                value = args[position] if positional else kwargs.get(argument.name)
                written[frozenset(info.before_set)] = value

        meta_items = self._meta_result(func, args, kwargs, bool(written))
        items: list[Any] = []
        outputs: list[tuple[int, Any]] = []
        for index, ret in enumerate(schema.returns):
            info = ret.alias_info
            if info is not None and info.is_write:
                target = written[frozenset(info.before_set)]
                if meta_items is not None and isinstance(target, torch.Tensor):
                    shape = meta_items[index].shape
                    if target.shape != shape:  # an out= tensor of the wrong size is resized
                        _poison(target.resize_(shape))
                items.append(target)
            else:
                if meta_items is None:
                    raise CapabilityError(
                        f"the graph emulator cannot tell the output shape of {func}: it has no "
                        "meta kernel and could not run on the captured inputs; capture it on CUDA"
                    )
                out = _allocate_like(meta_items[index], device)
                self._own(out)
                items.append(out)
                outputs.append((index, out))

        frozen_args = tuple(_map_tensors(a, _freeze) for a in args)
        frozen_kwargs = {k: _map_tensors(v, _freeze) for k, v in kwargs.items()}
        self.records.append(_Record(func, frozen_args, frozen_kwargs, outputs))
        return _pack(func, items)

    @staticmethod
    def _meta_result(
        func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], mutates: bool
    ) -> list[Any] | None:
        """The op's outputs computed on meta copies (or, without a meta kernel, for real on the
        inputs when the op writes nothing), or None when neither works for a mutating op."""
        try:
            return _as_items(func, func(*_to_meta(args), **_meta_kwargs(kwargs)))
        except NotImplementedError:
            pass
        if mutates:
            return None  # no way to check it without running it: trust the caller's shapes
        try:
            return _as_items(func, func(*args, **kwargs))
        except Exception:
            return None

    def _own(self, value: Any) -> None:
        _map_tensors(value, self.allocations.append)


class EmulatedGraph:
    """A graph recorded by the CPU emulator (a ``CapturedGraph``).

    Owns every tensor allocated under capture until ``reset`` (GRA-004: addresses stay
    fixed across replays) and reads tensors that existed before capture where they were
    (GRA-005).
    """

    def __init__(self, records: list[_Record], allocations: list[torch.Tensor]) -> None:
        self._records: list[_Record] | None = records
        self._allocations: list[torch.Tensor] | None = allocations
        self._ops = tuple(str(r.func) for r in records)

    @property
    def recorded_ops(self) -> tuple[str, ...]:
        """The recorded ATen ops, in replay order (``"aten.index_select.default"``...)."""
        return self._ops

    @property
    def allocations(self) -> tuple[torch.Tensor, ...]:
        """The tensors allocated under capture and owned by the graph (empty after reset)."""
        return tuple(self._allocations or ())

    def replay(self) -> None:
        """Re-run the recorded ops in capture order on the captured tensors (GRA-006).

        Raises:
            CaptureStateError: the graph was reset, or a capture is under way.
        """
        ensure_not_capturing("replay a graph")
        records = self._records
        if records is None:
            raise CaptureStateError("this graph was reset; capture it again to replay it")
        # Inference mode lets the recorded in-place ops write tensors made in any grad mode.
        with torch.inference_mode():
            for record in records:
                record.run()

    def reset(self) -> None:
        """Drop the recorded ops and the graph's references to what capture allocated."""
        self._records = None
        self._allocations = None


class EmulatorCapturer(GraphCapturer):
    """The capturer ``make_capturer`` returns for ``cpu``: emulated CUDA graphs.

    ``capture(fn)`` runs ``fn`` ``warmup`` times eagerly, then records it under
    ``_Recorder`` with the GRA-004 host-read guards, and returns an
    ``EmulatedGraph`` and ``fn``'s (poisoned) outputs.
    """

    def capture(self, fn: Callable[[], T]) -> tuple[EmulatedGraph, T]:
        """See ``capture``."""
        require_callable(fn)
        ensure_not_capturing("start a capture")
        for _ in range(self.warmup):
            fn()
        recorder = _Recorder()
        with capture_region(), host_sync_guard(), recorder:
            out = fn()
        return EmulatedGraph(recorder.records, recorder.allocations), out

