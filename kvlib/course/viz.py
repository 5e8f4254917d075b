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
