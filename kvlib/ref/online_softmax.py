"""Online softmax, tiled attention and split-K decoding: the algorithms under FlashAttention and
Flash-Decoding, in numpy, float64.

What it does:
- `online_softmax_update`: one step of the streaming softmax normaliser (running max `m`, running
  denominator `l`), Milakov & Gimelshein (2018), "Online normalizer calculation for softmax".
- `tiled_attention`: attention over K/V tiles (and query tiles) with a running max, denominator
  and rescaled accumulator: the FlashAttention forward recurrence (Dao et al., 2022). It never
  holds more than a `(query_tile, tile)` block of scores.
- `partial_attention` + `merge_partials`: split-K decoding (Dao et al., 2023, "Flash-Decoding for
  long-context inference"): each chunk of the cache returns a normalised partial output and its
  log-sum-exp; merging them is exact, associative and order-independent.
- `three_pass_attention`, `two_pass_attention`: the textbook safe softmax (max, sum, output
  passes) and the online-normaliser version, kept to count passes over K and V (`RowReadCounter`).
- `accumulated_attention`: per-token probabilities recovered after a fused pass from the saved
  log-sum-exp, with one more pass over K (what score-based eviction needs).
- Learned attention sinks (`sink=`, chapter 17; gpt-oss, OpenAI 2025; StreamingLLM, Xiao et al.,
  ICLR 2024): a logit that joins the softmax denominator with no value. `tiled_attention` starts
  its recurrence from it (m = sink, l = 1, acc = 0: a key of score `sink` and value 0);
  `merge_partials` adds it once, as one more partial (out 0, lse = sink), never once per split.

What it does not do: run fast. These are references for chapter 11's Triton kernel, written for
reading; they follow `kvlib.ref.attention.attention`'s layout: q (T, D), k (S, D), v (S, D_v).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kvlib._validate import check_array, check_positive_int


def online_softmax_update(m: float, l: float, block: np.ndarray) -> tuple[float, float]:
    """Fold one block of scores into the running max `m` and denominator `l = Σ exp(x - m)`.

    With `m_new = max(m, max(block))`, the old denominator was measured against `m`, so it is
    rescaled by `exp(m - m_new)` before the block's own terms are added:
    `l_new = l · exp(m - m_new) + Σ exp(block - m_new)`. Start from `(m, l) = (-inf, 0)`.

    Args:
        m: running maximum so far (-inf before any score).
        l: running denominator, relative to `m`.
        block: (N,) float scores (N may be 0; -inf entries are masked).
    Returns:
        (m_new, l_new). After the last block, softmax(x)_i = exp(x_i - m) / l and
        logsumexp(x) = m + log(l).
    """
    check_array("block", block, ndim=1, floating=True)
    if block.size == 0:
        return m, l
    m_new = max(m, float(block.max()))
    if m_new == -math.inf:  # nothing but masked scores so far
        return m_new, 0.0
    return m_new, l * math.exp(m - m_new) + float(np.exp(block - m_new).sum())


def _check_sink(sink) -> float | np.ndarray | None:
    """`sink` as a finite float (or a float array for `merge_partials`), or None."""
    if sink is None:
        return None
    if isinstance(sink, (bool, np.bool_)) or not isinstance(sink, (float, int, np.ndarray)):
        raise TypeError(f"sink: expected a finite float logit or None, got {type(sink).__name__}")
    if not np.all(np.isfinite(sink)):
        raise ValueError(f"sink: expected a finite logit (None for no sink), got {sink}")
    return sink if isinstance(sink, np.ndarray) else float(sink)


def _check_qkv(q: np.ndarray, k, v) -> tuple[int, int]:
    check_array("q", q, ndim=2, floating=True)
    if len(k.shape) != 2 or len(v.shape) != 2:
        raise ValueError(f"k, v: expected (S, D) and (S, D_v), got shapes {k.shape} and {v.shape}")
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"k: expected head dim D = {q.shape[1]} (from q), got {k.shape[1]}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v: expected S = {k.shape[0]} rows (from k), got {v.shape[0]}")
    return q.shape[0], k.shape[0]


def tiled_attention(
    q: np.ndarray,
    k,
    v,
    *,
    tile_size: int,
    query_tile_size: int | None = None,
    causal: bool = False,
    scale: float | None = None,
    sink: float | None = None,
) -> np.ndarray:
    """Attention computed tile by tile with the FlashAttention recurrence (Dao et al., 2022).

    For each tile of queries, keep per query a running max `m`, a denominator `l` and an
    unnormalised output `acc`; for each K/V tile:

        s = q_tile k_tileᵀ · scale                  # [query_tile, tile]
        m_new = max(m, rowmax(s));  p = exp(s - m_new)
        l   = l   · exp(m - m_new) + rowsum(p)
        acc = acc · exp(m - m_new) + p v_tile

    and return `acc / l`. Tiles need not divide the lengths. K and V are read once per query
    tile (once in all when one query tile covers T, as in decode). With `causal`, query i sits at
    position S - T + i (see `kvlib.ref.attention.causal_mask`) and tiles wholly in its future are
    skipped.

    Args:
        q: (T, D) float queries.
        k: (S, D) keys; v: (S, D_v) values (numpy arrays, or anything sliceable by rows).
        tile_size: K/V rows per tile (>= 1).
        query_tile_size: query rows per tile (default: tile_size).
        causal: apply the causal mask.
        scale: defaults to D ** -0.5.
        sink: a learned sink logit (this head's), or None: the recurrence starts from the state
            after a key of score `sink` and value 0, so the sink enters the denominator once.
    Returns:
        (T, D_v) float64, equal to `kvlib.ref.attention.attention` (with `sinks=sink`) to
        round-off.
    Raises:
        TypeError, ValueError: bad arrays or sizes; causal with T > S.
    """
    t, s = _check_qkv(q, k, v)
    tile_size = check_positive_int("tile_size", tile_size)
    query_tile_size = (
        tile_size
        if query_tile_size is None
        else check_positive_int("query_tile_size", query_tile_size)
    )
    if causal and t > s:
        raise ValueError(f"q: causal attention needs T <= S, got T = {t}, S = {s}")
    scale = q.shape[1] ** -0.5 if scale is None else float(scale)
    sink = _check_sink(sink)
    out = np.empty((t, v.shape[1]))
    for q_start in range(0, t, query_tile_size):
        q_tile = q[q_start : q_start + query_tile_size]  # [query_tile, D]
        rows = q_tile.shape[0]
        m = np.full(rows, -np.inf if sink is None else sink)  # running max per query
        l = np.full(rows, 0.0 if sink is None else 1.0)  # running denominator: exp(sink - sink)
        acc = np.zeros((rows, v.shape[1]))  # unnormalised output, [query_tile, D_v]
        # the tile's last query sees keys <= this
        last_visible = s - t + q_start + rows - 1 if causal else s - 1
        for k_start in range(0, last_visible + 1, tile_size):
            k_tile, v_tile = (
                np.asarray(k[k_start : k_start + tile_size]),
                np.asarray(v[k_start : k_start + tile_size]),
            )
            scores = q_tile @ k_tile.T * scale  # [query_tile, tile]
            # query i sits at position s - t + i; key 0 is visible to all, so m is finite after tile
            # 0
            if causal:
                # [query_tile, 1]
                query_positions = s - t + np.arange(q_start, q_start + rows)[:, None]
                key_positions = np.arange(k_start, k_start + k_tile.shape[0])[None, :]  # [1, tile]
                scores = np.where(key_positions <= query_positions, scores, -np.inf)
            # --- the online update: rescale what we have, add this tile ---
            m_new = np.maximum(m, scores.max(axis=1))
            correction = np.exp(m - m_new)  # exp(-inf) = 0 on the first tile
            p = np.exp(scores - m_new[:, None])  # [query_tile, tile]
            l = l * correction + p.sum(axis=1)
            acc = acc * correction[:, None] + p @ v_tile  # [query_tile, D_v]
            m = m_new
        out[q_start : q_start + rows] = acc / l[:, None]
    return out


# --- split-K decoding -----------------------------------------------------------------------------


def partial_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    scale: float | None = None,
    mask: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Attention of queries over one chunk of the cache, with the chunk's log-sum-exp.

    Args:
        q: (T, D) queries; k: (S_chunk, D); v: (S_chunk, D_v). S_chunk may be 0.
        mask: optional bool (T, S_chunk), True = may attend.
        scale: defaults to D ** -0.5.
    Returns:
        (out (T, D_v), lse (T,)): `out` normalised within the chunk, `lse = log Σ exp(scores)`.
        A query with nothing to attend to in the chunk (empty or fully masked) gets out = 0 and
        lse = -inf, which `merge_partials` gives zero weight: no NaN.
    """
    _check_qkv(q, k, v)
    scale = q.shape[1] ** -0.5 if scale is None else float(scale)
    scores = q @ k.T * scale  # (T, S_chunk)
    if mask is not None:
        check_array("mask", mask, ndim=2)
        if mask.shape != scores.shape or mask.dtype != np.bool_:
            raise ValueError(f"mask: expected bool {scores.shape}, got {mask.dtype} {mask.shape}")
        scores = np.where(mask, scores, -np.inf)
    m = scores.max(axis=1, initial=-np.inf)  # (T,)
    safe_m = np.where(np.isneginf(m), 0.0, m)  # rows with nothing visible: avoid -inf - -inf
    p = np.exp(scores - safe_m[:, None])  # (T, S_chunk)
    l = p.sum(axis=1)  # (T,)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(l[:, None] > 0, (p @ v) / l[:, None], 0.0)  # (T, D_v)
        lse = np.where(l > 0, safe_m + np.log(l), -np.inf)
    return out, lse


def merge_partials(
    outs: Sequence[np.ndarray],
    lses: Sequence[np.ndarray],
    *,
    sink: float | np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Merge partial attention results over disjoint chunks into the result over their union.

    With `M = max_i lse_i`, chunk i's weight is `w_i = exp(lse_i - M)` (its share of the softmax
    denominator), so `out = Σ w_i out_i / Σ w_i` and `lse = M + log Σ w_i`. Exact; associative and
    independent of order; chunks with lse = -inf (nothing visible) get weight 0.

    A learned sink joins here, once: one more partial with out = 0 and lse = sink, whose weight
    only enlarges the denominator. Adding it inside each split's partial instead counts it once
    per split (the classic bug; `partial_attention` therefore takes no sink).

    Args:
        outs: partial outputs, each (..., D_v).
        lses: their log-sum-exps, each (...).
        sink: the sink logit (a float, or an array broadcastable to an lse's shape), or None.
    Returns:
        (out (..., D_v), lse (...)); with a sink, `lse` includes it. If every chunk is empty for
        a query and there is no sink: out 0, lse -inf.
    """
    if len(outs) != len(lses) or not outs:
        raise ValueError(
            f"outs, lses: expected equally many (>= 1) partials, got {len(outs)} and {len(lses)}"
        )
    outs, lses = np.stack(outs), np.stack(lses)  # (n, ..., D_v), (n, ...)
    if outs.shape[:-1] != lses.shape:
        raise ValueError(
            f"lses: expected shape {outs.shape[1:-1]} per partial (outs without D_v), got "
            f"{lses.shape[1:]}"
        )
    if _check_sink(sink) is not None:  # once, as a partial of its own: its share of the denominator
        sink_lse = np.broadcast_to(np.asarray(sink, dtype=lses.dtype), lses.shape[1:])
        outs = np.concatenate([outs, np.zeros_like(outs[:1])])  # (n + 1, ..., D_v)
        lses = np.concatenate([lses, sink_lse[None]])  # (n + 1, ...)
    top = lses.max(axis=0)  # (...)
    safe_top = np.where(np.isneginf(top), 0.0, top)
    weights = np.exp(lses - safe_top)  # (n, ...): 0 for empty chunks
    total = weights.sum(axis=0)  # (...)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(
            total[..., None] > 0, (weights[..., None] * outs).sum(axis=0) / total[..., None], 0.0
        )
        lse = np.where(total > 0, safe_top + np.log(total), -np.inf)
    return out, lse


def split_k_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    num_splits: int,
    scale: float | None = None,
    sink: float | None = None,
) -> np.ndarray:
    """Decode attention with the cache split into `num_splits` chunks, each attended independently
    (in parallel on a GPU), then merged with their log-sum-exps.

    Args:
        q: (T, D) decode queries (no mask: the whole cache is in their past).
        k: (S, D); v: (S, D_v).
        num_splits: chunks (>= 1; more than S leaves some chunks empty, which is allowed).
        sink: a learned sink logit, or None; added once, in the merge.
    Returns:
        (T, D_v).
    """
    _, s = _check_qkv(q, k, v)
    num_splits = check_positive_int("num_splits", num_splits)
    _check_sink(sink)
    bounds = np.linspace(0, s, num_splits + 1).round().astype(int)
    partials = [
        partial_attention(q, k[a:b], v[a:b], scale=scale) for a, b in zip(bounds[:-1], bounds[1:])
    ]
    out, _ = merge_partials([o for o, _ in partials], [lse for _, lse in partials], sink=sink)
    return out


# --- per-token probabilities after a fused pass ---------------------------------------------------


def accumulated_attention(
    q: np.ndarray, k, lse: np.ndarray, *, tile_size: int, scale: float | None = None
) -> np.ndarray:
    """Each key's attention probability summed over the queries, recovered from the saved LSE.

    A fused kernel ends with `(out, lse)` per query and nothing per token. With the keys still
    cached, one more pass over K recovers every probability exactly,
    `p_ti = exp(q_t · k_i · scale - lse_t)`, one tile at a time with nothing `T × S` held: what
    FlashAttention's backward pass does (Dao et al., 2022), and what a score-based eviction
    policy such as H2O needs (Zhang et al., 2023). The price is reading K once more.

    Args:
        q: (T, D) float queries.
        k: (S, D) keys (a numpy array or a `RowReadCounter`).
        lse: (T,) each query's log-sum-exp over all S keys (`partial_attention`, or a kernel).
        tile_size: keys per tile (>= 1).
        scale: defaults to D ** -0.5.
    Returns:
        (S,) float64: `Σ_t softmax(q_t Kᵀ · scale)_i`; for one decode query, its probabilities.
    Raises:
        TypeError, ValueError: non-float q, shapes that disagree, tile_size < 1.
    """
    check_array("q", q, ndim=2, floating=True)
    check_array("lse", lse, ndim=1, floating=True)
    if len(k.shape) != 2 or k.shape[1] != q.shape[1]:
        raise ValueError(f"k: expected (S, {q.shape[1]}) (D from q), got shape {k.shape}")
    if lse.shape[0] != q.shape[0]:
        raise ValueError(f"lse: expected ({q.shape[0]},) (one per query), got {lse.shape}")
    tile_size = check_positive_int("tile_size", tile_size)
    scale = q.shape[1] ** -0.5 if scale is None else float(scale)
    totals = np.zeros(k.shape[0])
    for start in range(0, k.shape[0], tile_size):
        k_tile = k[start : start + tile_size]  # [tile, D]: the extra read
        scores = q @ k_tile.T * scale  # (T, tile)
        totals[start : start + k_tile.shape[0]] = np.exp(scores - lse[:, None]).sum(axis=0)
    return totals


# --- counting passes over K and V -----------------------------------------------------------------


class RowReadCounter:
    """Wraps a (S, D) array and counts the rows read through row slices; `passes = rows_read / S`.

    With `max_rows_per_read`, a slice of more rows raises ValueError: an algorithm that works
    under it provably never holds more than one tile of K or V.
    """

    def __init__(self, array: np.ndarray, *, max_rows_per_read: int | None = None):
        self.array = check_array("array", array, ndim=2)
        self.shape = array.shape
        self.max_rows_per_read = (
            None
            if max_rows_per_read is None
            else check_positive_int("max_rows_per_read", max_rows_per_read)
        )
        self.rows_read = 0

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: slice | tuple) -> np.ndarray:
        if isinstance(index, tuple) and len(index) == 2 and index[1] == slice(None):
            index = index[0]  # k[a:b, :] is k[a:b]
        if not isinstance(index, slice):
            raise TypeError(
                f"index: only row slices such as k[a:b] are allowed here, got {index!r}"
            )
        rows = self.array[index]
        if self.max_rows_per_read is not None and rows.shape[0] > self.max_rows_per_read:
            raise ValueError(
                f"index: read {rows.shape[0]} rows at once; at most {self.max_rows_per_read} (one "
                "tile) are allowed"
            )
        self.rows_read += rows.shape[0]
        return rows

    @property
    def passes(self) -> float:
        return self.rows_read / self.shape[0]


def three_pass_attention(q: np.ndarray, k, v, *, tile_size: int) -> np.ndarray:
    """Safe softmax the textbook way, streamed over K/V tiles: pass 1 finds the row max, pass 2
    the denominator, pass 3 the output. Reads K three times and V once. (T, D) -> (T, D_v)."""
    _check_qkv(q, k, v)
    s, scale = k.shape[0], q.shape[1] ** -0.5
    tiles = range(0, s, tile_size)
    # pass 1 over K
    m = np.max([(q @ k[a : a + tile_size].T * scale).max(axis=1) for a in tiles], axis=0)
    # pass 2 over K
    l = sum(np.exp(q @ k[a : a + tile_size].T * scale - m[:, None]).sum(axis=1) for a in tiles)
    return (
        sum(
            np.exp(q @ k[a : a + tile_size].T * scale - m[:, None]) @ v[a : a + tile_size]
            for a in tiles
        )
        / l[:, None]
    )  # pass 3


def two_pass_attention(q: np.ndarray, k, v, *, tile_size: int) -> np.ndarray:
    """The online normaliser (max and denominator together in one pass over K), then the output
    pass over K and V. Reads K twice and V once. (T, D) -> (T, D_v)."""
    _check_qkv(q, k, v)
    s, scale = k.shape[0], q.shape[1] ** -0.5
    m, l = np.full(q.shape[0], -np.inf), np.zeros(q.shape[0])
    for a in range(0, s, tile_size):  # pass 1 over K: running max and rescaled denominator
        scores = q @ k[a : a + tile_size].T * scale
        m_new = np.maximum(m, scores.max(axis=1))
        l = l * np.exp(m - m_new) + np.exp(scores - m_new[:, None]).sum(axis=1)
        m = m_new
    return (
        sum(
            np.exp(q @ k[a : a + tile_size].T * scale - m[:, None]) @ v[a : a + tile_size]
            for a in range(0, s, tile_size)
        )
        / l[:, None]
    )
