"""The page selectors Quest is measured against (chapter 15): the oracle, which scores each page by
the attention mass the query truly gives it, and random scores.

- `attention_mass_per_page`: softmax(q · K) over all of a sequence's keys, summed within each page
  and over the query heads of each KV head's group. Selecting the pages of largest mass captures
  the most attention any selection of that many pages can: the upper limit of a page selector
  (Quest's paper compares with an oracle of this kind; Tang et al., ICML 2024). It needs every key,
  so it reads the whole cache to decide what to read: a yardstick, not a method.
- `random_page_scores`: uniform scores, the floor any selector must clear.

Layouts as `kvlib.sparse.bounds`: q (B, H, D); the key pool (num_blocks, block_size, H_kv, D);
block tables (B, P); page scores (B, H_kv, P) or (B, P).
"""

from __future__ import annotations

import torch

__all__ = ["attention_mass_per_page", "random_page_scores"]


def attention_mass_per_page(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """The attention mass each page receives from one decode query, per KV head.

    Args:
        q: (B, H, D) one query per sequence and head (RoPE applied).
        key_cache: (num_blocks, block_size, H_kv, D), H a multiple of H_kv.
        block_tables: (B, P) integer; seq_lens: (B,) integer, each in [1, P · block_size].
        scale: the softmax scale; default D ** -0.5.
    Returns:
        (B, H_kv, P) float32: `Σ_{h in group} Σ_{t in page} softmax_t(scale · q_h · k_t)`; each
        row sums to G = H / H_kv over its pages, pages past a sequence's end hold 0.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group, pages = num_heads // num_kv_heads, block_tables.shape[1]
    scale = head_dim**-0.5 if scale is None else float(scale)
    keys = key_cache[block_tables.long()].float()  # (B, P, block_size, H_kv, D)
    keys = keys.flatten(1, 2).permute(0, 2, 3, 1)  # (B, H_kv, D, S), S = P · block_size
    grouped = q.float().view(batch, num_kv_heads, group, head_dim)  # (B, H_kv, G, D)
    scores = (grouped @ keys) * scale  # (B, H_kv, G, S)
    tokens = torch.arange(pages * block_size, device=q.device)
    scores = scores.masked_fill(tokens >= seq_lens.to(q.device)[:, None, None, None], -torch.inf)
    weights = scores.softmax(dim=-1)  # (B, H_kv, G, S)
    return weights.view(batch, num_kv_heads, group, pages, block_size).sum(dim=(2, 4))


def random_page_scores(
    num_sequences: int, num_pages: int, generator: torch.Generator, device=None
) -> torch.Tensor:
    """(num_sequences, num_pages) float32 uniform in [0, 1), drawn from `generator` (on its
    device) and moved to `device`: a selector that knows nothing."""
    scores = torch.rand(num_sequences, num_pages, generator=generator, device=generator.device)
    return scores.to(device)
