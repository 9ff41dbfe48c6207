"""Conformance: what a connector declares, and the roles its factory builds.

These tests need no engine: they read the factory's declaration, build each role for a sample
configuration and shut it down, and compare the worker's overridden hooks with the declared
hook graph behaviour.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ...protocols.capabilities import Capabilities, HookGraphMode
from ...protocols.executor import ExecutorConnector
from ...protocols.scheduler import SchedulerConnector
from ...protocols.worker import WorkerConnector
from ._base import ConformanceSuite
from ._harness_runs import start_engine
from .._attribution import hide_unless_harness_bug

__all__ = ["TestDeclaration"]
__tracebackhide__ = hide_unless_harness_bug  # authors see their frames, not these


def _overrides(obj: object, method: str) -> bool:
    return getattr(type(obj), method, None) is not getattr(WorkerConnector, method)


def _shutdown_again(role: SchedulerConnector | WorkerConnector, clause: str) -> None:
    try:
        role.shutdown()
    except Exception as e:
        raise ConformanceSuite.violation(
            clause,
            observed=f"a second {type(role).__qualname__}.shutdown() raised "
            f"{type(e).__name__}: {e}",
            expected="shutdown is safe to call more than once",
        ) from e


class TestDeclaration(ConformanceSuite):
    """The declaration is well formed and the factory builds roles that honour it."""

    @pytest.mark.kvspec_clause("GRA-001")
    def test_capabilities_are_declared_and_constant(self) -> None:
        """``capabilities`` is a Capabilities, the same value on every read (GRA-001)."""
        first = self.factory.capabilities
        self.check(
            isinstance(first, Capabilities), "GRA-001",
            observed=f"capabilities is a {type(first).__name__}",
            expected="a kvspec.protocols.Capabilities",
        )
        for _ in range(3):
            again = self.factory.capabilities
            self.check(
                again == first, "GRA-001",
                observed=f"capabilities changed between reads: {first!r} then {again!r}",
                expected="one declaration, constant for the factory's life",
            )
        self.check(
            isinstance(first.layer_hooks, HookGraphMode), "GRA-001",
            observed=f"layer_hooks is {first.layer_hooks!r}",
            expected="a HookGraphMode",
        )

    @pytest.mark.kvspec_clause("ERR-010")
    @pytest.mark.kvspec_startup
    def test_engine_starts(self) -> None:
        """An engine starts on the connector: every role is built, the KV caches are
        registered and handshakes exchanged, then it shuts down (ERR-010). When this fails,
        every other test of the connector is skipped with the reason, not failed again."""
        start_engine(self.factory)

    @pytest.mark.kvspec_clause("SCH-027")
    def test_scheduler_role_builds_and_shuts_down_twice(self, kvspec_tmpdir: Path) -> None:
        """``create_scheduler`` returns a SchedulerConnector whose shutdown is idempotent."""
        scheduler = self.factory.create_scheduler(self.engine_config(kvspec_tmpdir))
        self.check(
            isinstance(scheduler, SchedulerConnector), "SCH-027",
            observed=f"create_scheduler returned a {type(scheduler).__name__}",
            expected="an object satisfying SchedulerConnector",
        )
        scheduler.shutdown()
        _shutdown_again(scheduler, "SCH-027")

    @pytest.mark.kvspec_clause("WRK-015")
    def test_worker_role_builds_per_rank_and_shuts_down_twice(self, kvspec_tmpdir: Path) -> None:
        """``create_worker`` returns a WorkerConnector for each rank; shutdown is idempotent."""
        config = self.engine_config(kvspec_tmpdir, tp_size=2)
        workers = [self.factory.create_worker(config, rank) for rank in range(config.world_size)]
        try:
            for rank, worker in enumerate(workers):
                self.check(
                    isinstance(worker, WorkerConnector), "WRK-015",
                    observed=f"create_worker(config, {rank}) returned a {type(worker).__name__}",
                    expected="an object satisfying WorkerConnector",
                )
        finally:
            for worker in workers:
                worker.shutdown()
        for worker in workers:
            _shutdown_again(worker, "WRK-015")

    @pytest.mark.kvspec_clause("EXE-012")
    def test_executor_role_is_an_executor_or_none(self, kvspec_tmpdir: Path) -> None:
        """``create_executor`` returns an ExecutorConnector, or None for the standard one."""
        executor = self.factory.create_executor(self.engine_config(kvspec_tmpdir))
        self.check(
            executor is None or isinstance(executor, ExecutorConnector), "EXE-012",
            observed=f"create_executor returned a {type(executor).__name__}",
            expected="None (the standard aggregator) or an object satisfying ExecutorConnector",
        )

    @pytest.mark.kvspec_clause("EXE-012")
    @pytest.mark.kvspec_requires("custom_aggregator")
    def test_custom_aggregator_is_built(self, kvspec_tmpdir: Path) -> None:
        """A connector declaring ``custom_aggregator`` builds its executor (EXE-012)."""
        executor = self.factory.create_executor(self.engine_config(kvspec_tmpdir))
        self.check(
            isinstance(executor, ExecutorConnector), "EXE-012",
            observed=f"custom_aggregator is declared but create_executor returned {executor!r}",
            expected="an object satisfying ExecutorConnector",
        )

    @pytest.mark.kvspec_clause("GRA-001")
    @pytest.mark.kvspec_requires("layer_hooks")
    def test_declared_layer_hooks_are_implemented(self, kvspec_tmpdir: Path) -> None:
        """A worker declaring EAGER or CAPTURABLE hooks overrides both per-layer hooks."""
        worker = self.factory.create_worker(self.engine_config(kvspec_tmpdir), 0)
        try:
            missing = [
                m for m in ("wait_for_layer_load", "save_kv_layer") if not _overrides(worker, m)
            ]
            mode = self.capabilities.layer_hooks.name
            self.check(
                not missing, "GRA-001",
                observed=f"layer_hooks is {mode} but {type(worker).__qualname__} keeps the "
                f"WorkerConnector default of {', '.join(missing)}",
                expected="a connector with per-layer hooks implements wait_for_layer_load and "
                "save_kv_layer, or declares NO_LAYER_HOOKS",
            )
        finally:
            worker.shutdown()

    @pytest.mark.kvspec_clause("DRY-005")
    @pytest.mark.kvspec_requires("capturable_hooks")
    def test_capturable_worker_builds_dummy_metadata(self, kvspec_tmpdir: Path) -> None:
        """A worker declaring CAPTURABLE hooks implements build_dummy_connector_meta."""
        worker = self.factory.create_worker(self.engine_config(kvspec_tmpdir), 0)
        try:
            self.check(
                _overrides(worker, "build_dummy_connector_meta"), "DRY-005",
                observed=f"layer_hooks is CAPTURABLE but {type(worker).__qualname__} keeps the "
                "WorkerConnector default of build_dummy_connector_meta",
                expected="a capturable connector builds its own dummy metadata in the worker",
            )
        finally:
            worker.shutdown()
