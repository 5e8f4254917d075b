"""The toy decoder of chapter 1: `num_layers` layers of one attention head, random (seeded)
weights, sinusoidal positions. Its `forward` runs either on the whole prefix (naive generation:
re-encode everything every step) or on the new tokens only, reading and extending a `ToyKVCache`
(cached generation), and counts its work in `OpCounts` when asked.

What it deliberately does not do: batching, multiple heads per layer, RoPE, training: chapter 1 is
about the cache, not about language. Chapter 2's trained Llama-style model is `kvlib.model`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlib._validate import check_array, check_positive_int
from kvlib.ref.attention import attention, causal_mask
from kvlib.ref.op_counts import OpCounts
from kvlib.ref.toy_cache import ToyKVCache


@dataclass(frozen=True)
class ToyConfig:
    """Sizes of the toy decoder: `num_layers` layers of one attention head each."""

    vocab_size: int = 64
    d_model: int = 32
    head_dim: int = 16
    num_layers: int = 2

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "head_dim", "num_layers"):
            check_positive_int(name, getattr(self, name))
        if self.d_model % 2:
            raise ValueError(
                f"d_model: expected an even size (sinusoidal positions), got {self.d_model}"
            )


@dataclass(frozen=True)
class LayerWeights:
    """One layer's projections: w_q, w_k, w_v (d_model, D); w_o (D, d_model)."""

    w_q: np.ndarray
    w_k: np.ndarray
    w_v: np.ndarray
    w_o: np.ndarray


def sinusoidal_positions(positions: np.ndarray, d_model: int) -> np.ndarray:
    """Sinusoidal position encodings (Vaswani et al., 2017, sec. 3.5): (T,) ints -> (T, d_model)."""
    positions = check_array("positions", np.asarray(positions), ndim=1, integer=True)
    inv_freq = 10000.0 ** (-np.arange(0, d_model, 2) / d_model)  # (d_model / 2,)
    angles = positions[:, None] * inv_freq[None, :]  # (T, d_model / 2)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1)  # (T, d_model)


def rms_norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) along the last axis (Zhang & Sennrich, 2019), without a gain."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


class ToyModel:
    """A tiny decoder with random (seeded) weights: the smallest model that has a KV cache.

    tokens -> embedding + sinusoidal positions -> L x [x += attention(rms_norm(x)) W_o] ->
    rms_norm -> logits = x W_out. One attention head per layer.
    """

    def __init__(self, config: ToyConfig = ToyConfig(), seed: int = 0):
        self.config = config
        rng = np.random.default_rng(seed)
        c = config
        self.embedding = rng.normal(size=(c.vocab_size, c.d_model))  # (V, d_model)
        self.layers = [
            LayerWeights(
                w_q=rng.normal(size=(c.d_model, c.head_dim)) / np.sqrt(c.d_model),
                w_k=rng.normal(size=(c.d_model, c.head_dim)) / np.sqrt(c.d_model),
                w_v=rng.normal(size=(c.d_model, c.head_dim)) / np.sqrt(c.d_model),
                w_o=rng.normal(size=(c.head_dim, c.d_model)) / np.sqrt(c.head_dim),
            )
            for _ in range(c.num_layers)
        ]
        # (d_model, V)
        self.unembedding = rng.normal(size=(c.d_model, c.vocab_size)) / np.sqrt(c.d_model)

    def new_cache(self, max_seq_len: int) -> ToyKVCache:
        """An empty cache sized for this model."""
        return ToyKVCache(self.config.num_layers, max_seq_len, self.config.head_dim)

    def forward(
        self,
        token_ids: np.ndarray,
        cache: ToyKVCache | None = None,
        counts: OpCounts | None = None,
        mask: np.ndarray | None = None,
    ) -> np.ndarray:
        """Logits for T tokens.

        Without a cache, `token_ids` is the whole sequence (positions 0..T-1) and every token is
        re-encoded. With a cache holding S0 tokens, `token_ids` are the next T tokens (positions
        S0..S0+T-1); their keys and values are appended and they attend over all S0 + T.

        Args:
            token_ids: (T,) ints in [0, vocab_size).
            cache: a `ToyKVCache` to read and extend, or None.
            counts: if given, incremented with the work done.
            mask: bool (T, S) attention mask for every layer; default `causal_mask(T, S)`.
        Returns:
            (T, vocab_size) float64 logits.
        """
        check_array("token_ids", token_ids, ndim=1, integer=True)
        if token_ids.size == 0 or token_ids.min() < 0 or token_ids.max() >= self.config.vocab_size:
            raise ValueError(
                f"token_ids: expected 1+ ids in [0, {self.config.vocab_size}), got {token_ids!r}"
            )
        past = 0 if cache is None else cache.length
        t = token_ids.shape[0]
        x = self.embedding[token_ids] + sinusoidal_positions(
            np.arange(past, past + t), self.config.d_model
        )  # (T, d_model)
        for layer_idx, layer in enumerate(self.layers):
            h = rms_norm(x)  # (T, d_model)
            q, k, v = h @ layer.w_q, h @ layer.w_k, h @ layer.w_v  # (T, D) each
            if cache is not None:
                k, v = cache.update(layer_idx, k, v)  # (S, D), S = past + T
            layer_mask = causal_mask(t, k.shape[0]) if mask is None else mask  # (T, S)
            x = x + attention(q, k, v, layer_mask) @ layer.w_o  # (T, D) @ (D, d_model)
            if counts is not None:
                counts.projected_rows += t
                counts.score_entries += t * k.shape[0]
        if cache is not None:
            cache.advance(t)
        return rms_norm(x) @ self.unembedding  # (T, V)
