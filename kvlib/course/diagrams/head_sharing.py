"""Chapter 5's picture: which key/value head each query head reads, in MHA, GQA and MQA.

With H query heads and H_kv key/value heads (H_kv divides H), query head h reads KV head
h // (H / H_kv): consecutive query heads form a group, as `repeat_interleave` in
`kvlib.ops.attention.reference_attention` lays them out. MHA is H_kv = H, MQA H_kv = 1
(Shazeer, 2019), GQA anything between (Ainslie et al., 2023). The cache holds H_kv keys and
values per token per layer, so it shrinks by H / H_kv.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from kvlib._validate import check_positive_int
from kvlib.course.diagrams._boxes import COLOURS, box


def kv_head_of_query_head(num_heads: int, num_kv_heads: int) -> np.ndarray:
    """(H,) int: the KV head each query head reads (repeat_interleave's order).

    Raises:
        TypeError, ValueError: sizes that are not positive ints, or H_kv not dividing H.
    """
    h = check_positive_int("num_heads", num_heads)
    h_kv = check_positive_int("num_kv_heads", num_kv_heads)
    if h % h_kv:
        raise ValueError(f"num_kv_heads: expected a divisor of num_heads {h}, got {h_kv}")
    return np.repeat(np.arange(h_kv), h // h_kv)  # (H,)


def head_sharing(num_heads: int = 8, kv_head_counts=(8, 2, 1)):
    """One panel per entry of `kv_head_counts`: H query heads (top) joined to the KV head each
    reads (bottom); each KV head box stands for one cached key and one cached value vector.

    Boxes are tagged for tests: gid "query_head" (H per panel), "kv_head" (H_kv per panel) and
    the joining lines gid "share" (H per panel).

    Args:
        num_heads: H (1 to 32).
        kv_head_counts: the H_kv of each panel, each a divisor of H.
    Returns:
        the matplotlib Figure.
    Raises:
        TypeError, ValueError: H not an int in [1, 32], no panels, or an H_kv not dividing H.
    """
    h = check_positive_int("num_heads", num_heads)
    if h > 32:
        raise ValueError(f"num_heads: expected at most 32 (one box each), got {h}")
    counts = [int(c) for c in kv_head_counts]
    if not counts:
        raise ValueError("kv_head_counts: expected at least one H_kv, got none")
    fig, axes = plt.subplots(1, len(counts), figsize=(3.4 * len(counts), 3.0), squeeze=False)
    for ax, h_kv in zip(axes[0], counts, strict=True):
        owner = kv_head_of_query_head(h, h_kv)  # (H,)
        kind = "MHA" if h_kv == h else ("MQA" if h_kv == 1 else f"GQA-{h_kv}")
        for q in range(h):
            box(ax, q, 3.0, 0.8, 0.8, f"q{q}", colour=COLOURS["query"], gid="query_head", size=6)
        kv_w = h / h_kv
        for g in range(h_kv):
            x = g * kv_w + kv_w / 2 - 0.5
            box(ax, x, 0.0, 0.9, 0.5, f"k{g}", colour=COLOURS["key"], gid="kv_head", size=6)
            box(ax, x, -0.5, 0.9, 0.5, f"v{g}", colour=COLOURS["value"], size=6)
        for q in range(h):
            g = owner[q]
            (line,) = ax.plot(
                [q + 0.4, g * kv_w + kv_w / 2 - 0.05], [3.0, 0.5], color="0.4", lw=0.8
            )
            line.set_gid("share")
        ax.set_xlim(-0.5, h + 0.3)
        ax.set_ylim(-1.4, 4.4)
        ax.set_axis_off()
        ax.set_title(f"{kind}: H = {h}, H_kv = {h_kv}", size=10)
        ax.text(h / 2, -1.25, f"cache: {h_kv} K + {h_kv} V per token, layer", ha="center", size=8)
    fig.suptitle("Query heads (top) and the key/value head each reads (bottom)", size=11)
    fig.tight_layout()
    return fig
