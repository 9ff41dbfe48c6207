"""kvspec's HiCache backend against SGLang's ``file`` backend on one seeded workload: the same
keys stored and read in the same order through both, each through the path SGLang's
controller picks for it. Every hit query must give the same prefix, every load the same
hits, and the host pools the same bytes afterwards."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kvspec.sglang.suite import backends, have_sglang

pytestmark = pytest.mark.skipif(not have_sglang(), reason="needs SGLang: run under the "
                                "environment scripts/sglang_env.sh builds")


def _workload(seed: int, steps: int = 60) -> list[tuple[str, list[str]]]:
    """Requests share prefixes (a chain of page keys per prompt, as SGLang hashes them);
    ``store`` writes a request's pages, sometimes with a hole; ``query`` and ``load`` read
    a request's pages, sometimes ones never stored."""
    rng = random.Random(seed)
    prompts: list[list[str]] = []
    ops: list[tuple[str, list[str]]] = []
    for step in range(steps):
        if not prompts or rng.random() < 0.4:
            base = rng.choice(prompts)[:rng.randrange(0, 6)] if prompts and rng.random() < 0.6 else []
            prompts.append(base + [f"s{seed}-{step}-{i}" for i in range(rng.randrange(1, 12))])
        keys = rng.choice(prompts)
        kind = rng.choice(["store", "store", "query", "load"])
        if kind == "store" and len(keys) > 2 and rng.random() < 0.3:
            hole = rng.randrange(len(keys))
            keys = keys[:hole] + keys[hole + 1:]
        ops.append((kind, keys))
    return ops


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
@pytest.mark.parametrize("kvspec_extra", [{}, {"interface_v1": 0}], ids=["zero-copy", "generic"])
def test_kvspec_and_file_agree(tmp_path: Path, layout: str, kvspec_extra: dict[str, Any]) -> None:
    ops = _workload(seed=37)
    with backends("file", tmp_path / "file") as make_file, \
            backends("kvspec", tmp_path / "kvspec", extra_config=kvspec_extra) as make_kv:
        rigs = make_file(layout=layout), make_kv(layout=layout)
        seen: dict[str, list[int]] = {"hits": [], "partial": []}  # the workload is not trivial
        for step, (kind, keys) in enumerate(ops):
            answers = []
            loaded = []
            for rig in rigs:  # the same pool calls on both, so the same host slots
                idx = rig.alloc(len(keys))
                if kind == "store":
                    rig.fill(idx, seed=step)  # the same bytes for the same (step, page)
                    stored = rig.store(keys, idx)
                    answers.append(all(stored) if isinstance(stored, list) else stored)
                elif kind == "query":
                    answers.append(rig.query(keys))
                else:
                    got = rig.load(keys, idx)
                    hits = next((i for i, g in enumerate(got) if g is None or g is False), len(got))
                    answers.append(hits)
                    loaded.append([rig.page_bytes(idx, i) for i in range(hits)])
                rig.host.free(idx)
            assert answers[0] == answers[1], f"step {step} {kind} of {len(keys)} pages: file " \
                f"answered {answers[0]}, kvspec {answers[1]}"
            if kind != "store":
                seen["hits"].append(answers[0])
                if 0 < answers[0] < len(keys):
                    seen["partial"].append(step)
            if loaded:
                assert all(torch.equal(a, b) for a, b in zip(*loaded)), f"step {step}: other bytes"
        pools = [rig.host.kv_buffer.view(torch.uint8) for rig in rigs]  # bytes: NaNs differ
        assert torch.equal(*pools)
        assert sum(seen["hits"]) > 0 and 0 in seen["hits"] and seen["partial"], seen
