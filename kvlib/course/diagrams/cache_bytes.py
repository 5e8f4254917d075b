"""Chapter 3's picture: what one token's cache holds across a model's layers and KV heads.

Each layer keeps, per token, one key and one value vector for each of its H_kv key/value heads,
each D elements of b bytes: 2 · L · H_kv · D · b bytes per token (per sequence). The total in
the title comes from `kvlib.memory.formula.dense_kv_cache_bytes`, the function the chapter's
tables use, so the picture and the numbers cannot disagree.
"""

from __future__ import annotations

from kvlib._validate import check_positive_int
from kvlib.course.diagrams._boxes import COLOURS, box, new_canvas
from kvlib.memory.formula import dense_kv_cache_bytes

MAX_DRAWN_LAYERS = 6  # more layers are drawn as the first and last few with "⋮" between


def _layers_drawn(num_layers: int) -> list[int | None]:
    """Layer indices to draw, with None where a run of layers is elided."""
    if num_layers <= MAX_DRAWN_LAYERS:
        return list(range(num_layers))
    half = MAX_DRAWN_LAYERS // 2
    return [*range(half - 1), None, *range(num_layers - half, num_layers)]


def token_cache_layout(
    num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: int, *, name: str = ""
):
    """One token's cache as a picture: a row per layer, in it H_kv key vectors and H_kv value
    vectors (each box one vector of D elements), and the product 2 · L · H_kv · D · b.

    Layers beyond `MAX_DRAWN_LAYERS` are elided in the middle (the title counts all of them).
    Vector boxes are tagged for tests: gid "key_vector" and "value_vector" (H_kv per drawn layer
    each); elided layers are tagged "elided".

    Args:
        num_layers: L (>= 1).
        num_kv_heads: H_kv (1 to 64).
        head_dim: D (>= 1).
        bytes_per_element: b (>= 1), e.g. 2 for fp16/bf16.
        name: the model's name, for the title.
    Returns:
        the matplotlib Figure.
    Raises:
        TypeError, ValueError: a size that is not a positive int, or H_kv > 64.
    """
    num_kv_heads = check_positive_int("num_kv_heads", num_kv_heads)
    if num_kv_heads > 64:
        raise ValueError(f"num_kv_heads: expected at most 64 (one box each), got {num_kv_heads}")
    per_token = dense_kv_cache_bytes(num_layers, num_kv_heads, head_dim, bytes_per_element, 1)
    rows = _layers_drawn(num_layers)
    head_w = min(1.0, 12.0 / num_kv_heads)
    width = 2 * num_kv_heads * head_w + 4.5
    fig, ax = new_canvas(width, len(rows) + 2.2, figsize=(9.0, 0.45 * len(rows) + 1.8))
    for r, layer in enumerate(rows):
        y = len(rows) - 1 - r + 0.3
        if layer is None:
            ax.text(2.6 + num_kv_heads * head_w, y + 0.4, "⋮", ha="center", size=12)
            box(ax, 0, y, 0.01, 0.01, colour="none", linewidth=0, gid="elided")
            continue
        ax.text(2.0, y + 0.4, f"layer {layer}", ha="right", va="center", size=8)
        for h in range(num_kv_heads):
            label = f"k{h}" if head_w >= 0.6 else ""
            box(ax, 2.2 + h * head_w, y, head_w, 0.8, label, colour=COLOURS["key"],
                gid="key_vector", size=7)  # fmt: skip
            x_v = 2.5 + (num_kv_heads + h) * head_w
            label = f"v{h}" if head_w >= 0.6 else ""
            box(ax, x_v, y, head_w, 0.8, label, colour=COLOURS["value"], gid="value_vector",
                size=7)  # fmt: skip
    top = len(rows) + 0.45
    ax.text(2.2 + num_kv_heads * head_w / 2, top, f"{num_kv_heads} keys (H_kv)", ha="center",
            size=8)  # fmt: skip
    ax.text(2.5 + 1.5 * num_kv_heads * head_w, top, f"{num_kv_heads} values (H_kv)",
            ha="center", size=8)  # fmt: skip
    title = f"{name}: one token's cache" if name else "One token's cache"
    ax.set_title(
        f"{title}, each box a vector of D = {head_dim} elements of b = {bytes_per_element} bytes\n"
        f"2 · L · H_kv · D · b = 2 · {num_layers} · {num_kv_heads} · {head_dim} · "
        f"{bytes_per_element} = {per_token:,} bytes per token ({per_token / 1024:g} KiB)",
        size=10,
    )
    return fig
