"""The HiCache storage suite bound to the backend ``kvspec conform hicache:TARGET`` names
(``$KVSPEC_HICACHE_TARGET``, extra configuration in ``$KVSPEC_HICACHE_EXTRA`` as JSON);
pytest collects this file when the command passes it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, ClassVar

from ._config import HICACHE_EXTRA_ENV, HICACHE_TARGET_ENV
from .suite import HiCacheStorageSuite


class TestHiCacheBackend(HiCacheStorageSuite):
    """The STO suite on the backend named in ``$KVSPEC_HICACHE_TARGET``."""

    target: ClassVar[str] = os.environ.get(HICACHE_TARGET_ENV, "file")
    extra_config: ClassVar[Mapping[str, Any]] = json.loads(os.environ.get(HICACHE_EXTRA_ENV) or "{}")
