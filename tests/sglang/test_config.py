"""kvspec.sglang without SGLang: the configuration, the backend names, and an import that
leaves SGLang alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvspec.protocols.errors import InvalidArgumentError
from kvspec.sglang import HiCacheConfig, parse_target


def test_import_does_not_import_sglang() -> None:
    code = "import sys, kvspec.sglang, kvspec.sglang.suite; print('sglang' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(("spec", "name", "zero_copy"), [
    ("file", "file", False), ("nixl", "nixl", True), ("pkg.mod:Store", "dynamic", False),
])
def test_targets_and_the_path_the_controller_picks(spec: str, name: str, zero_copy: bool) -> None:
    target = parse_target(spec)
    assert target.name == name and target.zero_copy({}) is zero_copy
    if name == "dynamic":
        assert (target.module_path, target.class_name) == ("pkg.mod", "Store")
        assert target.zero_copy({"interface_v1": 1}) is True


@pytest.mark.parametrize("spec", ["", "pkg.mod:", ":Cls", "a b", "File"])
def test_malformed_targets_are_refused(spec: str) -> None:
    with pytest.raises(InvalidArgumentError, match="built-in name"):
        parse_target(spec)


@pytest.mark.parametrize(("changes", "message"), [
    ({"layout": "page_head"}, "layout must be one of"),
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"page_size": 0}, "page_size must be an int >= 1"),
    ({"tp_rank": 2, "tp_size": 2}, r"tp_rank must be an int in \[0, tp_size=2\)"),
    ({"extra_config": [1]}, "extra_config must be a mapping"),
])
def test_bad_configurations_are_refused(changes: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        HiCacheConfig(**changes)  # type: ignore[arg-type]


def test_extra_config_is_frozen() -> None:
    config = HiCacheConfig(extra_config={"a": 1})
    with pytest.raises(TypeError):
        config.extra_config["a"] = 2  # type: ignore[index]
