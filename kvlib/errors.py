"""The exceptions every kvlib module shares.

`CacheOverflowError` and `UnsupportedConfigError` subclass `ValueError`, so code that catches bad
arguments in general still catches them. `OutOfBlocksError` is not a bad argument but a full pool:
a `RuntimeError` the caller can avoid by asking first (`BlockPool.can_allocate`).
"""

from __future__ import annotations

__all__ = ["CacheOverflowError", "OutOfBlocksError", "UnsupportedConfigError"]


class CacheOverflowError(ValueError):
    """A write past a cache's capacity. The message names the capacity and the length asked for."""


class UnsupportedConfigError(ValueError):
    """A model config (or checkpoint) this course does not handle: an unknown model type, a
    missing field, an architectural feature kvlib does not implement. The message says which."""


class OutOfBlocksError(RuntimeError):
    """A paged cache's block pool has fewer free blocks than an allocation needs
    (`kvlib.cache.block_pool`). The message names the blocks needed and free; nothing was taken."""
