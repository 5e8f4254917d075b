"""Converting a trained multi-head model to MLA (chapter 6): `convert_to_mla` keeps a subset of each
head's dimensions rotating (decoupled RoPE, `kvlib.layers.mla.decoupled_rope_dims`), pools the
heads' rotary keys into one, and factorises the content keys and values into a low-rank latent
fitted on calibration activations. The converted model needs uptraining (`kvlib.training.uptrain`);
`kvlib.experiments.mla_uptraining` measures how much.
"""

from __future__ import annotations

import numpy as np
import torch

from kvlib._validate import check_positive_int
from kvlib.layers.mla import decoupled_rope_dims

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
       projections are mean-pooled (GQA's conversion, `kvlib.conversions.gqa.pool_kv_heads`).
    3. **Joint low-rank K/V**: the heads' content keys and values, stacked as `kv_b_proj` lays
       them out, are projected on their top d_c principal directions over calibration
       activations (`calibration_documents` course documents from `seed`): with M the stacked
       projection and U the top eigenvectors of (XMᵀ)ᵀ(XMᵀ), W_DKV = UᵀM and [W_UK; W_UV] = U
       (the factorisation of least squared error on those activations).
    4. **The latent's RMSNorm**: its gain is set to the latent's mean RMS on the calibration
       activations, so the norm rescales each token to the average scale instead of to 1.

    Steps 1, 2 and 4 change the function, so the copy needs uptraining (`kvlib.training.uptrain`);
    chapter 6 measures how much. TransMLA (Meng et al., 2025) and MHA2MLA (Ji et al., 2025)
    convert along these lines.

    Raises:
        ValueError: model is already MLA or GQA, has q/k/v biases, or kv_lora_rank/rope_dim are
            out of range (rope_dim as in `decoupled_rope_dims`; 1 ≤ d_c ≤ H·(D − d_R + D)).
    """
    import dataclasses

    from kvlib import data
    from kvlib.loaders.hf import model_from_state_dict

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
