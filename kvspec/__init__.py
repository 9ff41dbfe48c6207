"""kvspec: the KV-connector contract as a spec, typed Protocols and a conformance suite."""

__version__ = "0.1.0"
