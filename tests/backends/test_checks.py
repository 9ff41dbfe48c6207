"""Tests of kvspec.backends._checks: the argument checks the backends' scheduler roles share."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.backends._checks import check_block_ids
from kvspec.protocols import InvalidBlockIdError


@given(st.lists(st.integers(0, 99), max_size=300), st.sampled_from([list, tuple]))
def test_check_block_ids_keeps_ids_in_budget(ids: list[int], container: Any) -> None:
    assert check_block_ids(container(ids), 100) == tuple(ids)


@pytest.mark.parametrize("length", [1, 40])  # below and above msgspec's bulk path
@pytest.mark.parametrize(
    ("bad", "clause"),
    [(100, "LAY-012"), (-1, "ERR-003"), (True, "ERR-003"), (1.0, "ERR-003"),
     ("1", "ERR-003"), (None, "ERR-003")],
)
def test_check_block_ids_rejects_typed(length: int, bad: Any, clause: str) -> None:
    ids = [*range(length - 1), bad]
    with pytest.raises(InvalidBlockIdError) as info:
        check_block_ids(ids, 100)
    assert info.value.clause == clause


@pytest.mark.parametrize("ids", [{1, 2}, iter([1, 2]), 5, "12"])
def test_check_block_ids_rejects_what_is_not_an_ordered_sequence(ids: Any) -> None:
    if not isinstance(ids, (set, int, str)):  # a one-shot iterable of good ids is accepted
        assert check_block_ids(ids, 100) == (1, 2)
        return
    with pytest.raises(InvalidBlockIdError):
        check_block_ids(ids, 100)
