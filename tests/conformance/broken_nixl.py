"""Deliberately broken variants of the NIXL backend: HSK-006 (issue 48), STG-014 (issue 50). ``test_broken.py``
runs it through the real plugin in a subprocess and expects HSK-006, and no other clause, to
fail. It lives with the tests: the conformance package does not depend on the reference
backends."""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvspec.backends.nixl import NixlConnector, NixlLoad
from kvspec.backends.nixl._transport import NixlEndpoint
from kvspec.backends.nixl._worker import NixlWorker

__all__ = ["BROKEN_NIXL", "BROKEN_NIXL_STATE", "NoStateSendConnector", "StalePeersConnector"]


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


class _NoStateSendWorker(NixlWorker):
    """Moves a hand-off's attention blocks only: the state group is never sent, and the
    consumer reports the request finished (STG-014; SGLang's NIXL sender handled one state
    type and silently sent nothing for the others, SGLang PR 18939)."""

    def _read(self, endpoint: NixlEndpoint, load: NixlLoad) -> None:
        super()._read(endpoint, attrs.evolve(load, local_state=(), remote_state=()))


class NoStateSendConnector(NixlConnector):
    """Breaks STG-014: a state-space hybrid's state is never handed off, yet the decode
    engine's load is reported finished, so it decodes on a state block nobody wrote."""

    violates: ClassVar[str] = "STG-014"
    worker_class = _NoStateSendWorker

    @property
    def name(self) -> str:
        return "broken-no-state-send"


BROKEN_NIXL: tuple[tuple[type[NixlConnector], str], ...] = (
    (StalePeersConnector, StalePeersConnector.violates),
)
"""The broken NIXL variants the suite's run through the plugin catches, with the clause each
breaks (``test_broken.py``)."""

BROKEN_NIXL_STATE: tuple[tuple[type[NixlConnector], str], ...] = (
    (NoStateSendConnector, NoStateSendConnector.violates),
)
"""The broken NIXL variants of state groups, caught by ``test_state_nixl.py`` (the suite's
state scenarios are another helper's, so they run there), with the clause each breaks."""
