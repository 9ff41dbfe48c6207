"""Sleep and wake with the reference backends (WRK-018, WRK-019, HSK-006).

The offload backend keeps its host tier across the sleep: a request after the wake hits the
KV stored before it (the RL rollout case, vLLM issues 57810 and 42658), every byte checked
by the harness. NIXL deregisters at sleep and registers a new agent at wake; the decode
engine then handshakes again and keeps loading.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from kvspec.backends.offload import OffloadConnector
from kvspec.conformance.harness import Engine, HarnessConfig, RequestSpec, Workload, serve_pair
from kvspec.protocols import TransferRole

_PROMPTS = tuple(tuple(range(100 * i, 100 * i + 17)) for i in range(3))


def _wl(prefix: str, prompts: tuple[tuple[int, ...], ...] = _PROMPTS) -> Workload:
    return Workload([RequestSpec(f"{prefix}-{i}", p, max_new_tokens=2)
                     for i, p in enumerate(prompts)], name=prefix)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_offload_tier_is_kept_across_a_sleep(tp_size: int, tmp_path: Path) -> None:
    cfg = HarnessConfig(prefix_caching=False, tp_size=tp_size)
    with Engine(OffloadConnector(), cfg, tmpdir=str(tmp_path)) as engine:
        engine.run(_wl("store"))
        old = [id(t) for t in engine.workers.runtime.layers] if tp_size == 1 else []
        engine.sleep()
        engine.wake()
        if tp_size == 1:  # the harness re-allocated the tensors: new storage
            assert old != [id(t) for t in engine.workers.runtime.layers]
        hit = engine.run(_wl("hit"))
    # every prompt's full blocks but the one holding the last token came from the tier
    assert all(hit.external_tokens[f"hit-{i}"] == 16 for i in range(len(_PROMPTS)))


def test_offload_sleep_hooks_are_idempotent_and_refuse_another_layout(tmp_path: Path) -> None:
    cfg = HarnessConfig(prefix_caching=False)
    with Engine(OffloadConnector(), cfg, tmpdir=str(tmp_path)) as engine:
        rt = engine.workers.runtime
        worker = rt.connector
        kv = dict(zip(rt.layer_names, rt.layers))
        worker.restore_kv_caches(kv, rt.layout)  # awake: does nothing
        worker.unregister_kv_caches()
        worker.unregister_kv_caches()
        assert worker.pool is None
        other = HarnessConfig(block_size=8).layout()
        from kvspec.protocols import InvalidArgumentError
        with pytest.raises(InvalidArgumentError, match="WRK-019"):
            worker.restore_kv_caches(kv, other)
        worker.restore_kv_caches(kv, rt.layout)
        assert worker.pool is not None
        engine.run(_wl("after"))


def test_nixl_producer_sleep_makes_the_decoder_handshake_again(tmp_path: Path) -> None:
    pytest.importorskip("nixl")
    from kvspec.backends.nixl import NixlConnector
    factory = NixlConnector()
    base = HarnessConfig(prefix_caching=False)
    p_cfg = attrs.evolve(base, role=TransferRole.PRODUCER, engine_id="prefill")
    d_cfg = attrs.evolve(base, role=TransferRole.CONSUMER, engine_id="decode")
    with Engine(factory, p_cfg, tmpdir=str(tmp_path)) as p, \
            Engine(factory, d_cfg, tmpdir=str(tmp_path)) as d:
        _, first = serve_pair(p, d, _wl("before"))
        before = p.workers.handshakes()[0]
        p.sleep(peers=[d])
        assert p.workers.runtime.connector.endpoint is None  # deregistered
        p.wake()
        after = p.workers.handshakes()[0]
        assert before is not None and after is not None and before.payload != after.payload
        _, second = serve_pair(p, d, _wl("after", tuple(tuple(t + 5 for t in q)
                                                         for q in _PROMPTS)))
        peers = d.workers.runtime.connector.endpoint.peers
        assert any(name.endswith("-w1") for name in peers), peers
    assert all(first.external_tokens[f"before-{i}"] > 0 for i in range(len(_PROMPTS)))
    assert all(second.external_tokens[f"after-{i}"] > 0 for i in range(len(_PROMPTS)))
