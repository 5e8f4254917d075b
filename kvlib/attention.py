"""Reference attention in numpy, and the naive and cached generation loops of chapter 1.

What it does: scaled dot-product attention with a causal mask that works for any number of cached
keys (Vaswani et al., 2017, "Attention Is All You Need"); a tiny decoder (`ToyModel`) whose
`forward` runs either on the whole prefix (naive generation: re-encode everything every step) or on
new tokens only, reading and extending a `ToyKVCache` (cached generation); instrumentation
(`OpCounts`) that counts the work each path really does.

What it deliberately does not do: batching, multiple heads per layer, RoPE, training. The toy
model's weights are random (seeded): chapter 1 is about the cache, not about language. Chapter 2's
trained Llama-style model lives in `kvlib.model`.

Everything is float64 so that the naive and cached paths agree to round-off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvlib._validate import check_array, check_positive_int
from kvlib.errors import CacheOverflowError

# --- reference math -------------------------------------------------------------------------------


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax along `axis`: exp(x - max) / sum(exp(x - max)).

    Subtracting the row maximum changes nothing mathematically (it cancels between numerator and
    denominator) but keeps every exponent <= 0, so nothing overflows (the standard trick; see
    e.g. Goodfellow et al., *Deep Learning*, 2016, sec. 4.1). `-inf` entries get weight 0.

    Args:
        x: float array of any shape.
        axis: the axis to normalise over.
    Returns:
        An array of x's shape and dtype whose slices along `axis` sum to 1.
    Raises:
        TypeError: x is not a floating-point numpy array.
        ValueError: a slice along `axis` is all `-inf` (nothing to normalise).
    """
    check_array("x", x, floating=True)
    x_max = np.max(x, axis=axis, keepdims=True)
    if np.any(np.isneginf(x_max)):
        raise ValueError("x: a slice along the softmax axis is entirely -inf (a fully masked row)")
    e = np.exp(x - x_max)
    return e / np.sum(e, axis=axis, keepdims=True)


def causal_mask(num_queries: int, num_keys: int) -> np.ndarray:
    """Boolean causal mask for `num_queries` new tokens that follow `num_keys - num_queries` cached
    ones.

    Query i sits at absolute position `num_keys - num_queries + i` and may attend to keys
    0 .. that position. With `num_queries == num_keys` this is the usual lower-triangular prefill
    mask; with `num_queries == 1` it is a single row of True (decode); in between it is the
    chunked-prefill mask: full over the cached prefix, causal within the chunk.

    Returns:
        bool array (T, S): True where a query may attend to a key.
    Raises:
        TypeError / ValueError: sizes that are not positive ints, or num_queries > num_keys.
    """
    t = check_positive_int("num_queries", num_queries)
    s = check_positive_int("num_keys", num_keys)
    if t > s:
        raise ValueError(
            f"num_queries: expected <= num_keys ({s}), got {t} (queries need their own keys)"
        )
    query_positions = np.arange(s - t, s)[:, None]  # (T, 1)
    key_positions = np.arange(s)[None, :]  # (1, S)
    return key_positions <= query_positions  # (T, S)


def attention_weights(
    q: np.ndarray, k: np.ndarray, mask: np.ndarray | None = None, *, scale: float | None = None
) -> np.ndarray:
    """The attention probabilities softmax(q k^T * scale) with masked entries at 0.

    Args:
        q: (..., T, D) queries.
        k: (..., S, D) keys.
        mask: bool (T, S) or (..., T, S); True = may attend. None = attend everywhere.
        scale: defaults to D ** -0.5.
    Returns:
        (..., T, S) float array; each row sums to 1.
    Raises:
        TypeError, ValueError: see `attention`.
    """
    check_array("q", q, floating=True)
    check_array("k", k, floating=True)
    if q.ndim < 2 or k.ndim != q.ndim:
        raise ValueError(
            f"q, k: expected (..., T, D) and (..., S, D) of equal rank >= 2, got {q.shape} and "
            f"{k.shape}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"k: expected head dim D = {q.shape[-1]} (from q), got {k.shape[-1]}")
    if q.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"k: expected leading dims {q.shape[:-2]} (from q), got {k.shape[:-2]}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    scores = q @ np.swapaxes(k, -1, -2) * scale  # (..., T, S)
    if mask is not None:
        check_array("mask", mask)
        if mask.dtype != np.bool_:
            raise TypeError(f"mask: expected a bool array (True = attend), got dtype {mask.dtype}")
        if mask.shape not in (scores.shape[-2:], scores.shape):
            allowed = " or ".join(
                dict.fromkeys(str(shape) for shape in (scores.shape[-2:], scores.shape))
            )
            raise ValueError(
                f"mask: expected shape {allowed} (T queries x S keys), got {mask.shape}"
            )
        if not np.all(mask.any(axis=-1)):
            raise ValueError(
                "mask: every query row needs at least one True (a fully masked row has no output)"
            )
        scores = np.where(mask, scores, -np.inf)
    return softmax(scores, axis=-1)


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None = None,
    *,
    scale: float | None = None,
) -> np.ndarray:
    """Scaled dot-product attention, softmax(q k^T * scale) v (Vaswani et al., 2017).

    Args:
        q: (..., T, D) float queries.
        k: (..., S, D) float keys.
        v: (..., S, D_v) float values.
        mask: bool (T, S) or (..., T, S); True = may attend (see `causal_mask`). None = no mask.
        scale: multiplier of the scores; defaults to D ** -0.5.
    Returns:
        (..., T, D_v) array.
    Raises:
        TypeError: a non-array or non-float input, or a non-bool mask.
        ValueError: ranks or sizes that disagree, or a mask row with no True.
    """
    check_array("v", v, floating=True)
    weights = attention_weights(q, k, mask, scale=scale)  # (..., T, S)
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v: expected leading shape {k.shape[:-1]} (from k), got {v.shape[:-1]}")
    return weights @ v  # (..., T, D_v)


def cached_attention_step(
    q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One decode step of single-head attention with a KV cache, as a pure function.

    Appends the new token's key and value to the cache, then attends from the new query over
    every cached key (no mask needed: all of them are in the past).

    Args:
        q, k_new: (D,) the new token's query and key.
        v_new: (D_v,) its value.
        k_cache: (S, D) keys of the S earlier tokens (S may be 0).
        v_cache: (S, D_v) their values.
    Returns:
        (out (D_v,), k_cache (S + 1, D), v_cache (S + 1, D_v)).
    Raises:
        TypeError, ValueError: non-float arrays or shapes that disagree.
    """
    for name, x in (("q", q), ("k_new", k_new), ("v_new", v_new)):
        check_array(name, x, ndim=1, floating=True)
    check_array("k_cache", k_cache, ndim=2, floating=True)
    check_array("v_cache", v_cache, ndim=2, floating=True)
    if k_cache.shape != (k_cache.shape[0], q.shape[0]) or k_new.shape != q.shape:
        raise ValueError(
            f"k_new, k_cache: expected ({q.shape[0]},) and (S, {q.shape[0]}), got {k_new.shape} "
            f"and {k_cache.shape}"
        )
    if v_cache.shape != (k_cache.shape[0], v_new.shape[0]):
        raise ValueError(
            f"v_cache: expected ({k_cache.shape[0]}, {v_new.shape[0]}), got {v_cache.shape}"
        )
    k_cache = np.concatenate([k_cache, k_new[None, :]], axis=0)  # (S + 1, D)
    v_cache = np.concatenate([v_cache, v_new[None, :]], axis=0)  # (S + 1, D_v)
    out = attention(q[None, :], k_cache, v_cache)[0]  # (1, D_v) -> (D_v,)
    return out, k_cache, v_cache


def dense_kv_cache_bytes(
    num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: int, seq_len: int
) -> int:
    """Bytes a KV cache holds for one sequence: 2 * L * H_kv * D * b * S.

    The 2 is one key and one value vector per token, per head, per layer. Chapter 3 generalises
    this to every architecture (`kvlib.memory`).

    Raises:
        TypeError, ValueError: an argument that is not a positive int (seq_len may be 0).
    """
    factors = [
        check_positive_int("num_layers", num_layers),
        check_positive_int("num_kv_heads", num_kv_heads),
        check_positive_int("head_dim", head_dim),
        check_positive_int("bytes_per_element", bytes_per_element),
        check_positive_int("seq_len", seq_len, allow_zero=True),
    ]
    return 2 * int(np.prod(factors, dtype=object))


# --- the toy decoder ------------------------------------------------------------------------------


@dataclass
class OpCounts:
    """Work done by a forward pass, counted by instrumentation (not by formula).

    projected_rows: token rows pushed through a layer's projections (W_q, W_k, W_v, W_o), summed
        over layers: one per token per layer.
    score_entries: query-key dot products computed (entries of the score matrices), summed over
        layers.
    """

    projected_rows: int = 0
    score_entries: int = 0

    def __add__(self, other: OpCounts) -> OpCounts:
        return OpCounts(
            self.projected_rows + other.projected_rows, self.score_entries + other.score_entries
        )


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


@dataclass
class GenerationTrace:
    """What a generation loop produced: the tokens, each step's logits and each step's work.

    tokens: (P + N,) the prompt followed by N generated ids.
    logits: (N, V) the logits each new token was chosen from.
    step_counts: N `OpCounts`, one per forward pass.
    """

    tokens: np.ndarray
    logits: np.ndarray
    step_counts: list[OpCounts] = field(default_factory=list)

    @property
    def total_counts(self) -> OpCounts:
        return sum(self.step_counts, OpCounts())


def _check_generation_args(model: ToyModel, prompt_ids: np.ndarray, max_new_tokens: int) -> int:
    if not isinstance(model, ToyModel):
        raise TypeError(f"model: expected a ToyModel, got {type(model).__name__}")
    check_array("prompt_ids", prompt_ids, ndim=1, integer=True)
    if prompt_ids.size == 0:
        raise ValueError("prompt_ids: expected at least one token, got an empty prompt")
    return check_positive_int("max_new_tokens", max_new_tokens)


def generate_naive(model: ToyModel, prompt_ids: np.ndarray, max_new_tokens: int) -> GenerationTrace:
    """Greedy generation without a cache: every step re-encodes the whole prefix.

    Step i runs `model.forward` on all P + i tokens and keeps only the last row of logits, so the
    work per step grows as O(n^2) score entries in the prefix length n, O(n^3) per sequence.

    Args:
        model: a ToyModel.
        prompt_ids: (P,) ints.
        max_new_tokens: N >= 1.
    Returns:
        A GenerationTrace with tokens (P + N,), logits (N, V) and N step counts.
    """
    n = _check_generation_args(model, prompt_ids, max_new_tokens)
    tokens = list(prompt_ids)
    all_logits, step_counts = [], []
    for _ in range(n):
        counts = OpCounts()
        logits = model.forward(np.array(tokens), counts=counts)[-1]  # (V,): last position only
        tokens.append(int(np.argmax(logits)))
        all_logits.append(logits)
        step_counts.append(counts)
    return GenerationTrace(np.array(tokens), np.stack(all_logits), step_counts)


def generate_cached(
    model: ToyModel, prompt_ids: np.ndarray, max_new_tokens: int, cache: ToyKVCache | None = None
) -> GenerationTrace:
    """Greedy generation with a KV cache: prefill the prompt once, then feed one token per step.

    Step 0 (prefill) encodes the P prompt tokens and fills the cache; each later step encodes only
    the newest token, appends one K and one V row per layer and attends over the cache: O(n)
    score entries per step, O(n^2) per sequence.

    Args:
        model: a ToyModel.
        prompt_ids: (P,) ints.
        max_new_tokens: N >= 1.
        cache: an empty ToyKVCache to fill (for inspection afterwards); default: a new one of P + N
            rows.
    Returns:
        A GenerationTrace with tokens (P + N,), logits (N, V) and N step counts.
    Raises:
        ValueError: `cache` is not empty. CacheOverflowError: it is too small.
    """
    n = _check_generation_args(model, prompt_ids, max_new_tokens)
    if cache is None:
        cache = model.new_cache(prompt_ids.shape[0] + n)
    elif cache.length:
        raise ValueError(
            f"cache: expected an empty cache, got one holding {cache.length} tokens (reusing a "
            "cache across prompts mixes them)"
        )
    tokens = list(prompt_ids)
    all_logits, step_counts = [], []
    next_input = np.array(tokens)  # prefill: the whole prompt
    for _ in range(n):
        counts = OpCounts()
        logits = model.forward(next_input, cache=cache, counts=counts)[-1]  # (V,)
        tokens.append(int(np.argmax(logits)))
        all_logits.append(logits)
        step_counts.append(counts)
        next_input = np.array(tokens[-1:])  # decode: only the newest token
    return GenerationTrace(np.array(tokens), np.stack(all_logits), step_counts)
