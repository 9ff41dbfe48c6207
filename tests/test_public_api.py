"""Package hygiene: exports, docstrings and the one-way dependency rule."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import pkgutil
from pathlib import Path

import pytest

import kvspec

ROOT = Path(kvspec.__file__).resolve().parent
# kvspec.vllm and kvspec.vllm.connector import vLLM: they are checked where vLLM is
# installed (test.sh runs this file again under the vLLM environment, where
# KVSPEC_REQUIRE_VLLM=1 makes a missing vLLM an error, not a skip).
_VLLM_SPEC = importlib.util.find_spec("vllm")
HAVE_VLLM = _VLLM_SPEC is not None and _VLLM_SPEC.origin is not None  # not tests/vllm/
NEEDS_VLLM = {"kvspec.vllm", "kvspec.vllm.aggregation", "kvspec.vllm.connector"}
# kvspec.sglang.backend subclasses SGLang's HiCacheStorage: checked where SGLang is installed.
_SGLANG_SPEC = importlib.util.find_spec("sglang")
HAVE_SGLANG = _SGLANG_SPEC is not None and _SGLANG_SPEC.origin is not None  # not tests/sglang/
NEEDS_SGLANG = {"kvspec.sglang.backend"}
if os.environ.get("KVSPEC_REQUIRE_VLLM") == "1" and not HAVE_VLLM:
    raise RuntimeError("KVSPEC_REQUIRE_VLLM=1 but vLLM cannot be imported")
# Deprecated aliases of moved modules: every name warns and is the moved object.
MOVED_MODULES = {
    "kvspec.conformance.recording": "kvspec.conformance.connectors.recording",
}
PUBLIC_MODULES = sorted(
    m.name for m in pkgutil.walk_packages([str(ROOT)], "kvspec.")
    if not any(part.startswith("_") for part in m.name.split("."))
    and (HAVE_VLLM or m.name not in NEEDS_VLLM) and (HAVE_SGLANG or m.name not in NEEDS_SGLANG)
    and m.name not in MOVED_MODULES
)


@pytest.mark.parametrize("modname", PUBLIC_MODULES)
def test_all_names_exist_and_are_documented(modname: str) -> None:
    mod = importlib.import_module(modname)
    assert mod.__doc__ and mod.__doc__.strip(), f"{modname} has no module docstring"
    names = getattr(mod, "__all__", None)
    assert names is not None, f"{modname} has no __all__"
    for name in names:
        obj = getattr(mod, name)  # AttributeError: __all__ names a missing object
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__doc__ and obj.__doc__.strip(), f"{modname}.{name} has no docstring"
        if inspect.isclass(obj) and obj.__module__.startswith("kvspec"):
            for attr, member in vars(obj).items():
                if attr.startswith("_") or not callable(member) and not isinstance(member, property):
                    continue
                fn = member.fget if isinstance(member, property) else member
                fn = getattr(fn, "__func__", fn)
                assert getattr(fn, "__doc__", None), f"{modname}.{name}.{attr} has no docstring"


@pytest.mark.parametrize(("old", "new"), sorted(MOVED_MODULES.items()))
def test_moved_modules_keep_warning_aliases(old: str, new: str) -> None:
    mod, moved = importlib.import_module(old), importlib.import_module(new)
    assert mod.__doc__ and new in mod.__doc__
    assert set(mod.__all__) <= set(moved.__all__)
    for name in mod.__all__:
        with pytest.warns(DeprecationWarning, match=f"moved to {new}.{name}"):
            assert getattr(mod, name) is getattr(moved, name)


def test_moved_plugin_fixtures_keep_warning_aliases() -> None:
    from kvspec.conformance import plugin
    from kvspec.conformance.plugin import hooks

    for name in ("kvspec_capabilities", "kvspec_factory", "kvspec_profile", "kvspec_tmpdir"):
        with pytest.warns(DeprecationWarning, match=f"moved to {hooks.__name__}.{name}"):
            assert getattr(plugin, name) is getattr(hooks, name)


def _kvspec_imports(path: Path) -> set[str]:
    """Absolute names of the kvspec modules that ``path`` imports."""
    package = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("kvspec")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")  # ".../__init__" counts as one component too
                base = parts[: len(parts) - node.level]
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module and node.module.startswith("kvspec"):
                found.add(node.module)
    return found


# Deprecated aliases of moved modules (one release): each may import its new home, nothing else.
DEPRECATED_SHIMS = {  # from kvspec.bench import vllm_engine / vllm_adapter
    "vllm/engine.py": {"kvspec.bench"}, "vllm/bench.py": {"kvspec.bench"},
}


@pytest.mark.parametrize(
    ("package", "may_import"),
    [
        ("protocols", ("kvspec.protocols",)),
        ("spec", ("kvspec.spec",)),
        ("backends", ("kvspec.backends", "kvspec.protocols")),
        ("conformance", ("kvspec.conformance", "kvspec.protocols", "kvspec.spec")),
        ("vllm", ("kvspec.vllm", "kvspec.protocols")),
        ("sglang", ("kvspec.sglang", "kvspec.protocols")),
    ],
)
def test_dependencies_point_one_way(package: str, may_import: tuple[str, ...]) -> None:
    bad = []
    for path in (ROOT / package).rglob("*.py"):
        shim_may_import = DEPRECATED_SHIMS.get(path.relative_to(ROOT).as_posix(), set())
        for target in _kvspec_imports(path) - shim_may_import:
            if not any(target == p or target.startswith(p + ".") for p in may_import):
                bad.append(f"{path.relative_to(ROOT)} imports {target}")
    assert bad == []


def test_py_typed_is_shipped() -> None:
    assert (ROOT / "py.typed").exists()
