"""A ring-buffer KV cache for a sliding-window attention layer (chapter 17): memory that stops
growing.

With a window of W positions, the query at position p sees only the keys at positions
p - W < j <= p (Longformer's local attention, Beltagy et al., 2020; Mistral 7B's sliding window,
Jiang et al., 2023). A cache then never needs more than the last W keys and values of a sequence:
Mistral's rolling buffer cache stores position j in slot `j mod W` of a buffer of W slots, so a
new token overwrites the one that has just left every future query's window.

- `RingCache`: per layer, keys and values `(B, H_kv, W, D)` allocated on the layer's first write;
  position j of every sequence lives in slot `j % W`. Keys are stored after RoPE, as every kvlib
  cache stores them (RoPE is applied at the absolute position, which the ring's `length` gives the
  model). `length` counts the positions seen, not the tokens held (`held` = min(length, W)).
- A forward of T new tokens (a decode step, or a prefill chunk longer than the window) attends
  over [the ring's contents before the chunk, oldest first] + [the chunk's own K/V], with a mask on
  absolute positions (`kvlib.ops.attention.visible`, the model's own rule); only then are the
  chunk's last min(T, W) keys and values written into the ring. Each query of the chunk so sees
  exactly the keys inside its own window, even those the chunk itself overwrites.
- `ring_attention`: that attention; `update` returns a `RingKV` for it and the model calls it
  through `attention_backend`. It ignores the model's mask (built over cache indices
  0..length + T - 1, most of which the ring no longer holds) and builds its own.

What it deliberately does not do: padding or ragged batches (every sequence of the batch has the
same length, as in `DynamicCache`; `begin_forward` refuses an `attention_mask` with padding),
position ids other than the model's default 0, 1, 2, ... (the ring computes positions from
`length`), rollback (`truncate` refuses: see `rollback_refusal`), paging (paged windows come
later in chapter 17), fused kernels (attention is `reference_attention` over a gathered copy).
Layout: per layer `keys[l], values[l]` (B, H_kv, W, D); slot s holds the one position p among
the last `held` with p % W == s. Reading before writing, the ring's oldest key (position
length - W) is already outside the next query's window: W - 1 slots would do, but W keep Mistral's
slot = position mod W (Mistral writes the new token first, then attends over all W slots).
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch

from kvlib._validate import check_positive_int
from kvlib.cache.base import check_kv_append, check_unpadded
from kvlib.cache.dense import _DenseCache
from kvlib.ops.attention import reference_attention, visible

__all__ = ["RingCache", "RingKV", "ring_attention"]


class RingKV(NamedTuple):
    """What `RingCache.update` returns for one layer: the keys and values one forward's queries
    may read, the ring's contents before the forward (oldest first) followed by the forward's own,
    with their absolute positions.

    keys: (B, H_kv, n + T, D); values: (B, H_kv, n + T, D_v), n = min(length, W) before the forward.
    key_positions: (n + T,) int64; query_positions: (T,) int64, the forward's positions.
    window: W. num_positions: length + T, the key length of the model's mask (checked).
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_positions: torch.Tensor
    query_positions: torch.Tensor
    window: int
    num_positions: int


def ring_attention(q, kv: RingKV, mask, *, weights_out=None, scale=None) -> torch.Tensor:
    """Sliding-window attention over a `RingKV`: query at position p sees the key at position j
    when p - W < j <= p. `mask` (the model's, (B or 1, T, length + T) over cache indices) is
    not used beyond a check of its key length: the ring's own mask is built from absolute
    positions. Arguments and result as `kvlib.ops.attention.reference_attention`'s (whose
    `weights_out` then receives (B, H, T, n + T) weights over the keys `kv` holds).

    Raises:
        ValueError: a mask whose key length is not length + T (a model and a ring that disagree
            on the positions seen).
    """
    if mask.shape[-1] != kv.num_positions:
        raise ValueError(
            f"mask: expected {kv.num_positions} keys (the ring's positions seen plus this "
            f"forward's), got {mask.shape[-1]}"
        )
    ring_mask = visible(kv.key_positions[None, :], kv.query_positions[:, None], kv.window)
    return reference_attention(
        q, (kv.keys, kv.values), ring_mask[None], weights_out=weights_out, scale=scale
    )  # (B, H, T, D_v)


class RingCache(_DenseCache):
    """A sliding-window cache of W slots per sequence per layer (see the module docstring).

    Args:
        num_layers: L.
        window: W >= 1, the positions a query sees (itself included), as `ModelConfig.
            sliding_window` counts them.

    `update` raises as `kvlib.cache.base.check_kv_update` (wrong layer, shape, dtype, device);
    `begin_forward` raises ValueError for a padded batch; `truncate` raises NotImplementedError.
    `nbytes` is fixed once every layer has written: 2 · L · B · H_kv · W · D · b, whatever the
    length (Mistral 7B, Jiang et al., 2023: the rolling buffer cache).
    """

    attention_backend = staticmethod(ring_attention)
    rollback_refusal = (
        "once the ring has wrapped, each write overwrote the slot of the position that left the "
        "window; rolling back k positions needs the k positions before the window again, and "
        "the ring no longer holds them (a rollback needs a ring of W + k slots)"
    )

    def __init__(self, num_layers: int, window: int):
        self.num_layers = check_positive_int("num_layers", num_layers)
        self.window = check_positive_int("window", window)
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # (B, H_kv, W, D) each
        self.values: list[torch.Tensor | None] = [None] * num_layers  # (B, H_kv, W, D_v) each
        self.length = 0  # positions seen (RoPE's next position), not tokens held

    @classmethod
    def for_model(cls, model, window: int | None = None) -> RingCache:
        """A ring for `model` (a LlamaModel) with its config's `sliding_window`.

        Raises:
            ValueError: the config has no sliding window and none is given, or `window` differs
                from the config's; a hybrid model (`layer_types`).
        """
        if getattr(model.config, "layer_types", None) is not None:  # chapter 17's hybrids
            raise ValueError(
                f"model: its layers are of several kinds ({model.config.layer_types}); a RingCache "
                "would window every layer: use kvlib.cache.HybridCache"
            )
        configured = model.config.sliding_window
        if window is None and configured is None:
            raise ValueError(
                "window: expected an int (the model's config has sliding_window=None), got None"
            )
        if window is not None and configured is not None and window != configured:
            raise ValueError(
                f"window: expected the model's sliding_window {configured}, got {window}"
            )
        return cls(model.config.num_hidden_layers, configured if window is None else window)

    @property
    def held(self) -> int:
        """Tokens held per sequence per layer: min(length, W)."""
        return min(self.length, self.window)

    def begin_forward(self, num_tokens: int, attention_mask: torch.Tensor | None) -> None:
        """Refuse padding: every sequence's positions are 0, 1, ..., length - 1."""
        check_unpadded(attention_mask, "RingCache")

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> RingKV:
        """Read the ring, then write the T new rows (B, H_kv, T, D) of layer `layer_idx` into
        their slots (position % W; only the last min(T, W) of them, the others are outside every
        later window). Returns the `RingKV` this forward's queries attend over."""
        if check_kv_append(self.keys, layer_idx, k, v) is None:  # the layer's first write
            b, h_kv = k.shape[:2]
            self.keys[layer_idx] = k.new_zeros(b, h_kv, self.window, k.shape[3])
            self.values[layer_idx] = v.new_zeros(b, h_kv, self.window, v.shape[3])
        ring_k, ring_v = self.keys[layer_idx], self.values[layer_idx]
        t, start = k.shape[2], self.length - self.held
        old_positions = torch.arange(start, self.length, device=k.device)  # (n,), oldest first
        new_positions = torch.arange(self.length, self.length + t, device=k.device)  # (T,)
        old_slots = old_positions % self.window
        keys = torch.cat([ring_k.index_select(2, old_slots), k], dim=2)  # (B, H_kv, n + T, D)
        values = torch.cat([ring_v.index_select(2, old_slots), v], dim=2)  # (B, H_kv, n + T, D_v)
        kept = min(t, self.window)  # the chunk's last `kept` rows: distinct slots
        new_slots = new_positions[t - kept :] % self.window
        ring_k[:, :, new_slots] = k[:, :, t - kept :]
        ring_v[:, :, new_slots] = v[:, :, t - kept :]
        return RingKV(
            keys,
            values,
            torch.cat([old_positions, new_positions]),
            new_positions,
            self.window,
            self.length + t,
        )

    def reorder(self, indices: torch.Tensor) -> None:
        """Keep sequences `indices` (B',) of the batch, in that order (beam search)."""
        for tensors in (self.keys, self.values):
            for i, t in enumerate(tensors):
                if t is not None:
                    tensors[i] = t.index_select(0, indices.to(t.device))

    def repeat(self, num_copies: int) -> RingCache:
        """A new ring in which each sequence is copied `num_copies` times, consecutively."""
        num_copies = check_positive_int("num_copies", num_copies)
        bigger = copy.copy(self)
        bigger.keys = [
            None if t is None else t.repeat_interleave(num_copies, dim=0) for t in self.keys
        ]
        bigger.values = [
            None if t is None else t.repeat_interleave(num_copies, dim=0) for t in self.values
        ]
        return bigger

    @property
    def nbytes(self) -> int:
        """Bytes of the ring buffers: fixed once every layer has written (not O(length))."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)

    def _batch_size(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[0]
