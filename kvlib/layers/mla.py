"""Multi-head latent attention (MLA), DeepSeek-V2's attention (DeepSeek-AI, 2024, "DeepSeek-V2: A
Strong, Economical, and Efficient Mixture-of-Experts Language Model", sec. 2.1, equations 9-19),
with its two computations (chapter 6).

Per token `h` (d_model) and head `i` of `H`, with d_c = `kv_lora_rank`, d_h = `qk_nope_head_dim`,
d_R = `qk_rope_head_dim`, d_v = `v_head_dim`:

- latent: `c_KV = RMSNorm(W_DKV h)` (d_c); RMS-normalised before it is cached, as DeepSeek-V2
  states in sec. 3.1.2 (not in its equations) and DeepSeek-V3's reference `inference/model.py`
  does (`kv_norm`);
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
`kv_a_layernorm`, `kv_b_proj`, `o_proj`). The query comes from one plain `q_proj`, as in
DeepSeek-V2-Lite; V2's and V3's low-rank query compression (equations 12-14, `q_lora_rank`) is not
implemented: it saves activation memory in training and leaves the cache alone. Nor is DeepSeek-V3's
YaRN context extension, whose reference code multiplies the softmax scale by mscale².
"""

from __future__ import annotations

import torch
from torch import nn

from kvlib._validate import check_positive_int
from kvlib.layers.llama import RMSNorm, apply_rope
from kvlib.ops.attention import reference_attention


class MLAttention(nn.Module):
    """One MLA layer: `forward(x, cos, sin, mask, cache, backend, weights_out) -> (B, T, d_model)`,
    the signature of `kvlib.layers.llama.Attention`, so `LlamaModel` uses it for configs with a
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


# --- what each computation costs -------------------------------------------------------------

MODES = ("absorbed", "expanded", "expanded_cache")


def attention_cost(config, query_tokens: int, context_tokens: int, mode: str, *, dtype_bytes=2):
    """FLOPs and cache bytes read by one MLA layer's attention for `query_tokens` new tokens
    (T) attending to `context_tokens` (S ≥ T, the new ones included), by `mode`:

    - "absorbed": a latent cache, `W_UK` folded into the queries and `W_UV` applied after the
      sum (FlashMLA's "MQA mode", used for decode): 2·T·H·[d_h·d_c + S·(2·d_c + d_R) + d_c·d_v];
    - "expanded": a latent cache, every context token's K and V up-projected before attending
      (FlashMLA's "MHA mode", used for prefill): 2·H·[S·d_c·(d_h + d_v) + T·S·(d_h + d_R + d_v)];
    - "expanded_cache": the naive cache of expanded K and V: only the new tokens are
      up-projected, 2·H·[T·d_c·(d_h + d_v) + T·S·(d_h + d_R + d_v)], but it reads H times more.

    Counts multiply-adds as 2 FLOPs and leave out the projections every mode shares (q_proj,
    kv_a_proj_with_mqa, o_proj). Returns {"flops", "bytes_read"}, `bytes_read` being the cache
    (`dtype_bytes` per element: 2 for bf16).

    Raises:
        ValueError: an unknown mode, a config without MLA, or 0 < T ≤ S not holding.
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if not config.is_mla:
        raise ValueError("config: expected an MLA config (kv_lora_rank set), got kv_lora_rank None")
    check_positive_int("query_tokens", query_tokens)
    check_positive_int("context_tokens", context_tokens)
    if query_tokens > context_tokens:
        raise ValueError(
            f"context_tokens: expected at least query_tokens={query_tokens} (the new tokens are "
            f"part of the context), got {context_tokens}"
        )
    t, s, h = query_tokens, context_tokens, config.num_attention_heads
    d_c, d_h, d_r, d_v = (
        config.kv_lora_rank,
        config.qk_nope_head_dim,
        config.qk_rope_head_dim,
        config.v_head_dim,
    )
    if mode == "absorbed":
        flops = 2 * t * h * (d_h * d_c + s * (2 * d_c + d_r) + d_c * d_v)
        cached = s * (d_c + d_r)
    else:
        expanded_tokens = s if mode == "expanded" else t
        flops = 2 * h * (expanded_tokens * d_c * (d_h + d_v) + t * s * (d_h + d_r + d_v))
        cached = s * (d_c + d_r) if mode == "expanded" else s * h * (d_h + d_r + d_v)
    return {"flops": flops, "bytes_read": cached * dtype_bytes}


def absorption_crossover(config, context_tokens: int) -> int:
    """The smallest number of new tokens T (1 ≤ T ≤ S = `context_tokens`) for which expanding K
    and V ("expanded") costs no more FLOPs than the absorbed form, or `context_tokens + 1` if
    the absorbed form is cheaper for every T: where prefill switches from MQA mode to MHA mode."""
    for t in range(1, context_tokens + 1):
        expanded = attention_cost(config, t, context_tokens, "expanded")["flops"]
        if expanded <= attention_cost(config, t, context_tokens, "absorbed")["flops"]:
            return t
    return context_tokens + 1


# --- which dimensions rotate (decoupled RoPE; kvlib.conversions.mla uses it) ------------------


def decoupled_rope_dims(head_dim: int, rope_dim: int) -> tuple[list[int], list[int]]:
    """Which of a head's `head_dim` dimensions keep their rotation when a model with RoPE on whole
    heads becomes an MLA model with `rope_dim` decoupled rotary dimensions: `(nope, rope)` index
    lists, `rope` in the order MLA's d_R-dimensional RoPE rotates them.

    RoPE pairs dimension i with i + D/2 at frequency theta^(-2i/D)
    (`kvlib.layers.llama.rope_cos_sin`). A d_R-dimensional table has frequencies theta^(-2j/d_R) =
    theta^(-2(jD/d_R)/D): every (D/d_R)-th pair of the original. Keeping those pairs (evenly spaced
    frequencies, one of the selection rules of MHA2MLA's partial RoPE: Ji et al., 2025, "Towards
    Economical Inference: Enabling DeepSeek's Multi-Head Latent Attention in Any Transformer-based
    LLMs", ACL) rotates them exactly as before; the other pairs lose their rotation and become the
    content ("nope") dimensions.

    Raises:
        ValueError: rope_dim is not an even divisor of head_dim with an integer stride.
    """
    check_positive_int("head_dim", head_dim)
    check_positive_int("rope_dim", rope_dim)
    if rope_dim % 2 or head_dim % rope_dim:
        raise ValueError(
            f"rope_dim: expected an even divisor of head_dim {head_dim}, got {rope_dim}"
        )
    half, stride = head_dim // 2, head_dim // rope_dim
    kept_pairs = list(range(0, half, stride))
    rope = kept_pairs + [i + half for i in kept_pairs]
    nope = [i for i in range(head_dim) if i not in set(rope)]
    return nope, rope


# --- switching the computation --------------------------------------------------------------


def set_absorb(model, absorb: bool) -> None:
    """Switch every MLA layer of `model` (a `LlamaModel`) to the absorbed (True) or the naive
    (False) computation; other layers are left alone. Both give the same outputs."""
    for layer in model.model.layers:
        if isinstance(layer.self_attn, MLAttention):
            layer.self_attn.absorb = absorb
