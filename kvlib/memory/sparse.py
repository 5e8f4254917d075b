"""Chapter 3's equation for a cache read sparsely (chapter 15; Quest, Tang et al., ICML 2024): what
the per-page key bounds cost to store, and what one decode step reads.

A page of `block_size` tokens keeps, per layer and KV head, the element-wise minimum and maximum of
its keys: `2 · D` elements, the size of **one token's key and value**. So per layer

    bounds stored = ceil(S / block_size) · 2 · H_kv · D · b     (1 / block_size of the cache),

and a decode step that reads `k` of a sequence's `P = ceil(S / block_size)` pages in a sparse layer
reads the bounds of all `P` pages plus the selected pages' K/V:

    read = ((k - 1) · block_size + fill + P) · 2 · H_kv · D · b,

with `fill` the newest page's tokens (it is always read, and it is the only partial one). A layer
kept dense, or a sequence with no more than `k` pages, reads its `S` tokens and no bounds.

What it does not do: sliding-window, chunked, MLA or SSM layers (Quest as built in `kvlib.sparse`
selects pages of full-attention K/V heads), or quantized payloads.
"""

from __future__ import annotations

import math

from kvlib._validate import check_positive_int
from kvlib.config import DTYPE_BITS, load_config, normalize_dtype
from kvlib.errors import UnsupportedConfigError
from kvlib.memory.equation import _dtypes
from kvlib.memory.layers import LayerSpec, layer_specs

__all__ = ["page_bounds_bytes", "sparse_decode_read_bytes"]


def _full_attention_layers(config: dict) -> list[LayerSpec]:
    specs = layer_specs(config)
    others = sorted({s.kind for s in specs if s.kind != "full"})
    if others:
        raise UnsupportedConfigError(
            f"config: page bounds cover full-attention layers with K/V heads, not {others}"
        )
    return specs


def _bounds_bits(config: dict, cache_dtype, bounds_dtype) -> int:
    """Bits per bound element: `bounds_dtype`'s, else the cache's."""
    if bounds_dtype is None:
        return DTYPE_BITS[_dtypes(config, cache_dtype)[0]]
    return DTYPE_BITS[normalize_dtype(bounds_dtype)]


def page_bounds_bytes(
    config,
    seq_len: int,
    *,
    block_size: int = 16,
    batch_size: int = 1,
    cache_dtype=None,
    bounds_dtype=None,
) -> int:
    """Bytes of the page bounds (key minima and maxima) of `batch_size` sequences of `seq_len`
    tokens: per layer, `ceil(seq_len / block_size) · 2 · H_kv · D · b`.

    Args:
        config: a Hugging Face config (dict or path); cache_dtype: as `kv_cache_bytes`.
        bounds_dtype: the bounds' dtype (None: the cache's, as Quest's code keeps them; SGLang
            keeps them in float32, twice a 16-bit cache's bytes).
    Raises:
        UnsupportedConfigError: a layer that is not full attention; TypeError, ValueError: sizes
        that are not positive ints (seq_len may be 0), an unknown dtype.
    """
    config = load_config(config)
    seq_len = check_positive_int("seq_len", seq_len, allow_zero=True)
    block_size = check_positive_int("block_size", block_size)
    batch_size = check_positive_int("batch_size", batch_size)
    bits = _bounds_bits(config, cache_dtype, bounds_dtype)
    pages = math.ceil(seq_len / block_size)
    elements = sum(spec.elements_per_token for spec in _full_attention_layers(config)) * pages
    return batch_size * math.ceil(elements * bits / 8)


def sparse_decode_read_bytes(
    config,
    seq_len: int,
    pages_read: int,
    *,
    block_size: int = 16,
    dense_layers: int = 2,
    batch_size: int = 1,
    cache_dtype=None,
    bounds_dtype=None,
) -> int:
    """Bytes of K/V and page bounds one decode step reads for `batch_size` sequences holding
    `seq_len` tokens each (the new token's included), `pages_read` pages per sequence in every
    layer past the first `dense_layers` (see the module docstring); the K/V in `cache_dtype`,
    the bounds in `bounds_dtype` (as `page_bounds_bytes`).

    Raises:
        UnsupportedConfigError: a layer that is not full attention; TypeError, ValueError: sizes
        that are not positive ints (dense_layers may be 0), an unknown dtype.
    """
    config = load_config(config)
    seq_len = check_positive_int("seq_len", seq_len)
    pages_read = check_positive_int("pages_read", pages_read)
    block_size = check_positive_int("block_size", block_size)
    dense_layers = check_positive_int("dense_layers", dense_layers, allow_zero=True)
    batch_size = check_positive_int("batch_size", batch_size)
    bits = DTYPE_BITS[_dtypes(config, cache_dtype)[0]]
    bound_bits = _bounds_bits(config, cache_dtype, bounds_dtype)
    pages = math.ceil(seq_len / block_size)
    fill = seq_len - (pages - 1) * block_size  # tokens in the newest page
    elements = bound_elements = 0
    for spec in _full_attention_layers(config):
        if spec.index < dense_layers or pages <= pages_read:
            elements += spec.elements_per_token * seq_len  # everything, no bounds needed
        else:
            elements += spec.elements_per_token * ((pages_read - 1) * block_size + fill)
            bound_elements += spec.elements_per_token * pages  # every page's bounds
    return batch_size * math.ceil((elements * bits + bound_elements * bound_bits) / 8)
