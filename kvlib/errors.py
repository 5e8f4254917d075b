"""The exceptions every kvlib module shares.

Both subclass `ValueError`, so code that catches bad arguments in general still catches them.
"""

from __future__ import annotations

__all__ = ["CacheOverflowError", "UnsupportedConfigError"]


class CacheOverflowError(ValueError):
    """A write past a cache's capacity. The message names the capacity and the length asked for."""


class UnsupportedConfigError(ValueError):
    """A model config (or checkpoint) this course does not handle: an unknown model type, a
    missing field, an architectural feature kvlib does not implement. The message says which."""
