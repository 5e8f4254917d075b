"""Quest's page bounds, drawn (chapter 15; Tang et al., ICML 2024, "Quest").

`page_bounds_figure` draws keys of two dimensions, so that a page's element-wise key minimum and
maximum are a rectangle: on the left the keys of each page and its box, with the query as an
arrow; on the right, per page, the best true score of its keys against the query and Quest's
upper bound `q⁺ · M + q⁻ · m` (`kvlib.sparse.bounds.page_upper_bounds`, softmax scale 1), the
`budget` pages of highest bound marked as the ones read. A diagram, not a measurement.
"""

from __future__ import annotations

import torch

from kvlib._validate import check_positive_int
from kvlib.sparse.bounds import page_upper_bounds

__all__ = ["page_bounds_figure"]


def page_bounds_figure(keys, query, *, block_size: int = 4, budget: int = 2):
    """The figure of Quest's per-page boxes and bounds for one query.

    Args:
        keys: (T, 2) float, T a multiple of `block_size`: the keys in cache order.
        query: (2,) float.
        block_size: keys per page; budget: pages read (highest bounds), 1 <= budget <= pages.
    Returns:
        a matplotlib `Figure` with two axes (the boxes; the scores and bounds per page).
    Raises:
        ValueError: keys not (T, 2) with T a positive multiple of block_size, a query not (2,),
        a budget outside [1, pages]; TypeError, ValueError: sizes that are not positive ints.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    keys = torch.as_tensor(keys, dtype=torch.float64)
    query = torch.as_tensor(query, dtype=torch.float64)
    block_size = check_positive_int("block_size", block_size)
    budget = check_positive_int("budget", budget)
    if keys.dim() != 2 or keys.shape[1] != 2 or not len(keys) or len(keys) % block_size:
        raise ValueError(
            f"keys: expected (T, 2) with T a positive multiple of block_size = {block_size}, "
            f"got {tuple(keys.shape)}"
        )
    if query.shape != (2,):
        raise ValueError(f"query: expected a (2,) tensor, got {tuple(query.shape)}")
    pages = len(keys) // block_size
    if budget > pages:
        raise ValueError(f"budget: expected at most the {pages} pages, got {budget}")
    by_page = keys.view(pages, block_size, 2)
    low, high = by_page.amin(dim=1), by_page.amax(dim=1)  # (P, 2)
    bound = page_upper_bounds(query[None, None], low[None, :, None], high[None, :, None], scale=1)
    bound = bound[0, 0]  # (P,)
    best = (by_page @ query).amax(dim=1)  # (P,): the best true score in each page
    chosen = set(bound.topk(budget).indices.tolist())

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    colours = plt.get_cmap("tab10")
    for p in range(pages):
        colour = colours(p % 10)
        left.scatter(*by_page[p].T.numpy(), color=colour, s=18, label=f"page {p}")
        width, height = (high[p] - low[p]).tolist()
        left.add_patch(
            Rectangle(
                low[p].tolist(),
                width,
                height,
                fill=False,
                edgecolor=colour,
                lw=2.5 if p in chosen else 1,
                ls="-" if p in chosen else "--",
            )
        )
    left.annotate(
        "", xy=tuple(query.tolist()), xytext=(0, 0), arrowprops=dict(arrowstyle="->", lw=2)
    )
    left.text(*query.tolist(), "  q", fontsize=11)
    left.axhline(0, color="0.8", lw=0.5)
    left.axvline(0, color="0.8", lw=0.5)
    left.set_xlabel("key dimension 1")
    left.set_ylabel("key dimension 2")
    left.set_title("each page's keys and its min/max box (solid: read)")
    left.legend(fontsize=7, loc="best")
    left.set_aspect("equal", adjustable="datalim")

    x = range(pages)
    for p in x:
        right.bar(
            p,
            float(bound[p]),
            color=colours(p % 10),
            alpha=1.0 if p in chosen else 0.35,
            label="bound q⁺·max + q⁻·min" if p == 0 else None,
        )
    right.scatter(x, best.numpy(), color="k", marker="_", s=300, zorder=3, label="best q·k")
    right.set_xticks(list(x), [f"{p}" + (" (read)" if p in chosen else "") for p in x])
    right.set_xlabel("page")
    right.set_ylabel("score (no softmax scale)")
    right.set_title(f"the {budget} pages of highest bound are read")
    right.legend(fontsize=8)
    return fig
