"""Attention backends: what a layer calls to attend over the keys and values a cache stored.

A backend is a function `backend(q, kv, mask, *, weights_out=None) -> out` with

- `q`: (B, H, T, D) queries, RoPE applied;
- `kv`: what the cache's `update` returned; for the dense backends here, a pair of keys and values
  `(B, H_kv, S, D)` with `H` a multiple of `H_kv` (GQA: query head `h` reads KV head `h // G`,
  `G = H / H_kv`, consecutive heads forming a group as in Hugging Face's `repeat_kv`);
- `mask`: bool (B or 1, T, S), True where query `i` may attend to key `j` (the reference backend
  also takes (B, H, T, S), one mask per head: a cache that keeps different tokens per head);
- `weights_out`: a list to append the (B, H, T, S) attention weights to (not SDPA);
- `scale`: the softmax temperature; None: 1/sqrt(D) with D = q's last dimension. MLA's absorbed
  path passes its own (`kvlib.layers.mla`), because its queries are wider than the heads it scores;
- `out`: (B, H, T, D_v) in q's dtype (D_v: the values' last dimension, usually D).

`reference_attention` also takes `sinks`: (H,) learned sink logits (gpt-oss, OpenAI 2025: one
logit per head in the softmax denominator, no value; see `kvlib.ref.attention`), None by default;
the other backends do not.

The model picks one by name (`ATTENTION_BACKENDS`); a cache whose `update` returns something else
(a block table, quantized codes) brings its own as `cache.attention_backend`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "ATTENTION_BACKENDS",
    "get_backend",
    "grouped_attention",
    "reference_attention",
    "sdpa_attention",
]


def visible(
    key_positions: torch.Tensor, query_positions: torch.Tensor, sliding_window: int | None = None
) -> torch.Tensor:
    """The visibility rule, written once: a query at position p sees the key at position j when
    j <= p (causal) and, with a sliding window W, j > p - W (among the last W). Positions are
    int tensors that broadcast against each other; returns their broadcast shape, bool. The
    model's mask (`kvlib.model.attention_mask_3d`) and the caches that mask by the positions they
    hold (`EvictingCache`, `CompactingPagedCache`) all call it."""
    sees = key_positions <= query_positions
    if sliding_window is not None:
        sees &= key_positions > query_positions - sliding_window
    return sees


def reference_attention(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
    *,
    weights_out: list | None = None,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q kᵀ · scale, masked) v, written out: K/V repeated to H heads.

    With `sinks` ((H,) float, learned sink logits in the units of the scaled scores), each head's
    scores get one more column, its sink, before the softmax, and lose it after: the sink takes
    its share of the denominator and adds no value (gpt-oss's reference `sdpa`, OpenAI 2025;
    attention sinks: Xiao et al., ICLR 2024). `weights_out` then gets rows that sum to below 1.

    Returns (B, H, T, D_v) in q's dtype; scores and softmax in fp32 (fp64 for fp64 inputs). The
    readable baseline every other backend is checked against (Vaswani et al., 2017; GQA's head
    sharing: Ainslie et al., 2023).

    Raises:
        ValueError, TypeError: `sinks` not a floating (H,) tensor on q's device.
    """
    k, v = kv
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, S, D)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, H, T, S)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))  # fp32, or fp64 if given
    mask = mask[:, None] if mask.dim() == 3 else mask  # (B or 1, 1 or H, T, S)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        weights = scores.softmax(dim=-1).to(q.dtype)  # (B, H, T, S)
    else:
        _check_sinks(sinks, q)
        sink_column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        extended = torch.cat([scores, sink_column], dim=-1)  # (B, H, T, S + 1)
        weights = extended.softmax(dim=-1)[..., :-1].to(q.dtype)  # (B, H, T, S): sink dropped
    if weights_out is not None:
        weights_out.append(weights.detach())
    return weights @ v  # (B, H, T, D)


def _check_sinks(sinks: object, q: torch.Tensor) -> None:
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        raise TypeError(
            f"sinks: expected a floating (H,) tensor of sink logits, got {type(sinks).__name__} "
            f"{getattr(sinks, 'dtype', '')}"
        )
    if sinks.shape != (q.shape[1],) or sinks.device != q.device:
        raise ValueError(
            f"sinks: expected shape ({q.shape[1]},) (one per query head) on {q.device}, got "
            f"{tuple(sinks.shape)} on {sinks.device}"
        )


def grouped_attention(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
    *,
    weights_out: list | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """GQA without repeating K/V: the G query heads that share KV head j are folded into the query
    length, so one (G·T, D) × (D, S) product per KV head reads each cached key and value once.

    Query head h = j·G + g becomes row g·T + t of KV head j's queries: a reshape of q (B, H, T, D)
    to (B, H_kv, G·T, D), valid because a group's heads are consecutive (Hugging Face's
    `repeat_kv` layout). The scores (B, H_kv, G·T, S) are the same numbers the reference computes
    against repeated keys; nothing of size (B, H, S, D) is ever allocated. Decode kernels fold the
    group the same way (chapter 11). Arguments, result and score precision as
    `reference_attention`'s (Ainslie et al., 2023, "GQA").
    """
    k, v = kv
    b, h, t, d = q.shape
    h_kv, s = k.shape[1], k.shape[2]
    group = h // h_kv
    scale = d**-0.5 if scale is None else scale
    q_grouped = q.reshape(b, h_kv, group * t, d)  # rows: (g, t) for the group's heads g
    scores = (q_grouped @ k.transpose(-1, -2)) * scale  # (B, H_kv, G·T, S)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).view(b, h_kv, group, t, s)
    scores = scores.masked_fill(~mask[:, None, None], -math.inf)
    weights = scores.softmax(dim=-1).to(q.dtype)  # (B, H_kv, G, T, S)
    if weights_out is not None:
        weights_out.append(weights.detach().view(b, h, t, s))
    out = weights.view(b, h_kv, group * t, s) @ v  # (B, H_kv, G·T, D_v)
    return out.view(b, h, t, v.shape[-1])


def sdpa_attention(q, kv, mask, *, weights_out=None, scale=None) -> torch.Tensor:
    """PyTorch's fused `scaled_dot_product_attention` with `enable_gqa` (no repeated K/V).
    Arguments and result as `reference_attention`'s.

    Raises:
        ValueError: `weights_out` was given (a fused kernel never forms the weights).
    """
    if weights_out is not None:
        raise ValueError(
            "weights_out: the 'sdpa' backend never forms attention weights; use 'reference'"
        )
    k, v = kv
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None], enable_gqa=True, scale=scale
    )


ATTENTION_BACKENDS = {
    "reference": reference_attention,
    "grouped": grouped_attention,
    "sdpa": sdpa_attention,
}


def get_backend(name: str):
    """The backend called `name`.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    try:
        return ATTENTION_BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"attention_backend: expected one of {sorted(ATTENTION_BACKENDS)}, got {name!r}"
        ) from None
