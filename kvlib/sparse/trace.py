"""What a page selector would capture, measured offline from one forward pass (chapter 15).

- `attention_inputs`: run a model once over a text and keep, per layer, the queries before and
  after RoPE and the keys after RoPE (the keys a cache holds);
- `heaviest_old_pages` and `page_overlap`: each query's heaviest old pages, and how many of them
  a later query shares (how much the heavy pages move);
- `page_selection` and `captured_mass`: for every query of a layer from `first_query` on, the
  pages a selector picks, and the share of the layer's attention mass (summed over heads) that
  falls in them, the selection made as a decode step would make it: the query's own page forced
  in as the newest, the first page as the sink, and only pages up to the query's own counted.

The selection is causal: the bounds of every page before the query's own hold only keys the
query sees, and the query's own (partial) page is bounded from its keys up to the query, as the
cache's newest page is at that decode step (a bound over the whole page would use keys from the
future; it matters only when that page is left to its score, `recent_pages=0`).

Chapter 15 uses this to show how concentrated attention is, how far the bound falls short of the
oracle per layer, and two pitfalls (page size; queries before RoPE), without decoding
token by token. Decoding through `kvlib.sparse.SparsePagedCache` is what the quality sweeps measure.

Layouts: queries (H, T, D), keys (H_kv, T, D), one sequence; page masses (T, P).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kvlib.cache.paged_bounds import PageBoundsCache
from kvlib.layers.llama import apply_rope
from kvlib.sparse.baselines import random_page_scores
from kvlib.sparse.bounds import page_upper_bounds, quest_page_scores
from kvlib.sparse.selection import select_pages

__all__ = [
    "LayerInputs",
    "attention_inputs",
    "captured_mass",
    "heaviest_old_pages",
    "page_mass",
    "page_overlap",
    "page_selection",
]


@dataclasses.dataclass
class LayerInputs:
    """One layer's attention inputs over a text: `queries_before_rope` and `queries` (H, T, D),
    `keys` (H_kv, T, D) after RoPE, as cached."""

    queries_before_rope: torch.Tensor
    queries: torch.Tensor
    keys: torch.Tensor


@torch.no_grad()
def attention_inputs(model, ids: torch.Tensor) -> list[LayerInputs]:
    """One forward of `model` (a `kvlib.model.LlamaModel`, not MLA) over `ids` (1, T), keeping
    each layer's queries (before and after RoPE) and keys (after RoPE).

    Raises:
        ValueError: ids that are not (1, T), or an MLA model.
    """
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids: expected a (1, T) tensor, got {tuple(ids.shape)}")
    if model.config.is_mla:
        raise ValueError("model: an MLA model caches latents, not K/V heads per page")
    c, captured = model.config, []

    def keep(attention, args):  # args: (x, cos, sin, mask, cache, backend, weights_out)
        x, cos, sin = args[:3]
        _, t, _ = x.shape
        q = attention.q_proj(x).view(1, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = attention.k_proj(x).view(1, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        captured.append(LayerInputs(q[0], apply_rope(q, cos, sin)[0], apply_rope(k, cos, sin)[0]))

    hooks = [layer.self_attn.register_forward_pre_hook(keep) for layer in model.model.layers]
    try:
        model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def _pool(keys: torch.Tensor, block_size: int) -> PageBoundsCache:
    """The keys (H_kv, T, D) written to a one-layer `PageBoundsCache` (values: the keys again),
    through its interface: its pools, block table and bounds are what a decode step reads."""
    num_kv_heads, length, head_dim = keys.shape
    cache = PageBoundsCache(
        1,
        num_kv_heads,
        head_dim,
        num_blocks=-(-length // block_size),
        block_size=block_size,
        dtype=keys.dtype,
    )
    cache.update(0, keys[None], keys[None])
    cache.advance(length)
    return cache


def _own_page_scores(source, keys, rows, block_size) -> torch.Tensor:
    """(T',) Quest's score of each query's own page, bounded from the page's keys up to the query
    (source (T', H, D) the bounding queries; keys (H_kv, T, D))."""
    num_kv_heads, length, head_dim = keys.shape
    start = (rows // block_size) * block_size  # (T',)
    slots = start[:, None] + torch.arange(block_size)  # (T', bs)
    seen = slots <= rows[:, None]  # keys up to the query
    page = keys[:, slots.clamp(max=length - 1)].permute(1, 2, 0, 3)  # (T', bs, H_kv, D)
    hidden = ~seen[:, :, None, None]
    low = page.masked_fill(hidden, float("inf")).amin(dim=1)  # (T', H_kv, D)
    high = page.masked_fill(hidden, float("-inf")).amax(dim=1)
    return page_upper_bounds(source, low[:, None], high[:, None])[:, :, 0].sum(dim=1)


def page_mass(
    queries: torch.Tensor,
    keys: torch.Tensor,
    block_size: int,
    first_query: int = 0,
    every: int = 1,
) -> torch.Tensor:
    """(T', P) float32: the attention mass each page gets from queries `first_query`,
    `first_query + every`, ... < T, causally (query t sees keys 0..t), summed over all heads (each
    row sums to H). The softmax of `kvlib.sparse.baselines.attention_mass_per_page`, over the
    keys in order rather than through a block table."""
    num_heads, length, head_dim = queries.shape
    rows = torch.arange(first_query, length, every)
    keys = keys.float().repeat_interleave(num_heads // keys.shape[0], dim=0)  # (H, T, D)
    scores = queries[:, rows].float() @ keys.transpose(1, 2) * head_dim**-0.5  # (H, T', T)
    scores = scores.masked_fill(torch.arange(length) > rows[:, None], float("-inf"))
    pages = -(-length // block_size)
    weights = F.pad(scores.softmax(dim=-1), (0, pages * block_size - length))  # (H, T', P · bs)
    return weights.view(num_heads, len(rows), pages, block_size).sum(dim=(0, 3))  # (T', P)


def page_selection(
    queries: torch.Tensor,
    keys: torch.Tensor,
    block_size: int,
    budget_pages: int,
    *,
    selector: str = "quest",
    first_query: int = 0,
    every: int = 1,
    bound_queries: torch.Tensor | None = None,
    recent_pages: int = 1,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages `selector` ("quest", "oracle" or "random") picks for each query t =
    `first_query`, `first_query + every`, ..., as a decode step would (see the module docstring):
    `(mass, selected)`, the page masses (T', P) float32 (`page_mass`) and the selection (T', P)
    bool (`kvlib.sparse.selection.select_pages`, the sink forced in, and the newest page when
    `recent_pages` is 1). Arguments as for `captured_mass`.

    Raises:
        ValueError: an unknown `selector`, or what `select_pages` rejects.
    """
    if selector not in ("quest", "oracle", "random"):
        raise ValueError(f"selector: expected 'quest', 'oracle' or 'random', got {selector!r}")
    mass = page_mass(queries, keys, block_size, first_query, every)  # (T', P)
    rows = torch.arange(first_query, queries.shape[1], every)
    num_pages = rows // block_size + 1  # pages up to the query's own
    if selector == "oracle":
        scores = mass
    elif selector == "random":
        scores = random_page_scores(len(rows), mass.shape[1], torch.Generator().manual_seed(seed))
    else:
        cache = _pool(keys, block_size)
        table = torch.tensor(cache.manager.block_tables[0]).expand(len(rows), -1)
        source = (queries if bound_queries is None else bound_queries)[:, rows].transpose(0, 1)
        scores = quest_page_scores(source, cache.key_min[0], cache.key_max[0], table)
        own = rows // block_size
        scores[torch.arange(len(rows)), own] = _own_page_scores(source, keys, rows, block_size)
    return mass, select_pages(scores, num_pages, budget_pages, recent_pages=recent_pages)


def captured_mass(
    queries: torch.Tensor,
    keys: torch.Tensor,
    block_size: int,
    budget_pages: int,
    *,
    selector: str = "quest",
    first_query: int = 0,
    every: int = 1,
    bound_queries: torch.Tensor | None = None,
    recent_pages: int = 1,
    seed: int = 0,
) -> torch.Tensor:
    """(T',) float32: for each query t = `first_query`, `first_query + every`, ..., the share of
    its attention mass (all heads) in the `budget_pages` pages `selector` ("quest", "oracle" or
    "random") picks, the sink and the query's own page forced in (see the module docstring).

    Args:
        queries: (H, T, D) after RoPE; keys: (H_kv, T, D) after RoPE.
        bound_queries: (H, T, D), the queries Quest's bound is computed from (default
            `queries`; chapter 15's pitfall passes them before RoPE).
        recent_pages: pages always read at the end (chapter 15's pitfall passes 0).

    Raises:
        ValueError: as `page_selection`.
    """
    mass, selected = page_selection(
        queries,
        keys,
        block_size,
        budget_pages,
        selector=selector,
        first_query=first_query,
        every=every,
        bound_queries=bound_queries,
        recent_pages=recent_pages,
        seed=seed,
    )
    return (mass * selected).sum(dim=1) / mass.sum(dim=1)


def heaviest_old_pages(
    mass: torch.Tensor, first_query: int, block_size: int, k: int, *, skip: int = 0
) -> list[set[int] | None]:
    """Each query's `k` heaviest old pages: for row i of `mass` (T', P) (`page_mass` with
    `every=1`: query t = `first_query` + i), the indices of the `k` pages of most mass among pages
    1 .. own - `skip` - 1 (not the sink, page 0; not the query's own page, own = t //
    `block_size`; nor the `skip` pages before it), as a set; None for a query with fewer than `k`
    such pages, so that no excluded page is ever counted as a pick.

    Raises:
        ValueError: `mass` not 2-D, `k` < 1 or `skip` < 0.
    """
    if mass.dim() != 2:
        raise ValueError(f"mass: expected a (T', P) tensor, got shape {tuple(mass.shape)}")
    if k < 1 or skip < 0:
        raise ValueError(f"k, skip: expected k >= 1 and skip >= 0, got k={k}, skip={skip}")
    picks: list[set[int] | None] = []
    for i, row in enumerate(mass):
        end = (first_query + i) // block_size - skip  # candidates: pages 1 .. end - 1
        if end - 1 < k:
            picks.append(None)
        else:
            picks.append({int(j) + 1 for j in row[1:end].topk(k).indices})
    return picks


def page_overlap(picks: list[set[int] | None], gap: int) -> float:
    """The mean share |S_t & S_(t+gap)| / |S_t| of query t's picks (`heaviest_old_pages`) that
    the query `gap` steps later also picks, over the pairs where both have picks.

    Raises:
        ValueError: `gap` < 1, or no pair where both have picks.
    """
    if gap < 1:
        raise ValueError(f"gap: expected >= 1, got {gap}")
    pairs = [(a, b) for a, b in zip(picks, picks[gap:]) if a is not None and b is not None]
    if not pairs:
        raise ValueError(f"picks: no pair {gap} apart where both queries have picks")
    return sum(len(a & b) / len(a) for a, b in pairs) / len(pairs)
