"""Reference backends (NIXL transfer, host-memory offloading). Land in later issues."""

__all__: list[str] = []
