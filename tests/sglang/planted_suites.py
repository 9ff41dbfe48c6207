"""The STO suite on every planted-defect backend (``sglang_planted``) and on their unplanted
bases, in the one pytest session tests/sglang/test_planted.py starts. Not collected on its
own (its name does not start with ``test_``)."""

from __future__ import annotations

from typing import ClassVar

from kvspec.sglang.suite import HiCacheStorageSuite


class _Planted(HiCacheStorageSuite):
    concurrent_s: ClassVar[float] = 1.0


class TestFile(_Planted):
    target = "file"


class TestZeroCopyFile(_Planted):
    target = "sglang_planted:ZeroCopyFile"
    extra_config = {"interface_v1": 1}


class TestRankBlind(_Planted):
    target = "sglang_planted:RankBlind"


class TestNoneResults(_Planted):
    target = "sglang_planted:NoneResults"


class TestCountsPastHoles(_Planted):
    target = "sglang_planted:CountsPastHoles"


class TestRaisesOnMiss(_Planted):
    target = "sglang_planted:RaisesOnMiss"


class TestGetLooksElsewhere(_Planted):
    target = "sglang_planted:GetLooksElsewhere"


class TestLiesAboutFailedSets(_Planted):
    target = "sglang_planted:LiesAboutFailedSets"


class TestTornWrites(_Planted):
    target = "sglang_planted:TornWrites"


class TestOffByOnePage(_Planted):
    target = "sglang_planted:OffByOnePage"
    extra_config = {"interface_v1": 1}
