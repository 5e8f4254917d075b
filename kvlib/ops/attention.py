"""Attention backends: what a layer calls to attend over the keys and values a cache stored.

A backend is a function `backend(q, kv, mask, *, weights_out=None) -> out` with

- `q`: (B, H, T, D) queries, RoPE applied;
- `kv`: what the cache's `update` returned; for the dense backends here, a pair of keys and values
  `(B, H_kv, S, D)` with `H` a multiple of `H_kv` (GQA: query head `h` reads KV head `h // G`,
  `G = H / H_kv`, consecutive heads forming a group as in Hugging Face's `repeat_kv`);
- `mask`: bool (B or 1, T, S), True where query `i` may attend to key `j`;
- `weights_out`: a list to append the (B, H, T, S) attention weights to (reference only);
- `out`: (B, H, T, D) in q's dtype.

The model picks one by name (`ATTENTION_BACKENDS`); a cache whose `update` returns something else
(a block table, quantized codes) brings its own as `cache.attention_backend`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["ATTENTION_BACKENDS", "reference_attention", "sdpa_attention", "get_backend"]


def reference_attention(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
    *,
    weights_out: list | None = None,
) -> torch.Tensor:
    """softmax(q kᵀ / √D, masked) v, written out: K/V repeated to H heads, scores in fp32.

    Returns (B, H, T, D) in q's dtype. The readable baseline every other backend is checked
    against (Vaswani et al., 2017; GQA's head sharing: Ainslie et al., 2023).
    """
    k, v = kv
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, S, D)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    scores = scores.float().masked_fill(~mask[:, None], float("-inf"))
    weights = scores.softmax(dim=-1).to(q.dtype)  # (B, H, T, S)
    if weights_out is not None:
        weights_out.append(weights.detach())
    return weights @ v  # (B, H, T, D)


def sdpa_attention(q, kv, mask, *, weights_out=None) -> torch.Tensor:
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
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)


ATTENTION_BACKENDS = {"reference": reference_attention, "sdpa": sdpa_attention}


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
