"""Chapter 9's picture: eviction vs compaction in a paged cache.

`compaction_passes` draws one sequence's slots, grouped in blocks, three times: after scattered
eviction (holes everywhere, a block comes back only when all its slots are dead), after an
order-preserving repack, and after hole-filling with its slot -> position map. The moves and the
freed blocks are the library's own plans (`kvlib.cache.compaction_plans`: `freeable_blocks`,
`plan_repack`, `plan_hole_filling`, `SlotMap.move`), so the picture is what the cache does.
Hole-filling is the classic two-finger compactor (Jones, Hosking and Moss, *The Garbage Collection
Handbook*, 2011). It draws; it measures nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from kvlib._validate import check_positive_int
from kvlib.cache.compaction_plans import SlotMap, freeable_blocks, plan_hole_filling, plan_repack

COLORS = {"live": "#cfe3f5", "moved": "tab:orange", "dead": "white", "free": "0.85"}


def _after(live: list[bool], moves: list[tuple[int, int]]) -> list[int]:
    """Each slot's position in the text after the moves: the survivors fill the first slots
    (`SlotMap.move`), every slot behind them is -1 (vacated)."""
    positions = torch.tensor([t if alive else -1 for t, alive in enumerate(live)])
    slots = SlotMap(positions, torch.zeros(len(live)), torch.zeros(len(live), dtype=torch.int64))
    kept = slots.move(moves, sum(live)).positions.tolist()
    return kept + [-1] * (len(live) - len(kept))


def _draw_row(ax, y, positions, block_size, moved, freed, label):
    """Slots left to right, a gap between blocks; each slot labelled with its token's position."""
    for slot, position in enumerate(positions):
        block = slot // block_size
        x = slot + 0.5 * block  # a half-slot gap between blocks
        kind = (
            "free"
            if block in freed
            else "dead"
            if position < 0
            else "moved"
            if slot in moved
            else "live"
        )
        box = Rectangle((x, y), 0.92, 0.8, facecolor=COLORS[kind], edgecolor="0.35", lw=0.6)
        box.set_gid(f"slot-{kind}")
        ax.add_patch(box)
        if position >= 0 and block not in freed:
            ax.text(x + 0.46, y + 0.4, f"T{position}", ha="center", va="center", fontsize=6)
    for block in range(math.ceil(len(positions) / block_size)):
        x = block * (block_size + 0.5)
        ax.text(x + block_size / 2, y - 0.3, f"block {block}", ha="center", fontsize=6.5)
        if block in freed:
            ax.text(x + block_size / 2, y + 0.4, "freed", ha="center", va="center", fontsize=7)
    ax.text(-0.6, y + 0.4, label, ha="right", va="center", fontsize=8)


def compaction_passes(live: Sequence[bool], block_size: int) -> Figure:
    """Draw one sequence's slots after eviction, after a repack and after hole-filling.

    Args:
        live: (num_slots,) bools, slot i holds a survivor (slot i holds token T{i} before any
            compaction: slot order is text order).
        block_size: slots per block (>= 1).
    Returns:
        the Figure. Every slot is a Rectangle whose `gid` is "slot-live", "slot-moved" (copied
        by the pass), "slot-dead" (an evicted token still holding its slot) or "slot-free" (in a
        block the pass gave back); arrows (`gid` "move") show each copy.
    Raises:
        ValueError: `live` is empty; `block_size` not a positive int.
    """
    block_size = check_positive_int("block_size", block_size)
    flags = [bool(x) for x in live]
    if not flags:
        raise ValueError("live: expected at least one slot, got an empty sequence")
    num_survivors = sum(flags)
    num_blocks = math.ceil(len(flags) / block_size)
    kept_blocks = math.ceil(num_survivors / block_size)
    freed_by_pass = set(range(kept_blocks, num_blocks))
    plans = {"repack": plan_repack(flags), "hole-filling": plan_hole_filling(flags)}
    fig, ax = plt.subplots(figsize=(10, 3.8))
    rows = [
        (
            "after eviction",
            [t if alive else -1 for t, alive in enumerate(flags)],
            set(),
            set(freeable_blocks(flags, block_size)),
            [],
        )
    ]
    for name, moves in plans.items():
        rows.append((name, _after(flags, moves), {dst for _, dst in moves}, freed_by_pass, moves))
    for row, (name, positions, moved, freed, moves) in enumerate(rows):
        y = 2.2 * (len(rows) - 1 - row)
        label = name
        if row == 0:
            label += f"\n{len(freed)} of {num_blocks} blocks free"
        else:
            label += f"\n{len(moves)} copies, {len(freed)} blocks freed"
        _draw_row(ax, y, positions, block_size, moved, freed, label)
        for i, (src, dst) in enumerate(moves):
            height = 5 + 2.5 * (i % 4)  # points above the row, staggered so the arrows part
            arrow = FancyArrowPatch(
                (src + 0.5 * (src // block_size) + 0.46, y + 0.8),
                (dst + 0.5 * (dst // block_size) + 0.46, y + 0.8),
                connectionstyle=f"arc,angleA=90,angleB=90,armA={height},armB={height},rad=2",
                arrowstyle="-|>",
                mutation_scale=6,
                lw=0.6,
                color="tab:red",
                alpha=0.7,
            )
            arrow.set_gid("move")
            ax.add_patch(arrow)
    ax.set_xlim(-0.5, num_blocks * (block_size + 0.5))
    ax.set_ylim(-0.3, 2.2 * len(rows) - 0.6)
    ax.axis("off")
    ax.set_title(
        "Scattered eviction frees no block; compaction moves survivors forward (T = position in"
        " the text)",
        fontsize=9,
    )
    fig.tight_layout()
    return fig
