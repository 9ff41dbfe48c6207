"""Benchmarks of the project's backends, run with ``kvspec bench``.

``kvspec bench offload`` (``kvspec.bench.offload``) measures the offload backend's
store and load copies against a same-run memory-copy ceiling. The package imports
``kvspec.protocols`` and ``kvspec.backends`` only, never the conformance suite; import
the submodules directly (this package imports nothing heavy).
"""

from __future__ import annotations

__all__: list[str] = []
