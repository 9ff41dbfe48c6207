"""The spec version these Protocols implement."""

from __future__ import annotations

__all__ = ["SPEC_VERSION"]

SPEC_VERSION = "0.3"
"""The version of the spec (``docs/spec``) the Protocols implement; connectors announce it
in their handshake metadata (HSK-003). Always equal to ``kvspec.spec.SPEC_VERSION`` (a test
checks it)."""
