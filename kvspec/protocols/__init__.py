"""Typed Protocols and value types of the KV-connector contract (filled in below)."""
