"""The connector as a whole: one factory object that declares capabilities and builds roles.

Engines and the conformance suite receive a connector as an import path to a factory
(``pkg.module:Factory``), a class with a no-argument constructor or an instance.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Protocol, runtime_checkable

from .capabilities import Capabilities
from .executor import ExecutorConnector
from .scheduler import SchedulerConnector
from .views import EngineConfigView
from .worker import WorkerConnector

__all__ = ["ConnectorFactory"]


@runtime_checkable
class ConnectorFactory(Protocol):
    """Builds the roles of one connector and declares what it can do.

    The engine calls ``create_scheduler`` once in the scheduler process,
    ``create_worker`` once per rank in each worker process, and ``create_executor``
    once next to the scheduler. Factories must be cheap to construct and hold no resources:
    the roles own them.
    """

    @property
    @abstractmethod
    def name(self) -> str:
        """A short human-readable connector name for logs and reports."""

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """What the connector declares (GRA-001); constant for the factory's life."""

    @abstractmethod
    def create_scheduler(self, config: EngineConfigView) -> SchedulerConnector:
        """Build the scheduler role for an engine."""

    @abstractmethod
    def create_worker(self, config: EngineConfigView, rank: int) -> WorkerConnector:
        """Build the worker role for one rank (``0 <= rank < config.world_size``)."""

    def create_executor(self, config: EngineConfigView) -> ExecutorConnector | None:
        """Build the executor role, or return None to use the standard aggregator (EXE-012).

        Default: None.
        """
        return None
