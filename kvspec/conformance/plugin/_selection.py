"""Which connectors and suite tests a session runs, read from its options and arguments.

With no argument (pytest collects ``testpaths`` or the current directory) the whole suite
is collected in addition. With arguments, the suite is collected only as far as they name
it: the suite directory or a directory holding it (the whole suite), a suite module by path,
or a node id as pytest prints it for a suite test. The suite usually lies outside the
rootdir, so pytest prints its node ids relative to the suite directory
(``test_engine.py::TestEngine::test_scenario[...]``); such an argument names no file where
pytest looks, so it is taken out of the arguments, the suite directory is collected instead
(which keeps the node ids as printed, for ``--lf`` too) and only the named tests are kept.

``connector_specs`` reads the connectors a session runs the suite against, and
``collect_suite_only`` is what ``kvspec conform`` adds: the suite in place of the project's
own tests.

Light at import, like the plugin that imports it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from ._suite_discovery import suite_dir

__all__ = [
    "SUITE_ONLY_OPTION", "SuitePlan", "collect_suite_only", "connector_specs", "holds_suite",
    "plan_suite", "suite_node",
]

SUITE_ONLY_OPTION = "--kvspec-suite-only"
"""The hidden option ``run_conformance`` passes (``kvspec conform``): collect the suite in
place of the project's own tests (see ``collect_suite_only``). An option, not a plugin
object, so that pytest-xdist workers, which read the command line again, see it too."""


def connector_specs(config: pytest.Config) -> list[str]:
    """The connector specs of a session: the command-line options, then the ini lines."""
    given = list(config.getoption("kvspec_conformance", None) or [])
    given += [str(s) for s in config.getini("kvspec_conformance") or []]
    return list(dict.fromkeys(s.strip() for s in given if s.strip()))


def collect_suite_only(config: pytest.Config) -> None:
    """Collect the conformance suite, and only it, unless pytest was given paths.

    pytest determines the rootdir and the ini file from its path arguments, or from the
    invocation directory when there are none. ``kvspec conform`` therefore passes no path,
    and this puts the suite directory in place of what pytest would collect then
    (``testpaths`` or the current directory). Paths and node ids given after ``--`` are
    left to ``plan_suite``, with the whole suite added when they name none of it. (Passing
    the suite directory as an argument made pytest look for the rootdir from the suite
    directory: inside kvspec, which read kvspec's own ``pyproject.toml``.)
    """
    root = suite_dir()
    if config.args_source is not pytest.Config.ArgsSource.ARGS:
        config.args[:] = [str(root)]
    elif not any(suite_node(a, config, root) is not None or holds_suite(a, config, root)
                 for a in config.args):
        config.args.append(str(root))


@dataclass(frozen=True)
class SuitePlan:
    """What the plugin collects of the suite.

    Attributes:
        root: The suite directory.
        collect: Whether the suite is collected at all.
        names: Suite node ids chosen by hand, relative to the suite directory
            (``test_x.py``, ``test_x.py::TestX::test_y[spec]``); empty: the whole suite.
        strict: Whether a chosen node id that names no collected test is an error (not
            under ``--lf``, which may leave a named test uncollected, as it does for
            pytest's own arguments).
    """

    root: Path
    collect: bool
    names: tuple[str, ...] = ()
    strict: bool = True

    def ignores(self, path: Path) -> bool:
        """Whether ``path`` is a suite module that no chosen node id lies in."""
        if not self.names or path.parent != self.root or not _is_module(path):
            return False
        return path.name not in {n.partition("::")[0] for n in self.names}

    def keeps(self, node: pytest.Item | pytest.Collector) -> bool:
        """Whether collection keeps ``node``: not a suite node, or one on the way to (or
        under) a chosen node id."""
        if not self.names:
            return True
        key = self._key(node)
        if key is None:
            return True
        if any(_names(n, key) for n in self.names):
            return True
        return isinstance(node, pytest.Collector) and any(
            n.startswith(key + "::") for n in self.names
        )

    def _key(self, node: pytest.Item | pytest.Collector) -> str | None:
        # The node id relative to the suite directory, whatever pytest's rootdir.
        path = getattr(node, "path", None)
        if path is None or Path(path).parent != self.root:
            return None
        rest = node.nodeid.partition("::")[2]
        return f"{Path(path).name}::{rest}" if rest else Path(path).name

    def select(self, items: list[pytest.Item]) -> None:
        """Keep, of the suite's items, those the chosen node ids name (in place; collection
        already dropped the others, see ``keeps``).

        Raises:
            pytest.UsageError: A chosen node id names no collected test.
        """
        if not self.names:
            return
        matched: set[str] = set()
        kept: list[pytest.Item] = []
        for item in items:
            key = self._key(item)
            if key is None:
                kept.append(item)
                continue
            hits = [n for n in self.names if _names(n, key)]
            matched.update(hits)
            if hits:
                kept.append(item)
        missing = [n for n in self.names if n not in matched]
        if missing and self.strict:
            raise pytest.UsageError(
                "kvspec: not found in the conformance suite: " + ", ".join(missing)
            )
        items[:] = kept


def _names(given: str, key: str) -> bool:
    # pytest's own rule for a node id argument: the node itself or anything under it, and a
    # function named without parameters takes all its parametrizations.
    if key == given or key.startswith(given + "::"):
        return True
    return "[" not in given.rpartition("::")[2] and key.startswith(given + "[")


def _is_module(path: Path) -> bool:
    return path.name.startswith("test_") and path.suffix == ".py"


def _resolve(arg: str, config: pytest.Config) -> Path:
    path = Path(arg.split("::", 1)[0])
    return path if path.is_absolute() else Path(config.invocation_params.dir) / path


def suite_node(arg: str, config: pytest.Config, root: Path) -> str | None:
    """The suite node id (relative to ``root``) that ``arg`` names, or None.

    ``arg`` names one when its path part is a suite module: as a path that exists, or, where
    nothing exists at that path, as pytest prints it: relative to the suite directory, or
    relative to the invocation directory with the suite directory standing for the rootdir.
    """
    part, sep, rest = arg.partition("::")
    if not part:
        return None
    given = Path(part)
    full = _resolve(arg, config)
    candidates: list[Path] = []
    if full.exists():
        candidates.append(full.resolve())
    else:
        if not given.is_absolute():
            candidates.append(root / given)
        normal = Path(os.path.normpath(full))
        if normal.is_relative_to(config.rootpath):  # as printed relative to the rootdir
            candidates.append(root / normal.relative_to(config.rootpath))
    for path in candidates:
        if path.parent == root and _is_module(path) and path.is_file():
            return path.name + sep + rest
    return None


def holds_suite(arg: str, config: pytest.Config, root: Path) -> bool:
    """Whether the path of ``arg`` is the suite directory ``root`` or a directory above it."""
    path = _resolve(arg, config).resolve()
    return path == root or path in root.parents


def _rerun_suite_failures(config: pytest.Config, root: Path) -> None:
    """Let ``--lf`` collect the suite modules that hold last failures.

    Once it has found a failure to rerun, ``--lf`` skips every file not on the path of a
    last failure, looking for those paths under the rootdir; where a suite node id is
    relative to the suite directory that finds no suite module, and a run with failures of
    both the suite and the project's own tests would drop the suite's. Adds the suite
    modules to the paths the cache plugin looks up (a private set of pytest's ``lfplugin``;
    nothing is done where it is missing).
    """
    lf = config.pluginmanager.get_plugin("lfplugin")
    paths = getattr(lf, "_last_failed_paths", None)
    failed = getattr(lf, "lastfailed", None)
    if not isinstance(paths, set) or not isinstance(failed, dict):
        return
    for nodeid in failed:
        part = str(nodeid).partition("::")[0]
        module = root / part
        if part and module.parent == root and _is_module(module) and module.is_file() \
                and not (config.rootpath / part).exists():
            paths.update((module, root))


def plan_suite(config: pytest.Config) -> SuitePlan:
    """Decide what of the suite a session with connectors collects; adjust ``config.args``.

    The suite directory is added to the arguments when pytest was given none, or when they
    name suite tests (which are then the only suite tests kept, see ``SuitePlan.select``);
    arguments that hold the whole suite are left as given.
    """
    plan = _plan(config, suite_dir())
    if config.getoption("lf", False):
        if plan.collect and not plan.names:
            _rerun_suite_failures(config, plan.root)
        plan = replace(plan, strict=False)
    return plan


def _plan(config: pytest.Config, root: Path) -> SuitePlan:
    if config.args_source is not pytest.Config.ArgsSource.ARGS:
        if not any(holds_suite(a, config, root) for a in config.args):
            config.args.append(str(root))
        return SuitePlan(root, collect=True)
    names: list[str] = []
    others: list[str] = []
    for arg in config.args:
        node = suite_node(arg, config, root)
        if node is None:
            others.append(arg)
        else:
            names.append(node)
    if any(holds_suite(a, config, root) for a in others):
        config.args[:] = others
        return SuitePlan(root, collect=True)
    if not names:
        return SuitePlan(root, collect=False)
    config.args[:] = [*others, str(root)]
    return SuitePlan(root, collect=True, names=tuple(dict.fromkeys(names)))
