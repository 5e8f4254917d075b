"""Drawing primitives shared by chapters 1-7's diagrams: labelled boxes and arrows on an axes
whose units are the picture's own (one unit = one box width), with no ticks or grid.

Nothing here knows about attention; the diagram modules decide what each box stands for.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

# One colour per role, used by every diagram so that "key" looks the same in each chapter.
COLOURS = {
    "query": "#f4a261",
    "key": "#2a9d8f",
    "value": "#457b9d",
    "latent": "#9c6ade",
    "rope": "#e9c46a",
    "computed": "#e76f51",
    "cached": "#a8dadc",
    "free": "white",
    "masked": "0.92",
    "state": "#fefae0",
}


def new_canvas(width: float, height: float, *, figsize: tuple[float, float]):
    """A figure with one axes spanning x in [0, width] and y in [0, height] (y grows upwards),
    equal aspect, axes hidden. Returns (fig, ax)."""
    fig, ax = plt.subplots(figsize=figsize)
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.set_aspect("equal")
    ax.set_axis_off()
    return fig, ax


def box(ax, x, y, width, height, text="", *, colour="white", size=9, **style) -> Rectangle:
    """Draw a rectangle with its lower-left corner at (x, y) and `text` centred in it; return the
    patch (tests count them by their `gid`, set through `style`)."""
    style.setdefault("edgecolor", "black")
    style.setdefault("linewidth", 0.8)
    patch = Rectangle((x, y), width, height, facecolor=colour, **style)
    ax.add_patch(patch)
    if text:
        ax.text(x + width / 2, y + height / 2, text, ha="center", va="center", size=size)
    return patch


def arrow(ax, start, end, *, colour="black", width=1.0, style="-|>", **kwargs) -> None:
    """Draw an arrow from `start` to `end` (x, y points)."""
    ax.add_patch(
        FancyArrowPatch(
            start, end, arrowstyle=style, mutation_scale=10, color=colour, lw=width, **kwargs
        )
    )


def count(fig, gid: str) -> int:
    """How many patches tagged `gid` the figure's axes hold (for tests and assertions)."""
    return sum(1 for ax in fig.axes for p in ax.patches if p.get_gid() == gid)
