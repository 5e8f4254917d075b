"""Multi-head latent attention (MLA), DeepSeek-V2's attention (DeepSeek-AI, 2024, "DeepSeek-V2: A
Strong, Economical, and Efficient Mixture-of-Experts Language Model", sec. 2.1, equations 9-19),
with its two computations (chapter 6).

Per token `h` (d_model) and head `i` of `H`, with d_c = `kv_lora_rank`, d_h = `qk_nope_head_dim`,
d_R = `qk_rope_head_dim`, d_v = `v_head_dim`:

- latent: `c_KV = RMSNorm(W_DKV h)` (d_c); RMS-normalised before it is cached, as DeepSeek-V3's
  reference `inference/model.py` does (`kv_norm`);
- decoupled RoPE: one rotary key `k_R = RoPE(W_KR h)` (d_R) shared by all heads, and per-head
  rotary queries `q_R,i`; the content parts `q_C,i` (d_h) carry no rotation;
- keys and values up-projected from the latent: `k_C,i = W_UK,i c_KV`, `v_i = W_UV,i c_KV`;
- `score_i(t, j) = (q_C,i · k_C,i(j) + q_R,i · k_R(j)) / sqrt(d_h + d_R)`.

**Naive** (`absorb=False`): expand every head's K (d_h + d_R) and V (d_v) and cache them: a
dense cache of `H · (d_h + d_R + d_v)` values per token per layer. **Absorbed** (`absorb=True`,
DeepSeek-V3's `attn_impl = "absorb"`): since `q_C,i · (W_UK,i c) = (W_UK,iᵀ q_C,i) · c`, fold
`W_UK,i` into the query once per step, attend over the cached latents directly, and apply `W_UV,i`
after the weighted sum. Only `[c_KV, k_R]` is cached (`kvlib.cache.LatentCache`), d_c + d_R values
per token per layer, and the attention is MQA over those rows with keys of width d_c + d_R and
values of width d_c. The scale stays 1/sqrt(d_h + d_R): the absorbed queries are wider, but the
scores are the same numbers.

The decoupling is what makes absorption exact: a rotation applied to the latent would sit between
`W_UK,i` and the query and depend on the key's position, so `W_UK,i` could not be folded into a
query computed once per step.

Parameter names follow Hugging Face's DeepseekV2 (`q_proj`, `kv_a_proj_with_mqa`,
`kv_a_layernorm`, `kv_b_proj`, `o_proj`); query compression (`q_lora_rank`) is not implemented.
"""

from __future__ import annotations

import torch
from torch import nn

from kvlib.model import RMSNorm, apply_rope
from kvlib.ops.attention import reference_attention

__all__ = ["MLAttention"]


class MLAttention(nn.Module):
    """One MLA layer: `forward(x, cos, sin, mask, cache, backend, weights_out) -> (B, T, d_model)`,
    the signature of `kvlib.model.Attention`, so `LlamaModel` uses it for configs with a
    `kv_lora_rank`.

    `absorb` picks the computation (see the module docstring); both give the same outputs. With a
    cache, the naive form needs a dense cache (`DynamicCache`: expanded K and V), the absorbed form
    a `LatentCache`. `cos`, `sin`: RoPE tables for d_R dimensions.
    """

    def __init__(self, config, layer_idx: int, *, absorb: bool = True):
        super().__init__()
        self.config, self.layer_idx, self.absorb = config, layer_idx, absorb
        h, n = config.hidden_size, config.num_attention_heads
        self.d_c, self.d_nope = config.kv_lora_rank, config.qk_nope_head_dim
        self.d_rope, self.d_v = config.qk_rope_head_dim, config.v_head_dim
        self.q_proj = nn.Linear(h, n * (self.d_nope + self.d_rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.d_c + self.d_rope, bias=False)  # W_DKV; W_KR
        self.kv_a_layernorm = RMSNorm(self.d_c, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.d_c, n * (self.d_nope + self.d_v), bias=False)  # W_UK; W_UV
        self.o_proj = nn.Linear(n * self.d_v, h, bias=False)
        self.scale = (self.d_nope + self.d_rope) ** -0.5  # the scores' width, absorbed or not

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK (H, d_h, d_c) and W_UV (H, d_v, d_c), views of `kv_b_proj.weight`."""
        n = self.config.num_attention_heads
        w = self.kv_b_proj.weight.view(n, self.d_nope + self.d_v, self.d_c)
        return w[:, : self.d_nope], w[:, self.d_nope :]

    def forward(self, x, cos, sin, mask, cache=None, backend=reference_attention, weights_out=None):
        b, t, _ = x.shape
        n = self.config.num_attention_heads
        q = self.q_proj(x).view(b, t, n, self.d_nope + self.d_rope).transpose(1, 2)  # (B, H, T, .)
        q_nope, q_rope = q.split([self.d_nope, self.d_rope], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin)  # (B, H, T, d_R)
        latent, rope_key = self.kv_a_proj_with_mqa(x).split([self.d_c, self.d_rope], dim=-1)
        latent = self.kv_a_layernorm(latent)[:, None]  # (B, 1, T, d_c): what is cached
        rope_key = apply_rope(rope_key[:, None], cos, sin)  # (B, 1, T, d_R), cached rotated
        w_uk, w_uv = self.up_projections()
        if self.absorb:
            q_latent = torch.einsum("bhtn,hnc->bhtc", q_nope, w_uk)  # W_UK folded into q
            queries = torch.cat([q_latent, q_rope], dim=-1)  # (B, H, T, d_c + d_R)
            if cache is None:
                rows = torch.cat([latent, rope_key], dim=-1)  # (B, 1, T, d_c + d_R)
                kv = (rows, latent)
            else:
                kv = cache.update(self.layer_idx, latent, rope_key)
            # MQA over the latent rows: keys [c_KV, k_R], values c_KV
            out_latent = backend(queries, kv, mask, weights_out=weights_out, scale=self.scale)
            out = torch.einsum("bhtc,hvc->bhtv", out_latent, w_uv)  # W_UV after the sum
        else:
            kv_heads = torch.einsum("bxtc,hdc->bhtd", latent, self.kv_b_proj.weight.view(
                n, self.d_nope + self.d_v, self.d_c))  # fmt: skip
            k_nope, v = kv_heads.split([self.d_nope, self.d_v], dim=-1)  # (B, H, T, .)
            k = torch.cat([k_nope, rope_key.expand(b, n, t, self.d_rope)], dim=-1)
            queries = torch.cat([q_nope, q_rope], dim=-1)  # (B, H, T, d_h + d_R)
            kv = (k, v) if cache is None else cache.update(self.layer_idx, k, v)
            out = backend(queries, kv, mask, weights_out=weights_out, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, n * self.d_v))
