"""The pytest integration of the conformance suite: the plugin and the ways to run the suite.

The plugin is the module ``kvspec.conformance.plugin.hooks``, registered under the
``pytest11`` entry point ``kvspec``: it holds every pytest hook and fixture, and each hook
hands its work to a plain module of this package:

* ``_selection``: which connectors and suite tests a session runs (``--kvspec-conformance``,
  node ids, ``kvspec conform``'s suite in place of the project's tests);
* ``_suite_discovery``: the suite's topic modules and classes, ``make_suite``, test keys;
* ``_recorder``: each tracked test's outcome, the per-clause summary, the JSON report;
* ``_expected_failures``: the expected-failures file (``--kvspec-xfail``);
* ``_progress``: the progress lines of ``kvspec conform``;
* ``_run_conformance``: ``run_conformance``, the suite run from Python.

Which clause a failure broke is judged by ``kvspec.conformance._attribution``, which the
harness uses too. The options are documented in ``kvspec.conformance.plugin.hooks``.

This package registers no hook itself. ``pytest_plugins`` names the hooks module so that an
installation whose metadata still gives the package as the entry point (kvspec before the
hooks had a module of their own, an editable install not yet reinstalled) loads them too.
"""

from __future__ import annotations

import warnings
from typing import Any

from ._expected_failures import KVSpecXfailWarning
from ._selection import connector_specs

__all__ = ["KVSpecXfailWarning", "connector_specs"]

pytest_plugins = ["kvspec.conformance.plugin.hooks"]

_MOVED_TO_HOOKS = frozenset(
    {"kvspec_capabilities", "kvspec_factory", "kvspec_profile", "kvspec_tmpdir"}
)


def __getattr__(name: str) -> Any:
    # Deprecated aliases: the fixtures were module attributes of kvspec.conformance.plugin
    # when it was one module; they live in kvspec.conformance.plugin.hooks now.
    if name not in _MOVED_TO_HOOKS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"kvspec.conformance.plugin.{name} moved to kvspec.conformance.plugin.hooks.{name}; "
        "the old name goes in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    from . import hooks

    return getattr(hooks, name)
