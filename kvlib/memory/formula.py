"""The KV-cache equation in its simplest form: every layer full attention, one sequence.
Chapter 1 meets it; `kvlib.memory.layers` and `equation` generalise it to every architecture.
"""

from __future__ import annotations

import math

from kvlib._validate import check_positive_int


def kv_elements_per_token(num_kv_heads: int, head_dim: int) -> int:
    """Elements one attention layer caches per token: 2 * H_kv * D (one key and one value vector
    per KV head).

    Raises:
        TypeError, ValueError: an argument that is not a positive int.
    """
    return (
        2
        * check_positive_int("num_kv_heads", num_kv_heads)
        * check_positive_int("head_dim", head_dim)
    )


def dense_kv_cache_bytes(
    num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: int, seq_len: int
) -> int:
    """Bytes a KV cache holds for one sequence: 2 * L * H_kv * D * b * S.

    The 2 is one key and one value vector per token, per head, per layer. Chapter 3 generalises
    this to every architecture (`kvlib.memory.kv_cache_bytes`).

    Raises:
        TypeError, ValueError: an argument that is not a positive int (seq_len may be 0).
    """
    per_token = kv_elements_per_token(num_kv_heads, head_dim)
    return math.prod(
        [
            check_positive_int("num_layers", num_layers),
            per_token,
            check_positive_int("bytes_per_element", bytes_per_element),
            check_positive_int("seq_len", seq_len, allow_zero=True),
        ]
    )
