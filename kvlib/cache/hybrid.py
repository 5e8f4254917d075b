"""The cache of a hybrid model (chapter 17): per layer the cache its kind needs, behind the one
cache interface the model already calls.

A model with `ModelConfig.layer_types` mixes three kinds of layer, and each caches something
else for a sequence:

- "full" attention: every token's K and V, growing with the length (`DynamicCache`);
- "sliding" attention: the last W tokens' K and V in a ring of W slots (`RingCache`);
- "linear" attention: one state (H, D_k, D_v), the same size after 10 tokens or 10 million
  (`kvlib.layers.linear_attention.RecurrentStateCache`).

`HybridCache` holds one of each, sized for all L layers but written only by the layers of its
kind, and dispatches by layer index: attention layers call `update(layer_idx, k, v)` and attend
through `attention_backend` (the ring's attention for what the ring returned, the model's backend
for a full layer's keys and values); linear layers call `update_state(layer_idx, q, k, v,
log_decay)`, which advances the state and returns the layer's output. `advance(T)` commits the
forward in all three. vLLM v1 splits a hybrid the same way, by kind of layer: a `KVCacheSpec`
per kind (`FullAttentionSpec`, `SlidingWindowSpec`, `MambaSpec` in `vllm/v1/kv_cache_interface.py`)
and a `SingleTypeKVCacheManager` per group of layers of one kind
(`vllm/v1/core/single_type_kv_cache_manager.py`).

What it deliberately does not do: padding or ragged batches (every sequence has the same
length, as in `RingCache` and `RecurrentStateCache`; `begin_forward` refuses a padded mask),
rollback (`truncate` refuses: a ring has overwritten and a state has summed what a rollback
would need; take `RecurrentStateCache.snapshot`s instead), paging.
Layout: `full.keys[l], full.values[l]` (B, H_kv, S, D) for full layers; `ring.keys[l],
ring.values[l]` (B, H_kv, W, D) for sliding layers; `recurrent.states[l]` (B, H, D, D) for linear
layers; None for a layer of another kind.
"""

from __future__ import annotations

import copy

import torch

from kvlib._validate import check_positive_int
from kvlib.cache.base import check_unpadded
from kvlib.cache.dense import DynamicCache
from kvlib.cache.ring import RingCache, RingKV, ring_attention
from kvlib.layers.linear_attention import RecurrentStateCache
from kvlib.ops.attention import get_backend, reference_attention

__all__ = ["HybridCache"]

KINDS = ("full", "sliding", "linear")


class HybridCache:
    """Per layer the cache of its kind (see the module docstring).

    Args:
        layer_types: L kinds, each "full", "sliding" or "linear" (`ModelConfig.layer_types`).
        window: W of the sliding layers (None if there are none).
        chunk_size: C of the linear layers' chunked prefill (`RecurrentStateCache`).
        dense_backend: what full layers attend with (`kvlib.ops.attention`'s signature).

    Raises:
        ValueError: an unknown kind, a window missing for sliding layers or given without any.
    """

    def __init__(
        self,
        layer_types,
        window: int | None = None,
        *,
        chunk_size: int = 64,
        dense_backend=reference_attention,
    ):
        self.layer_types = tuple(layer_types)
        if not self.layer_types or any(kind not in KINDS for kind in self.layer_types):
            raise ValueError(f"layer_types: expected one of {KINDS} per layer, got {layer_types!r}")
        if ("sliding" in self.layer_types) != (window is not None):
            raise ValueError(
                "window: expected an int exactly when a layer is 'sliding', got "
                f"{window!r} for {self.layer_types}"
            )
        self.num_layers = len(self.layer_types)
        self.full = DynamicCache(self.num_layers)
        self.ring = None if window is None else RingCache(self.num_layers, window)
        self.recurrent = RecurrentStateCache(self.num_layers, chunk_size)
        self.dense_backend = dense_backend
        self.length = 0

    @classmethod
    def for_model(cls, model) -> HybridCache:
        """A cache for `model` (a LlamaModel whose config has `layer_types`), its full layers
        attending with the model's backend.

        Raises:
            ValueError: a model without `layer_types`.
        """
        config = model.config
        if config.layer_types is None:
            raise ValueError(
                "model: expected a config with layer_types (a hybrid), got layer_types=None; "
                "a model whose layers are all alike takes a DynamicCache or a RingCache"
            )
        return cls(
            config.layer_types,
            config.sliding_window,
            dense_backend=get_backend(model.attention_backend),
        )

    @classmethod
    def factory(cls, model, batch_size: int, max_seq_len: int) -> HybridCache:
        """`for_model`, with the signature of `generate`'s `cache=` factories (the sizes are not
        needed: the full layers grow, the others are fixed)."""
        return cls.for_model(model)

    def _kind(self, layer_idx: int, expected: tuple[str, ...], call: str) -> str:
        is_int = isinstance(layer_idx, int) and not isinstance(layer_idx, bool)
        if not is_int or not 0 <= layer_idx < self.num_layers:
            raise ValueError(
                f"layer_idx: expected an int in [0, {self.num_layers}), got {layer_idx!r}"
            )
        kind = self.layer_types[layer_idx]
        if kind not in expected:
            raise ValueError(
                f"layer_idx: layer {layer_idx} is {kind!r}; {call} serves {' and '.join(expected)} "
                "layers"
            )
        return kind

    def begin_forward(self, num_tokens: int, attention_mask: torch.Tensor | None) -> None:
        """Refuse padding: a state sums every token it is given."""
        check_unpadded(attention_mask, "HybridCache")

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """An attention layer's new K/V (B, H_kv, T, D): a full layer's are appended (returns
        all its keys and values so far), a sliding layer's go into the ring (returns a `RingKV`).

        Raises:
            ValueError: a linear layer's index (it calls `update_state`); else as the caches'.
        """
        if self._kind(layer_idx, ("full", "sliding"), "update") == "full":
            return self.full.update(layer_idx, k, v)  # (B, H_kv, length + T, D) each
        return self.ring.update(layer_idx, k, v)

    def attention_backend(self, q, kv, mask, *, weights_out=None) -> torch.Tensor:
        """Attend over what `update` returned: the ring's attention for a `RingKV` (it builds its
        own window mask), the dense backend under the model's mask for a full layer's keys and
        values. Returns (B, H, T, D)."""
        if isinstance(kv, RingKV):
            return ring_attention(q, kv, mask, weights_out=weights_out)
        return self.dense_backend(q, kv, mask, weights_out=weights_out)

    def update_state(self, layer_idx: int, q, k, v, log_decay) -> torch.Tensor:
        """A linear layer's T tokens: attend with its state and replace the state by the one after
        them (`RecurrentStateCache.update`: chunked for a prompt, recurrent for one token).
        q, k (B, H, T, D_k), v (B, H, T, D_v), log_decay (B, H, T); returns (B, H, T, D_v).

        Raises:
            ValueError: an attention layer's index; else as `RecurrentStateCache.update`.
        """
        self._kind(layer_idx, ("linear",), "update_state")
        return self.recurrent.update(layer_idx, q, k, v, log_decay)

    def advance(self, num_tokens: int) -> None:
        """Commit `num_tokens` tokens that every layer has processed, in every part."""
        num_tokens = check_positive_int("num_tokens", num_tokens)
        for part in self._parts():
            part.advance(num_tokens)
        self.length += num_tokens

    def _parts(self) -> list:
        return [part for part in (self.full, self.ring, self.recurrent) if part is not None]

    @property
    def seq_lens(self) -> torch.Tensor:
        """(B,) int64: positions seen per sequence, all equal to `length`."""
        return torch.full((self._batch_size(),), self.length, dtype=torch.int64)

    def _batch_size(self) -> int:
        tensors = self.full.keys + self.recurrent.states + (self.ring.keys if self.ring else [])
        return next((t.shape[0] for t in tensors if t is not None), 0)

    def reorder(self, indices: torch.Tensor) -> None:
        """Keep sequences `indices` (B',) of the batch, in that order (beam search)."""
        self.full.reorder(indices)
        if self.ring is not None:
            self.ring.reorder(indices)
        states = self.recurrent.states
        for i, state in enumerate(states):
            if state is not None:
                states[i] = state.index_select(0, indices.to(state.device))

    def repeat(self, num_copies: int) -> HybridCache:
        """A new cache in which each sequence is copied `num_copies` times, consecutively (one
        prefill, several samples)."""
        num_copies = check_positive_int("num_copies", num_copies)
        bigger = copy.copy(self)
        bigger.full = self.full.repeat(num_copies)
        bigger.ring = None if self.ring is None else self.ring.repeat(num_copies)
        bigger.recurrent = copy.copy(self.recurrent)
        bigger.recurrent.states = [
            None if s is None else s.repeat_interleave(num_copies, dim=0)
            for s in self.recurrent.states
        ]
        return bigger

    def truncate(self, length: int) -> None:
        """Refused: see the module docstring.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "HybridCache does not roll back: its ring has overwritten the positions before the "
            "window and its linear layers' states have summed the tokens a rollback would drop; "
            "snapshot the state (RecurrentStateCache.snapshot) where a rollback may resume"
        )

    def nbytes_by_kind(self) -> dict[str, int]:
        """Bytes held by each kind of layer: {"full": grows with the length, "sliding": fixed
        once the ring is allocated, "linear": fixed once every state is written}."""
        return {
            "full": self.full.nbytes,
            "sliding": 0 if self.ring is None else self.ring.nbytes,
            "linear": self.recurrent.nbytes,
        }

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's cache: 2 · B · H_kv · D · b · (S per full layer + W per sliding
        layer) + B · H · D_k · D_v · b per linear layer (chapter 3's equation, layer by layer)."""
        return sum(self.nbytes_by_kind().values())
