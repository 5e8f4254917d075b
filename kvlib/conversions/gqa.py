"""Converting a trained multi-head model to GQA or MQA (chapter 5).

Grouped-query attention (Ainslie et al., 2023, "GQA: Training Generalized Multi-Query Transformer
Models from Multi-Head Checkpoints", EMNLP) lets `G = H / H_kv` consecutive query heads share one
key/value head, so the cache holds `H_kv` heads instead of `H`; MQA (Shazeer, 2019) is `H_kv = 1`.
The paper converts a trained MHA checkpoint in two steps (its sec. 2.1):

1. **mean-pool** the key and value projection heads of each group into one head (in its
   ablation, better than keeping the group's first head, which beats random initialisation);
2. **uptrain** the converted model for a fraction `alpha` of the original pre-training steps (it
   uses alpha = 0.05).

Here: `pool_kv_heads` (one projection) and `convert_kv_heads` (a whole `LlamaModel`, any
Llama-family checkpoint: the course model or SmolLM2). Uptraining is `kvlib.training.uptrain`; the
sweeps that measure what the conversion costs are `kvlib.experiments.gqa_uptraining` and
`kvlib.experiments.gqa_smollm2`.

Head layout: KV head `j` serves query heads `j*G .. j*G + G - 1` (Hugging Face's `repeat_kv`), so
old KV heads `j*G' .. j*G' + G' - 1` pool into new head `j`, with `G' = H_kv_old / H_kv_new`.
"""

from __future__ import annotations

import dataclasses

import torch

from kvlib._validate import check_positive_int
from kvlib.loaders.hf import model_from_state_dict
from kvlib.model import LlamaModel

INITS = ("mean", "first", "random")


def pool_kv_heads(
    weight: torch.Tensor,
    num_kv_heads: int,
    *,
    head_dim: int,
    init: str = "mean",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One key or value projection with its heads merged into `num_kv_heads` groups.

    Args:
        weight: a `k_proj`/`v_proj` weight (H_kv_old · D, d_model) or bias (H_kv_old · D,), rows
            grouped by head as the model stores them.
        num_kv_heads: H_kv_new, a divisor of H_kv_old.
        head_dim: D.
        init: "mean" (each new head is the mean of its group's heads: GQA's conversion), "first"
            (the group's first head), or "random" (normal noise with the weight's standard
            deviation, from `generator`): the paper's three initialisations.
    Returns:
        (H_kv_new · D, d_model) or (H_kv_new · D,), in weight's dtype; weight is not modified.
    Raises:
        TypeError: weight is not a floating-point tensor.
        ValueError: an unknown init, a head_dim that does not divide the rows, or a
            num_kv_heads that does not divide H_kv_old.
    """
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise TypeError(f"weight: expected a floating-point tensor, got {type(weight).__name__}")
    if init not in INITS:
        raise ValueError(f"init: expected one of {INITS}, got {init!r}")
    check_positive_int("head_dim", head_dim)
    check_positive_int("num_kv_heads", num_kv_heads)
    rows = weight.shape[0]
    if rows % head_dim:
        raise ValueError(f"head_dim: expected a divisor of weight's {rows} rows, got {head_dim}")
    old_heads = rows // head_dim
    if old_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads: expected a divisor of the weight's {old_heads} heads, "
            f"got {num_kv_heads}"
        )
    group = old_heads // num_kv_heads
    # (H_kv_new, G', D, ...): consecutive old heads form a group
    heads = weight.reshape(num_kv_heads, group, head_dim, *weight.shape[1:])
    if init == "mean":
        pooled = heads.mean(dim=1)
    elif init == "first":
        pooled = heads[:, 0]
    else:
        pooled = (
            torch.randn(heads[:, 0].shape, generator=generator, dtype=torch.float32)
            * weight.float().std()
        )
    return pooled.reshape(num_kv_heads * head_dim, *weight.shape[1:]).to(weight.dtype).clone()


def convert_kv_heads(
    model: LlamaModel, num_kv_heads: int, *, init: str = "mean", seed: int = 0
) -> LlamaModel:
    """A copy of `model` with `num_kv_heads` key/value heads per layer (GQA; 1: MQA): every
    layer's `k_proj` and `v_proj` (weights and biases) pooled by `pool_kv_heads`, everything
    else copied, the config's `num_key_value_heads` set. `model` is not modified.

    Raises:
        ValueError: num_kv_heads does not divide the model's `num_key_value_heads`, or an unknown
            init.
    """
    config = model.config
    check_positive_int("num_kv_heads", num_kv_heads)
    if config.num_key_value_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads: expected a divisor of the model's num_key_value_heads "
            f"{config.num_key_value_heads}, got {num_kv_heads}"
        )
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            tensor = pool_kv_heads(
                tensor, num_kv_heads, head_dim=config.head_dim, init=init, generator=generator
            )
        state[name] = tensor.detach().clone()
    new_config = dataclasses.replace(config, num_key_value_heads=num_kv_heads)
    dtype = next(model.parameters()).dtype
    converted = model_from_state_dict(new_config, state, dtype=dtype, source="converted model")
    converted.attention_backend = model.attention_backend
    return converted
