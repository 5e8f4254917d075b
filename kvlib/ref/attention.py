"""Reference attention in numpy (chapters 1 and 4): softmax, the causal mask for any number of
cached keys, scaled dot-product attention (Vaswani et al., 2017, "Attention Is All You Need"), and
one cached decode step. Float64, so the naive and cached paths of chapter 1 agree to round-off.

Learned attention sinks (`sinks=`; chapter 17): one logit per head that joins the softmax's
denominator and carries no value, `out = Σ_j exp(s_j - m) v_j / (exp(sink - m) + Σ_j exp(s_j - m))`,
so a head may attend to "nothing" (gpt-oss, OpenAI 2025, model card and reference implementation:
the sink is a score column concatenated before the softmax and dropped after it). StreamingLLM
(Xiao et al., ICLR 2024) found that models trained without one use their first tokens as sinks.

What it deliberately does not do: batching, multiple heads, RoPE. `kvlib.model` is the real model.
"""

from __future__ import annotations

import numpy as np

from kvlib._validate import check_array, check_positive_int


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
    q: np.ndarray,
    k: np.ndarray,
    mask: np.ndarray | None = None,
    *,
    scale: float | None = None,
    sinks: np.ndarray | float | None = None,
) -> np.ndarray:
    """The attention probabilities softmax(q k^T * scale) with masked entries at 0.

    Args:
        q: (..., T, D) queries.
        k: (..., S, D) keys.
        mask: bool (T, S) or (..., T, S); True = may attend. None = attend everywhere.
        scale: defaults to D ** -0.5.
        sinks: learned sink logits, shape q.shape[:-2] (one per head: (H,) for q (H, T, D); a
            float for q (T, D)), in the units of the scaled scores; None = no sink.
    Returns:
        (..., T, S) float array; each row sums to 1, or to 1 - (the sink's share) with sinks.
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
    if sinks is None:
        return softmax(scores, axis=-1)
    sinks = np.asarray(sinks, dtype=scores.dtype) if isinstance(sinks, float) else sinks
    check_array("sinks", sinks, floating=True)
    if sinks.shape != scores.shape[:-2]:
        raise ValueError(
            f"sinks: expected shape {scores.shape[:-2]} (one logit per head: q's leading dims), "
            f"got {sinks.shape}"
        )
    sink_column = np.broadcast_to(sinks[..., None, None], scores.shape[:-1] + (1,))  # (..., T, 1)
    extended = np.concatenate([scores, sink_column], axis=-1)  # (..., T, S + 1)
    return softmax(extended, axis=-1)[..., :-1]  # the sink's column dropped: it has no value


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None = None,
    *,
    scale: float | None = None,
    sinks: np.ndarray | float | None = None,
) -> np.ndarray:
    """Scaled dot-product attention, softmax(q k^T * scale) v (Vaswani et al., 2017).

    Args:
        q: (..., T, D) float queries.
        k: (..., S, D) float keys.
        v: (..., S, D_v) float values.
        mask: bool (T, S) or (..., T, S); True = may attend (see `causal_mask`). None = no mask.
        scale: multiplier of the scores; defaults to D ** -0.5.
        sinks: learned sink logits (one per head, shape q.shape[:-2]; see the module docstring),
            or None.
    Returns:
        (..., T, D_v) array.
    Raises:
        TypeError: a non-array or non-float input (sinks included), or a non-bool mask.
        ValueError: ranks or sizes that disagree (sinks included), or a mask row with no True.
    """
    check_array("v", v, floating=True)
    weights = attention_weights(q, k, mask, scale=scale, sinks=sinks)  # (..., T, S)
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
