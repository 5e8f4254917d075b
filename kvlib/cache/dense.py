"""Contiguous KV caches for `kvlib.model.LlamaModel`: a growing one and a preallocated one.

Both implement `kvlib.cache.KVCache`: `update(layer_idx, k, v)` stores a layer's new keys and values
`(B, H_kv, T, D)` and returns all of that layer's keys and values so far `(B, H_kv, length + T,
D)`, which the model's attention backend reads; the model then calls `advance(T)`. Every sequence
of the batch holds the same number of slots (`length`; left padding is masked, not skipped).

- `DynamicCache`: the classic `past_key_values` style: `torch.cat` per layer per step; every step
  allocates new tensors (counted in `allocations`).
- `StaticCache`: one buffer `(L, 2, B, H_kv, S_max, D)` allocated once; writes at `length`, returns
  views (the nanochat scheme). Overflow raises `CacheOverflowError` naming capacity and request.

What they do not do: paging (chapter 7), eviction (chapter 8), quantization (chapter 10).
"""

from __future__ import annotations

import copy

import torch

from kvlib._validate import check_positive_int
from kvlib.cache.base import check_kv_append, check_kv_update, check_moves, check_truncate_length
from kvlib.errors import CacheOverflowError

__all__ = ["DynamicCache", "StaticCache"]


class _DenseCache:
    """What the two dense caches share: the committed length and its per-sequence view."""

    num_layers: int
    length: int
    rollback_refusal: str | None = None  # why `truncate` cannot roll this cache back, if so

    def _batch_size(self) -> int:
        raise NotImplementedError

    @property
    def seq_lens(self) -> torch.Tensor:
        """(B,) int64: tokens held per sequence, all equal to `length` in a dense cache."""
        return torch.full((self._batch_size(),), self.length, dtype=torch.int64)

    def advance(self, num_tokens: int) -> None:
        """Commit `num_tokens` new tokens (after every layer has written them)."""
        self.length += check_positive_int("num_tokens", num_tokens)

    def truncate(self, length: int) -> None:
        """Roll every sequence back to its first `length` positions (speculative decoding's
        rollback of rejected draft tokens; Leviathan et al., 2023): the cache then equals one
        that never saw the later positions.

        Raises:
            ValueError: `length` not an int in [0, self.length].
            NotImplementedError: a cache that cannot roll back (`rollback_refusal` says why).
        """
        if self.rollback_refusal:
            raise NotImplementedError(
                f"{type(self).__name__} does not roll back: {self.rollback_refusal}"
            )
        length = check_truncate_length(length, self.length)
        self._keep(length)
        self.length = length

    def move_tokens(self, src, dst) -> None:
        """Copy the K/V of positions `src` to positions `dst` (tree speculation); the dense and
        static caches define it.

        Raises:
            NotImplementedError: here (`rollback_refusal` says why, if the cache has a reason).
        """
        why = self.rollback_refusal or "it has no move_tokens"
        raise NotImplementedError(f"{type(self).__name__} does not move tokens: {why}")


class DynamicCache(_DenseCache):
    """A growing cache: per layer, keys and values `(B, H_kv, S, D)` concatenated each step."""

    def __init__(self, num_layers: int):
        self.num_layers = check_positive_int("num_layers", num_layers)
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0
        self.allocations = 0  # tensors allocated by torch.cat (two per layer per step)

    def update(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append T new rows for layer `layer_idx`; return its (B, H_kv, length + T, D) keys and
        values."""
        old_k = check_kv_append(self.keys, layer_idx, k, v)
        if old_k is None:
            self.keys[layer_idx], self.values[layer_idx] = k, v
        else:
            self.keys[layer_idx] = torch.cat([old_k, k], dim=2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], v], dim=2)
            self.allocations += 2
        return self.keys[layer_idx], self.values[layer_idx]

    def reorder(self, indices: torch.Tensor) -> None:
        """Keep sequences `indices` (B',) of the batch, in that order (beam search)."""
        for i in range(self.num_layers):
            if self.keys[i] is not None:
                self.keys[i] = self.keys[i].index_select(0, indices.to(self.keys[i].device))
                self.values[i] = self.values[i].index_select(0, indices.to(self.values[i].device))

    def repeat(self, num_copies: int) -> DynamicCache:
        """A new cache in which each sequence is copied `num_copies` times, consecutively (prefill
        once, decode several samples or beams)."""
        num_copies = check_positive_int("num_copies", num_copies)
        bigger = copy.copy(self)  # keeps the class (and any subclass's behaviour)
        bigger.keys = [
            None if k is None else k.repeat_interleave(num_copies, dim=0) for k in self.keys
        ]
        bigger.values = [
            None if v is None else v.repeat_interleave(num_copies, dim=0) for v in self.values
        ]
        return bigger

    def move_tokens(self, src, dst) -> None:
        """Copy the K/V of positions `src` to positions `dst` in every layer (tree speculation's
        accepted branch moved into place; then `truncate`).

        Raises:
            ValueError: as `kvlib.cache.base.check_moves`.
        """
        src, dst = check_moves(src, dst, self.length)
        for tensors in (self.keys, self.values):
            for t in tensors:
                if t is not None:
                    t[:, :, dst] = t[:, :, src]  # the read is a copy: sources read first

    def _keep(self, length: int) -> None:
        """Each layer's tensors cut to their first `length` positions: views, so a rollback
        copies nothing (the next `update`'s `torch.cat` allocates, as every step does)."""
        for tensors in (self.keys, self.values):
            for i, t in enumerate(tensors):
                if t is not None:
                    tensors[i] = t[:, :, :length] if length else None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)

    def _batch_size(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[0]


class StaticCache(_DenseCache):
    """A preallocated cache. Layout: buffer `(L, 2, B, H_kv, S_max, D)`; `buffer[l, 0]` holds layer
    l's keys and `buffer[l, 1]` its values; positions `[0, length)` are filled."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        sizes = [
            check_positive_int(n, v)
            for n, v in (
                ("num_layers", num_layers),
                ("batch_size", batch_size),
                ("num_kv_heads", num_kv_heads),
                ("max_seq_len", max_seq_len),
                ("head_dim", head_dim),
            )
        ]
        self.num_layers, self.batch_size, self.num_kv_heads, self.max_seq_len, self.head_dim = sizes
        self.buffer = torch.zeros(
            num_layers,
            2,
            batch_size,
            num_kv_heads,
            max_seq_len,
            head_dim,
            dtype=dtype,
            device=device,
        )
        self.length = 0
        self.allocations = 1

    @classmethod
    def for_model(cls, model, batch_size: int, max_seq_len: int) -> StaticCache:
        """A cache sized for `model` (a LlamaModel), in its dtype and on its device."""
        c, weight = model.config, model.lm_head.weight
        return cls(
            c.num_hidden_layers,
            batch_size,
            c.num_key_value_heads,
            max_seq_len,
            c.head_dim,
            dtype=weight.dtype,
            device=weight.device,
        )

    def update(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write T new rows for layer `layer_idx` at `length`; return views `(B, H_kv, length + T,
        D)`.

        Raises:
            CacheOverflowError: length + T > max_seq_len. ValueError/TypeError: wrong layer, shape,
            dtype or device.
        """
        check_kv_update(
            self.num_layers,
            layer_idx,
            k,
            v,
            (self.batch_size, self.num_kv_heads, self.head_dim),
            self.buffer.dtype,
            self.buffer.device,
        )
        if v.shape[-1] != self.head_dim:
            raise ValueError(
                f"v: expected head dimension {self.head_dim} (StaticCache holds K and V of one "
                f"width; MLA's latent belongs in kvlib.cache.LatentCache), got {v.shape[-1]}"
            )
        end = self.length + k.shape[2]
        if end > self.max_seq_len:
            raise CacheOverflowError(
                f"StaticCache holds {self.max_seq_len} tokens per sequence; writing {k.shape[2]} "
                f"after {self.length} needs {end}"
            )
        self.buffer[layer_idx, 0, :, :, self.length : end] = k
        self.buffer[layer_idx, 1, :, :, self.length : end] = v
        return self.buffer[layer_idx, 0, :, :, :end], self.buffer[layer_idx, 1, :, :, :end]

    def advance(self, num_tokens: int) -> None:
        if self.length + num_tokens > self.max_seq_len:
            raise CacheOverflowError(
                f"StaticCache holds {self.max_seq_len} tokens per sequence; cannot advance to "
                f"{self.length + num_tokens}"
            )
        super().advance(num_tokens)

    def reorder(self, indices: torch.Tensor) -> None:
        """Keep sequences `indices` (B,) in that order, in place (the batch size cannot change)."""
        if indices.shape != (self.batch_size,):
            raise ValueError(
                f"indices: expected ({self.batch_size},) for a static batch, got "
                f"{tuple(indices.shape)}"
            )
        self.buffer[:, :, :, :, : self.length] = self.buffer[
            :, :, indices.to(self.buffer.device), :, : self.length
        ]

    def repeat(self, num_copies: int) -> StaticCache:
        """A new cache with each sequence copied `num_copies` times (batch B * num_copies), same
        capacity."""
        num_copies = check_positive_int("num_copies", num_copies)
        bigger = copy.copy(self)  # keeps the class (and any subclass's behaviour)
        bigger.batch_size = self.batch_size * num_copies
        bigger.buffer = self.buffer.new_zeros(
            self.num_layers,
            2,
            bigger.batch_size,
            self.num_kv_heads,
            self.max_seq_len,
            self.head_dim,
        )
        bigger.buffer[:, :, :, :, : self.length] = self.buffer[
            :, :, :, :, : self.length
        ].repeat_interleave(num_copies, dim=2)
        bigger.allocations = self.allocations + 1
        return bigger

    def move_tokens(self, src, dst) -> None:
        """As `DynamicCache.move_tokens`, in the buffer."""
        src, dst = check_moves(src, dst, self.length)
        self.buffer[:, :, :, :, dst] = self.buffer[:, :, :, :, src]

    def _keep(self, length: int) -> None:
        """The rolled-back positions zeroed, as in a buffer that was never written there."""
        self.buffer[:, :, :, :, length : self.length] = 0

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def _batch_size(self) -> int:
        return self.batch_size
