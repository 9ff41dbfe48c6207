"""The conformance suite: checks that a connector honours the kvspec contract.

There are three ways in, and they run the same tests:

1. **The pytest plugin** (loaded automatically once kvspec is installed)::

       pytest --kvspec-conformance=mypkg.conn:Factory [--kvspec-conformance=...]
              [--kvspec-profile=full] [--kvspec-report=report.json]
              [--kvspec-xfail=xfail.txt] [--kvspec-write-xfail=xfail.txt]

   collects the suite modules of the installed package (in addition to ``testpaths`` when no
   path is given; paths and node ids given restrict collection as usual) and runs every
   suite test once per connector. It works under pytest-xdist (``-n``). Options are
   described in ``kvspec.conformance.plugin.hooks``.

2. **Subclassing**, inside a project's own test suite::

       # tests/test_kvspec_conformance.py
       from kvspec.conformance import make_suite

       globals().update(make_suite("mypkg.conn:Factory"))

   creates one ``Test<Topic>`` class per suite topic, bound to that connector (its
   ``connector`` class attribute). The plugin still reports and applies ``--kvspec-xfail``.

3. **From Python or the command line**: ``run_conformance`` and
   ``kvspec conform [SPEC ...] [--profile full] [--report PATH] [--xfail PATH]
   [--write-xfail PATH] [-- pytest args]``; with no SPEC, ``kvspec conform`` certifies the
   project's own connectors, ``DEFAULT_CONNECTORS``.

A connector is named by a spec: ``"pkg.module:Name"``, a class, or a factory instance
(``load_factory``).

Reports: a header line per connector (kvspec and spec versions, connector name, spec and
capabilities), a table of pass / fail / skip / xfail counts per clause at the end, and with
``--kvspec-report`` a JSON file ``{kvspec_version, spec_version, connectors: [{spec, name,
capabilities}], tests: [{nodeid, key, outcome, clauses, connector, duration, message}],
clauses: {ID: {pass, fail, skip, xfail, level, title}}}``. A test that fails with a
``ContractViolation`` is reported as ``clause SCH-005 (<title>) broken
by <connector name>: observed: ...; expected: ...``, followed by the exception's optional
``reproduce`` text.

Expected-failures file (``--kvspec-xfail``, written by ``--kvspec-write-xfail``): plain text,
one test key per line, ``#`` comments. The key of a suite test is
``<file>::<TopicClass>::<test>[<connector spec>]`` (``[<connector spec>-<other ids>]`` when
the test has further parameters), with ``<file>`` relative to the suite directory::

    test_declaration.py::TestDeclaration::test_declared_layer_hooks_are_implemented[mypkg.conn:Factory]

It is the same for both ways in and on every installation. Listed tests are strict xfails:
one that passes fails the run as ``XPASS(strict)``; a line matching no test warns.

This package imports no Protocol, torch or pytest until one of its functions is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._loader import capability_names, factory_spec, has_capability, load_factory
    from .plugin._run_conformance import ConformanceResult, run_conformance
    from .plugin._suite_discovery import make_suite, suite_classes
    from .suite._base import ConformanceSuite

__all__ = [
    "DEFAULT_CONNECTORS",
    "ConformanceResult",
    "ConformanceSuite",
    "capability_names",
    "factory_spec",
    "has_capability",
    "load_factory",
    "make_suite",
    "run_conformance",
    "suite_classes",
]

DEFAULT_CONNECTORS: tuple[str, ...] = (
    "kvspec.conformance.connectors.null:NullConnector",
    "kvspec.conformance.connectors.shared_storage:SharedStorageConnector",
    "kvspec.conformance.connectors.layerwise:LayerwiseStorageConnector",
    "kvspec.backends.offload:OffloadConnector",
    "kvspec.backends.offload:LayerwiseOffloadConnector",
    "kvspec.backends.nixl:NixlConnector",
)
"""The connectors ``kvspec conform`` certifies when given none: the project's own."""

_LAZY = {
    "ConformanceResult": ".plugin._run_conformance",
    "run_conformance": ".plugin._run_conformance",
    "ConformanceSuite": ".suite._base",
    "capability_names": "._loader",
    "factory_spec": "._loader",
    "has_capability": "._loader",
    "load_factory": "._loader",
    "make_suite": ".plugin._suite_discovery",
    "suite_classes": ".plugin._suite_discovery",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
