"""Loading connectors from specs, capability names, suite discovery, keys and the xfail file."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import kvspec.conformance as conformance
from kvspec.conformance import (
    ConformanceResult,
    ConformanceSuite,
    capability_names,
    factory_spec,
    has_capability,
    load_factory,
    make_suite,
    run_conformance,
    suite_classes,
)
from kvspec.conformance.plugin._expected_failures import read_xfail_file, write_xfail_file
from kvspec.conformance.plugin._suite_discovery import suite_dir, suite_files, xfail_key
from kvspec.conformance.suite import test_declaration as declaration
from kvspec.protocols import (
    Capabilities,
    ConnectorFactory,
    FailureReporting,
    HookGraphMode,
    InvalidArgumentError,
)

# Not imported by its name: pytest would collect it here as a test class without a connector.
DECLARATION = declaration.TestDeclaration

MODULE = "kvspec_loader_fixture_conn"

SOURCE = '''
from kvspec.protocols import Capabilities, ConnectorFactory


class Factory(ConnectorFactory):
    name = "fixture"
    capabilities = Capabilities()

    def create_scheduler(self, config):
        raise NotImplementedError

    def create_worker(self, config, rank):
        raise NotImplementedError


class Holder:
    class Inner(Factory):
        name = "inner"


INSTANCE = Factory()


class NeedsArgs(Factory):
    def __init__(self, x):
        self.x = x


class NotAFactory:
    name = "nope"


class BadCaps(Factory):
    capabilities = {"async_loads": True}


class NoName(Factory):
    name = ""


class Raises(Factory):
    @property
    def capabilities(self):
        raise RuntimeError("boom")
'''


@pytest.fixture
def conn_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    (tmp_path / f"{MODULE}.py").write_text(SOURCE)
    (tmp_path / "kvspec_loader_broken.py").write_text("import nosuchdependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    module = importlib.import_module(MODULE)
    yield module
    sys.modules.pop(MODULE, None)
    sys.modules.pop("kvspec_loader_broken", None)


def test_load_factory_from_spec_class_and_instance(conn_module: ModuleType) -> None:
    f = load_factory(f"{MODULE}:Factory")
    assert isinstance(f, conn_module.Factory) and isinstance(f, ConnectorFactory)
    assert load_factory(f"{MODULE}:Holder.Inner").name == "inner"
    assert load_factory(f"{MODULE}:INSTANCE") is conn_module.INSTANCE
    assert isinstance(load_factory(conn_module.Factory), conn_module.Factory)
    assert load_factory(conn_module.INSTANCE) is conn_module.INSTANCE


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "expected 'package.module:Name'"),
        ("a:b:c", "expected 'package.module:Name'"),
        (":Factory", "expected 'package.module:Name'"),
        (f"{MODULE}:", "expected 'package.module:Name'"),
        ("bad-name:Factory", "expected 'package.module:Name'"),
        ("kvspec_no_such_module:Factory", "module 'kvspec_no_such_module' not found"),
        ("kvspec_loader_broken:Factory", "importing module 'kvspec_loader_broken' failed"),
        (f"{MODULE}:Missing", f"'{MODULE}' has no attribute 'Missing'"),
        (f"{MODULE}:Holder.Missing", f"'{MODULE}:Holder' has no attribute 'Missing'"),
        (f"{MODULE}:NeedsArgs", "could not instantiate NeedsArgs with no arguments"),
        (f"{MODULE}:NotAFactory", "is not a ConnectorFactory: NotAFactory lacks capabilities, "
                                  "create_scheduler, create_worker, create_executor"),
        (f"{MODULE}:BadCaps", "capabilities must be a kvspec.protocols.Capabilities, got dict"),
        (f"{MODULE}:NoName", "name must be a non-empty str, got ''"),
        (f"{MODULE}:Raises", "reading its name or capabilities raised RuntimeError: boom"),
    ],
)
def test_load_factory_says_what_is_wrong(
    conn_module: ModuleType, spec: str, message: str
) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        load_factory(spec)
    assert message in str(info.value)


def test_load_factory_rejects_non_factories() -> None:
    with pytest.raises(InvalidArgumentError, match="is not a ConnectorFactory"):
        load_factory(object())  # type: ignore[arg-type]


def test_factory_spec_round_trips(conn_module: ModuleType) -> None:
    assert factory_spec(conn_module.INSTANCE) == f"{MODULE}:Factory"
    assert factory_spec(conn_module.Holder.Inner) == f"{MODULE}:Holder.Inner"
    again = load_factory(factory_spec(load_factory(f"{MODULE}:Holder.Inner")))
    assert again.name == "inner"

    class Local(conn_module.Factory):  # type: ignore[name-defined,misc]
        pass

    with pytest.raises(InvalidArgumentError, match="not importable by name"):
        factory_spec(Local())


def test_capability_names_and_has_capability() -> None:
    names = capability_names()
    assert set(names) == {
        "async_loads", "delayed_free", "accepts_split_kv", "heterogeneous_tp",
        "custom_aggregator", "handles_preemptions", "needs_token_rows", "fault_injection",
        "layer_hooks", "capturable_hooks",
        "eager_hooks", "reports_failures", "multiple_kv_cache_groups", "sleep_mode",
    }
    plain = Capabilities()
    assert not any(has_capability(plain, n) for n in names if n != "accepts_split_kv")
    assert has_capability(plain, "accepts_split_kv")
    eager = Capabilities(layer_hooks=HookGraphMode.EAGER)
    assert has_capability(eager, "layer_hooks") and has_capability(eager, "eager_hooks")
    assert not has_capability(eager, "capturable_hooks")
    capturable = Capabilities(layer_hooks=HookGraphMode.CAPTURABLE)
    assert has_capability(capturable, "layer_hooks")
    assert has_capability(capturable, "capturable_hooks")
    rich = Capabilities(
        async_loads=True, failure_reporting=FailureReporting.INVALID_BLOCKS, kv_cache_groups=2,
        custom_aggregator=True,
    )
    for name in ("async_loads", "reports_failures", "multiple_kv_cache_groups",
                 "custom_aggregator"):
        assert has_capability(rich, name)
    with pytest.raises(InvalidArgumentError, match="unknown capability name 'flying'"):
        has_capability(plain, "flying")


def test_suite_discovery() -> None:
    assert suite_dir() == Path(conformance.__file__).resolve().parent / "suite"
    assert suite_dir() / "test_declaration.py" in suite_files()
    classes = suite_classes()
    assert DECLARATION in classes
    assert all(issubclass(c, ConformanceSuite) and c.__name__.startswith("Test") for c in classes)
    assert len({c.__name__ for c in classes}) == len(classes)


def test_make_suite_binds_every_topic_class(conn_module: ModuleType) -> None:
    made = make_suite(f"{MODULE}:Factory")
    assert sorted(made) == sorted(c.__name__ for c in suite_classes())
    sub = made["TestDeclaration"]
    assert issubclass(sub, DECLARATION) and sub is not DECLARATION
    assert sub.connector == f"{MODULE}:Factory"
    assert sub.__module__ == __name__
    assert DECLARATION.connector is None
    with pytest.raises(InvalidArgumentError):
        make_suite(f"{MODULE}:Missing")


def test_xfail_key_is_the_same_for_both_ways_in(conn_module: ModuleType) -> None:
    sub = make_suite(f"{MODULE}:Factory")["TestDeclaration"]
    direct = xfail_key(DECLARATION, None, "test_x", "a.b:C")
    assert direct == "test_declaration.py::TestDeclaration::test_x[a.b:C]"
    assert xfail_key(sub, __file__, "test_x", "a.b:C") == direct
    assert xfail_key(DECLARATION, None, "test_x", "a.b:C", "3-x") == \
        "test_declaration.py::TestDeclaration::test_x[a.b:C-3-x]"


def test_xfail_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "xfail.txt"
    path.write_text(
        "# header\n\n  a.py::T::t[x:Y]  # why\nb.py::T::t[x:Y-1]\n   # indented comment\n"
        "c.py::T::t[x:Y#1]\n"
    )
    entries = read_xfail_file(path)
    assert [(e.key, e.line, e.reason) for e in entries] == [
        ("a.py::T::t[x:Y]", 3, "why"), ("b.py::T::t[x:Y-1]", 4, ""),
        ("c.py::T::t[x:Y#1]", 6, ""),
    ]
    write_xfail_file(path, ["z", "a", "z"], header=("one", ""))
    assert path.read_text() == "# one\n#\na\nz\n"


def test_conformance_result_from_report() -> None:
    report = {
        "tests": [{"outcome": o} for o in ("pass", "pass", "fail", "skip", "xfail")],
        "clauses": {"GRA-001": {"pass": 2}},
    }
    result = ConformanceResult.from_report(1, report)
    assert (result.passed, result.failed, result.skipped, result.xfailed) == (2, 1, 1, 1)
    assert result.exit_code == 1 and not result.ok
    assert result.clauses["GRA-001"]["pass"] == 2
    with pytest.raises(TypeError):
        result.report["x"] = 1  # type: ignore[index]


def test_run_conformance_validates_arguments() -> None:
    with pytest.raises(InvalidArgumentError):
        run_conformance([])
    with pytest.raises(InvalidArgumentError):
        run_conformance(["a:B"], profile="huge")


def test_public_api_is_lazy_and_complete() -> None:
    assert set(conformance.__all__) <= set(dir(conformance))
    for name in conformance.__all__:
        assert getattr(conformance, name) is not None
    with pytest.raises(AttributeError):
        conformance.no_such_name  # noqa: B018
    assert conformance.DEFAULT_CONNECTORS == (
        "kvspec.conformance.connectors.null:NullConnector",
        "kvspec.conformance.connectors.shared_storage:SharedStorageConnector",
        "kvspec.conformance.connectors.layerwise:LayerwiseStorageConnector",
        "kvspec.backends.offload:OffloadConnector",
        "kvspec.backends.offload:LayerwiseOffloadConnector",
        "kvspec.backends.nixl:NixlConnector",
    )
