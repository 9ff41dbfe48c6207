"""Conformance: the engine paths vLLM 0.33 takes around a connector beyond the plain step.

A step that fails on one rank after the connector outputs were collected (vLLM 0.33's
fault-tolerant executor salvages them into the next step, EXE-013); an asynchronous match
the engine cuts to 0 tokens before allocating (SCH-034); the block hashes a connector
advertises in its KV events, each loadable on its own (EVT-010); and saves started in one
step that must complete in steps that run no forward (WRK-021). Every run checks every KV
byte, report and release, as always.
"""

from __future__ import annotations

import time
from pathlib import Path

import attrs
import pytest

from ...protocols import BlockHash, BlockRemoved, BlockStored, Direction, KVCacheEvent
from ..harness import Engine, RequestSpec, Workload
from ._base import ConformanceSuite
from ._harness_runs import config_for
from .._attribution import hide_unless_harness_bug

__all__ = ["TestEnginePaths"]
__tracebackhide__ = hide_unless_harness_bug  # authors see their frames, not these

_PROMPTS = tuple(tuple(range(100 * i + 7, 100 * i + 20 + 4 * i)) for i in range(3))
"""Three prompts of 13 to 21 tokens: whole blocks and a remainder."""

_MAX_PROBES = 24
"""Advertised block hashes probed per test (EVT-010): the first ones in event order."""


def _requests(prefix: str, *, arrival: int = 0, new: int = 2) -> list[RequestSpec]:
    return [RequestSpec(f"{prefix}-{i}", p, max_new_tokens=new, arrival_step=arrival)
            for i, p in enumerate(_PROMPTS)]


class TestEnginePaths(ConformanceSuite):
    """Failed steps, cut matches, advertised blocks and saves without a forward."""

    @pytest.mark.kvspec_clause("EXE-013", "SCH-015", "SCH-021", "WRK-009", "WRK-013")
    def test_a_step_failed_on_one_rank_is_salvaged(self, tmp_path: Path) -> None:
        """Two ranks. Three prompts are served and stored, the same prompts arrive again
        at step 6, and steps 7 and 8 fail, on rank 1 and on rank 0, after every rank's
        connector output was collected (vLLM 0.33 with ``enable_fault_tolerance``): the
        engine aggregates nothing for them, salvages every rank's output into the next
        step's aggregate (EXE-013) and aborts every unfinished request, loads in flight
        included (SCH-021). Every transfer must still be reported exactly once by each
        rank (a report repeated after its salvaged one is WRK-009), every awaited one
        must complete, and the same prompts served once more finish with every byte
        checked."""
        cfg = config_for(self.capabilities, prefix_caching=False, tp_size=2,
                         fail_steps=((7, 1), (8, 0)))
        with Engine(self.factory, cfg, tmpdir=str(tmp_path)) as engine:
            first = engine.run(Workload([*_requests("store"), *_requests("again", arrival=6)],
                                        name="served, served again, steps 7 and 8 failed"))
            assert first.steps > 7  # the first failed step ran
            ended = set(first.finished) | set(first.aborted)
            assert ended == {f"{p}-{i}" for p in ("store", "again") for i in range(3)}
            while engine.step_id < 8:  # the second failure may fall after the run ended
                engine.step()
            retry = engine.run(Workload(_requests("retry"), name="retried after the faults"))
        assert {f"retry-{i}" for i in range(3)} <= set(retry.finished)

    @pytest.mark.kvspec_clause("SCH-034", "SCH-008", "WRK-013")
    @pytest.mark.kvspec_requires("async_loads")
    def test_an_async_match_cut_to_zero_loads_nothing(self, tmp_path: Path) -> None:
        """Three prompts are served and stored, then served again by an engine that cuts
        every asynchronous match to 0 tokens before allocating (vLLM's auxiliary-output
        cap, a local hit with a partial last block or a replayed window does this): it
        calls ``update_state_after_alloc`` with ``num_external_tokens=0`` and computes the
        request itself. The connector must start no load for it and report no
        ``finished_recving`` (SCH-034); the requests finish with every byte checked."""
        cfg = config_for(self.capabilities, prefix_caching=False, cut_async_matches=True)
        with Engine(self.factory, cfg, tmpdir=str(tmp_path)) as engine:
            engine.run(Workload(_requests("store"), name="stored"))
            time.sleep(0.05)
            again = engine.run(Workload(_requests("again"), name="matches cut to 0"))
            later = engine.run(Workload(_requests("later"), name="matches cut to 0 again"))
            cut = engine.cut_requests
        if not cut:
            pytest.skip("the connector answered no asynchronous match: nothing was cut")
        for result, prefix in ((again, "again"), (later, "later")):
            assert {f"{prefix}-{i}" for i in range(3)} <= set(result.finished)
            loaded = {r: n for r, n in result.external_tokens.items()
                      if n and r.startswith(prefix)}
            self.check(not loaded, "SCH-034", observed=f"tokens counted as loaded for "
                       f"requests whose matches were cut to 0: {loaded}",
                       expected="no load for a match cut to 0")

    @pytest.mark.kvspec_clause("EVT-010", "EVT-004", "EVT-005")
    def test_every_advertised_block_loads_on_its_own(self, tmp_path: Path) -> None:
        """Prompts are served and stored (one under a cache salt); then, for each block
        hash the connector advertised in a ``BlockStored`` event and did not remove since,
        a request whose prompt is exactly the tokens up to and including that block, plus
        one, under the same salt and LoRA, must get a match that covers that block
        (EVT-010): a router that reads the events sends such a request here. Skipped for a
        connector that advertises nothing."""
        cfg = config_for(self.capabilities, prefix_caching=False)
        design = cfg.block_size // cfg.token_scale  # the block size the prompts are written for
        specs = [RequestSpec(f"store-{i}", p, max_new_tokens=2,
                             cache_salt="tenant" if i == 1 else None)
                 for i, p in enumerate((*_PROMPTS, _PROMPTS[0] + tuple(range(900, 912))))]
        probed = 0
        with Engine(self.factory, cfg, tmpdir=str(tmp_path)) as engine:
            events = list(engine.run(Workload(specs, name="stored")).events)
            known: dict[BlockHash, tuple[RequestSpec, int]] = {}
            for spec in specs:  # the prompt's full blocks, by the engine's own hashes
                for i, own in enumerate(engine.block_hashes(spec.request_id)):
                    if (i + 1) * design <= len(spec.prompt):
                        known.setdefault(own, (spec, i))
            for h in [h for h in _advertised(events) if h in known][:_MAX_PROBES]:
                if h not in _advertised(events):
                    continue  # removed since (evicted): no longer advertised
                spec, index = known[h]
                probe = RequestSpec(f"probe-{probed}", (*spec.prompt[: (index + 1) * design], 1),
                                    max_new_tokens=1, cache_salt=spec.cache_salt,
                                    lora_id=spec.lora_id)
                result = engine.run(Workload([probe], name=f"probe of block {index} of "
                                             f"{spec.request_id}"))
                events += result.events
                matched = result.matched_tokens.get(probe.request_id, 0)
                want = (index + 1) * cfg.block_size
                self.check(
                    matched >= want or h not in _advertised(events), "EVT-010",
                    observed=f"the connector advertised block hash {_show(h)} (block "
                    f"{index} of {spec.request_id!r}: tokens [0, {want})) as stored, and a "
                    f"request for exactly those tokens plus one got a match of {matched} "
                    "tokens", expected="every advertised block loadable on its own: a "
                    "match covering the prefix that ends with it")
                probed += 1
        if not probed:
            pytest.skip("the connector advertised no stored block (no BlockStored event)")

    @pytest.mark.kvspec_clause("WRK-021", "WRK-003", "SCH-016")
    @pytest.mark.kvspec_requires("delayed_free")
    def test_saves_finish_in_steps_without_a_forward(self, tmp_path: Path) -> None:
        """Requests finish and the connector delays their free to store them; from then on
        the engine runs only steps that bind metadata and call ``wait_for_save`` but run no
        forward, as vLLM does since 0.31. The stores started before must still complete
        and be reported within the transfer timeout (WRK-021). If they are not, the engine
        runs one request with a forward: stores that then complete were finalized only
        inside a forward (WRK-021); stores that still do not were never reported (SCH-016)."""
        base = config_for(self.capabilities, prefix_caching=False)
        cfg = attrs.evolve(base, transfer_timeout_s=3 * base.transfer_timeout_s)
        with Engine(self.factory, cfg, tmpdir=str(tmp_path)) as engine:
            engine.run(Workload(_requests("store"), name="stored"), leave_pending=True)
            waiting = _sends(engine)
            deadline = time.monotonic() + base.transfer_timeout_s
            while _sends(engine) and time.monotonic() < deadline:
                engine.step()  # nothing scheduled: metadata bound, wait_for_save, no forward
            left = _sends(engine)
            if left:
                engine.run(Workload([RequestSpec("forward", tuple(range(500, 509)),
                                                 max_new_tokens=1)], name="one forward"),
                           leave_pending=True)
                deadline = time.monotonic() + base.transfer_timeout_s
                while set(left) & set(_sends(engine)) and time.monotonic() < deadline:
                    engine.step()
                never = sorted(set(left) & set(_sends(engine)))
                self.check(not never, "SCH-016", observed=f"the stores of {never} (delayed "
                           "frees) were never reported, neither in steps without a forward "
                           "nor after one", expected="every delayed free reported in "
                           "finished_sending")
                self.check(False, "WRK-021", observed=f"the stores of {left} (delayed frees) "
                           f"were not reported in {base.transfer_timeout_s:g} s of steps "
                           "without a forward, and were once a step ran a forward",
                           expected="saves started in an earlier step completed and reported "
                           "in steps that run no forward")
        if not waiting:
            pytest.skip("the connector delayed no free: no store was in flight")


def _sends(engine: Engine) -> list[str]:
    """The requests whose delayed free the engine still awaits."""
    return sorted(rid for rid, d in engine.awaited if d is Direction.SEND)


def _advertised(events: list[KVCacheEvent]) -> dict[BlockHash, None]:
    """The block hashes stored and not removed since, in the order first advertised."""
    out: dict[BlockHash, None] = {}
    for ev in events:
        if isinstance(ev, BlockStored):
            out.update(dict.fromkeys(ev.block_hashes))
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                out.pop(h, None)
    return out




def _show(h: BlockHash) -> str:
    return h.hex()[:16] if isinstance(h, bytes) else str(h)
