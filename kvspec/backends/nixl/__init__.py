"""The reference NIXL backend for prefill/decode disaggregation:
``kvspec.backends.nixl:NixlConnector`` (name ``"nixl"``).

The connector's roles (``NixlScheduler``, ``NixlWorker``, their
``NixlMetadata``, ``NixlSettings``) sit on the transport layer:
``NixlEndpoint`` (one agent, one
registered KV region, prepared descriptor lists, READs with notifications, deadlines),
the plain-data handshake description ``PeerInfo`` and the descriptor geometry
``BlockGeometry``. Importing it does not import ``nixl``; constructing an endpoint
does (``NixlUnavailableError`` without it).
"""

from ._descriptors import (
    BlockGeometry,
    BlockRuns,
    LayoutSummary,
    MemKind,
    PeerInfo,
    check_compatible,
)
from ._heads import head_runs
from ._scheduler import PARAMS_KIND, NixlLoad, NixlMetadata, NixlScheduler, NixlSettings
from ._transport import (
    EndpointClosedError,
    NixlEndpoint,
    NixlError,
    NixlResources,
    NixlTransfer,
    NixlUnavailableError,
    TransferState,
    load_nixl,
)
from ._worker import NixlWorker
from .connector import NixlConnector

__all__ = [
    "BlockGeometry",
    "BlockRuns",
    "EndpointClosedError",
    "LayoutSummary",
    "MemKind",
    "NixlConnector",
    "NixlEndpoint",
    "NixlError",
    "NixlLoad",
    "NixlMetadata",
    "NixlResources",
    "NixlScheduler",
    "NixlSettings",
    "NixlTransfer",
    "NixlUnavailableError",
    "NixlWorker",
    "PARAMS_KIND",
    "PeerInfo",
    "TransferState",
    "check_compatible",
    "head_runs",
    "load_nixl",
]
