"""Demonstrations that run kvspec's reference backends end to end (``kvspec demo ...``)."""

from __future__ import annotations

__all__: list[str] = []
