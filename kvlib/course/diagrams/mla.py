"""Chapter 6's picture: what one token caches per layer under GQA and under MLA.

GQA caches H_kv keys and H_kv values of D elements each. MLA (DeepSeek-V2, Liu et al., 2024,
Section 2.1) caches one normalised latent c_KV of d_c elements and one rotary key k_R of d_R
elements shared by every head (the decoupled RoPE); each head's content key and value are
up-projected from c_KV at attention time (or the up-projections are absorbed into the query and
the output), so they are never cached. Widths are drawn to scale, one unit per element.
"""

from __future__ import annotations

from kvlib._validate import check_positive_int
from kvlib.course.diagrams._boxes import COLOURS, arrow, box, new_canvas


def mla_vs_gqa(num_kv_heads: int, head_dim: int, kv_lora_rank: int, rope_head_dim: int,
               num_heads: int):  # fmt: skip
    """Two bars to scale: GQA's 2 · H_kv · D elements per token per layer, and MLA's
    d_c + d_R, with what MLA computes from them at attention time (not cached).

    Cached segments are tagged for tests: gid "gqa_vector" (2 · H_kv), "latent" and "rope" (one
    each).

    Args:
        num_kv_heads: GQA's H_kv (1 to 64).
        head_dim: D, of GQA and of MLA's per-head content keys.
        kv_lora_rank: d_c, the latent's width.
        rope_head_dim: d_R, the shared rotary key's width.
        num_heads: H, MLA's query heads (each gets its own key and value from the latent).
    Returns:
        the matplotlib Figure.
    Raises:
        TypeError, ValueError: a size that is not a positive int, or H_kv > 64.
    """
    h_kv = check_positive_int("num_kv_heads", num_kv_heads)
    d = check_positive_int("head_dim", head_dim)
    d_c = check_positive_int("kv_lora_rank", kv_lora_rank)
    d_r = check_positive_int("rope_head_dim", rope_head_dim)
    h = check_positive_int("num_heads", num_heads)
    if h_kv > 64:
        raise ValueError(f"num_kv_heads: expected at most 64 (one box each), got {h_kv}")
    gqa = 2 * h_kv * d
    mla = d_c + d_r
    scale = 14.0 / max(gqa, mla)  # drawing units per element
    fig, ax = new_canvas(17.5, 7.2, figsize=(9.5, 4.0))
    x0 = 3.0
    ax.text(x0 - 0.2, 5.6, f"GQA-{h_kv}", ha="right", va="center", size=9)
    for i in range(2 * h_kv):
        colour = COLOURS["key"] if i < h_kv else COLOURS["value"]
        label = ("k" if i < h_kv else "v") if d * scale > 0.35 else ""
        box(ax, x0 + i * d * scale, 5.2, d * scale, 0.8, label, colour=colour, gid="gqa_vector",
            size=6)  # fmt: skip
    ax.text(x0 + gqa * scale + 0.2, 5.6, f"{gqa:,}", va="center", size=9)
    ax.text(x0 - 0.2, 3.4, "MLA", ha="right", va="center", size=9)
    box(ax, x0, 3.0, d_c * scale, 0.8, f"c_KV ({d_c})", colour=COLOURS["latent"], gid="latent",
        size=7)  # fmt: skip
    box(ax, x0 + d_c * scale, 3.0, d_r * scale, 0.8, "k_R", colour=COLOURS["rope"], gid="rope",
        size=6)  # fmt: skip
    ax.text(x0 + mla * scale + 0.2, 3.4, f"{mla:,} = {d_c} + {d_r}", va="center", size=9)
    ax.text(x0 + 7.0, 6.6, "cached per token, per layer (elements, to scale)", ha="center",
            size=9)  # fmt: skip
    arrow(ax, (x0 + d_c * scale / 2, 2.95), (x0 + d_c * scale / 2, 1.75), colour="0.4")
    ax.text(
        x0 + d_c * scale / 2 + 0.3,
        1.0,
        f"not cached: W_UK, W_UV give each of the {h} heads a key ({d}) and a value\n"
        f"from c_KV at attention time (or are absorbed into the query and the output);\n"
        f"k_R is one rotary key shared by all {h} heads (decoupled RoPE)",
        va="center",
        size=8,
    )
    ax.set_title(f"One token, one layer: GQA caches {gqa / mla:.2f}× what MLA caches", size=10)
    return fig
