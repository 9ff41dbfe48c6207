"""The conformance suite. Lands with the conformance-suite issue."""

__all__: list[str] = []
