"""Chapter 14's picture: a prompt's prefix walked through the offload tiers, and KV transfer.

`tier_walk` draws a prompt's full blocks as the hash chain that keys them (chapter 7's chained
block hash, salted per model in `kvlib.offload.keys`), each block coloured by the tier it was
found in (the device's prefix cache, then host memory, then disk), the walk stopping at the first
miss (a later block's key depends on every block before it, and its K/V on their tokens); under
it the tiers, with demotion down and promotion up. Below that, the prefill/decode split: a
prefill engine exports the blocks it computed under their keys, and a decode engine imports them
into its store, where the same walk finds them (`kvlib.offload.transfer`; LMCache and vLLM's KV
connectors do the same). The tier of each block is given (e.g. from `TieredStore.tier_of`), so
the picture shows a real store's state. It draws; it measures nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch, Rectangle

TIER_COLORS = {"device": "tab:green", "host": "tab:blue", "disk": "tab:orange", None: "white"}


def tier_walk(found_in: Sequence[str | None], *, transfer: bool = True) -> Figure:
    """Draw a prompt's full blocks by the tier each is found in, and the tiers under them.

    Args:
        found_in: per full block of the prompt, in order: "device", "host", "disk" or None
            (in no tier). At least one block.
        transfer: also draw the prefill -> decode transfer of the same blocks.
    Returns:
        the Figure; every block is a Rectangle with `gid` "hit-<tier>" for a block the walk
        reuses, "miss" for the first block no tier holds and every block after it (recomputed,
        even if a tier holds it: the walk has stopped).
    Raises:
        ValueError: `found_in` empty or naming another tier.
    """
    if not found_in:
        raise ValueError("found_in: expected the tier of at least one block, got none")
    for i, tier in enumerate(found_in):
        if tier not in TIER_COLORS:
            raise ValueError(
                f"found_in[{i}]: expected 'device', 'host', 'disk' or None, got {tier!r}"
            )
    stop = next((i for i, tier in enumerate(found_in) if tier is None), len(found_in))
    rows = 3 if transfer else 2
    fig, ax = plt.subplots(figsize=(10, 1.0 + 1.1 * rows))
    width = min(1.4, 11.0 / len(found_in))
    y = 2.6 * (rows - 1) + 0.6
    for i, tier in enumerate(found_in):
        x = i * width
        reused = i < stop
        box = Rectangle(
            (x, y),
            width * 0.8,
            0.7,
            lw=0.8,
            edgecolor="0.3",
            facecolor=TIER_COLORS[tier] if reused else "white",
            alpha=0.85 if reused else 1.0,
            hatch=None if reused else "///",
        )
        box.set_gid(f"hit-{tier}" if reused else "miss")
        ax.add_patch(box)
        ax.text(x + width * 0.4, y + 0.35, f"h{i}", ha="center", va="center", fontsize=7)
        if i:
            ax.add_patch(
                FancyArrowPatch(
                    (x - width * 0.2, y + 0.35),
                    (x, y + 0.35),
                    arrowstyle="-|>",
                    mutation_scale=6,
                    lw=0.6,
                )
            )
    ax.text(
        0,
        y + 1.0,
        f"the prompt's {len(found_in)} full blocks, keyed by the hash chain "
        f"(h_i = hash(h_i-1, tokens of block i)): {stop} reused, "
        f"{len(found_in) - stop} recomputed",
        fontsize=8,
    )
    # --- the tiers ---
    ty = y - 2.0
    tiers = (("device", "GPU pool (chapter 7)"), ("host", "CPU memory"), ("disk", "safetensors"))
    for i, (name, what) in enumerate(tiers):
        x = 0.3 + 3.8 * i
        ax.add_patch(
            FancyBboxPatch(
                (x, ty),
                2.8,
                1.0,
                boxstyle="round,pad=0.05",
                fc=TIER_COLORS[name],
                alpha=0.35,
                ec="0.3",
            )
        )
        held = sum(1 for t in found_in if t == name)
        ax.text(
            x + 1.4,
            ty + 0.5,
            f"{name}: {what}\n{held} of the prompt's blocks",
            ha="center",
            va="center",
            fontsize=7.5,
        )
        # from the tier on the left (red, upper) and back to it (green, lower)
        arrows = ((0.95, 0.05, 0.75, "tab:red"), (0.05, 0.95, 0.25, "tab:green")) if i else ()
        for tail, head, height, color in arrows:
            ax.add_patch(
                FancyArrowPatch(
                    (x - tail, ty + height),
                    (x - head, ty + height),
                    arrowstyle="-|>",
                    mutation_scale=7,
                    color=color,
                )
            )
    ax.text(
        3.6,
        ty - 0.35,
        "red: demote (LRU), green: promote (hit); the walk asks the tiers left to right",
        fontsize=7,
    )
    if transfer:
        py = ty - 2.1
        for x, name in (
            (0.3, "prefill engine\ncomputes the prompt"),
            (7.9, "decode engine\nimports, then decodes"),
        ):
            ax.add_patch(
                FancyBboxPatch((x, py), 2.8, 0.9, boxstyle="round,pad=0.05", fc="0.93", ec="0.3")
            )
            ax.text(x + 1.4, py + 0.45, name, ha="center", va="center", fontsize=7.5)
        ax.add_patch(
            FancyArrowPatch(
                (3.2, py + 0.45), (7.85, py + 0.45), arrowstyle="-|>", mutation_scale=9, lw=1.2
            )
        )
        ax.text(
            5.5,
            py + 0.6,
            f"{len(found_in)} blocks as (salted key, K/V) frames",
            ha="center",
            fontsize=7,
        )
        ax.text(
            5.5,
            py + 0.1,
            "into the decode engine's store: its walk then hits them",
            ha="center",
            fontsize=7,
        )
    ax.set_xlim(-0.2, max(len(found_in) * width, 11.6))
    bottom = ty - 2.5 if transfer else ty - 0.8  # below the lowest row of boxes
    ax.set_ylim(bottom, y + 1.4)
    ax.axis("off")
    handles = [
        Patch(facecolor=TIER_COLORS[t], alpha=0.85, label=f"found on {t}")
        for t in ("device", "host", "disk")
    ]
    handles.append(Patch(facecolor="white", edgecolor="0.3", hatch="///", label="recomputed"))
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=7.5, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig
