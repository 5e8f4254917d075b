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

import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kvlib._validate import check_positive_int
from kvlib.model import RMSNorm, apply_rope
from kvlib.ops.attention import get_backend, reference_attention

__all__ = [
    "MLAttention",
    "absorption_crossover",
    "attention_cost",
    "convert_to_mla",
    "decoupled_rope_dims",
    "load_course_mla_model",
    "set_absorb",
]


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


# --- converting a trained multi-head model -------------------------------------------------


def decoupled_rope_dims(head_dim: int, rope_dim: int) -> tuple[list[int], list[int]]:
    """Which of a head's `head_dim` dimensions keep their rotation when a model with RoPE on whole
    heads becomes an MLA model with `rope_dim` decoupled rotary dimensions: `(nope, rope)` index
    lists, `rope` in the order MLA's d_R-dimensional RoPE rotates them.

    RoPE pairs dimension i with i + D/2 at frequency theta^(-2i/D) (`kvlib.model.rope_cos_sin`).
    A d_R-dimensional table has frequencies theta^(-2j/d_R) = theta^(-2(jD/d_R)/D): every
    (D/d_R)-th pair of the original. Keeping those pairs (evenly spaced frequencies, one of the
    selection rules of MHA2MLA's partial RoPE: Ji et al., 2025, "Towards Economical Inference:
    Enabling DeepSeek's Multi-Head Latent Attention in Any Transformer-based LLMs", ACL) rotates
    them exactly as before; the other pairs lose their rotation and become the content ("nope")
    dimensions.

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


CALIBRATION_SEED = 7  # documents unseen in training (seeds 0, 1), uptraining (1000+) and eval (99)


def _attention_inputs(model, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's attention input (after its input RMSNorm) for `tokens`: [(N, d_model)]."""
    captured = []

    def grab(module, args):
        captured.append(args[0].detach().reshape(-1, args[0].shape[-1]).double())

    hooks = [layer.self_attn.register_forward_pre_hook(grab) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def convert_to_mla(
    model,
    kv_lora_rank: int,
    rope_dim: int,
    *,
    calibration_documents: int = 16,
    seed: int = CALIBRATION_SEED,
):
    """An MLA copy of a trained multi-head model (`LlamaModel`, RoPE on whole heads, H_kv = H,
    no biases), with a latent of `kv_lora_rank` (d_c) and `rope_dim` (d_R) decoupled rotary
    dimensions: (d_c + d_R) cached values per token per layer. `model` is not modified.

    Per layer:

    1. **Decoupled RoPE** (`decoupled_rope_dims`): each head keeps d_R of its D dimensions
       rotating (query and key), at the same frequencies; the other D − d_R become the content
       dimensions d_h. Queries are only permuted, so the scale 1/sqrt(d_h + d_R) is unchanged.
    2. **One shared rotary key**: MLA has one k_R for all heads, so the heads' rotary key
       projections are mean-pooled (GQA's conversion, `kvlib.gqa.pool_kv_heads`).
    3. **Joint low-rank K/V**: the heads' content keys and values, stacked as `kv_b_proj` lays
       them out, are projected on their top d_c principal directions over calibration
       activations (`calibration_documents` course documents from `seed`): with M the stacked
       projection and U the top eigenvectors of (XMᵀ)ᵀ(XMᵀ), W_DKV = UᵀM and [W_UK; W_UV] = U
       (the factorisation of least squared error on those activations).
    4. **The latent's RMSNorm**: its gain is set to the latent's mean RMS on the calibration
       activations, so the norm rescales each token to the average scale instead of to 1.

    Steps 1, 2 and 4 change the function, so the copy needs uptraining (`kvlib.gqa.uptrain`);
    chapter 6 measures how much. TransMLA (Meng et al., 2025) and MHA2MLA (Ji et al., 2025)
    convert along these lines.

    Raises:
        ValueError: model is already MLA or GQA, has q/k/v biases, or kv_lora_rank/rope_dim are
            out of range (rope_dim as in `decoupled_rope_dims`; 1 ≤ d_c ≤ H·(D − d_R + D)).
    """
    import dataclasses

    from kvlib import data
    from kvlib.model import model_from_state_dict

    config = model.config
    if config.is_mla or config.num_key_value_heads != config.num_attention_heads or config.qkv_bias:
        raise ValueError(
            "model: expected multi-head attention without biases (H_kv = H, not MLA), got "
            f"kv_lora_rank={config.kv_lora_rank}, num_key_value_heads="
            f"{config.num_key_value_heads} of {config.num_attention_heads}, "
            f"qkv_bias={config.qkv_bias}"
        )
    n, d = config.num_attention_heads, config.head_dim
    nope, rope = decoupled_rope_dims(d, rope_dim)
    d_nope = len(nope)
    check_positive_int("kv_lora_rank", kv_lora_rank)
    if kv_lora_rank > n * (d_nope + d):
        raise ValueError(
            f"kv_lora_rank: expected at most {n * (d_nope + d)} (the rows of the stacked content "
            f"keys and values), got {kv_lora_rank}"
        )
    rng = np.random.default_rng(seed)
    tokens = torch.from_numpy(
        np.stack([data.make_document(rng).tokens for _ in range(calibration_documents)])
    )
    inputs = _attention_inputs(model, tokens)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i, x in enumerate(inputs):
        prefix = f"model.layers.{i}.self_attn."
        w_q = state.pop(prefix + "q_proj.weight").double().view(n, d, -1)
        w_k = state.pop(prefix + "k_proj.weight").double().view(n, d, -1)
        w_v = state.pop(prefix + "v_proj.weight").double().view(n, d, -1)
        state[prefix + "q_proj.weight"] = torch.cat([w_q[:, nope], w_q[:, rope]], 1).flatten(0, 1)
        w_kr = w_k[:, rope].mean(dim=0)  # (d_R, d_model): one rotary key for all heads
        stacked = torch.cat([w_k[:, nope], w_v], dim=1).flatten(0, 1)  # (H·(d_h + d_v), d_model)
        outputs = x @ stacked.T  # (N, H·(d_h + d_v))
        _, eigenvectors = torch.linalg.eigh(outputs.T @ outputs)  # ascending eigenvalues
        basis = eigenvectors[:, -kv_lora_rank:].flip(-1)  # (rows, d_c), strongest first
        w_dkv = basis.T @ stacked  # (d_c, d_model)
        latent_rms = (x @ w_dkv.T).pow(2).mean(dim=-1).sqrt().mean()
        state[prefix + "kv_a_proj_with_mqa.weight"] = torch.cat([w_dkv, w_kr])
        state[prefix + "kv_a_layernorm.weight"] = latent_rms.expand(kv_lora_rank).clone()
        state[prefix + "kv_b_proj.weight"] = basis.contiguous()
    mla_config = dataclasses.replace(
        config,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=d_nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=d,
    )
    dtype = next(model.parameters()).dtype
    state = {k: v.to(dtype) for k, v in state.items()}
    converted = model_from_state_dict(mla_config, state, dtype=dtype, source="converted model")
    converted.attention_backend = model.attention_backend
    return converted


# --- the equal-bytes sweep behind results/mla_uptraining.csv ---------------------------------

ROPE_DIM = 16  # d_R = D/2 for the course model's D = 32, DeepSeek-V2's ratio (d_R = d_h/2)
SWEEP_RANKS = (112, 48)  # d_c + d_R = 128 and 64 values per token per layer: GQA-2's and MQA's
SWEEP_ALPHAS = (0.0, 0.01, 0.025, 0.05, 0.1, 0.25)
REFERENCE_ALPHA = 0.25  # chapter 5's sweep stops at 0.1; the references are rerun here at 0.25
MLA_MODEL_DIR = Path(__file__).with_name("weights") / "course-model-mla"
SAVED_POINT = ("MLA", REFERENCE_ALPHA, SWEEP_RANKS[0])  # the sweep saves this one to MLA_MODEL_DIR


def uptraining_point(
    attention: str,
    alpha: float,
    *,
    kv_lora_rank: int | None = None,
    progress: bool = False,
    save_to: str | os.PathLike | None = None,
) -> dict:
    """One row of `results/mla_uptraining.csv`: the course model as `attention` ("MLA": converted
    by `convert_to_mla` with `kv_lora_rank` and `ROPE_DIM`; "GQA-2", "MQA": mean-pooled by
    `kvlib.gqa.convert_kv_heads`; "MHA": itself, the control), uptrained for `alpha` of its
    training steps (`kvlib.gqa.uptrain`, the same recipe for all), then evaluated
    (`kvlib.train.evaluate`). `save_to`: a directory to write the model to (Hugging Face
    format).

    Raises:
        ValueError: an unknown attention, or kv_lora_rank given for anything but "MLA".
    """
    from kvlib.gqa import convert_kv_heads, evaluated_row, uptrain
    from kvlib.train import load_course_model

    kv_heads = {"MHA": 4, "GQA-2": 2, "MQA": 1}
    if attention not in (*kv_heads, "MLA") or (attention == "MLA") != (kv_lora_rank is not None):
        raise ValueError(
            f"attention: expected 'MLA' with a kv_lora_rank or one of {list(kv_heads)} without, "
            f"got {attention!r} with kv_lora_rank={kv_lora_rank}"
        )
    model = load_course_model()
    if attention == "MLA":
        model = convert_to_mla(model, kv_lora_rank, ROPE_DIM)
    elif attention != "MHA":
        model = convert_kv_heads(model, kv_heads[attention], init="mean")
    steps = 0
    if alpha > 0:
        set_absorb(model, False)  # the same numbers; the expanded form trains faster here
        steps = len(uptrain(model, alpha, progress=progress))
        set_absorb(model, True)
    row = {
        "attention": attention,
        "kv_lora_rank": kv_lora_rank or "",
        "rope_dim": ROPE_DIM if kv_lora_rank else "",
        "alpha": alpha,
        "uptrain_steps": steps,
        **evaluated_row(model),
    }
    if save_to is not None:
        from kvlib.model import save_hf_checkpoint

        save_hf_checkpoint(model, save_to)
    return row


def load_course_mla_model(*, absorb: bool = True, attention_backend: str = "reference"):
    """The course model converted to MLA (d_c = 112, d_R = 16: GQA-2's cache bytes) and uptrained
    for alpha = 0.25, as `python -m kvlib.mla uptraining` saved it (`SAVED_POINT`), in eval mode.

    `attention_backend` names the model's backend (`kvlib.ops.ATTENTION_BACKENDS`). The absorbed
    form is MQA over the latent rows, so "reference" repeats that one KV head H times per call
    (chapter 5's repeat-K/V pitfall, 128x the latent for DeepSeek-V3); "grouped" reads it once.

    Raises:
        FileNotFoundError: the weights are missing (rerun the sweep).
        ValueError: an unknown attention_backend.
    """
    from kvlib.model import load_hf_checkpoint

    get_backend(attention_backend)  # fails early on an unknown name
    model = load_hf_checkpoint(MLA_MODEL_DIR)
    model.attention_backend = attention_backend
    set_absorb(model, absorb)
    return model


def set_absorb(model, absorb: bool) -> None:
    """Switch every MLA layer of `model` (a `LlamaModel`) to the absorbed (True) or the naive
    (False) computation; other layers are left alone. Both give the same outputs."""
    for layer in model.model.layers:
        if isinstance(layer.self_attn, MLAttention):
            layer.self_attn.absorb = absorb


def sweep_points() -> list[tuple]:
    """(attention, alpha, kv_lora_rank) of every row of the sweep: both MLA sizes at every alpha,
    and MHA, GQA-2 and MQA at `REFERENCE_ALPHA` (their smaller alphas are chapter 5's)."""
    return [("MLA", a, r) for r in SWEEP_RANKS for a in SWEEP_ALPHAS] + [
        (name, REFERENCE_ALPHA, None) for name in ("MHA", "GQA-2", "MQA")
    ]


def uptraining_sweep(out_csv: str) -> list[dict]:
    """Every point of `sweep_points`, written to `out_csv` (the committed
    `results/mla_uptraining.csv`; about 30 minutes on 2 CPU cores); the model of `SAVED_POINT`
    is written to `MLA_MODEL_DIR` (shipped: chapter 6 loads it with `load_course_mla_model`)."""
    import csv

    from tqdm import tqdm

    rows = [
        uptraining_point(
            name,
            alpha,
            kv_lora_rank=rank,
            save_to=MLA_MODEL_DIR if (name, alpha, rank) == SAVED_POINT else None,
        )
        for name, alpha, rank in tqdm(sweep_points(), desc="MLA sweep", unit="point")
    ]
    with open(out_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kvlib.mla",
        description="Chapter 6's sweep: the course model converted to MLA at GQA-2's and MQA's "
        "cache bytes, uptrained, against MHA, GQA-2 and MQA (CPU, 2 threads).",
    )
    parser.add_argument("sweep", choices=["uptraining"])
    parser.add_argument("--out", default="results/mla_uptraining.csv", help="output CSV")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    rows = uptraining_sweep(args.out)
    print(f"wrote {len(rows)} points to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
