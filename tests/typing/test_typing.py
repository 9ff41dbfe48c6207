"""Run mypy --strict on the type-test modules and compare with what they expect."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

api = pytest.importorskip("mypy.api")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ERROR = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): error: (?P<msg>.*?)\s+\[(?P<code>[a-z-]+)\]$")
EXPECT = re.compile(r"#\s*E:\s*(?P<code>[a-z-]+)")


@pytest.fixture(scope="module")
def mypy_errors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[tuple[int, str]]]:
    cache = tmp_path_factory.mktemp("mypy-cache")
    stdout, stderr, _status = api.run([
        "--strict", "--show-error-codes", "--no-error-summary", "--no-pretty",
        "--cache-dir", str(cache), "--config-file", str(ROOT / "pyproject.toml"),
        str(HERE / "good_connector.py"), str(HERE / "bad_connector.py"),
    ])
    assert not stderr.strip(), stderr
    found: dict[str, set[tuple[int, str]]] = {"good_connector.py": set(), "bad_connector.py": set()}
    for line in stdout.splitlines():
        m = ERROR.match(line)
        if m:
            found.setdefault(Path(m["path"]).name, set()).add((int(m["line"]), m["code"]))
        elif ": error:" in line:
            pytest.fail(f"unparsed mypy error: {line}")
    return found


def test_minimal_connector_type_checks(mypy_errors: dict[str, set[tuple[int, str]]]) -> None:
    assert mypy_errors["good_connector.py"] == set()
    assert set(mypy_errors) == {"good_connector.py", "bad_connector.py"}, "errors inside kvspec"


def test_wrong_signatures_are_rejected(mypy_errors: dict[str, set[tuple[int, str]]]) -> None:
    expected = {
        (n, m["code"])
        for n, text in enumerate((HERE / "bad_connector.py").read_text().splitlines(), 1)
        if (m := EXPECT.search(text))
    }
    assert len(expected) >= 5
    assert mypy_errors["bad_connector.py"] == expected
