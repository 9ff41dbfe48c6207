"""The base class of every conformance topic class."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest

from ...protocols.capabilities import Capabilities
from ...protocols.connector import ConnectorFactory
from ...protocols.errors import ContractViolation
from ...protocols.views import EngineConfigView, TransferRole
from .._loader import has_capability

__all__ = ["ConformanceSuite"]


class ConformanceSuite:
    """Base class of the suite's topic classes; suite tests are methods of its subclasses.

    Each topic module ``kvspec/conformance/suite/test_<topic>.py`` defines one
    ``class Test<Topic>(ConformanceSuite)``. The connector under test comes from the
    ``kvspec_factory`` fixture: the plugin parametrizes it over every
    ``--kvspec-conformance=SPEC``; a subclass that sets ``connector`` (what
    ``kvspec.conformance.make_suite`` creates) runs against that connector alone.

    Before each test an autouse fixture sets ``factory`` and ``capabilities``, and skips
    the test when an engine on the connector does not even start (tried once per connector;
    ``TestDeclaration.test_engine_starts``, marked ``kvspec_startup``, reports why).
    Tests tag the clauses they check with ``@pytest.mark.kvspec_clause("SCH-005")`` and the
    capabilities they need with ``@pytest.mark.kvspec_requires("async_loads")``; they report
    a broken clause by raising ``ContractViolation``, most easily
    through ``check``.

    Attributes:
        connector: The connector this class is bound to (a spec, class or factory), or None
            to take it from the plugin's ``--kvspec-conformance`` option.
        factory: The connector factory under test (set for each test).
        capabilities: Its declared capabilities (set for each test).
    """

    connector: ClassVar[str | type | ConnectorFactory | None] = None
    factory: ConnectorFactory
    capabilities: Capabilities

    @pytest.fixture(autouse=True)
    def _kvspec_bind_connector(
        self, request: pytest.FixtureRequest, kvspec_factory: ConnectorFactory,
        kvspec_capabilities: Capabilities,
    ) -> None:
        self.factory = kvspec_factory
        self.capabilities = kvspec_capabilities
        if request.node.get_closest_marker("kvspec_startup") is None:
            from ._harness_runs import startup_failure

            why = startup_failure(kvspec_factory)
            if why is not None:
                pytest.skip(f"the connector does not start ({why}); "
                            "test_declaration.py::TestDeclaration::test_engine_starts reports it")

    def has(self, capability: str) -> bool:
        """Whether the connector under test declares ``capability`` (see ``has_capability``)."""
        return has_capability(self.capabilities, capability)

    @staticmethod
    def engine_config(
        tmpdir: Path | str,
        *,
        engine_id: str = "kvspec-conformance",
        role: TransferRole = TransferRole.BOTH,
        num_layers: int = 2,
        block_size: int = 16,
        num_blocks: int = 64,
        tp_size: int = 1,
        pp_size: int = 1,
        extra: Mapping[str, Any] | None = None,
    ) -> EngineConfigView:
        """A sample engine configuration whose ``extra`` names a scratch directory.

        ``extra["kvspec.tmpdir"]`` is ``str(tmpdir)``: connectors that store anything
        (files, sockets) put it there during conformance runs. The user's connector
        configuration (``$KVSPEC_CONNECTOR_EXTRA``, ``kvspec conform --extra``) comes first;
        other ``extra`` entries are merged in.
        """
        from ..harness.config import connector_extra

        merged: dict[str, Any] = {**connector_extra(), "kvspec.tmpdir": str(tmpdir)}
        merged.update(extra or {})
        return EngineConfigView(
            engine_id=engine_id, role=role, num_layers=num_layers, block_size=block_size,
            num_blocks=num_blocks, tp_size=tp_size, pp_size=pp_size, extra=merged,
        )

    @staticmethod
    def violation(
        clause: str, *, observed: str, expected: str, reproduce: str | None = None
    ) -> ContractViolation:
        """Build the ``ContractViolation`` a test raises when a clause is broken.

        ``reproduce``, if given, is text (a configuration, a call sequence, a falsifying
        example) that the report prints after the violation.
        """
        return ContractViolation(clause, observed=observed, expected=expected, reproduce=reproduce)

    @classmethod
    def check(
        cls,
        condition: object,
        clause: str,
        *,
        observed: str,
        expected: str,
        reproduce: str | None = None,
    ) -> None:
        """Raise ``violation`` of ``clause`` unless ``condition`` is true."""
        if not condition:
            raise cls.violation(clause, observed=observed, expected=expected, reproduce=reproduce)
