"""Quest's upper bound on the attention score a query can give any key of a page (Tang et al., ICML
2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", Algorithm 1).

A page keeps the element-wise minimum `m` and maximum `M` of its keys
(`kvlib.cache.paged_bounds`). Every key `k` of the page lies in the box `m <= k <= M`, so for a
query `q`

    q · k = Σ_i q_i k_i  <=  Σ_i max(q_i m_i, q_i M_i)  =  q⁺ · M + q⁻ · m,

with `q⁺ = max(q, 0)` and `q⁻ = min(q, 0)`: a positive coordinate is largest at the box's top, a
negative one at its bottom. The right-hand form is two matrix products, which is how it is
computed here. No key of the page can score above the bound; a page whose bound is low holds no
key the query attends to much (the bound can be loose: a high bound promises nothing).

GQA: the `G = H / H_kv` query heads of a group read one KV head's pages, so a page's bound for a
KV head is the **largest** bound over the group's query heads: it bounds every score any head of
the group can give the page. (Averaging the group's queries first, a shortcut some
implementations take, gives a number that is not a bound.)

One block table per sequence serves every KV head of a layer (chapter 11's kernel reads all KV
heads through it), so `quest_page_scores` ranks a sequence's pages by the **sum** of their bounds
over the KV heads: chapter 15 measures it against the largest, which captures less attention.

What it does not do: choose pages (`kvlib.sparse.selection`) or attend (`kvlib.sparse.cache`).
Layouts: q (B, H, D); the pools' bounds (num_blocks, H_kv, D); a sequence's pages through its block
table (B, P).
"""

from __future__ import annotations

import torch

__all__ = ["gather_page_bounds", "page_upper_bounds", "quest_page_scores"]


def gather_page_bounds(
    key_min: torch.Tensor, key_max: torch.Tensor, block_tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's page bounds in logical order, through its block table.

    Args:
        key_min, key_max: (num_blocks, H_kv, D), the pool's per-block bounds.
        block_tables: (B, P) integer: sequence b's logical page p lives in block
            `block_tables[b, p]`.
    Returns:
        (key_min, key_max), each (B, P, H_kv, D) (entries past a sequence's last page read
        whatever block the table names there: mask them).
    """
    blocks = block_tables.long()
    return key_min[blocks], key_max[blocks]  # (B, P, H_kv, D)


def page_upper_bounds(
    q: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, *, scale: float | None = None
) -> torch.Tensor:
    """Quest's bound on the score `scale · q_h · k` of every key `k` of each page, per KV head
    (the largest over the group's query heads; see the module docstring).

    Args:
        q: (B, H, D) one decode query per sequence and head (RoPE applied, as the keys were).
        key_min, key_max: (B, P, H_kv, D) each sequence's page bounds (`gather_page_bounds`), in
            any float dtype; H a multiple of H_kv.
        scale: the softmax scale; default D ** -0.5.
    Returns:
        (B, H_kv, P), float32 (float64 for float64 inputs): `max over h in group g of
        scale · (q_h⁺ · M + q_h⁻ · m)`.
    Raises:
        ValueError: shapes that disagree, or H not a multiple of H_kv.
    """
    if q.dim() != 3 or key_min.dim() != 4 or key_min.shape != key_max.shape:
        raise ValueError(
            "q, key_min, key_max: expected (B, H, D) and two equal (B, P, H_kv, D), got "
            f"{tuple(q.shape)}, {tuple(key_min.shape)}, {tuple(key_max.shape)}"
        )
    batch, num_heads, head_dim = q.shape
    num_kv_heads = key_min.shape[2]
    if key_min.shape[0] != batch or key_min.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"key_min: expected (B, P, H_kv, D) = ({batch}, P, a divisor of {num_heads}, "
            f"{head_dim}) to match q {tuple(q.shape)}, got {tuple(key_min.shape)}"
        )
    scale = head_dim**-0.5 if scale is None else float(scale)
    group = num_heads // num_kv_heads
    dtype = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 if given
    grouped = q.to(dtype).view(batch, num_kv_heads, group, head_dim)  # (B, H_kv, G, D)
    top = key_max.to(dtype).permute(0, 2, 3, 1)  # (B, H_kv, D, P)
    bottom = key_min.to(dtype).permute(0, 2, 3, 1)
    bound = grouped.clamp(min=0) @ top + grouped.clamp(max=0) @ bottom  # (B, H_kv, G, P)
    return bound.amax(dim=2) * scale  # (B, H_kv, P)


def quest_page_scores(
    q: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, block_tables: torch.Tensor
) -> torch.Tensor:
    """A page score per sequence for one block table serving every KV head: the page bounds
    (`page_upper_bounds` over the pool's bounds gathered through `block_tables`) summed over the
    KV heads.

    Args:
        q: (B, H, D); key_min, key_max: (num_blocks, H_kv, D) pools; block_tables: (B, P).
    Returns:
        (B, P) float32 (entries past a sequence's pages are meaningless: `select_pages` ignores
        them).
    """
    bounds = page_upper_bounds(q, *gather_page_bounds(key_min, key_max, block_tables))
    return bounds.sum(dim=1)  # (B, P)
