"""MLA's latent cache (chapter 6): one row of `d_c + d_R` numbers per token per layer, whatever
the number of heads.

Multi-head latent attention (DeepSeek-AI, 2024, "DeepSeek-V2", sec. 2.1) caches, for each token, the
normalised latent `c_KV` (`kv_lora_rank` = d_c values) from which every head's key and value are
up-projected, and one rotary key `k_R` (`qk_rope_head_dim` = d_R values) shared by all heads. This
cache stores the two side by side in one row, `[c_KV, k_R]`, as FlashMLA does (512 + 64 = 576
values for DeepSeek-V3), so that the absorbed attention reads it as an MQA cache: keys are whole
rows (width d_c + d_R), values are their first d_c numbers (`kvlib.layers.mla`).

Layout per layer: `(B, 1, S, d_c + d_R)`, growing by `torch.cat` like `DynamicCache`.
"""

from __future__ import annotations

import torch

from kvlib.cache.base import check_kv_update
from kvlib.cache.dense import DynamicCache

__all__ = ["LatentCache"]


class LatentCache(DynamicCache):
    """MLA's cache: per layer, rows `[c_KV, k_R]` of shape (B, 1, S, d_c + d_R).

    `update(layer_idx, latent, rope_key)` takes the new tokens' latent (B, 1, T, d_c) and rotary
    key (B, 1, T, d_R), both already final (RMS-normalised, rotated), and returns
    `(rows, latent_view)`: the layer's rows so far (B, 1, S, d_c + d_R), the keys of absorbed
    attention, and a view of their first d_c columns (B, 1, S, d_c), its values. `nbytes` counts
    each row once.

    Raises (from `update`):
        ValueError: shapes other than (B, 1, T, d_c) and (B, 1, T, d_R), or widths that change
            between calls. TypeError: a dtype other than the cache's.
    """

    def __init__(self, num_layers: int):
        super().__init__(num_layers)
        self.latent_dims: list[int | None] = [None] * num_layers

    def update(self, layer_idx: int, latent: torch.Tensor, rope_key: torch.Tensor):
        check_kv_update(self.num_layers, layer_idx, latent, rope_key)
        if latent.shape[1] != 1:
            raise ValueError(
                f"latent: expected (B, 1, T, d_c) (one latent shared by all heads), got "
                f"{tuple(latent.shape)}"
            )
        rows = torch.cat([latent, rope_key], dim=-1)  # (B, 1, T, d_c + d_R)
        old = self.keys[layer_idx]
        if old is None:
            self.keys[layer_idx], self.latent_dims[layer_idx] = rows, latent.shape[-1]
        else:
            if latent.shape[-1] != self.latent_dims[layer_idx] or rows.shape[-1] != old.shape[-1]:
                raise ValueError(
                    f"latent, rope_key: expected widths {self.latent_dims[layer_idx]} and "
                    f"{old.shape[-1] - self.latent_dims[layer_idx]} (this layer's so far), got "
                    f"{latent.shape[-1]} and {rope_key.shape[-1]}"
                )
            if rows.dtype != old.dtype or rows.shape[0] != old.shape[0]:
                raise TypeError(
                    f"latent: expected batch {old.shape[0]} and dtype {old.dtype} (the cache's), "
                    f"got {rows.shape[0]} and {rows.dtype}"
                )
            self.keys[layer_idx] = torch.cat([old, rows], dim=2)
            self.allocations += 1
        all_rows = self.keys[layer_idx]
        return all_rows, all_rows[..., : self.latent_dims[layer_idx]]

    def reorder(self, indices: torch.Tensor) -> None:
        """Keep sequences `indices` (B',) of the batch, in that order (beam search)."""
        for i, rows in enumerate(self.keys):
            if rows is not None:
                self.keys[i] = rows.index_select(0, indices.to(rows.device))

    def repeat(self, num_copies: int) -> LatentCache:
        bigger = super().repeat(num_copies)
        bigger.latent_dims = list(self.latent_dims)
        return bigger
