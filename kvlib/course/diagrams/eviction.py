"""Chapter 8's picture: which tokens of a sequence survive an eviction policy.

`eviction_survivors` runs the library's own policies (`kvlib.cache.eviction_policies`:
StreamingLLM's sinks + recent window, Xiao et al., ICLR 2024; H2O's heavy hitters + recent
window, Zhang et al., NeurIPS 2023) on one KV head whose accumulated attention is given, keeps
the `budget` highest priorities the way `EvictingCache` does, and draws one row of tokens per
policy, each token coloured by why it stayed (or white: evicted). It draws; it measures nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from kvlib._validate import check_positive_int
from kvlib.cache.eviction_policies import H2O, LayerState, StreamingLLM

ROLE_COLORS = {
    "sink": "tab:purple",
    "recent window": "tab:green",
    "heavy hitter": "tab:orange",
    "evicted": "white",
}


def _state(scores: torch.Tensor) -> LayerState:
    """One sequence, one KV head of `S` tokens at positions 0..S-1, with H2O's `scores` (S,)."""
    num_tokens = scores.shape[0]
    empty = torch.zeros(1, 1, num_tokens, 1)
    return LayerState(
        keys=empty,
        values=empty.clone(),
        positions=torch.arange(num_tokens)[None, None],
        scores=scores.float()[None, None].clone(),
        seen=torch.ones(1, 1, num_tokens, dtype=torch.int64),
    )


def _kept(priority: torch.Tensor, budget: int) -> list[int]:
    """The `budget` highest priorities, ties to the older token: `EvictingCache`'s rule."""
    ranked = priority.sort(dim=-1, descending=True, stable=True).indices
    return ranked[..., :budget].sort(dim=-1).values[0, 0].tolist()


def survivor_roles(
    scores: Sequence[float], budget: int, num_sinks: int = 4, recent_fraction: float = 0.5
) -> dict[str, list[str]]:
    """Why each token stays under StreamingLLM and H2O (one KV head, one eviction).

    Args:
        scores: (S,) the attention each token has accumulated (H2O's score), S > budget.
        budget: tokens kept, > num_sinks.
        num_sinks: StreamingLLM's sinks (the paper's 4).
        recent_fraction: H2O's share of the budget for the recent window (the paper's half).
    Returns:
        {"StreamingLLM": roles, "H2O": roles}, each a list of S strings, keys of `ROLE_COLORS`.
    Raises:
        ValueError: `scores` not 1-D or not longer than `budget`; `budget` not above
        `num_sinks`; `recent_fraction` outside [0, 1) (from `H2O`).
    """
    budget = check_positive_int("budget", budget)
    num_sinks = check_positive_int("num_sinks", num_sinks, allow_zero=True)
    score_tensor = torch.as_tensor(scores, dtype=torch.float32)
    if score_tensor.dim() != 1 or score_tensor.shape[0] <= budget:
        raise ValueError(
            f"scores: expected a 1-D sequence longer than budget={budget}, got shape "
            f"{tuple(score_tensor.shape)}"
        )
    num_tokens = score_tensor.shape[0]
    roles = {}
    streaming = StreamingLLM(num_sinks)
    streaming.check_budget(budget)
    kept = _kept(streaming.priority(_state(score_tensor), None, None, budget), budget)
    roles["StreamingLLM"] = [
        "evicted" if t not in kept else "sink" if t < num_sinks else "recent window"
        for t in range(num_tokens)
    ]
    h2o = H2O(recent_fraction)
    priority = h2o.priority(_state(score_tensor), None, None, budget)
    kept = _kept(priority, budget)
    roles["H2O"] = [
        "evicted"
        if t not in kept
        else "recent window"
        if math.isinf(priority[0, 0, t])
        else "heavy hitter"
        for t in range(num_tokens)
    ]
    return roles


def eviction_survivors(
    scores: Sequence[float], budget: int, num_sinks: int = 4, recent_fraction: float = 0.5
) -> Figure:
    """Draw the accumulated attention of S tokens and, below it, which tokens StreamingLLM and
    H2O keep with a budget of `budget` (arguments and errors as `survivor_roles`).

    Returns:
        the Figure: a bar per token (its score), then one row of S squares per policy; each kept
        square's `gid` is its role ("sink", "recent window", "heavy hitter"), evicted ones
        "evicted".
    """
    roles = survivor_roles(scores, budget, num_sinks, recent_fraction)
    num_tokens = len(scores)
    fig, (ax_score, ax_rows) = plt.subplots(
        2, 1, figsize=(9, 3.6), gridspec_kw={"height_ratios": [1.1, 1.3]}, sharex=True
    )
    ax_score.bar(range(num_tokens), scores, width=0.8, color="0.55")
    ax_score.set_ylabel("attention\nreceived")
    ax_score.set_title(
        f"Which of {num_tokens} tokens survive a budget of {budget} (one KV head)", fontsize=10
    )
    for row, row_roles in enumerate(roles.values()):
        y = len(roles) - 1 - row
        for t, role in enumerate(row_roles):
            square = Rectangle(
                (t - 0.45, y - 0.4), 0.9, 0.8, facecolor=ROLE_COLORS[role], edgecolor="0.3", lw=0.6
            )
            square.set_gid(role)
            ax_rows.add_patch(square)
    ax_rows.set_yticks(range(len(roles)), list(reversed(roles)))
    ax_rows.set_ylim(-0.6, len(roles) - 0.4)
    ax_rows.set_xlim(-0.8, num_tokens - 0.2)
    ax_rows.set_xlabel("position in the text (oldest left, newest right)")
    for side in ("top", "right"):
        ax_score.spines[side].set_visible(False)
        ax_rows.spines[side].set_visible(False)
    handles = [Patch(facecolor=c, edgecolor="0.3", label=r) for r, c in ROLE_COLORS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig
