"""Issue 36, inputs 9 and 10: ``FailedStores`` (the offload backend's worker metadata)
refuses a str where it takes bytes or a collection of request ids, with a typed error
naming the clause."""

from __future__ import annotations

import pytest

from kvspec.backends.offload._scheduler import FailedStores
from kvspec.protocols import InvalidArgumentError, MalformedMetadataError


def test_decode_requires_bytes() -> None:
    """Input 9: ``FailedStores.decode('["a"]')`` decoded a str."""
    with pytest.raises(MalformedMetadataError) as err:
        FailedStores.decode('["a"]')  # type: ignore[arg-type]
    assert err.value.clause == "ERR-005" and "[ERR-005]" in str(err.value)
    good = FailedStores(frozenset({"a", "b"}))
    assert FailedStores.decode(good.encode()) == good
    for bad in (b"", b"[]", b'[""]', b'["a", 1]', b'{"a": 1}', b'["\x80"]'):
        with pytest.raises(MalformedMetadataError) as err:
            FailedStores.decode(bad)
        assert err.value.clause == "ERR-005"


@pytest.mark.parametrize("ids", ["ab", b"ab", {"a": 1}])
def test_a_str_is_not_a_collection_of_ids(ids: object) -> None:
    """Input 10: ``FailedStores('ab')`` split the str into {'a', 'b'}."""
    with pytest.raises(InvalidArgumentError) as err:
        FailedStores(ids)  # type: ignore[arg-type]
    assert err.value.clause == "ERR-002" and "[ERR-002]" in str(err.value)
    assert FailedStores(["a", "b"]).request_ids == {"a", "b"}
