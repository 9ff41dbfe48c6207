"""vLLM's own connectors, certified by kvspec's suite: the vLLM-to-kvspec direction.

``VllmConnectorFactory`` runs a vLLM ``KVConnectorBase_V1`` subclass as a kvspec connector,
so the reference harness drives it through the whole conformance suite, byte checks
included. The suite and the CLI accept it by name::

    kvspec conform vllm:ExampleConnector
    pytest --kvspec-conformance=vllm:NixlConnector
    pytest --kvspec-conformance=vllm:my_pkg.my_module:MyConnector

``kvspec vllm-connectors`` writes docs/vllm-connectors.md from such runs.
"""

from __future__ import annotations

from ._wire import VllmMetadata
from .factory import VllmConnectorFactory

__all__ = ["VllmConnectorFactory", "VllmMetadata", "factory_from_spec"]


def factory_from_spec(connector: str) -> VllmConnectorFactory:
    """The factory for ``connector``, the part of a ``vllm:...`` spec after ``vllm:``."""
    return VllmConnectorFactory(connector)
