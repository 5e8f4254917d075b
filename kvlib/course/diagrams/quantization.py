"""Chapter 10's pictures: where a quantized cache keeps its scales, and what KIVI keeps exact.

`scale_groups` draws one head's `(S, D)` keys (tokens down, channels across) once per scheme,
each group of elements that shares one scale outlined and shaded alike; the groups are read from
the scale tensor `kvlib.quant.quantize` returns, so per-token (`reduce="channels"`), per-channel
(`reduce="tokens"`) and grouped schemes are drawn as the library stores them.

`kivi_residual` streams tokens one at a time into a real `kvlib.cache.QuantizedCache` and draws
what it then holds: the quantized history (keys flushed in whole groups of G tokens with
per-channel scales, values token by token with per-token scales) and the full-precision residual
of the newest tokens (KIVI, Liu et al., ICML 2024). Both draw; neither measures anything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from kvlib._validate import check_positive_int
from kvlib.cache.quantized import QuantizedCache
from kvlib.quant import QuantScheme, quantize

SHADES = ("#cfe3f5", "#f7d9b5")  # neighbouring scale groups alternate
EXACT = "#b7e4b0"  # full precision (the residual)


def _group_of(scheme: QuantScheme, scale_shape, num_tokens: int, head_dim: int):
    """(token, channel) -> (row, col) of the scale that decodes it, from the scale's shape."""
    rows, cols = scale_shape[-2], scale_shape[-1]
    return lambda t, c: (t * rows // num_tokens, c * cols // head_dim)


def scale_groups(schemes: Sequence[QuantScheme], num_tokens: int = 8, head_dim: int = 8) -> Figure:
    """Draw which elements of one head's `(S, D)` keys share a scale, one panel per scheme.

    Args:
        schemes: the schemes to draw (`kvlib.quant.QuantScheme`; per-tensor included).
        num_tokens: S, rows of the block (>= 1; a multiple of a per-channel group size).
        head_dim: D, columns (>= 1; a multiple of a per-token group size).
    Returns:
        the Figure; each panel holds one Rectangle per scale (`gid` "scale-group") outlining
        the elements it decodes, so a panel's count of them is its scheme's number of scales.
    Raises:
        ValueError: no schemes, a bad size, or a group size that does not divide its axis (from
        `kvlib.quant.quantize`).
    """
    num_tokens = check_positive_int("num_tokens", num_tokens)
    head_dim = check_positive_int("head_dim", head_dim)
    if not schemes:
        raise ValueError("schemes: expected at least one QuantScheme, got none")
    block = torch.randn(num_tokens, head_dim, generator=torch.Generator().manual_seed(0))
    fig, axes = plt.subplots(1, len(schemes), figsize=(3.2 * len(schemes), 3.4), squeeze=False)
    for ax, scheme in zip(axes[0], schemes):
        scale = quantize(block, scheme).scale  # (S / G, D) per channel, (S, D / g) per token
        group_of = _group_of(scheme, scale.shape, num_tokens, head_dim)
        for t in range(num_tokens):
            for c in range(head_dim):
                row, col = group_of(t, c)
                ax.add_patch(
                    Rectangle(
                        (c, num_tokens - 1 - t),
                        1,
                        1,
                        facecolor=SHADES[(row + col) % 2],
                        edgecolor="white",
                        lw=0.5,
                    )
                )
        rows, cols = scale.shape[-2], scale.shape[-1]
        height, width = num_tokens / rows, head_dim / cols
        for row in range(rows):
            for col in range(cols):
                outline = Rectangle(
                    (col * width, num_tokens - (row + 1) * height),
                    width,
                    height,
                    fill=False,
                    edgecolor="0.2",
                    lw=1.4,
                )
                outline.set_gid("scale-group")
                ax.add_patch(outline)
        ax.set_xlim(-0.2, head_dim + 0.2)
        ax.set_ylim(-0.2, num_tokens + 0.2)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_xlabel(f"channels (D = {head_dim}) →", fontsize=8)
        ax.set_ylabel(f"← tokens (S = {num_tokens})", fontsize=8)
        ax.set_title(f"{scheme.granularity}\n{rows * cols} scales", fontsize=9)
    fig.suptitle("Elements outlined together share one scale", fontsize=10)
    fig.tight_layout()
    return fig


def kivi_layout(
    key_scheme: QuantScheme,
    value_scheme: QuantScheme,
    num_tokens: int,
    residual_length: int,
) -> dict[str, tuple[int, int]]:
    """Stream `num_tokens` tokens one at a time into a one-layer `QuantizedCache` and count
    what it holds: {"keys": (quantized, exact), "values": (quantized, exact)} tokens.

    Raises:
        ValueError: a bad count or scheme (from `QuantizedCache`).
    """
    num_tokens = check_positive_int("num_tokens", num_tokens)
    cache = QuantizedCache(1, key_scheme, value_scheme, residual_length=residual_length)
    head_dim = 2 * max(key_scheme.group_size or 1, value_scheme.group_size or 1, 2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(num_tokens):
        k, v = torch.randn(2, 1, 1, 1, head_dim, generator=generator)  # (B, H_kv, T, D) each
        cache.update(0, k, v)
    counts = {}
    for name in ("keys", "values"):
        history = getattr(cache, name)[0]
        residual = getattr(cache, f"residual_{name}")[0]
        counts[name] = (0 if history is None else history.num_tokens, residual.shape[2])
    return counts


def kivi_residual(
    key_scheme: QuantScheme, value_scheme: QuantScheme, num_tokens: int, residual_length: int
) -> Figure:
    """Draw what a `QuantizedCache` with residual `residual_length` holds after `num_tokens`
    tokens streamed one at a time (arguments and errors as `kivi_layout`).

    Returns:
        the Figure: a row of tokens for keys and one for values; each token is a Rectangle whose
        `gid` is "quantized" or "exact"; brackets (`gid` "key-group") mark each group of tokens
        that shares per-channel key scales.
    """
    counts = kivi_layout(key_scheme, value_scheme, num_tokens, residual_length)
    fig, ax = plt.subplots(figsize=(10, 2.7))
    for row, name in enumerate(("keys", "values")):
        y = 1.6 * (1 - row)
        quantized, exact = counts[name]
        scheme = key_scheme if name == "keys" else value_scheme
        for t in range(quantized + exact):
            kind = "quantized" if t < quantized else "exact"
            box = Rectangle(
                (t, y),
                0.9,
                0.9,
                facecolor=SHADES[0] if kind == "quantized" else EXACT,
                edgecolor="0.4",
                lw=0.5,
            )
            box.set_gid(kind)
            ax.add_patch(box)
        if name == "keys" and scheme.reduce == "tokens":
            group = scheme.group_size
            for g in range(math.ceil(quantized / group)):
                ax.plot(
                    [g * group, g * group, (g + 1) * group - 0.1, (g + 1) * group - 0.1],
                    [y + 1.05, y + 1.2, y + 1.2, y + 1.05],
                    color="0.2",
                    lw=1,
                    gid="key-group",
                )
            ax.text(
                0, y + 1.3, "each bracket: one group of key scales (one per channel)", fontsize=7
            )
        ax.text(
            -0.8, y + 0.45, f"{name}\n{scheme.granularity}", ha="right", va="center", fontsize=8
        )
        ax.text(
            quantized + exact + 0.5,
            y + 0.45,
            f"{quantized} quantized, {exact} exact",
            va="center",
            fontsize=8,
        )
    ax.set_xlim(-0.5, num_tokens + 14)
    ax.set_ylim(-0.2, 3.0)
    ax.axis("off")
    ax.set_title(
        f"A quantized cache after {num_tokens} tokens, residual R = {residual_length} "
        "(oldest left)",
        fontsize=10,
    )
    handles = [
        Patch(facecolor=SHADES[0], edgecolor="0.4", label="quantized"),
        Patch(facecolor=EXACT, edgecolor="0.4", label="full precision (residual)"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig
