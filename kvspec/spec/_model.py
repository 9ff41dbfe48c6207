"""The value types of the clause registry."""

from __future__ import annotations

import enum
import re

import attrs

__all__ = ["Area", "Clause", "Level"]

_ID_RE = re.compile(r"^(SCH|WRK|EXE|EVT|LAY|KVG|SPD|STG|DRY|GRA|HSK|STO|ERR)-(\d{3})$")


class Level(enum.Enum):
    """RFC 2119 requirement level of a clause."""

    MUST = "MUST"
    SHOULD = "SHOULD"
    MAY = "MAY"


class Area(enum.Enum):
    """The areas of the contract; each clause ID starts with its area's code."""

    SCH = "Scheduler role"
    WRK = "Worker role"
    EXE = "Executor role and aggregation"
    EVT = "Events and connector output"
    LAY = "KV-cache layout"
    KVG = "KV-cache groups"
    SPD = "Speculative decoding"
    STG = "State groups (state-space hybrids)"
    DRY = "Dummy runs"
    GRA = "Graph capture and replay"
    HSK = "Handshake"
    STO = "HiCache storage backends (SGLang)"
    ERR = "Errors and bad input"

    @property
    def page(self) -> str:
        """The docs page (under docs/spec/) that holds this area's clauses."""
        return f"{self.name.lower()}.md"


def _check_text(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"clause {attribute.name} must be a non-empty string")
    if "\n" in value:
        raise ValueError(f"clause {attribute.name} must be one line, got {value!r}")


@attrs.frozen
class Clause:
    """One numbered rule of the contract.

    Attributes:
        id: Stable identifier, ``AREA-NNN`` (for example ``SCH-005``). Never reused.
        level: MUST, SHOULD or MAY.
        title: A few words naming the rule, used in tables and reports.
        rule: The rule, in one sentence.
        rationale: Why the rule exists, in one sentence.
        sources: Engine versions, issues and pull requests the rule was read from.
    """

    id: str
    level: Level
    title: str = attrs.field(validator=_check_text)
    rule: str = attrs.field(validator=_check_text)
    rationale: str = attrs.field(validator=_check_text)
    sources: tuple[str, ...] = ()

    def __attrs_post_init__(self) -> None:
        if not _ID_RE.match(self.id):
            raise ValueError(f"clause id {self.id!r} does not match AREA-NNN with a known area")
        if not isinstance(self.level, Level):
            raise TypeError(f"clause {self.id}: level must be a Level, got {self.level!r}")
        if not re.search(rf"\b{self.level.value}\b", self.rule):
            raise ValueError(
                f"clause {self.id}: its rule must state its level {self.level.value!r} in words"
            )

    @property
    def area(self) -> Area:
        """The area this clause belongs to, from its ID prefix."""
        return Area[self.id.split("-", 1)[0]]

    @property
    def anchor(self) -> str:
        """The HTML anchor of the clause on its docs page."""
        return self.id.lower()

    @property
    def url(self) -> str:
        """The clause's location relative to the docs root, ``spec/<area>.md#<anchor>``."""
        return f"spec/{self.area.page}#{self.anchor}"
