"""Benchmarks of the project's backends and adapter, run with ``kvspec bench NAME``
(module ``kvspec.bench.NAME``; ``kvspec.cli.bench`` prints their reports).

``kvspec bench offload`` (``kvspec.bench.offload``) measures the offload backend's store
and load copies against a same-run memory-copy ceiling; ``nixl``, ``aggregate``,
``graphs`` and ``vllm`` (with ``vllm_long``) the others. ``vllm_engine`` runs vLLM engines
in child processes for the vLLM benchmarks, the demo and the vLLM tests; vLLM itself is
imported only in those processes, through ``kvspec.vllm``. Import the submodules directly
(this package imports nothing heavy).
"""

from __future__ import annotations

__all__: list[str] = []
