"""The offload backend stores running requests' blocks while they run, and fences those
stores when a request is preempted (WRK-012): the suite's fence test passes it and catches
the same backend with ``handle_preemptions`` left out, through the real plugin."""

from __future__ import annotations

import json

import pytest

pytest_plugins = ["pytester"]

UNFENCED = '''
from kvspec.backends.offload import OffloadConnector, OffloadWorker


class _Worker(OffloadWorker):
    def handle_preemptions(self, preempted_req_ids):
        return None  # the copies of preempted requests go on reading


class Unfenced(OffloadConnector):
    worker_class = _Worker
'''


@pytest.mark.parametrize(("spec", "fails"), [
    ("kvspec.backends.offload:OffloadConnector", False),
    ("unfenced_offload:Unfenced", True),
])
def test_the_fence_test_tells_a_fencing_offload_worker_from_one_that_does_not(
    pytester: pytest.Pytester, spec: str, fails: bool
) -> None:
    pytester.makepyfile(unfenced_offload=UNFENCED)
    report = pytester.path / "report.json"
    result = pytester.runpytest_subprocess(
        f"--kvspec-conformance={spec}", f"--kvspec-report={report}", "-p", "no:cacheprovider",
        "-k", "test_preempted_requests_transfers_are_fenced",
    )
    data = json.loads(report.read_text())
    failed = {cid for cid, row in data["clauses"].items() if row["fail"]}
    passed = {cid for cid, row in data["clauses"].items() if row["pass"]}
    if fails:
        assert result.ret == 1, result.stdout.str()[-3000:]
        assert failed == {"WRK-012"}
    else:
        assert result.ret == 0, result.stdout.str()[-3000:]
        assert "WRK-012" in passed and not failed
