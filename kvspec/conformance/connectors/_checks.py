"""Argument checks shared by the example connectors (ERR-002): the protocols' own."""

from __future__ import annotations

from kvspec.protocols._argchecks import check_count, check_request

__all__ = ["check_count", "check_request"]
