"""Plots and animations for the notebooks.

Each function returns a matplotlib object and leaves showing it to the notebook, so a figure's
title, axis labels (with units) and legend are set here once. Nothing here computes attention
that `kvlib.ref` does not already define; it only draws it.
"""

from __future__ import annotations

import dataclasses

import matplotlib.pyplot as plt
import numpy as np
from matplotlib import animation

from kvlib._validate import check_positive_int
from kvlib.ref.attention import attention_weights
from kvlib.ref.toy_model import ToyModel, rms_norm, sinusoidal_positions


@dataclasses.dataclass(frozen=True)
class DecodeFrame:
    """Layer 0 of a ToyModel's cache right after one decode step.

    Attributes:
        step: the decode step (1 = the first token generated after the prefill).
        keys, values: (S, D) float64 copies of layer 0's cached rows after this step.
        weights: (S,) the new token's attention weights over them.
    """

    step: int
    keys: np.ndarray
    values: np.ndarray
    weights: np.ndarray


def decode_frames(model: ToyModel, prompt_ids: np.ndarray, num_steps: int) -> list[DecodeFrame]:
    """Greedy cached decoding, step by step, with a snapshot of layer 0's cache after each step.

    Args:
        model: the ToyModel to run.
        prompt_ids: (P,) int token ids.
        num_steps: decode steps to record (>= 1).
    Returns:
        `num_steps` frames; frame i's cache holds P + i rows.
    Raises:
        TypeError, ValueError: bad `prompt_ids` or `num_steps` (from `ToyModel.forward`).
    """
    num_steps = check_positive_int("num_steps", num_steps)
    cache = model.new_cache(prompt_ids.shape[0] + num_steps)
    logits = model.forward(prompt_ids, cache=cache)[-1]  # prefill
    layer = model.layers[0]
    frames = []
    for step in range(1, num_steps + 1):
        token = int(np.argmax(logits))
        position = cache.length  # the new token's position
        logits = model.forward(np.array([token]), cache=cache)[-1]  # one decode step
        d_model = model.config.d_model
        x = model.embedding[token] + sinusoidal_positions(np.array([position]), d_model)  # (1, d)
        query = rms_norm(x) @ layer.w_q  # (1, D): layer 0's query of the new token
        keys = cache.buffer[0, 0, : cache.length].copy()  # (S, D)
        values = cache.buffer[0, 1, : cache.length].copy()
        frames.append(DecodeFrame(step, keys, values, attention_weights(query, keys)[0]))
    return frames


def decode_animation(
    model: ToyModel, prompt_ids: np.ndarray, num_steps: int, *, interval_ms: int = 600
) -> animation.FuncAnimation:
    """Animate cached decoding in layer 0: the K/V cache grows by one row per step, one score row.

    Each frame is one decode step of `decode_frames`: the new token's query (1 x D) is scored
    against every cached key (S x D), giving one row of S attention weights, which mix the S
    cached values. Render it with `.to_jshtml()` to play it in a static page without a kernel.

    Args:
        model: the ToyModel to run.
        prompt_ids: (P,) the prompt.
        num_steps: decode steps to show (>= 1).
    """
    frames = decode_frames(model, prompt_ids, num_steps)
    max_len, head_dim = frames[-1].keys.shape
    vmax = float(np.abs(np.concatenate([frames[-1].keys, frames[-1].values])).max())
    fig, (ax_k, ax_w, ax_v) = plt.subplots(
        1, 3, figsize=(10, 4.2), dpi=60, gridspec_kw={"width_ratios": [3, 1.2, 3]}
    )

    def draw(index: int) -> None:
        frame = frames[index]
        length = frame.keys.shape[0]
        for ax in (ax_k, ax_w, ax_v):
            ax.clear()
        for ax, data, name in ((ax_k, frame.keys, "K cache"), (ax_v, frame.values, "V cache")):
            shown = np.full((max_len, head_dim), np.nan)
            shown[:length] = data
            ax.imshow(
                shown,
                aspect="auto",
                cmap="coolwarm",
                vmin=-vmax,
                vmax=vmax,
                interpolation="nearest",
            )
            ax.axhline(length - 1.5, color="black", lw=0.8)
            ax.set_title(f"{name}: {length} rows x D={head_dim}")
            ax.set_xlabel("head dimension")
            ax.set_ylabel("cached token position")
            ax.grid(False)
        ax_w.barh(np.arange(length), frame.weights, color="tab:green")
        ax_w.set_ylim(max_len - 0.5, -0.5)
        ax_w.set_xlim(0, 1)
        ax_w.set_title("one score row")
        ax_w.set_xlabel("attention weight")
        fig.suptitle(
            f"decode step {frame.step}: the query of position {length - 1} reads all {length} "
            "cached K and V rows"
        )

    draw(0)
    plt.close(fig)  # the animation, not a static copy, is what the notebook shows
    return animation.FuncAnimation(fig, draw, frames=range(num_steps), interval=interval_ms)


@dataclasses.dataclass(frozen=True)
class PoolSnapshot:
    """A `kvlib.cache.block_manager.BlockManager` at one moment, for drawing.

    Attributes:
        caption: what the last operation did.
        block_size: slots per block.
        block_tables: sequence name -> its block ids, in logical order.
        num_tokens: sequence name -> tokens it holds.
        ref_cnt: (num_blocks,) each block's reference count.
        cached: (num_blocks,) whether a block carries a prefix-cache hash.
        written: slots written by the last operation (flattened slot ids).
    """

    caption: str
    block_size: int
    block_tables: dict[str, list[int]]
    num_tokens: dict[str, int]
    ref_cnt: np.ndarray
    cached: np.ndarray
    written: tuple[int, ...] = ()

    @classmethod
    def of(cls, manager, caption: str, written=()) -> PoolSnapshot:
        """Copy what `manager` (a BlockManager) holds now."""
        pool = manager.pool
        return cls(
            caption,
            manager.block_size,
            {str(s): list(t) for s, t in manager.block_tables.items()},
            {str(s): len(t) for s, t in manager.token_ids.items()},
            np.array([b.ref_cnt for b in pool.blocks]),
            np.array([b.block_hash is not None for b in pool.blocks]),
            tuple(written),
        )


def _filled_slots(snapshot: PoolSnapshot) -> dict[int, tuple[str, int]]:
    """Physical slot -> (the first sequence holding it, how many sequences hold its block)."""
    filled: dict[int, tuple[str, int]] = {}
    for name, table in snapshot.block_tables.items():
        for t in range(snapshot.num_tokens[name]):
            block = table[t // snapshot.block_size]
            slot = block * snapshot.block_size + t % snapshot.block_size
            filled.setdefault(slot, (name, int(snapshot.ref_cnt[block])))
    return filled


def block_table_animation(
    snapshots: list[PoolSnapshot], *, interval_ms: int = 1400
) -> animation.FuncAnimation:
    """Animate a block pool: left, the physical blocks (one row each, one cell per slot, labelled
    with its slot id `block * block_size + offset`), coloured by the sequence holding them,
    shared blocks marked with their reference count; right, each sequence's block table. Render
    with `.to_jshtml()` to play it in a static page.

    Raises:
        ValueError: no snapshots.
    """
    if not snapshots:
        raise ValueError("snapshots: expected at least one PoolSnapshot, got none")
    names = list(dict.fromkeys(n for s in snapshots for n in s.block_tables))
    colours = dict(zip(names, plt.cm.tab10.colors, strict=False))
    num_blocks, block_size = len(snapshots[0].ref_cnt), snapshots[0].block_size
    fig, (ax_pool, ax_tables) = plt.subplots(
        1, 2, figsize=(10, 0.42 * num_blocks + 1.6), dpi=60, gridspec_kw={"width_ratios": [3, 2]}
    )

    def draw(index: int) -> None:
        snap = snapshots[index]
        filled = _filled_slots(snap)
        for ax in (ax_pool, ax_tables):
            ax.clear()
            ax.set_axis_off()
        for block in range(num_blocks):
            for offset in range(block_size):
                slot = block * block_size + offset
                owner = filled.get(slot)
                face = "white" if owner is None else colours[owner[0]]
                ax_pool.add_patch(
                    plt.Rectangle(
                        (offset, block),
                        1,
                        1,
                        facecolor=face,
                        alpha=0.75 if owner else 1.0,
                        edgecolor="black",
                        lw=2.5 if slot in snap.written else 0.5,
                        hatch="//" if owner and owner[1] > 1 else None,  # a shared block
                    )
                )
                shared = bool(owner and owner[1] > 1)
                ax_pool.text(
                    offset + 0.5,
                    block + 0.5,
                    str(slot),
                    ha="center",
                    va="center",
                    size=8,
                    bbox={"facecolor": "white", "lw": 0, "pad": 0.5} if shared else None,
                )
            state = (
                f"ref_cnt {snap.ref_cnt[block]}"
                if snap.ref_cnt[block]
                else ("free, cached" if snap.cached[block] else "free")
            )
            ax_pool.text(-0.2, block + 0.5, f"block {block}", ha="right", va="center", size=9)
            ax_pool.text(block_size + 0.2, block + 0.5, state, ha="left", va="center", size=9)
        ax_pool.set_xlim(-2.2, block_size + 2.6)
        ax_pool.set_ylim(num_blocks, -0.9)
        ax_pool.text(block_size / 2, -0.45, "physical blocks (slot ids)", ha="center", size=10)
        ax_tables.set_xlim(0, 1)
        ax_tables.set_ylim(num_blocks, -0.9)
        ax_tables.text(0, -0.45, "block tables (logical order)", size=10)
        for row, name in enumerate(snap.block_tables):
            ax_tables.text(
                0,
                1 + 1.4 * row,
                f"{name}: {snap.block_tables[name]}\n    {snap.num_tokens[name]} tokens",
                color=colours[name],
                size=11,
                va="center",
                family="monospace",
            )
        fig.suptitle(f"{index + 1}/{len(snapshots)}: {snap.caption}", size=11)

    draw(0)
    plt.close(fig)  # the animation, not a static copy, is what the notebook shows
    return animation.FuncAnimation(fig, draw, frames=range(len(snapshots)), interval=interval_ms)


def draw_block_table(
    ax,
    positions,
    block_table,
    block_size: int,
    *,
    moved=(),
    title: str = "",
) -> None:
    """Draw one sequence's blocks as rows of slots (chapter 9): each slot shows the text position
    of the token it holds ("T5"), an evicted slot is grey with a cross, and the slot indices in
    `moved` (destinations of a compaction pass) are highlighted. `positions` is the slot ->
    position map (-1: evicted) and `block_table` the physical block ids, in logical order; rows are
    labelled with them, so a static figure shows the table without running anything."""
    from matplotlib.patches import Rectangle

    positions = [int(p) for p in positions]
    moved = set(moved)
    num_blocks = len(block_table)
    for i in range(num_blocks * block_size):
        row, col = divmod(i, block_size)
        y = num_blocks - 1 - row
        if i >= len(positions):
            face, text = "white", ""
        elif positions[i] < 0:
            face, text = "0.85", "×"
        else:
            face, text = ("#f4a261" if i in moved else "#a8dadc"), f"T{positions[i]}"
        ax.add_patch(Rectangle((col, y), 1, 1, facecolor=face, edgecolor="black"))
        ax.text(col + 0.5, y + 0.5, text, ha="center", va="center", fontsize=9)
    ax.set_xlim(0, block_size)
    ax.set_ylim(0, max(num_blocks, 1))
    ax.set_yticks([num_blocks - 1 - r + 0.5 for r in range(num_blocks)])
    ax.set_yticklabels([f"block {b}" for b in block_table])
    ax.set_xticks([c + 0.5 for c in range(block_size)])
    ax.set_xticklabels([f"slot {c}" for c in range(block_size)], fontsize=8)
    ax.set_title(title)
    ax.tick_params(length=0)


def engine_timeline(ax, engine, title: str) -> None:
    """Draw a served `kvlib.engine.LLMEngine`'s schedule on `ax` (chapter 12): one row per
    request, waiting (grey) from its arrival until it is first scheduled, then a cell per step it
    computes: prefill (a chunk of more than one token, or its first step) or decode."""
    from collections import defaultdict

    seen = set()
    cells = defaultdict(list)  # request -> [(step, kind)]
    for s in engine.stats:
        for rid, n in s.scheduled:
            cells[rid].append((s.step, "prefill" if n > 1 or rid not in seen else "decode"))
            seen.add(rid)
    colors = {"prefill": "tab:blue", "decode": "tab:orange"}
    for row, (rid, request) in enumerate(engine.requests.items()):
        first = cells[rid][0][0]
        ax.broken_barh(
            [(request.arrival_step, first - request.arrival_step)], (row - 0.4, 0.8), color="0.85"
        )
        for kind in colors:
            steps = [(step, 1) for step, k in cells[rid] if k == kind]
            ax.broken_barh(steps, (row - 0.4, 0.8), color=colors[kind])
    ax.set_yticks(range(len(engine.requests)))
    ax.set_yticklabels([f"req {i}" for i in range(len(engine.requests))], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("engine step")
    ax.set_title(title, fontsize=10)
