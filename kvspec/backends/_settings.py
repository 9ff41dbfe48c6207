"""Settings read from ``EngineConfigView.extra`` through msgspec (ERR-002).

A backend declares its settings as a frozen ``msgspec.Struct`` whose fields are named by
their ``extra`` keys (``msgspec.field(name=...)`` where the attribute is named otherwise)
and typed with their bounds; ``read_settings`` converts ``extra`` into it in one pass and
turns msgspec's message into one that names the key, the value and what was expected.
"""

from __future__ import annotations

import re
import sys
from typing import Annotated, TypeVar

import msgspec

from kvspec.protocols import EngineConfigView, InvalidArgumentError

__all__ = ["Finite", "Positive", "PositiveSeconds", "read_settings"]

S = TypeVar("S", bound=msgspec.Struct)

Finite = Annotated[float, msgspec.Meta(ge=0, le=sys.float_info.max)]
"""A finite number >= 0 (an int is taken as a float; a bool, NaN or infinity is not)."""
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0, le=sys.float_info.max)]
"""A finite number of seconds > 0."""
Positive = Annotated[int, msgspec.Meta(ge=1)]
"""An int >= 1 (not a bool)."""

_AT = re.compile(r"^(.*) - at `\$\.(.+)`$", re.DOTALL)


def read_settings(config: object, settings: type[S]) -> S:
    """``config.extra`` as ``settings`` (keys it does not name are the connector's others).

    Raises:
        InvalidArgumentError: ``config`` is not an ``EngineConfigView``, or a key holds a
            value of the wrong type or range (ERR-002).
    """
    if not isinstance(config, EngineConfigView):
        raise InvalidArgumentError(
            f"config must be an EngineConfigView, got {type(config).__name__}",
            clause="ERR-002",
        )
    keys = set(settings.__struct_encode_fields__)
    extra = {k: v for k, v in config.extra.items() if k in keys}
    try:
        return msgspec.convert(extra, settings)
    except msgspec.ValidationError as e:
        found = _AT.match(str(e))
        if found is None:  # pragma: no cover - msgspec names the field of every error
            raise InvalidArgumentError(f"config.extra is malformed: {e}",
                                       clause="ERR-002") from None
        why, key = found.groups()
        raise InvalidArgumentError(
            f"config.extra[{key!r}] is {extra.get(key)!r}; {why[0].lower()}{why[1:]}",
            clause="ERR-002") from None
