"""Chapter 11's picture: the paged split-K decode kernel's grid and one program's walk.

`decode_grid` draws, for a given batch (its block tables and lengths), the programs the kernel
launches (one per sequence x KV head x split, `kvlib.kernels.paged_decode_attention`), the token
range each split covers (the kernel's rule: `ceil(ceil(seq_len / num_splits) / BLOCK_N) *
BLOCK_N` tokens per split, whole tiles, so late splits of a short sequence are empty), one
sequence's walk through its block table in `[BLOCK_N, D]` tiles, and the reduce that merges the
splits' partial outputs by their log-sum-exp (Flash-Decoding, Dao et al., 2023). It draws;
nothing runs on a device.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from kvlib._validate import check_positive_int

SPLIT_COLORS = ("#cfe3f5", "#f7d9b5", "#c9e7c3", "#e6d0ee", "#f5c9c9", "#e8e3b8")


def split_ranges(seq_len: int, num_splits: int, block_n: int) -> list[tuple[int, int]]:
    """The token range [start, end) of each split of a sequence of `seq_len` tokens, as the
    kernel computes it (whole tiles of `block_n`; an empty split has start >= end)."""
    per_split = math.ceil(math.ceil(seq_len / num_splits) / block_n) * block_n
    return [(s * per_split, min((s + 1) * per_split, seq_len)) for s in range(num_splits)]


def decode_grid(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_heads: int,
    num_splits: int,
    block_size: int,
    block_n: int,
) -> Figure:
    """Draw the kernel's grid of programs and sequence 0's walk through its block table.

    Args:
        block_tables: (B, max_blocks) int, physical block of each logical block.
        seq_lens: (B,) int, tokens cached per sequence (>= 1).
        num_kv_heads: H_kv (>= 1).
        num_splits: splits per (sequence, KV head) (>= 1).
        block_size: tokens per cache block (>= 1).
        block_n: BLOCK_N, tokens per tile (>= 1).
    Returns:
        the Figure: left, one Rectangle per program (`gid` "program", or "program-empty" for a
        split with no tokens), B x H_kv rows by `num_splits` columns; right, sequence 0's
        logical blocks (`gid` "block", labelled with their physical block), its tiles
        (`gid` "tile") and the reduce.
    Raises:
        ValueError: shapes that disagree, a length < 1, a block table too short for its length,
        or a size that is not a positive int.
    """
    for name, value in (
        ("num_kv_heads", num_kv_heads),
        ("num_splits", num_splits),
        ("block_size", block_size),
        ("block_n", block_n),
    ):
        check_positive_int(name, value)
    tables = torch.as_tensor(block_tables)
    lengths = [int(n) for n in torch.as_tensor(seq_lens).reshape(-1)]
    if tables.dim() != 2 or tables.shape[0] != len(lengths):
        raise ValueError(
            f"block_tables: expected (B, max_blocks) with B = len(seq_lens) = {len(lengths)}, "
            f"got shape {tuple(tables.shape)}"
        )
    if min(lengths) < 1 or max(math.ceil(n / block_size) for n in lengths) > tables.shape[1]:
        raise ValueError(
            f"seq_lens: expected lengths >= 1 that fit {tables.shape[1]} blocks of "
            f"{block_size}, got {lengths}"
        )
    fig, (ax_grid, ax_walk) = plt.subplots(
        1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [1, 1.7]}
    )
    # --- the grid: rows (sequence b, KV head h), columns splits ---
    rows = [(b, h) for b in range(len(lengths)) for h in range(num_kv_heads)]
    for r, (b, h) in enumerate(rows):
        y = len(rows) - 1 - r
        for s, (start, end) in enumerate(split_ranges(lengths[b], num_splits, block_n)):
            empty = start >= end
            box = Rectangle(
                (s, y),
                0.92,
                0.85,
                lw=0.6,
                edgecolor="0.35",
                facecolor="0.92" if empty else SPLIT_COLORS[s % len(SPLIT_COLORS)],
            )
            box.set_gid("program-empty" if empty else "program")
            ax_grid.add_patch(box)
            label = "empty" if empty else f"{start}–{end - 1}"
            ax_grid.text(s + 0.46, y + 0.42, label, ha="center", va="center", fontsize=6.5)
        ax_grid.text(-0.1, y + 0.42, f"b={b}, h={h}", ha="right", va="center", fontsize=7)
    ax_grid.set_xlim(-1.3, num_splits)
    ax_grid.set_ylim(-0.2, len(rows))
    ax_grid.axis("off")
    ax_grid.set_title(
        f"{len(rows) * num_splits} programs: B × H_kv × splits\n(tokens each split reads)",
        fontsize=9,
    )
    # --- sequence 0: logical blocks -> physical blocks, tiles, splits, reduce ---
    length = lengths[0]
    ranges = split_ranges(length, num_splits, block_n)
    split_of = [next(s for s, (a, e) in enumerate(ranges) if a <= t < e) for t in range(length)]
    num_blocks = math.ceil(length / block_size)
    scale = 12.0 / max(length, 1)  # x units per token
    for j in range(num_blocks):
        first = j * block_size
        box = Rectangle(
            (first * scale, 2.2),
            min(block_size, length - first) * scale,
            0.8,
            lw=0.8,
            edgecolor="0.25",
            facecolor=SPLIT_COLORS[split_of[first] % len(SPLIT_COLORS)],
        )
        box.set_gid("block")
        ax_walk.add_patch(box)
        ax_walk.text(
            (first + min(block_size, length - first) / 2) * scale,
            2.6,
            f"phys {int(tables[0, j])}",
            ha="center",
            va="center",
            fontsize=6.5,
        )
    for start in range(0, length, block_n):
        end = min(start + block_n, length)
        tile = Rectangle(
            (start * scale, 1.85),
            (end - start) * scale - 0.05,
            0.22,
            lw=0.6,
            edgecolor="0.3",
            facecolor="0.75",
        )
        tile.set_gid("tile")
        ax_walk.add_patch(tile)
    ax_walk.text(
        0,
        3.25,
        f"sequence 0: {length} tokens in blocks of {block_size}, "
        "block_tables[0] maps each to a physical block",
        fontsize=8,
    )
    ax_walk.text(
        0,
        1.45,
        f"tiles of BLOCK_N = {block_n} tokens ([BLOCK_N, D] of K and V "
        "per load), coloured blocks: the split that reads them",
        fontsize=7.5,
    )
    live = [(s, r) for s, r in enumerate(ranges) if r[0] < r[1]]
    for i, (s, _) in enumerate(live):
        x = 12.0 * (i + 0.5) / len(live)
        ax_walk.add_patch(
            Rectangle(
                (x - 0.8, 0.35),
                1.6,
                0.55,
                facecolor=SPLIT_COLORS[s % len(SPLIT_COLORS)],
                edgecolor="0.3",
                lw=0.6,
            )
        )
        ax_walk.text(x, 0.62, f"split {s}: out, lse", ha="center", va="center", fontsize=6.5)
        ax_walk.add_patch(
            FancyArrowPatch((x, 0.35), (6.0, -0.45), arrowstyle="-|>", mutation_scale=7, lw=0.7)
        )
    ax_walk.add_patch(Rectangle((4.6, -1.0), 2.8, 0.55, facecolor="white", edgecolor="0.2"))
    ax_walk.text(
        6.0, -0.72, "reduce: weights exp2(lse − max)", ha="center", va="center", fontsize=7
    )
    ax_walk.set_xlim(-0.3, 12.3)
    ax_walk.set_ylim(-1.2, 3.6)
    ax_walk.axis("off")
    fig.tight_layout()
    return fig
