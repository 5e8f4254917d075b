"""Chapter 4's pictures: merging two partial softmax states, and split-K decoding.

A chunk of scores s_j with values v_j is summarised by its state (m, ℓ, acc): the running
maximum m = max s_j, the denominator ℓ = Σ exp(s_j - m) and the numerator acc = Σ exp(s_j - m) v_j.
Two states merge exactly: m = max(m₁, m₂), ℓ = ℓ₁ e^(m₁-m) + ℓ₂ e^(m₂-m), acc likewise, and the
output is acc / ℓ (Milakov and Gimelshein, 2018, "Online normalizer calculation for softmax";
FlashAttention, Dao et al., 2022). Split-K decoding (Flash-Decoding, Dao et al., 2023) gives each
chunk of the cache to its own program and merges their (out, lse) at the end; the chunk bounds
drawn here are those `kvlib.ref.online_softmax.split_k_attention` uses.
"""

from __future__ import annotations

import numpy as np

from kvlib._validate import check_array, check_positive_int
from kvlib.course.diagrams._boxes import COLOURS, arrow, box, new_canvas
from kvlib.ref.online_softmax import merge_partials, partial_attention


def _state(scores: np.ndarray, values: np.ndarray) -> tuple[float, float, float]:
    """(m, ℓ, acc) of one chunk of scalar scores and scalar values."""
    m = float(scores.max())
    p = np.exp(scores - m)
    return m, float(p.sum()), float(p @ values)


def merge_two_states(scores: np.ndarray, values: np.ndarray, split: int):
    """Draw one query's scores split at `split` into two chunks, each chunk's (m, ℓ, acc), the
    merge of the two states, and the result checked against the softmax over all scores.

    Score boxes are tagged gid "score" (one per score); the three state boxes gid "state".

    Args:
        scores: (S,) float scores of one query (2 <= S <= 16).
        values: (S,) float values (one scalar per key, so the numbers fit in the boxes).
        split: chunk 1 is scores[:split], chunk 2 scores[split:] (1 <= split < S).
    Returns:
        the matplotlib Figure.
    Raises:
        TypeError, ValueError: arrays that are not 1-D float of equal length 2..16, or a split
        outside [1, S).
    """
    scores = check_array("scores", scores, ndim=1, floating=True)
    values = check_array("values", values, ndim=1, floating=True)
    s = scores.shape[0]
    if not 2 <= s <= 16 or values.shape != scores.shape:
        raise ValueError(
            f"scores, values: expected equal lengths from 2 to 16, got {s} and {values.shape[0]}"
        )
    split = check_positive_int("split", split)
    if split >= s:
        raise ValueError(f"split: expected 1 <= split < {s} (len(scores)), got {split}")
    states = [_state(scores[:split], values[:split]), _state(scores[split:], values[split:])]
    m = max(states[0][0], states[1][0])
    ell = sum(st[1] * np.exp(st[0] - m) for st in states)
    acc = sum(st[2] * np.exp(st[0] - m) for st in states)
    weights = np.exp(scores - scores.max())
    direct = float(weights @ values / weights.sum())  # the softmax over all scores at once
    fig, ax = new_canvas(s + 9.0, 8.0, figsize=(9.0, 4.6))
    x0 = 0.5
    for j in range(s):
        colour = COLOURS["key"] if j < split else COLOURS["value"]
        box(ax, x0 + j + (0.5 if j >= split else 0), 6.0, 1, 1, f"{scores[j]:.1f}",
            colour=colour, alpha=0.8, gid="score", size=7)  # fmt: skip
    ax.text(x0 + split / 2, 7.3, "chunk 1", ha="center", size=9)
    ax.text(x0 + 0.5 + (split + s) / 2, 7.3, "chunk 2", ha="center", size=9)
    centres = [x0 + split / 2, x0 + 0.5 + (split + s) / 2]
    for centre, (m_i, l_i, acc_i), i in zip(centres, states, (1, 2), strict=True):
        text = f"m{i} = {m_i:.2f}\nℓ{i} = {l_i:.3f}\nacc{i} = {acc_i:.3f}"
        box(ax, centre - 1.6, 3.3, 3.2, 1.9, text, colour=COLOURS["state"], gid="state", size=8)
        arrow(ax, (centre, 5.95), (centre, 5.25))
        arrow(ax, (centre, 3.25), ((centres[0] + centres[1]) / 2, 2.05), colour="0.4")
    middle = (centres[0] + centres[1]) / 2
    merged = f"m = max(m1, m2) = {m:.2f}\nℓ = ℓ1·e^(m1-m) + ℓ2·e^(m2-m) = {ell:.3f}\n"
    merged += f"acc = acc1·e^(m1-m) + acc2·e^(m2-m) = {acc:.3f}"
    box(ax, middle - 4.2, 0.2, 8.4, 1.8, merged, colour=COLOURS["state"], gid="state", size=8)
    ax.text(
        s + 2.0,
        1.1,
        f"out = acc / ℓ = {acc / ell:.4f}\none softmax over\nall scores: {direct:.4f}",
        va="center",
        size=9,
    )
    ax.set_title("Two partial softmax states and their exact merge (one query, scalar values)")
    return fig


def split_k(seq_len: int, num_splits: int):
    """Draw split-K decoding: a cache of `seq_len` keys cut into `num_splits` chunks (the bounds
    `split_k_attention` uses), one program per chunk producing (out_i, lse_i), and the merge.

    The per-chunk results are computed for real on random data and merged with
    `merge_partials`; the title says the merged output equals one pass over the whole cache.
    Chunk boxes are tagged gid "chunk", program boxes gid "program".

    Args:
        seq_len: S, the cached keys (1 to 100,000).
        num_splits: chunks (1 to 16; more than S leaves some empty, as in `split_k_attention`).
    Returns:
        the matplotlib Figure.
    Raises:
        TypeError, ValueError: sizes that are not positive ints in range.
    """
    s = check_positive_int("seq_len", seq_len)
    n = check_positive_int("num_splits", num_splits)
    if s > 100_000 or n > 16:
        raise ValueError(f"seq_len, num_splits: expected <= 100000 and <= 16, got {s} and {n}")
    bounds = np.linspace(0, s, n + 1).round().astype(int)  # as split_k_attention cuts
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(1, 8)), rng.normal(size=(s, 8)), rng.normal(size=(s, 8))
    partials = [partial_attention(q, k[a:b], v[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    merged, _ = merge_partials([o for o, _ in partials], [lse for _, lse in partials])
    whole, _ = partial_attention(q, k, v)
    exact = bool(np.allclose(merged, whole, rtol=1e-12, atol=1e-12))
    width = 12.0
    fig, ax = new_canvas(width + 1.0, 7.0, figsize=(9.0, 4.2))
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        x = 0.5 + width * a / s
        w = width * (b - a) / s
        box(ax, x, 5.2, max(w, 0.02), 1.0, f"{a}–{b - 1}" if b > a and w > 1.2 else "",
            colour=COLOURS["cached"], gid="chunk", size=7)  # fmt: skip
        centre = 0.5 + width * (i + 0.5) / n
        label = f"program {i}\n(out, lse)" if width / n > 1.4 else f"p{i}"
        box(ax, centre - 0.45 * width / n, 2.8, 0.9 * width / n, 1.2, label,
            colour=COLOURS["state"], gid="program", size=7)  # fmt: skip
        arrow(ax, (x + w / 2, 5.15), (centre, 4.05), colour="0.5", width=0.7)
        arrow(ax, (centre, 2.75), (0.5 + width / 2, 1.45), colour="0.5", width=0.7)
    box(ax, 0.5 + width / 2 - 2.5, 0.3, 5.0, 1.1, "merge: weights e^(lse_i - max lse)",
        colour=COLOURS["computed"], alpha=0.6, size=8)  # fmt: skip
    ax.text(0.5 + width / 2, 6.5, f"the cache: S = {s} keys, {n} chunks", ha="center", size=9)
    verdict = "equals" if exact else "differs from"
    ax.set_title(f"Split-K decoding: the merged output {verdict} one pass over the cache", size=10)
    return fig
