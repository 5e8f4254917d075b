"""Chapter 7's picture: a paged cache's block tables and slot mapping, drawn from a live
`kvlib.cache.block_manager.BlockManager`.

Each sequence's tokens fill logical blocks of `block_size` slots; its block table maps logical
block i to a physical block of the pool; token t is stored in slot
`block_table[t // block_size] * block_size + t % block_size` (its slot mapping). A physical
block shared by several sequences (a forked sample, or a prefix-cache hit) has a reference count
above 1. PagedAttention: Kwon et al., SOSP 2023; names as in vLLM v1 and nano-vllm.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from kvlib.course.diagrams._boxes import COLOURS, box


def block_table_diagram(manager, *, title: str = ""):
    """Draw `manager`'s state: left, each sequence's logical blocks (one cell per slot, with the
    token position it holds) and its slot mapping; right, every physical block with its
    `ref_cnt` (hatched when shared); an arrow per block-table entry. Slots come from
    `manager.slot`, so the picture is the manager's own mapping.

    Patches are tagged for tests: gid "logical_block" (one per block-table entry),
    "physical_block" (one per pool block) and "table_entry" (one arrow per block-table entry).

    Args:
        manager: a BlockManager (at most 8 sequences and 32 physical blocks).
        title: the figure's title.
    Returns:
        the matplotlib Figure.
    Raises:
        TypeError: `manager` has no block tables (not a BlockManager).
        ValueError: more than 8 sequences or 32 blocks (too many to draw).
    """
    if not hasattr(manager, "block_tables") or not hasattr(manager, "pool"):
        raise TypeError(f"manager: expected a BlockManager, got {type(manager).__name__}")
    seq_ids = {str(s): s for s in manager.block_tables}  # label -> the manager's own id
    tables = {str(s): list(t) for s, t in manager.block_tables.items()}
    blocks = manager.pool.blocks
    if len(tables) > 8 or len(blocks) > 32:
        raise ValueError(
            f"manager: expected at most 8 sequences and 32 blocks to draw, got {len(tables)} "
            f"and {len(blocks)}"
        )
    size = manager.block_size
    colours = dict(zip(tables, plt.cm.tab10.colors, strict=False))
    rows = sum(len(t) for t in tables.values()) + 1.2 * len(tables)
    height = max(rows, len(blocks) * 0.9) + 1.5
    fig, ax = plt.subplots(figsize=(10.0, 0.32 * height + 0.8))
    phys_x = 2.0 + size + 6.0
    phys_y = {b: height - 1.5 - 0.9 * b for b in range(len(blocks))}
    for b, block in enumerate(blocks):
        owners = [s for s, t in tables.items() if b in t]
        colour = colours[owners[0]] if owners else COLOURS["free"]
        hatch = "//" if block.ref_cnt > 1 else None
        box(ax, phys_x, phys_y[b], 2.2, 0.7, f"block {b}", colour=colour, alpha=0.6,
            hatch=hatch, gid="physical_block", size=7)  # fmt: skip
        state = f"ref_cnt {block.ref_cnt}" if block.ref_cnt else "free"
        if block.ref_cnt > 1:
            state += " (shared)"
        if not block.ref_cnt and block.block_hash is not None:
            state += ", cached"
        ax.text(phys_x + 2.4, phys_y[b] + 0.35, state, va="center", size=7)
    y = height - 1.5
    for seq, table in tables.items():
        num_tokens = manager.num_tokens(seq_ids[seq])
        slots = [manager.slot(seq_ids[seq], t) for t in range(num_tokens)]
        ax.text(0.0, y + 0.35, f"{seq}", ha="right", va="center", size=9, color=colours[seq])
        for i, physical in enumerate(table):
            box(ax, 0.3, y, 1.6, 0.7, f"logical {i}", colour="white", gid="logical_block",
                size=6)  # fmt: skip
            for offset in range(size):
                t = i * size + offset
                filled = t < num_tokens
                box(ax, 2.0 + offset, y, 1.0, 0.7, f"t{t}" if filled else "",
                    colour=colours[seq] if filled else "white", alpha=0.5, size=6)  # fmt: skip
            (line,) = ax.plot([2.0 + size + 0.1, phys_x - 0.1], [y + 0.35, phys_y[physical] + 0.35],
                              color=colours[seq], lw=1.0)  # fmt: skip
            line.set_gid("table_entry")
            y -= 0.9
        ax.text(0.3, y + 0.5, f"block table {table}, slots {_ranges(slots)}", size=7)
        y -= 0.9
    ax.set_xlim(-1.0, phys_x + 5.0)
    ax.set_ylim(min(y, min(phys_y.values())) - 0.3, height)
    ax.set_axis_off()
    ax.text(2.0 + size / 2, height - 0.6, f"logical blocks ({size} slots each)", ha="center",
            size=9)  # fmt: skip
    ax.text(phys_x + 1.1, height - 0.6, "physical blocks", ha="center", size=9)
    ax.set_title(title or "Block tables: logical blocks -> physical blocks", size=10)
    return fig


def _ranges(slots: list[int]) -> str:
    """[0, 1, 2, 3, 12, 13] -> '0-3, 12-13': a slot mapping in short."""
    parts, start = [], None
    for i, s in enumerate(slots):
        if start is None:
            start = s
        if i + 1 == len(slots) or slots[i + 1] != s + 1:
            parts.append(f"{start}-{s}" if s != start else f"{s}")
            start = None
    return ", ".join(parts)
