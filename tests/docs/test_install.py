"""The install path the docs give connector authors works: a wheel built from the checkout
(``pip wheel --no-deps``) installs, and the suite runs from the installed copy, its pytest
plugin found by its entry point (docs/connector-authors.md, issue 18 item 12)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_a_built_wheel_installs_and_runs_the_suite(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env.pop("PYTHONPATH", None)
    dist = tmp_path / "dist"
    # --no-build-isolation: the build backend is already here, and CI may have no index
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "-q", "-w", str(dist), str(ROOT)], tmp_path, env)
    assert built.returncode == 0, built.stderr
    (wheel,) = dist.glob("kvspec-*-py3-none-any.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "kvspec/py.typed" in names
    assert "kvspec/conformance/suite/test_engine.py" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "kvspec = kvspec.conformance.plugin.hooks" in zipfile.ZipFile(wheel).read(entry_points).decode()
    site = tmp_path / "site"
    installed = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                      str(site), str(wheel)], tmp_path, env)
    assert installed.returncode == 0, installed.stderr
    work = tmp_path / "project"
    work.mkdir()
    env["PYTHONPATH"] = str(site)  # the installed copy first (its dependencies come from here)
    which = _run([sys.executable, "-c", "import kvspec; print(kvspec.__file__)"], work, env)
    assert which.stdout.strip().startswith(str(site)), which.stdout + which.stderr
    suite = _run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                  "--kvspec-conformance=kvspec.conformance.connectors.null:NullConnector",
                  "-k", "TestDeclaration"], work, env)
    assert suite.returncode == 0, suite.stdout[-3000:] + suite.stderr[-2000:]
    assert "passed" in suite.stdout and "kvspec conformance" in suite.stdout
