"""The STO suite catches planted defects, each with its clause, through SGLang's
``dynamic`` loading path (``module:Class``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvspec.protocols.errors import ContractViolation
from kvspec.sglang.suite import HiCacheStorageSuite, backends, have_sglang

pytestmark = pytest.mark.skipif(not have_sglang(), reason="needs SGLang: run under the "
                                "environment scripts/sglang_env.sh builds")


@pytest.mark.parametrize(("cls", "check", "args", "clause"), [
    ("RankBlind", "test_rank_coordinates_never_alias", ("tp_rank",), "STO-007"),
    ("NoneResults", "test_round_trip_controller_path", ("layer_first",), "STO-002"),
    ("CountsPastHoles", "test_longest_prefix_across_batches_and_holes", (), "STO-001"),
])
def test_planted_defect_is_caught_with_its_clause(
    tmp_path: Path, cls: str, check: str, args: tuple[str, ...], clause: str
) -> None:
    suite = HiCacheStorageSuite()
    with backends(f"sglang_planted:{cls}", tmp_path / "store") as make:
        with pytest.raises(ContractViolation) as caught:
            getattr(suite, check)(make, *args)
    assert caught.value.clause == clause, caught.value


def test_the_unplanted_file_backend_passes_the_same_checks(tmp_path: Path) -> None:
    suite = HiCacheStorageSuite()
    with backends("file", tmp_path / "store") as make:
        suite.test_rank_coordinates_never_alias(make, "tp_rank")
        suite.test_round_trip_controller_path(make, "layer_first")
        suite.test_longest_prefix_across_batches_and_holes(make)
