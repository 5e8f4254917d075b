"""Chapter 17's picture: a sliding-window layer's cache as a ring, and as pages.

`ring_and_pages` draws one sequence after `num_positions` tokens through a layer with window W:
the positions of the text (those some later query can still see, and those no query will ever
read again); the ring's W slots, each labelled with the position it holds, read back from a real
`kvlib.cache.ring.RingCache` that was fed each position's own index as its key; and, optionally,
the same positions in pages of `block_size` slots, the pages that the layer can give back marked
(`kvlib.cache.paged_window.freeable_blocks`). Mistral's rolling buffer (Jiang et al., 2023) is
the ring. It draws; it measures nothing.
"""

from __future__ import annotations

import math

import torch
from matplotlib.figure import Figure

from kvlib._validate import check_positive_int
from kvlib.cache.ring import RingCache
from kvlib.course.diagrams._boxes import COLOURS, box, new_canvas

LIVE, DEAD, NEXT = COLOURS["cached"], "0.88", COLOURS["query"]


def ring_contents(window: int, num_positions: int) -> list[int | None]:
    """The position each of a ring's `window` slots holds after `num_positions` tokens (None:
    never written): one layer of one head whose key for position p is p itself, written through
    `RingCache.update` one token at a time and read back from its buffer."""
    window = check_positive_int("window", window)
    num_positions = check_positive_int("num_positions", num_positions, allow_zero=True)
    ring = RingCache(1, window)
    written = [False] * window
    for p in range(num_positions):
        key = torch.full((1, 1, 1, 1), float(p), dtype=torch.float64)  # (B, H_kv, T, D)
        ring.update(0, key, key)
        ring.advance(1)  # what the model's forward does once every layer wrote
        written[p % window] = True
    if num_positions == 0:
        return [None] * window
    slots = ring.keys[0][0, 0, :, 0].tolist()  # (W,): the key, i.e. the position, per slot
    return [int(v) if w else None for v, w in zip(slots, written)]


def ring_and_pages(
    window: int, num_positions: int, block_size: int | None = None, freed: list[int] = ()
) -> Figure:
    """Draw the positions, the ring's slots and (with `block_size`) the pages.

    Args:
        window: W, the positions a query sees (itself and W - 1 before it).
        num_positions: tokens so far (>= 1); the next query is at this position.
        block_size: slots per page, or None for no page row.
        freed: logical page indices the layer may give back (drawn crossed out).
    Returns:
        the Figure. Positions are Rectangles with `gid` "position-live" or "position-dead",
        ring slots "slot" (the next write's slot "slot-next"), pages "page-live" or
        "page-freed" (a page's slots still to be written hatched over it: "page-unwritten").
    Raises:
        ValueError: a non-positive window, block size or position count.
    """
    window = check_positive_int("window", window)
    num_positions = check_positive_int("num_positions", num_positions)
    rows = 3 if block_size is not None else 2
    width = max(num_positions, window) + 4
    fig, ax = new_canvas(width, 2.2 * rows + 0.6, figsize=(min(11, 0.42 * width + 1), 1.3 * rows))
    first_live = max(0, num_positions - window + 1)  # the next query sees first_live..n
    top = 2.2 * (rows - 1) + 0.4
    ax.text(0, top + 1.15, f"the text: {num_positions} positions, window W = {window}", size=8)
    for p in range(num_positions):
        live = p >= first_live
        box(ax, p + 3, top, 0.92, 0.8, str(p), colour=LIVE if live else DEAD, size=6,
            gid="position-live" if live else "position-dead")  # fmt: skip
    box(ax, num_positions + 3, top, 0.92, 0.8, "q", colour=NEXT, size=6, gid="position-next")
    ax.text(2.6, top + 0.4, "positions", ha="right", va="center", size=7)
    y = top - 2.2
    for slot, position in enumerate(ring_contents(window, num_positions)):
        nxt = slot == num_positions % window
        label = "" if position is None else str(position)
        box(ax, slot + 3, y, 0.92, 0.8, label, colour=NEXT if nxt else LIVE, size=6,
            gid="slot-next" if nxt else "slot")  # fmt: skip
        ax.text(slot + 3.46, y - 0.35, f"s{slot}", ha="center", size=5.5, color="0.4")
    ax.text(2.6, y + 0.4, "ring slots", ha="right", va="center", size=7)
    ax.text(window + 3.3, y + 0.4, f"next write: slot {num_positions} mod {window}", size=7,
            va="center")  # fmt: skip
    if block_size is not None:
        block_size = check_positive_int("block_size", block_size)
        y -= 2.2
        gone = set(freed)
        for page in range(math.ceil(num_positions / block_size)):
            start = page * block_size
            kind = "page-freed" if page in gone else "page-live"
            label = f"page {page}" + (" freed" if page in gone else "")
            box(ax, start + 3, y, block_size - 0.08, 0.8, label, colour=DEAD if page in gone
                else LIVE, size=6, gid=kind)  # fmt: skip
            empty = (page + 1) * block_size - num_positions  # slots the next tokens will fill
            if empty > 0:
                box(ax, num_positions + 3, y, empty - 0.08, 0.8, "", colour="white", hatch="///",
                    gid="page-unwritten")  # fmt: skip
        ax.text(2.6, y + 0.4, "pages", ha="right", va="center", size=7)
    ax.set_title(
        "A sliding-window layer keeps the last W positions: in a ring (slot = position mod W) or"
        " in pages",
        fontsize=8.5,
    )
    return fig
