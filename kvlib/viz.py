"""Plots and animations for the notebooks.

Each function returns a matplotlib object and leaves showing it to the notebook, so a figure's
title, axis labels (with units) and legend are set here once. Nothing here computes attention
that `kvlib.attention` does not already define; it only draws it.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib import animation

from kvlib.attention import ToyModel, attention_weights, rms_norm, sinusoidal_positions


def decode_animation(model: ToyModel, prompt_ids: np.ndarray, num_steps: int, *, interval_ms: int = 600) -> animation.FuncAnimation:
    """Animate cached decoding in layer 0: the K/V cache grows by one row per step, one score row.

    Each frame is one decode step: the new token's query (1 x D) is scored against every cached
    key (S x D), giving one row of S attention weights, which mix the S cached values. The
    animation is built from a real `generate_cached` run's cache. Render it with `.to_jshtml()`
    to play it in a static page without a kernel.

    Args:
        model: the ToyModel to run.
        prompt_ids: (P,) the prompt.
        num_steps: decode steps to show (>= 1).
    """
    from kvlib.attention import generate_cached

    prompt_len = prompt_ids.shape[0]
    cache = model.new_cache(prompt_len + num_steps)
    trace = generate_cached(model, prompt_ids, num_steps + 1, cache=cache)  # cache: P + num_steps rows
    keys, values = cache.buffer[0, 0, : cache.length], cache.buffer[0, 1, : cache.length]  # (S, D)
    layer = model.layers[0]
    x = model.embedding[trace.tokens[: cache.length]] + sinusoidal_positions(np.arange(cache.length), model.config.d_model)
    queries = rms_norm(x) @ layer.w_q  # (S, D): layer 0's query of every position

    max_len, head_dim = keys.shape
    vmax = float(np.abs(np.concatenate([keys, values])).max())
    fig, (ax_k, ax_w, ax_v) = plt.subplots(1, 3, figsize=(10, 4.2), dpi=60, gridspec_kw={"width_ratios": [3, 1.2, 3]})

    def draw(step: int) -> None:
        length = prompt_len + step  # the cache holds the prompt and `step` generated tokens
        weights = attention_weights(queries[length - 1][None, :], keys[:length])[0]  # (S,)
        for ax in (ax_k, ax_w, ax_v):
            ax.clear()
        for ax, data, name in ((ax_k, keys, "K cache"), (ax_v, values, "V cache")):
            shown = np.full((max_len, head_dim), np.nan)
            shown[:length] = data[:length]
            ax.imshow(shown, aspect="auto", cmap="coolwarm", vmin=-vmax, vmax=vmax, interpolation="nearest")
            ax.axhline(length - 1.5, color="black", lw=0.8)
            ax.set_title(f"{name}: {length} rows x D={head_dim}")
            ax.set_xlabel("head dimension")
            ax.set_ylabel("cached token position")
            ax.grid(False)
        ax_w.barh(np.arange(length), weights, color="tab:green")
        ax_w.set_ylim(max_len - 0.5, -0.5)
        ax_w.set_xlim(0, 1)
        ax_w.set_title("one score row")
        ax_w.set_xlabel("attention weight")
        fig.suptitle(f"decode step {step}: the query of position {length - 1} reads all {length} cached K and V rows")

    draw(1)
    plt.close(fig)  # the animation, not a static copy, is what the notebook shows
    return animation.FuncAnimation(fig, draw, frames=range(1, num_steps + 1), interval=interval_ms)
