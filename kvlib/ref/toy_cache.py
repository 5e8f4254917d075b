"""The toy decoder's KV cache (chapter 1): one preallocated float64 buffer, with the same
`update`/`advance` protocol as `kvlib.cache.KVCache`, in numpy.
"""

from __future__ import annotations

import numpy as np

from kvlib._validate import check_array, check_positive_int
from kvlib.errors import CacheOverflowError
from kvlib.memory.formula import dense_kv_cache_bytes


class ToyKVCache:
    """A preallocated key/value cache for the toy decoder.

    Layout: one float64 buffer `(L, 2, S_max, D)`; `buffer[l, 0]` holds layer l's keys and
    `buffer[l, 1]` its values, rows `[0, length)` filled. Each layer writes its new rows at
    `length` and reads views up to `length + T`; `advance(T)` moves `length` after the last layer
    (the nanochat `KVCache` scheme). Rows are never rewritten: a token's K and V do not change
    once computed.
    """

    def __init__(self, num_layers: int, max_seq_len: int, head_dim: int):
        self.num_layers = check_positive_int("num_layers", num_layers)
        self.max_seq_len = check_positive_int("max_seq_len", max_seq_len)
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.buffer = np.zeros((num_layers, 2, max_seq_len, head_dim))  # (L, 2, S_max, D)
        self.length = 0

    def update(self, layer_idx: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write T new rows of keys/values for `layer_idx` at `length`; return views of all rows
        so far (the same `update`/`advance` protocol as `kvlib.cache.KVCache`, in numpy).

        Args:
            layer_idx: 0 <= layer_idx < L.
            k, v: (T, D) the new tokens' keys and values.
        Returns:
            (keys, values), each a (length + T, D) view into the buffer.
        Raises:
            CacheOverflowError: length + T > max_seq_len (names capacity and requested length).
            ValueError, TypeError: bad layer index or shapes.
        """
        if (
            isinstance(layer_idx, bool)
            or not isinstance(layer_idx, (int, np.integer))
            or not 0 <= layer_idx < self.num_layers
        ):
            raise ValueError(
                f"layer_idx: expected an int in [0, {self.num_layers}), got {layer_idx!r}"
            )
        check_array("k", k, ndim=2, floating=True)
        check_array("v", v, ndim=2, floating=True)
        if k.shape != v.shape or k.shape[1] != self.head_dim:
            raise ValueError(
                f"k, v: expected equal shapes (T, {self.head_dim}), got {k.shape} and {v.shape}"
            )
        end = self.length + k.shape[0]
        if end > self.max_seq_len:
            raise CacheOverflowError(
                f"ToyKVCache holds at most {self.max_seq_len} tokens; writing {k.shape[0]} after "
                f"{self.length} needs {end}"
            )
        self.buffer[layer_idx, 0, self.length : end] = k
        self.buffer[layer_idx, 1, self.length : end] = v
        return self.buffer[layer_idx, 0, :end], self.buffer[layer_idx, 1, :end]  # (S, D) views

    def advance(self, num_tokens: int) -> None:
        """Move the write position by `num_tokens` (after the last layer has written them)."""
        num_tokens = check_positive_int("num_tokens", num_tokens)
        if self.length + num_tokens > self.max_seq_len:
            raise CacheOverflowError(
                f"ToyKVCache holds at most {self.max_seq_len} tokens; cannot advance to "
                f"{self.length + num_tokens}"
            )
        self.length += num_tokens

    @property
    def used_bytes(self) -> int:
        """Bytes of the filled rows: 2 * L * D * 8 * length (one head per layer, float64)."""
        return dense_kv_cache_bytes(
            self.num_layers, 1, self.head_dim, self.buffer.itemsize, self.length
        )
