"""The conformance suite's tests, one module per topic.

Nothing here runs unless asked: ``pytest --kvspec-conformance=pkg.module:Factory`` collects
these modules in addition to the given paths, and ``kvspec.conformance.make_suite``
binds their classes to one connector in a user's test module.

How a topic module is written (adding one needs nothing else):

- the file is ``kvspec/conformance/suite/test_<topic>.py`` and defines exactly one
  ``class Test<Topic>(ConformanceSuite)`` (class names are unique across modules), with
  ``__all__ = ["Test<Topic>"]`` and docstrings on the module, the class and every method;
- tests are methods ``test_*``; the connector under test is ``self.factory`` (also the
  ``kvspec_factory`` fixture) and its declaration ``self.capabilities``
  (``kvspec_capabilities``); ``kvspec_profile`` is ``"default"`` or ``"full"``;
  ``kvspec_tmpdir`` is a fresh directory per test (function-scoped, so a ``@given`` test
  uses ``tmp_path_factory.mktemp`` instead); ``self.engine_config(tmpdir)`` builds a sample
  ``EngineConfigView``;
- every test is tagged ``@pytest.mark.kvspec_clause("SCH-005", ...)`` with the IDs it checks
  (unknown IDs are a collection error) and, if it needs a capability,
  ``@pytest.mark.kvspec_requires("async_loads", ...)`` (see
  ``kvspec.conformance.capability_names``; the test is skipped for connectors that do
  not declare it);
- a broken clause is reported by raising ``ContractViolation``
  (``self.check(cond, "SCH-005", observed=..., expected=...)``), optionally with a
  ``reproduce`` text; plain asserts work but report no clause;
- property tests use hypothesis with ``settings()`` defaults, so ``--kvspec-profile=full``
  scales them; they never set ``max_examples`` themselves.
"""

from __future__ import annotations

__all__: list[str] = []
