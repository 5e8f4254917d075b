"""The interface every KV cache in kvlib implements, and the checks they share.

A cache holds, for each of the model's `L` layers, the keys and values of the tokens seen so far.
The model talks to a cache through five calls and never looks inside it (the attention seam):

- `update(layer_idx, k, v)`: store layer `layer_idx`'s new keys and values `(B, H_kv, T, D)` and
  return what attention over the stored tokens reads. A dense cache returns keys and values
  `(B, H_kv, length + T, D)`; a cache with another layout (paged, quantized) returns its own
  handle and names the function that attends over it in `attention_backend`.
- `advance(T)`: commit the `T` tokens every layer has written (the model calls it once per
  forward, after the last layer).
- `reorder(indices)`: keep sequences `indices` of the batch, in that order (beam search).
- `repeat(n)`: a new cache with each sequence copied `n` times (one prefill, several samples).
- `seq_lens`: `(B,)` int64, the tokens each sequence holds (vLLM's `seq_lens`, nanochat's
  `cache_seqlens`); `length` is the longest.

The model calls `cache.attention_backend` if the cache has one, else its own backend
(`kvlib.ops.attention`), so a new cache plugs in without editing the model's layers. A cache that
wants to know which positions are padding (the paged cache stores only real tokens) defines
`begin_forward(T, attention_mask)`; the model calls it before the first layer with the step's
token count and the `(B, length + T)` mask (or None: no padding). Two more optional hooks serve a
cache that decides positions (`evicting.EvictingCache`): `query_positions(T)` gives the RoPE
positions of the step's queries, and `rotates_keys = True` asks the layer for keys before RoPE (the
cache rotates them when it reads them).

**Rollback** (speculative decoding, chapter 16): a cache that can forget its newest positions
defines `truncate(length)`, after which it holds exactly what it held when its `length` was
`length`, as if the positions after it had never been written (the K/V of rejected draft
tokens). Dense, static, latent, paged and page-bounds caches define it; a cache that cannot undo a
write (a quantized cache whose flush quantized a token the rollback keeps, an evicting cache that
evicted) raises `NotImplementedError` saying why. Tree speculation also needs `move_tokens(src,
dst)`: the K/V of positions `src` copied to positions `dst` in every layer and sequence (the
accepted branch moved into place before the truncate; chapter 9's repack within a sequence).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = [
    "KVCache",
    "check_kv_append",
    "check_kv_update",
    "check_moves",
    "check_truncate_length",
    "check_unpadded",
]


@runtime_checkable
class KVCache(Protocol):
    """What `kvlib.model.LlamaModel` needs of a cache (see the module docstring)."""

    num_layers: int
    length: int

    @property
    def seq_lens(self) -> torch.Tensor: ...

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor): ...

    def advance(self, num_tokens: int) -> None: ...

    def reorder(self, indices: torch.Tensor) -> None: ...

    def repeat(self, num_copies: int) -> KVCache: ...


def check_kv_update(
    num_layers: int,
    layer_idx: int,
    k: torch.Tensor,
    v: torch.Tensor,
    expected: tuple[int, int, int] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> None:
    """Validate one `update` call: `layer_idx` in [0, num_layers), k (B, H_kv, T, D) and v
    (B, H_kv, T, D_v) with the same B, H_kv and T (D_v = D except in MLA, whose value heads may be
    narrower than its query/key heads), and, where given, k's (B, H_kv, D) == `expected` and the
    cache's dtype and device.

    Raises:
        ValueError: a bad layer index, shape or device. TypeError: a dtype other than the cache's.
    """
    if (
        isinstance(layer_idx, bool)
        or not isinstance(layer_idx, int)
        or not 0 <= layer_idx < num_layers
    ):
        raise ValueError(f"layer_idx: expected an int in [0, {num_layers}), got {layer_idx!r}")
    if (
        not isinstance(k, torch.Tensor)
        or not isinstance(v, torch.Tensor)
        or k.dim() != 4
        or v.dim() != 4
        or k.shape[:3] != v.shape[:3]
    ):
        raise ValueError(
            "k, v: expected (B, H_kv, T, D) and (B, H_kv, T, D_v) tensors, got "
            f"{tuple(getattr(k, 'shape', ()))} and {tuple(getattr(v, 'shape', ()))}"
        )
    if expected is not None and (k.shape[0], k.shape[1], k.shape[3]) != expected:
        raise ValueError(
            f"k: expected (B, H_kv, T, D) with (B, H_kv, D) = {expected}, got {tuple(k.shape)}"
        )
    if dtype is not None and (k.dtype != dtype or v.dtype != dtype):
        raise TypeError(f"k, v: expected dtype {dtype} (the cache's), got {k.dtype} and {v.dtype}")
    if device is not None and (k.device != device or v.device != device):
        raise ValueError(f"k, v: expected device {device} (the cache's), got {k.device}")


def check_kv_append(
    stored: list[torch.Tensor | None], layer_idx: int, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor | None:
    """`check_kv_update` for a cache that appends to one tensor per layer: `stored[l]` is layer l's
    keys so far (B, H_kv, S, D), or None before its first update; the new k must match its batch,
    heads, head size, dtype and device. Returns `stored[layer_idx]`.

    Raises:
        As `check_kv_update`.
    """
    old = (
        stored[layer_idx]
        if isinstance(layer_idx, int)
        and not isinstance(layer_idx, bool)
        and 0 <= layer_idx < len(stored)
        else None
    )
    check_kv_update(
        len(stored),
        layer_idx,
        k,
        v,
        None if old is None else (old.shape[0], old.shape[1], old.shape[3]),
        None if old is None else old.dtype,
        None if old is None else old.device,
    )
    return old


def check_unpadded(attention_mask: torch.Tensor | None, cache_name: str) -> None:
    """Refuse padding, for a cache that keeps one length for every sequence (it decides positions
    itself: `EvictingCache`, `CompactingPagedCache`). `attention_mask` is what the model passes to
    `begin_forward`: (B, length + T), 1 for real tokens, or None.

    Raises:
        ValueError: a mask with any 0.
    """
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            f"attention_mask: {cache_name} does not support padding; pass unpadded sequences of "
            "one length"
        )


def check_truncate_length(length: object, held: int) -> int:
    """`length` as an int in [0, held]: the positions a `truncate(length)` keeps of the `held` a
    cache holds (rolling back never adds tokens).

    Raises:
        ValueError: `length` is not an int (a bool is not), or lies outside [0, held].
    """
    if isinstance(length, bool) or not isinstance(length, int):
        raise ValueError(f"length: expected an int in [0, {held}], got {length!r}")
    if not 0 <= length <= held:
        raise ValueError(
            f"length: expected an int in [0, {held}] (the positions held; a rollback keeps a "
            f"prefix of them), got {length}"
        )
    return length


def check_moves(src, dst, held: int) -> tuple[list[int], list[int]]:
    """`src` and `dst` as lists of positions in [0, held) of one length, `dst` without repeats, and
    every destination at or before its source, in increasing order: a forward copy then reads
    every source before it is overwritten (what `move_tokens` needs).

    Raises:
        ValueError: anything else, naming the argument.
    """
    src, dst = [int(i) for i in src], [int(i) for i in dst]
    if len(src) != len(dst):
        raise ValueError(f"src, dst: expected one length, got {len(src)} and {len(dst)}")
    for name, positions in (("src", src), ("dst", dst)):
        if any(not 0 <= i < held for i in positions):
            raise ValueError(f"{name}: expected positions in [0, {held}), got {positions}")
    if any(b <= a for a, b in zip(dst, dst[1:])) or any(d > s for s, d in zip(src, dst)):
        raise ValueError(
            f"dst: expected increasing positions, each at or before its source, got {dst} for "
            f"sources {src}"
        )
    return src, dst
