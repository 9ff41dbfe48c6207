"""A deliberately broken variant of the NIXL backend: HSK-006 (issue 48). ``test_broken.py``
runs it through the real plugin in a subprocess and expects HSK-006, and no other clause, to
fail. It lives with the tests: the conformance package does not depend on the reference
backends."""

from __future__ import annotations

from typing import ClassVar

from kvspec.backends.nixl import NixlConnector
from kvspec.backends.nixl._worker import NixlWorker

__all__ = ["BROKEN_NIXL", "StalePeersConnector"]


class _StalePeersWorker(NixlWorker):
    """Keeps the first agents it reached of every producer engine, whatever that engine
    publishes later (HSK-006)."""

    def _forget_engine(self, engine_id: str) -> None:
        return None  # the slip: a producer that woke from a sleep is still read at its old agent


class StalePeersConnector(NixlConnector):
    """Breaks HSK-006: the consumer never handshakes again with a producer engine it has
    read from: after the producer slept and woke with a new agent, every READ goes to the
    agent it closed, fails, and the decode engine recomputes what it should load."""

    violates: ClassVar[str] = "HSK-006"
    selection: ClassVar[str] = "test_two_engines_producer_sleeps"
    worker_class = _StalePeersWorker

    @property
    def name(self) -> str:
        return "broken-stale-peers"


BROKEN_NIXL: tuple[tuple[type[StalePeersConnector], str], ...] = (
    (StalePeersConnector, StalePeersConnector.violates),
)
"""The broken NIXL variants with the clause each breaks."""
