"""Deliberately graph-unsafe variants of the layerwise-storage connector, one clause each.

Every factory here is the
``LayerwiseStorageConnector`` with one per-layer
hook changed. Each still declares ``HookGraphMode.CAPTURABLE`` and behaves correctly when its
hooks run eagerly at every step; each breaks under dummy runs or graph capture, which is what
the graph and dummy-run clauses exist to catch. Each names the clause it breaks in its
docstring and its ``violates`` class attribute, and is listed with that clause in
``BROKEN_GRAPH_CONNECTORS``.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvspec.protocols import ConnectorMetadata, ForwardContextView

from .layerwise import LayerwiseStorageConnector, LayerwiseStorageWorker

__all__ = [
    "AssertsRealMetadataConnector",
    "BROKEN_GRAPH_CONNECTORS",
    "BrokenGraphConnector",
    "ItemInHookConnector",
    "PythonDecidesConnector",
]


class BrokenGraphConnector(LayerwiseStorageConnector):
    """Base of the graph-unsafe variants: a layerwise-storage connector that breaks
    ``violates``."""

    violates: ClassVar[str] = ""
    """The ID of the one clause the variant breaks."""
    variant: ClassVar[str] = ""
    """A short tag telling apart variants that break the same clause."""

    @property
    def name(self) -> str:
        """``"broken-<clause>-<variant>"``, e.g. ``"broken-gra-004-item-in-hook"``."""
        return f"broken-{self.violates.lower()}-{self.variant}"


# ------------------------------------------------------------------------------ GRA-004


class _PythonDecidesWorker(LayerwiseStorageWorker):
    """Copies blocks chosen in Python from the bound metadata (GRA-004)."""

    _loaded_ok: tuple[bool, ...] = ()  # per load of the bound metadata

    def wait_for_layer_load(self, layer_name: str) -> None:
        views = self._slot_views(layer_name, "wait_for_layer_load")
        if views is None:
            return
        meta = self._slot.get("wait_for_layer_load")
        slot, kv = views.slot, self._kv
        assert kv is not None
        staging, tensor = self._buf["load_staging"], kv.tensors[slot]
        # The bug: which blocks to copy is decided here, in Python, from this step's
        # metadata. Captured with dummy metadata the loop runs zero times, so the graph
        # records no copy and every replay skips the real loads.
        for i, (block, _key) in enumerate(meta.loads):
            if self._loaded_ok[i]:
                kv.block(tensor, block).copy_(staging[i, slot])

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, forward_context: ForwardContextView
    ) -> None:
        views = self._slot_views(layer_name, "save_kv_layer")
        if views is None:
            return
        meta = self._slot.get("save_kv_layer")
        slot, kv = views.slot, self._kv
        assert kv is not None
        staging = self._buf["save_staging"]
        for i, (block, _key) in enumerate(meta.saves):  # same bug as the loads
            staging[i, slot].copy_(kv.block(kv_layer, block))

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        loads = len(self._slot.get("bind_connector_metadata").loads)
        mask = self._buf.get("load_mask")
        self._loaded_ok = tuple(mask[:loads].tolist()) if mask is not None else ()


class PythonDecidesConnector(BrokenGraphConnector):
    """Breaks GRA-004 and so GRA-006: its per-layer hooks loop, in Python, over the block ids
    of the bound metadata and copy each block with Python-int indexing. Eagerly that is
    correct; captured under FULL graphs with dummy metadata (no job) the loops record
    nothing, so every replay silently skips the step's real loads and saves. A Python
    decision is invisible from outside; what the suite observes, and reports, is the replay
    moving other bytes than the same step run eagerly (GRA-006)."""

    violates = "GRA-006"
    variant = "python-decides"
    worker_class = _PythonDecidesWorker


class _ItemInHookWorker(LayerwiseStorageWorker):
    """Reads a tensor value on the host inside a per-layer hook (GRA-004)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        # The bug: a host sync (aten._local_scalar_dense) inside a hook that is captured.
        if int(self._buf["load_mask"].sum().item()) == 0:
            return
        super().wait_for_layer_load(layer_name)


class ItemInHookConnector(BrokenGraphConnector):
    """Breaks GRA-004: ``wait_for_layer_load`` first counts the step's loads with
    ``int(load_mask.sum().item())`` and returns early when there are none: a host sync
    inside a captured hook, which graph capture refuses (and which, captured anyway, would
    freeze the dummy run's "nothing to load" answer into every replay)."""

    violates = "GRA-004"
    variant = "item-in-hook"
    worker_class = _ItemInHookWorker


# ------------------------------------------------------------------------------ DRY-005


class _AssertsRealMetadataWorker(LayerwiseStorageWorker):
    """Refuses dummy metadata in a per-layer hook (DRY-005)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        meta = self._slot.get("wait_for_layer_load")
        # The bug (vLLM issue 26675): the hook insists on a real step. Explicit raise rather
        # than ``assert`` so that ``python -O`` cannot hide it.
        if meta.dummy:
            raise AssertionError(
                f"wait_for_layer_load({layer_name!r}) expects the metadata of a real step, "
                "got dummy metadata"
            )
        super().wait_for_layer_load(layer_name)


class AssertsRealMetadataConnector(BrokenGraphConnector):
    """Breaks DRY-005: ``wait_for_layer_load`` raises AssertionError unless the bound
    metadata describes a real step, while the metadata its own ``build_dummy_connector_meta``
    builds is marked dummy, so every warm-up and capture forward fails (the pattern of vLLM
    issue 26675: a connector whose hooks cannot run on its own dummy metadata)."""

    violates = "DRY-005"
    variant = "asserts-real"
    worker_class = _AssertsRealMetadataWorker


BROKEN_GRAPH_CONNECTORS: tuple[tuple[type[BrokenGraphConnector], str], ...] = tuple(
    (cls, cls.violates)
    for cls in (PythonDecidesConnector, ItemInHookConnector, AssertsRealMetadataConnector)
)
"""Every graph-unsafe variant with the clause it breaks."""
