"""The Llama family's layers: RMSNorm (Zhang & Sennrich, 2019), rotary position embeddings in the
Hugging Face `rotate_half` convention (Su et al., 2021; with Llama 3.1's "llama3" frequency
scaling), attention over a cache through the attention seam, and the SwiGLU MLP (Shazeer, 2020).

`kvlib.model.DecoderLayer` puts them together (or MLA's attention, `kvlib.layers.mla`). Parameter
names are Hugging Face's (`self_attn.q_proj`, `mlp.gate_proj`, ...). What it does not do: build a
model (`kvlib.model`) or load weights (`kvlib.loaders`).
Layouts: activations (B, T, d_model); q (B, H, T, D); k, v (B, H_kv, S, D).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvlib.ops.attention import reference_attention


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight, computed in float32 (Zhang & Sennrich, 2019)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        ) * self.weight


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: dict | None = None, device=None
) -> torch.Tensor:
    """RoPE's angular frequencies theta^(-2i/D), i < D/2: (D/2,) float32, radians per position.

    With Llama 3.1's scaling (`scaling["rope_type"] == "llama3"`; Meta's reference
    `apply_scaling`, Grattafiori et al., 2024), frequencies whose wavelength `2π/f` is shorter than
    `original_max_position_embeddings / high_freq_factor` are kept, those longer than
    `original_max_position_embeddings / low_freq_factor` are divided by `factor`, and those in
    between are interpolated linearly in `original_max_position_embeddings / wavelength`.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = theta**-exponents  # (D/2,)
    if scaling is None:
        return inv_freq
    factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelength = 2 * math.pi / inv_freq  # (D/2,) positions per turn
    smooth = ((old_context / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: long, 1: short
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for rotary embeddings at integer `positions` (B, T): each (B, T, D).

    Frequencies from `rope_inverse_frequencies` (theta^(-2i/D), optionally Llama 3.1-scaled), each
    used twice ([f, f] concatenated): the Hugging Face convention that pairs dimension i with
    i + D/2 (see `rotate_half`).
    """
    inv_freq = rope_inverse_frequencies(head_dim, theta, scaling, positions.device)  # (D/2,)
    angles = positions.float()[..., None] * inv_freq  # (B, T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (B, T, D)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, D) by the angles of cos, sin (B, T, D): x·cos + rotate_half(x)·sin,
    computed in float32 for 16-bit and float32 inputs and in float64 for float64 ones (never
    rounding a float64 x to float32), returned in x's dtype."""
    if x.dtype == torch.float64:
        return x * cos[:, None] + rotate_half(x) * sin[:, None]
    return (x.float() * cos[:, None] + rotate_half(x.float()) * sin[:, None]).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)

    def forward(self, x, cos, sin, mask, cache=None, backend=reference_attention, weights_out=None):
        b, t, _ = x.shape
        c = self.config
        q = (
            self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        )  # (B, H, T, D)
        # (B, H_kv, T, D)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        # (B, H_kv, T, D)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        if not getattr(cache, "rotates_keys", False):  # a cache that rotates on read gets raw keys
            k = apply_rope(k, cos, sin)  # keys are cached already rotated
        # the seam: the cache stores K/V and says what attention reads; a backend attends over it
        kv = (k, v) if cache is None else cache.update(self.layer_idx, k, v)
        attend = getattr(cache, "attention_backend", None) or backend
        out = attend(q, kv, mask, weights_out=weights_out)  # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, c.num_attention_heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU
