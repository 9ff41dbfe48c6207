"""Finding the suite's topic modules and classes, binding them to a connector, and test keys.

The suite itself is the package ``kvspec.conformance.suite`` (its ``test_*.py`` topic
modules); this module finds it where kvspec is installed, lists its topic classes, binds
them to one connector (``make_suite``) and names each suite test the same way on every
installation (``xfail_key``, ``connector_label``).

Light at import: it imports neither the Protocols nor the suite modules until asked, because
the pytest plugin imports it in every pytest session.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...protocols.connector import ConnectorFactory
    from ..suite._base import ConformanceSuite

__all__ = [
    "BASE_MODULE",
    "SUITE_PACKAGE",
    "connector_label",
    "make_suite",
    "suite_classes",
    "suite_dir",
    "suite_files",
    "topic_class",
    "xfail_key",
]

SUITE_PACKAGE = "kvspec.conformance.suite"
BASE_MODULE = "kvspec.conformance.suite._base"


def suite_dir() -> Path:
    """The directory of the installed ``kvspec.conformance.suite`` package."""
    spec = importlib.util.find_spec(SUITE_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:  # pragma: no cover - a broken installation
        return Path(__file__).resolve().parent.parent / "suite"
    return Path(locations[0]).resolve()


def suite_files() -> list[Path]:
    """The suite's topic modules, ``suite/test_*.py``, sorted by name."""
    return sorted(suite_dir().glob("test_*.py"))


def suite_classes() -> tuple[type[ConformanceSuite], ...]:
    """Every topic class of the suite, ordered by module then class name.

    A topic class is a ``ConformanceSuite`` subclass whose name starts with ``Test``,
    defined in one of the ``kvspec/conformance/suite/test_*.py`` modules. Class names are
    unique across modules (``make_suite`` keys its result by them).

    Raises:
        RuntimeError: Two topic modules define a class of the same name.
    """
    from ..suite._base import ConformanceSuite

    found: dict[str, type[ConformanceSuite]] = {}
    for path in suite_files():
        module = importlib.import_module(f"{SUITE_PACKAGE}.{path.stem}")
        for name, obj in sorted(vars(module).items()):
            if (
                isinstance(obj, type) and issubclass(obj, ConformanceSuite)
                and obj.__module__ == module.__name__ and name.startswith("Test")
            ):
                if name in found:
                    raise RuntimeError(
                        f"suite topic class {name} is defined in both {found[name].__module__} "
                        f"and {module.__name__}; topic class names must be unique"
                    )
                found[name] = obj
    return tuple(found.values())


def make_suite(
    connector: str | ConnectorFactory | type, *, module: str | None = None
) -> dict[str, type[ConformanceSuite]]:
    """Return the whole suite bound to one connector, as test classes keyed by name.

    Each topic class ``Test<Topic>`` gets a subclass of the same name whose ``connector``
    class attribute is ``connector``; pytest collects them from a test module that adds them
    to its namespace::

        # tests/test_kvspec_conformance.py
        from kvspec.conformance import make_suite

        globals().update(make_suite("mypkg.conn:Factory"))

    The connector is loaded once here, so that a bad spec fails at collection with a clear
    message.

    Args:
        connector: A connector spec (see ``load_factory``).
        module: The ``__module__`` of the new classes; default: the caller's module.

    Raises:
        InvalidArgumentError: The connector cannot be loaded.
    """
    from .._loader import load_factory

    load_factory(connector)
    if module is None:
        module = str(sys._getframe(1).f_globals.get("__name__", __name__))
    out: dict[str, type[ConformanceSuite]] = {}
    for cls in suite_classes():
        out[cls.__name__] = type(
            cls.__name__,
            (cls,),
            {
                "connector": connector,
                "__module__": module,
                "__qualname__": cls.__name__,
                "__doc__": cls.__doc__,
            },
        )
    return out


def topic_class(cls: type) -> type:
    """The suite topic class a test class derives from (itself if none)."""
    for c in cls.__mro__:
        if c.__module__.startswith(SUITE_PACKAGE + ".test_"):
            return c
    return cls


def connector_label(connector: object) -> str:
    """The spec string that names a connector in ids, keys and reports."""
    if isinstance(connector, str):
        return connector
    from .._loader import factory_spec

    try:
        return factory_spec(connector)  # type: ignore[arg-type]
    except Exception:
        cls = connector if isinstance(connector, type) else type(connector)
        return f"{cls.__module__}:{cls.__qualname__}"


def xfail_key(
    cls: type, module_file: str | None, function: str, connector: str, extra_ids: str = ""
) -> str:
    """The expected-failures key of one suite test.

    ``<file>::<TopicClass>::<function>[<connector>]``, or ``[<connector>-<other ids>]`` for a
    test with further parameters. ``<file>`` is the topic module's path relative to the
    suite directory (``test_declaration.py``) and ``<TopicClass>`` the suite topic class,
    whichever way the test was collected, so the key is the same for the plugin and for
    subclasses made by ``make_suite``, and the same on every installation.
    """
    topic = topic_class(cls)
    file = None
    topic_module = sys.modules.get(topic.__module__)
    topic_file = getattr(topic_module, "__file__", None) or module_file
    if topic_file is not None:
        path = Path(topic_file).resolve()
        try:
            file = path.relative_to(suite_dir()).as_posix()
        except ValueError:
            file = path.name
    ids = connector + (f"-{extra_ids}" if extra_ids else "")
    return f"{file}::{topic.__qualname__}::{function}[{ids}]"
