"""The fault seam: how an engine (or the conformance harness) tells a connector to fail or
slow down its transfers, so what the connector does then can be checked.

A connector that declares ``Capabilities.fault_injection`` reads ``FaultPlan.from_config`` in
its roles and honours it: with ``fail_loads`` every load fails (reported in
``finished_recving`` and ``failed_recving`` with its blocks invalid, WRK-011); with
``fail_stores`` every store fails (it is never matched afterwards); with ``delay_s`` no
load or store completes sooner than that after it started, so transfers stay in flight
across steps, through aborts and preemptions; with ``stall_s`` every load's copy into the
KV caches hangs that long *inside* the copy, past the connector's last look at its
deadline, and then writes its blocks anyway (a page being swapped in, a file mapping on a
slow device): the load is reported failed at its deadline (WRK-014) and its late writes
must not reach blocks the engine has handed on (WRK-017); ``deadline_s``, when set, is every
transfer's deadline in place of the connector's own, so a stall can outlast it. The seam is
in the connector's own transfer code, so it works the same for files, host memory and NIXL
peers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from .errors import InvalidArgumentError
from .views import EngineConfigView

__all__ = ["FAULTS_KEY", "FaultPlan"]

FAULTS_KEY = "kvspec.faults"
"""The ``EngineConfigView.extra`` key of a ``FaultPlan``'s plain-data form."""

_KEYS = frozenset({"fail_loads", "fail_stores", "delay_s", "stall_s", "deadline_s"})


@attrs.frozen
class FaultPlan:
    """Faults a connector injects into its own transfers (see the module docstring).

    Attributes:
        fail_loads: Every load fails, its blocks invalid.
        fail_stores: Every store fails; what it would have stored is never matched.
        delay_s: Every load and store completes no sooner than this many seconds after it
            started (0: no delay). Connectors bound it by their own transfer timeout.
        stall_s: Every load's copy into the KV caches hangs this many seconds once it has
            begun, whatever its deadline, then completes (0: no stall).
        deadline_s: Every transfer's deadline, in seconds after it started, in place of the
            connector's own (0: the connector's own).

    Raises:
        InvalidArgumentError: a field of the wrong type or range (ERR-002).
    """

    fail_loads: bool = False
    fail_stores: bool = False
    delay_s: float = 0.0
    stall_s: float = 0.0
    deadline_s: float = 0.0

    def __attrs_post_init__(self) -> None:
        for name in ("fail_loads", "fail_stores"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(
                    f"FaultPlan.{name} must be a bool, got {getattr(self, name)!r}",
                    clause="ERR-002",
                )
        for name in ("delay_s", "stall_s", "deadline_s"):
            d = getattr(self, name)
            if isinstance(d, bool) or not isinstance(d, (int, float)) or not (
                math.isfinite(d) and 0 <= d <= 3600
            ):
                raise InvalidArgumentError(
                    f"FaultPlan.{name} must be a number of seconds in [0, 3600], got {d!r}",
                    clause="ERR-002",
                )

    @property
    def active(self) -> bool:
        """True when any fault is planned."""
        return self.fail_loads or self.fail_stores or self.delay_s > 0 or self.stall_s > 0 \
            or self.deadline_s > 0

    def deadline(self, own_s: float) -> float:
        """The transfer deadline to use, in seconds: ``deadline_s`` when set, else
        ``own_s`` (the connector's own)."""
        return self.deadline_s or own_s

    def to_plain(self) -> dict[str, object]:
        """The plain-data form stored under ``extra["kvspec.faults"]``."""
        return {"fail_loads": self.fail_loads, "fail_stores": self.fail_stores,
                "delay_s": float(self.delay_s), "stall_s": float(self.stall_s),
                "deadline_s": float(self.deadline_s)}

    @classmethod
    def from_config(cls, config: EngineConfigView) -> FaultPlan:
        """The plan in ``config.extra["kvspec.faults"]``; no faults when it is absent.

        Raises:
            InvalidArgumentError: the entry is not a mapping of the known keys with valid
                values (ERR-002).
        """
        if not isinstance(config, EngineConfigView):
            raise InvalidArgumentError(
                f"config must be an EngineConfigView, got {type(config).__name__}",
                clause="ERR-002",
            )
        raw = config.extra.get(FAULTS_KEY)
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping) or not set(raw) <= _KEYS:
            raise InvalidArgumentError(
                f"extra[{FAULTS_KEY!r}] is {raw!r}; expected a mapping with keys among "
                f"{sorted(_KEYS)}", clause="ERR-002",
            )
        return cls(**{k: raw[k] for k in raw})
