"""Chapter 12's picture: the serving engine's step loop and its token budget.

`engine_steps` draws the loop every step goes around (the waiting and running queues, the
scheduler, the block manager, the model runner, the sampler; vLLM v1 and nano-vllm name theirs
the same) and, under it, what each step computed: one bar per step, as wide as the token budget
(`max_num_batched_tokens`), split into each request's tokens, so a long prompt's chunks
(chunked prefill, Sarathi-Serve, Agrawal et al., OSDI 2024) and the decodes beside them are
visible. The step plans are given as data (`(request_id, num_tokens)` pairs, what the engine's
per-step statistics record), so the picture does not depend on the engine's internals. It
draws; it measures nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch, Rectangle

from kvlib._validate import check_positive_int

REQUEST_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink")
STAGES = (
    ("scheduler", "picks each request's\ntokens within the budget"),
    ("block manager", "allocates blocks\n(or preempts)"),
    ("model runner", "one forward over\nall scheduled tokens"),
    ("sampler", "one token per request\nthat finished its prompt"),
)


def _loop(ax) -> None:
    """The stages left to right, the queues before them, an arrow back to the start."""
    ax.add_patch(
        FancyBboxPatch(
            (0.0, 0.3), 1.3, 1.2, boxstyle="round,pad=0.05", fc="0.95", ec="0.3", gid="queue"
        )
    )
    ax.text(0.65, 1.15, "waiting", ha="center", fontsize=8, weight="bold")
    ax.text(0.65, 0.6, "running", ha="center", fontsize=8, weight="bold")
    ax.plot([0.05, 1.25], [0.9, 0.9], color="0.6", lw=0.6)
    for i, (name, what) in enumerate(STAGES):
        x = 2.0 + 2.3 * i
        ax.add_patch(
            FancyBboxPatch(
                (x, 0.3), 1.9, 1.2, boxstyle="round,pad=0.05", fc="#e8f0fa", ec="0.3", gid="stage"
            )
        )
        ax.text(x + 0.95, 1.15, name, ha="center", fontsize=8.5, weight="bold")
        ax.text(x + 0.95, 0.65, what, ha="center", va="center", fontsize=6.5)
        ax.add_patch(
            FancyArrowPatch(
                (x - 0.7 if i == 0 else x - 0.4, 0.9),
                (x - 0.05, 0.9),
                arrowstyle="-|>",
                mutation_scale=8,
            )
        )
    end = 2.0 + 2.3 * (len(STAGES) - 1) + 1.9
    ax.add_patch(
        FancyArrowPatch(
            (end, 0.3),
            (0.65, 0.25),
            connectionstyle="arc3,rad=-0.12",
            arrowstyle="-|>",
            mutation_scale=8,
            color="0.4",
        )
    )
    ax.text(
        end / 2,
        -0.45,
        "next step: finished requests leave and free their blocks; new tokens stream out",
        ha="center",
        fontsize=7,
        color="0.3",
    )
    ax.set_xlim(-0.2, end + 0.2)
    ax.set_ylim(-0.7, 1.7)
    ax.axis("off")


def engine_steps(steps: Sequence[Sequence[tuple[str, int]]], token_budget: int) -> Figure:
    """Draw the engine's step loop and, per step, the tokens each request computed.

    Args:
        steps: per step, its plan: (request id, tokens computed) pairs, each count >= 1.
        token_budget: `max_num_batched_tokens`, the most tokens one step computes (>= 1).
    Returns:
        the Figure; each (request, tokens) of a step is a Rectangle with `gid` "chunk", as wide
        as its tokens; a step's unused budget is a Rectangle with `gid` "unused".
    Raises:
        ValueError: no steps, a count < 1, or a step over the budget.
    """
    token_budget = check_positive_int("token_budget", token_budget)
    if not steps:
        raise ValueError("steps: expected at least one step's plan, got none")
    for i, plan in enumerate(steps):
        total = sum(int(n) for _, n in plan)
        if any(int(n) < 1 for _, n in plan) or total > token_budget:
            raise ValueError(
                f"steps[{i}]: expected counts >= 1 summing to at most token_budget="
                f"{token_budget}, got {list(plan)}"
            )
    requests = list(dict.fromkeys(rid for plan in steps for rid, _ in plan))
    color = {rid: REQUEST_COLORS[i % len(REQUEST_COLORS)] for i, rid in enumerate(requests)}
    fig, (ax_loop, ax_steps) = plt.subplots(
        2,
        1,
        figsize=(10, 2.6 + 0.32 * len(steps)),
        gridspec_kw={"height_ratios": [2.4, 0.4 + 0.32 * len(steps)]},
    )
    _loop(ax_loop)
    ax_loop.set_title("One engine step (repeated until no request is left)", fontsize=10)
    for i, plan in enumerate(steps):
        y, x = len(steps) - 1 - i, 0
        for rid, n in plan:
            chunk = Rectangle(
                (x, y),
                int(n),
                0.75,
                facecolor=color[rid],
                edgecolor="white",
                alpha=0.85,
                gid="chunk",
            )
            ax_steps.add_patch(chunk)
            if int(n) >= 2:
                ax_steps.text(
                    x + int(n) / 2,
                    y + 0.37,
                    f"{rid}: {n}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
            x += int(n)
        if x < token_budget:
            ax_steps.add_patch(
                Rectangle(
                    (x, y),
                    token_budget - x,
                    0.75,
                    facecolor="white",
                    edgecolor="0.7",
                    hatch="///",
                    lw=0.5,
                    gid="unused",
                )
            )
    ax_steps.set_yticks(
        [len(steps) - 1 - i + 0.37 for i in range(len(steps))],
        [f"step {i}" for i in range(len(steps))],
        fontsize=7,
    )
    ax_steps.set_xlim(0, token_budget)
    ax_steps.set_ylim(-0.15, len(steps))
    ax_steps.set_xlabel(
        f"tokens computed, out of the budget of {token_budget} per step", fontsize=8
    )
    for side in ("top", "right"):
        ax_steps.spines[side].set_visible(False)
    handles = [Patch(facecolor=color[r], label=f"request {r}") for r in requests]
    handles.append(Patch(facecolor="white", edgecolor="0.7", hatch="///", label="unused"))
    ax_steps.legend(
        handles=handles,
        fontsize=7,
        ncol=len(handles),
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35 - 0.4 / len(steps)),
        frameon=False,
    )
    fig.tight_layout()
    return fig
