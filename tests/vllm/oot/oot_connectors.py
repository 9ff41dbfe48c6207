"""Out-of-tree vLLM connectors kvspec has no profile for, as a third party writes them.

Each is a small subclass of vLLM's ExampleConnector (``kvspec conform
vllm:oot_connectors:NAME`` with this folder on ``PYTHONPATH``):

* ``ReadsEngineState`` reads, at construction, what vLLM's engine always gives a connector:
  the model's name and the resolved KV-cache layout (LMCache's MP connector does both);
* ``NeedsAService`` fails at construction, as a connector whose server is down does;
* ``PlainMetadata`` builds step metadata of a plain class kvspec's codec cannot carry
  without pickle (vLLM pickles it): kvspec's gap, never the connector's clause.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector


class ReadsEngineState(ExampleConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        self.model_name = vllm_config.model_config.model
        self.layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
        super().__init__(vllm_config, role, kv_cache_config)


class NeedsAService(ExampleConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        raise ConnectionRefusedError("cannot reach the cache server at tcp://127.0.0.1:9")


class _Opaque(KVConnectorMetadata):
    def __init__(self, requests: Any) -> None:
        self.requests = requests  # no annotation: kvspec cannot tell its type


class PlainMetadata(ExampleConnector):
    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return _Opaque(super().build_connector_meta(scheduler_output).requests)
