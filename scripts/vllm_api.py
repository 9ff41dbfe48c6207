"""Read vLLM's KV-connector API from each release's wheel; write the per-release tables.

Run by hand (not by CI), in kvspec's environment:

    python scripts/vllm_api.py                    # vLLM 0.28.0 .. 0.33.0
    python scripts/vllm_api.py --releases 0.32.0 0.33.0 --cache /tmp/vllm-wheels

For each release it downloads the wheel with ``pip download --no-deps`` (into ``--cache``,
kept between runs, never committed), reads two files of it with zipfile and parses them
with ast, without importing or running anything from the wheel:

* ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``: every method of
  ``KVConnectorBase_V1`` (parameters, decorators, whether it is abstract);
* ``vllm/v1/worker/kv_connector_model_runner_mixin.py``: the connector methods the model
  runner's hook driver calls.

It writes ``tests/vllm/data/vllm_api.json`` (the facts, which ``tests/vllm/test_releases.py``
checks the adapter against) and the method table of ``docs/compatibility.md`` (between its
``<!-- vllm-api:start -->`` and ``<!-- vllm-api:end -->`` markers).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RELEASES = ("0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
MIXIN = "vllm/v1/worker/kv_connector_model_runner_mixin.py"
CLASS = "KVConnectorBase_V1"
LANDMARKS = {
    "KVOutputAggregator": "class KVOutputAggregator",
    "build_dummy_connector_meta": "def build_dummy_connector_meta",
}
"""Other facts the compatibility page dates: the first file of the wheel's ``vllm/`` tree
that contains the text, if any."""
DATA = ROOT / "tests" / "vllm" / "data" / "vllm_api.json"
PAGE = ROOT / "docs" / "compatibility.md"
START, END = "<!-- vllm-api:start -->", "<!-- vllm-api:end -->"


def wheel(release: str, cache: Path) -> Path:
    """The release's wheel in ``cache``, downloaded first if needed."""
    found = sorted(cache.glob(f"vllm-{release}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        f"vllm=={release}", "-d", str(cache)], check=True)
        found = sorted(cache.glob(f"vllm-{release}-*.whl"))
    if not found:
        raise SystemExit(f"no wheel of vllm {release} in {cache}")
    return found[0]


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Parameter names in order, ``*args`` / ``**kwargs`` marked, ``=`` after defaulted."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    out = [p.arg + ("=" if d else "") for p, d in zip(positional, defaults)]
    if a.vararg:
        out.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        out.append("*")
    out += [p.arg + ("=" if d is not None else "") for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append("**" + a.kwarg.arg)
    return out


def base_methods(source: str) -> dict[str, dict[str, Any]]:
    """``KVConnectorBase_V1``'s methods: parameters, kind and abstractness."""
    tree = ast.parse(source)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == CLASS)
    out: dict[str, dict[str, Any]] = {}
    for node in cls.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        decorators = {ast.unparse(d).rsplit(".", 1)[-1] for d in node.decorator_list}
        kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decorators),
                    "method")
        out[node.name] = {"params": _params(node), "kind": kind,
                          "abstract": "abstractmethod" in decorators}
    return out


def driver_calls(source: str, methods: set[str]) -> list[str]:
    """Connector methods called by name in the hook driver, sorted."""
    called = {n.func.attr for n in ast.walk(ast.parse(source))
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    return sorted(called & methods)


def read(release: str, cache: Path) -> dict[str, Any]:
    with zipfile.ZipFile(wheel(release, cache)) as z:
        methods = base_methods(z.read(BASE).decode())
        names = set(z.namelist())
        calls = driver_calls(z.read(MIXIN).decode(), set(methods)) if MIXIN in names else None
        landmarks: dict[str, str | None] = dict.fromkeys(LANDMARKS)
        for name in sorted(names):
            if not (name.startswith("vllm/") and name.endswith(".py")):
                continue
            text = z.read(name).decode(errors="replace")
            for key, needle in LANDMARKS.items():
                if landmarks[key] is None and needle in text:
                    landmarks[key] = name
    return {"methods": methods, "driver_calls": calls, "landmarks": landmarks}


def _sig(entry: dict[str, Any]) -> str:
    prefix = {"classmethod": "classmethod ", "staticmethod": "staticmethod ",
              "property": "property "}.get(entry["kind"], "")
    params = [p for p in entry["params"] if p not in ("self", "cls")]
    return prefix + "(" + ", ".join(params) + ")" + (", abstract" if entry["abstract"] else "")


def table(api: dict[str, dict[str, Any]]) -> str:
    """The Markdown method table: a row per method, a column per release."""
    releases = list(api)
    names = sorted({m for r in releases for m in api[r]["methods"]})
    head = ["method", *releases]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        cells, previous = [], None
        for r in releases:
            entry = api[r]["methods"].get(name)
            if entry is None:
                cells.append("removed" if previous is not None else "—")
            elif previous is None:
                cells.append(f"`{_sig(entry)}`" + (" (added)" if r != releases[0] else ""))
            elif _sig(entry) != _sig(previous):
                cells.append(f"changed: `{_sig(entry)}`")
            else:
                cells.append("same")
            previous = entry
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    calls = ["**called by the hook driver**"]
    for r in releases:
        c = api[r]["driver_calls"]
        calls.append("(no driver file)" if c is None else ", ".join(f"`{m}`" for m in c))
    lines.append("| " + " | ".join(calls) + " |")
    for key in LANDMARKS:
        cells = [f"**{key}**"]
        for r in releases:
            where = api[r].get("landmarks", {}).get(key)
            cells.append(f"in `{where.removeprefix('vllm/')}`" if where else "absent")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--releases", nargs="+", default=list(RELEASES))
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "kvspec" / "wheels")
    args = parser.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    api = {}
    for release in args.releases:
        print(f"vllm {release}", file=sys.stderr, flush=True)
        api[release] = read(release, args.cache)
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text(json.dumps(api, indent=1, sort_keys=True) + "\n")
    page = PAGE.read_text()
    if START not in page or END not in page:
        raise SystemExit(f"{PAGE} has no {START} ... {END} markers")
    before, rest = page.split(START, 1)
    _, after = rest.split(END, 1)
    PAGE.write_text(f"{before}{START}\n{table(api)}\n{END}{after}")
    print(f"wrote {DATA.relative_to(ROOT)} and the table of {PAGE.relative_to(ROOT)}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
