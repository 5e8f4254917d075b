"""Chapter 1's pictures: what one attention layer caches per token, and the work of one decode
step with and without the cache.

Both are drawn from the sizes given and, for the scores, from `kvlib.ref.attention.causal_mask`,
the mask the chapter's code applies, so the picture shows the cells that code computes. The
technique is the standard key/value cache of autoregressive transformers (Vaswani et al., 2017,
decoding one position at a time; Pope et al., 2022, "Efficiently Scaling Transformer Inference").
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from kvlib._validate import check_positive_int
from kvlib.course.diagrams._boxes import COLOURS, arrow, box, new_canvas
from kvlib.ref.attention import causal_mask


def layer_cache_per_token(num_tokens: int = 6):
    """One attention layer after `num_tokens` tokens: each token's input row x_t is projected to
    a query, a key and a value row (each D wide). The K and V rows of every token are kept (the
    cache: 2 vectors per token per layer); of the queries only the newest one is ever used again,
    so past Q rows are drawn faded and are not kept.

    Boxes are tagged for tests: gid "q_row", "k_row", "v_row" (one per token each) and "cached"
    (each kept row: 2 * num_tokens).

    Args:
        num_tokens: tokens seen so far, the newest included (1 to 24).
    Returns:
        the matplotlib Figure.
    Raises:
        TypeError, ValueError: `num_tokens` not an int in [1, 24].
    """
    n = check_positive_int("num_tokens", num_tokens)
    if n > 24:
        raise ValueError(f"num_tokens: expected at most 24 (one row each), got {n}")
    row_h, width = 0.8, 3.0
    columns = {"x": 0.0, "q": 4.5, "k": 8.5, "v": 12.0}
    fig, ax = new_canvas(16.5, n * row_h + 3.0, figsize=(8.0, 0.3 * n + 2.1))
    for t in range(n):
        y = (n - 1 - t) * row_h + 1.0
        newest = t == n - 1
        box(ax, columns["x"], y, width, row_h, f"x{t}", size=8)
        box(
            ax,
            columns["q"],
            y,
            width,
            row_h,
            f"q{t}" + (" (new)" if newest else ""),
            colour=COLOURS["query"],
            alpha=1.0 if newest else 0.25,
            linestyle="-" if newest else ":",
            gid="q_row",
            size=8,
        )
        for kind in ("k", "v"):
            colour = COLOURS["key" if kind == "k" else "value"]
            label = f"{kind}{t}"
            box(ax, columns[kind], y, width, row_h, label, colour=colour, gid=f"{kind}_row", size=8)
            edge = 2.2 if newest else 0.8  # the newest rows: written this step
            box(ax, columns[kind], y, width, row_h, colour="none", linewidth=edge, gid="cached")
        arrow(ax, (width, y + row_h / 2), (columns["q"], y + row_h / 2), colour="0.5", width=0.6)
    top = n * row_h + 1.1
    ax.text(columns["x"] + width / 2, top, "inputs x_t\n(d_model)", ha="center", size=9)
    ax.text(columns["q"] + width / 2, top, "queries\n(D)", ha="center", size=9)
    ax.text(columns["k"] + width / 2, top, "keys\n(D)", ha="center", size=9)
    ax.text(columns["v"] + width / 2, top, "values\n(D)", ha="center", size=9)
    ax.text(
        (columns["k"] + columns["v"] + width) / 2,
        0.05,
        f"cached: {n} K rows + {n} V rows\n= 2·D values per token, per layer",
        ha="center",
        size=9,
    )
    ax.text(
        columns["q"] + width / 2,
        0.05,
        "only q_new is used:\npast queries are not kept",
        ha="center",
        size=8,
        va="bottom",
    )
    ax.set_title("What one attention layer keeps per token: K and V rows, not Q", size=11)
    return fig


def decode_step_work(num_tokens: int = 6):
    """The scores one decode step computes when the sequence holds `num_tokens` tokens (the new
    one last): without a cache, every row of the causal score matrix again (n(n+1)/2 scores, and
    n rows projected to Q, K, V); with the cache, one row (n scores, 1 row projected, n - 1 K/V
    rows read back). The computed cells are those `causal_mask` allows.

    Score cells are tagged for tests: gid "computed" (computed this step) and "skipped".

    Args:
        num_tokens: the sequence length n after this step's token (1 to 24).
    Returns:
        the matplotlib Figure (two panels: naive, cached).
    Raises:
        TypeError, ValueError: `num_tokens` not an int in [1, 24].
    """
    n = check_positive_int("num_tokens", num_tokens)
    if n > 24:
        raise ValueError(f"num_tokens: expected at most 24 (one cell per score), got {n}")
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 4.4))
    naive_rows = causal_mask(n, n)  # (n, n): every query row again
    cached_rows = causal_mask(1, n)  # (1, n): the new query only
    naive_summary = f"{int(naive_rows.sum())} scores, {n} rows projected"
    cached_summary = f"{int(cached_rows.sum())} scores, 1 row projected, {n - 1} K/V rows read"
    panels = [
        (axes[0], naive_rows, 0, "naive step", naive_summary),
        (axes[1], cached_rows, n - 1, "cached step", cached_summary),
    ]
    for ax, mask, first_row, title, summary in panels:
        ax.set_xlim(-0.2, n + 0.2)
        ax.set_ylim(-0.2, n + 1.6)
        ax.set_aspect("equal")
        ax.set_axis_off()
        for i in range(n):
            computed_row = i - first_row if i >= first_row else None
            for j in range(n):
                y = n - 1 - i
                if computed_row is not None and mask[computed_row, j]:
                    box(ax, j, y, 1, 1, colour=COLOURS["computed"], gid="computed")
                elif j <= i:
                    box(ax, j, y, 1, 1, colour=COLOURS["cached"], alpha=0.35, gid="skipped")
                else:
                    box(ax, j, y, 1, 1, colour=COLOURS["masked"], gid="skipped")
        ax.text(n / 2, n + 0.9, f"{title}: {summary}", ha="center", size=9)
        ax.text(n / 2, n + 0.25, "keys 0 … n-1 →", ha="center", size=8)
        ax.text(-0.1, n / 2, "queries ↓", ha="right", va="center", size=8, rotation=90)
    fig.suptitle(
        f"Scores of one decode step at n = {n}: red = computed this step "
        "(grey: masked; pale: computed at earlier steps)",
        size=10,
    )
    return fig
