"""The machine-readable clause registry of the kvspec contract.

The normative text lives in docs/spec/; this registry is its twin, kept equal by a test,
so that tests, reports and error messages can name clauses. Clause IDs are stable.

Example:
    >>> from kvspec.spec import get_clause
    >>> get_clause("SCH-005").title
    'A full hit leaves one token to compute'
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from ._clauses import CLAUSES
from ._model import Area, Clause, Level

__all__ = [
    "CLAUSES",
    "ENGINE_VERSIONS",
    "SPEC_VERSION",
    "Area",
    "Clause",
    "Level",
    "clauses_in",
    "counts",
    "get_clause",
]

SPEC_VERSION = "0.3"
"""Version of the spec text. The major part changes when a MUST clause changes meaning."""

ENGINE_VERSIONS = ("vLLM 0.28", "vLLM 0.29", "vLLM 0.30", "vLLM 0.31", "vLLM 0.32", "vLLM 0.33")
"""Engine versions whose connector contract the clauses were read from."""

_BY_ID: Mapping[str, Clause] = MappingProxyType({c.id: c for c in CLAUSES})
if len(_BY_ID) != len(CLAUSES):  # pragma: no cover - guarded by tests
    raise RuntimeError("duplicate clause id in the registry")


def get_clause(clause_id: str) -> Clause:
    """Return the clause with this ID.

    Raises:
        KeyError: No clause has this ID; the message lists the valid areas.
    """
    if not isinstance(clause_id, str):
        raise TypeError(f"clause id must be a str like 'SCH-001', got {type(clause_id).__name__}")
    try:
        return _BY_ID[clause_id.upper()]
    except KeyError:
        areas = ", ".join(a.name for a in Area)
        raise KeyError(
            f"no clause {clause_id!r}; IDs are AREA-NNN with AREA one of {areas}"
        ) from None


def clauses_in(area: Area) -> tuple[Clause, ...]:
    """Return the clauses of one area, in ID order."""
    if not isinstance(area, Area):
        raise TypeError(f"area must be an Area, got {area!r}")
    return tuple(sorted((c for c in CLAUSES if c.area is area), key=lambda c: c.id))


def counts() -> dict[Area, dict[Level, int]]:
    """Return the number of clauses per area and level."""
    table = {a: {lv: 0 for lv in Level} for a in Area}
    for c in CLAUSES:
        table[c.area][c.level] += 1
    return table
