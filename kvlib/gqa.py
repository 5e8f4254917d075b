"""Converting a trained multi-head model to GQA or MQA, and measuring what it costs (chapter 5).

Grouped-query attention (Ainslie et al., 2023, "GQA: Training Generalized Multi-Query Transformer
Models from Multi-Head Checkpoints", EMNLP) lets `G = H / H_kv` consecutive query heads share one
key/value head, so the cache holds `H_kv` heads instead of `H`; MQA (Shazeer, 2019) is `H_kv = 1`.
The paper converts a trained MHA checkpoint in two steps (its sec. 2.1):

1. **mean-pool** the key and value projection heads of each group into one head (in its
   ablation, better than keeping the group's first head, which beats random initialisation);
2. **uptrain** the converted model for a fraction `alpha` of the original pre-training steps (it
   uses alpha = 0.05).

Here: `pool_kv_heads` (one projection), `convert_kv_heads` (a whole `LlamaModel`, any Llama-family
checkpoint: the course model or SmolLM2), `uptrain` (the course model's curriculum scaled by alpha),
and `python -m kvlib.gqa` (the sweeps behind `results/gqa_uptraining.csv` and
`results/gqa_smollm2.csv`).

Head layout: KV head `j` serves query heads `j*G .. j*G + G - 1` (Hugging Face's `repeat_kv`), so
old KV heads `j*G' .. j*G' + G' - 1` pool into new head `j`, with `G' = H_kv_old / H_kv_new`.
"""

from __future__ import annotations

import dataclasses

import torch

from kvlib._validate import check_positive_int
from kvlib.model import LlamaModel, model_from_state_dict

__all__ = [
    "INITS",
    "convert_kv_heads",
    "pool_kv_heads",
    "uptrain",
]

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


UPTRAIN_LR = 1e-3  # a third of the original peak: the converted model restarts from trained weights
UPTRAIN_SEED = 1000  # batch seeds 1000, 1001: unseen in training (0, 1) and evaluation (99)


def uptrain(
    model: LlamaModel,
    alpha: float,
    *,
    lr: float = UPTRAIN_LR,
    seed: int = UPTRAIN_SEED,
    progress: bool = True,
) -> list[dict]:
    """Continue training `model` in place for a fraction `alpha` of the course model's training
    steps: its curriculum with every phase scaled by alpha (`kvlib.train.scaled_curriculum`), the
    warm-up scaled too, the same optimizer (`kvlib.train.fit`). GQA's uptraining (Ainslie et al.,
    2023, sec. 2.1, alpha = 0.05 there). Returns `fit`'s log, one entry per step.

    Raises:
        ValueError: alpha is not a positive number.
    """
    from kvlib.train import fit, scaled_curriculum

    curriculum = scaled_curriculum(alpha)
    return fit(
        model,
        curriculum,
        lr=lr,
        warmup=max(1, round(100 * alpha)),
        seed=seed,
        eval_every=None,
        desc=f"uptraining (alpha={alpha:g})",
        progress=progress,
    )


SWEEP_ALPHAS = (0.0, 0.01, 0.025, 0.05, 0.1)
SWEEP_KV_HEADS = (2, 1)


def uptraining_point(num_kv_heads: int, init: str, alpha: float, *, progress: bool = False) -> dict:
    """One row of `results/gqa_uptraining.csv`: the course model converted to `num_kv_heads` KV
    heads with `init` (or, with init "none" and 4 heads, the MHA model itself: the control that
    gets the same extra training), uptrained for `alpha`, then evaluated by `kvlib.train.evaluate`
    (held-out loss in nats/token, copy accuracy, recall accuracy per SET-to-GET distance)."""
    from kvlib.train import load_course_model

    model = load_course_model()
    if init != "none":
        model = convert_kv_heads(model, num_kv_heads, init=init)
    elif num_kv_heads != model.config.num_key_value_heads:
        raise ValueError(
            f"init: 'none' keeps the MHA model's heads, got num_kv_heads={num_kv_heads}"
        )
    steps = len(uptrain(model, alpha, progress=progress)) if alpha > 0 else 0
    return {
        "num_kv_heads": num_kv_heads,
        "init": init,
        "alpha": alpha,
        "uptrain_steps": steps,
        **evaluated_row(model),
    }


def evaluated_row(model: LlamaModel) -> dict:
    """The measured columns of an uptraining sweep's row (chapters 5 and 6): cache bytes per
    token, `kvlib.train.evaluate`'s metrics rounded to 5 digits, and how they were produced
    (uptraining lr and seed, threads, versions, date)."""
    import datetime

    import numpy as np

    from kvlib.memory import kv_bytes_per_token
    from kvlib.train import evaluate

    metrics = evaluate(model)
    return {
        "kv_bytes_per_token": kv_bytes_per_token(model.config.to_hf()),
        "heldout_loss": round(metrics["heldout_loss"], 5),
        "copy_accuracy": round(metrics["copy_accuracy"], 5),
        **{f"recall_{d}": round(a, 5) for d, a in metrics["recall_accuracy"].items()},
        "lr": UPTRAIN_LR,
        "seed": UPTRAIN_SEED,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "date": datetime.date.today().isoformat(),
    }


def uptraining_sweep(out_csv: str, *, alphas=SWEEP_ALPHAS, kv_heads=SWEEP_KV_HEADS) -> list[dict]:
    """Every (num_kv_heads, init, alpha) point, plus the MHA control at every alpha, written to
    `out_csv` (the committed `results/gqa_uptraining.csv`; about 25 minutes on 2 CPU cores)."""
    import csv

    from tqdm import tqdm

    points = [(4, "none", a) for a in alphas] + [
        (h, init, a) for h in kv_heads for init in INITS for a in alphas
    ]
    rows = [uptraining_point(*p) for p in tqdm(points, desc="GQA uptraining sweep", unit="point")]
    with open(out_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows


PASSKEY_LENGTHS = (200, 320, 560)
PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def smollm2_variant_metrics(model, reference, tokenizer) -> dict:
    """`model` against `reference` (the original SmolLM2) on the course essay: perplexity, and
    top-1 agreement and mean/max KL(P_reference || P_model) in nats of the next-token
    distributions at every position (one forward pass each)."""
    from kvlib.evaluation import agreement, course_text, perplexity

    ids = torch.tensor([tokenizer.encode(course_text())])
    with torch.no_grad():
        compared = agreement(reference(ids)[0], model(ids)[0])
    return {
        "text_tokens": ids.shape[1],
        "perplexity": round(perplexity(model, ids), 4),
        "top1_agreement": round(compared.top1, 4),
        "mean_kl_nats": round(compared.mean_kl, 4),
        "max_kl_nats": round(compared.max_kl, 4),
    }


def smollm2_variants(model) -> dict:
    """SmolLM2 as shipped (3 KV heads) and pooled to MQA (1 KV head) by mean and by first head,
    without uptraining: {name: model}."""
    return {
        "original (3 KV heads)": model,
        "MQA, mean-pooled": convert_kv_heads(model, 1, init="mean"),
        "MQA, first head": convert_kv_heads(model, 1, init="first"),
    }


def smollm2_sweep(out_json: str, *, seed: int = 0) -> dict:
    """SmolLM2's variants (`smollm2_variants`): text metrics (`smollm2_variant_metrics`) and
    passkey retrieval over `PASSKEY_LENGTHS` x `PASSKEY_DEPTHS` (one seeded key per cell, the same
    keys for every variant), written to `out_json` (the committed `results/gqa_smollm2.json`)."""
    import datetime
    import json

    import numpy as np
    from tqdm import tqdm

    from kvlib.evaluation import passkey_trial
    from kvlib.memory import kv_bytes_per_token
    from kvlib.smollm2 import load_smollm2

    reference, tokenizer = load_smollm2()
    rng = np.random.default_rng(seed)
    cells = [
        (n, d, int(rng.integers(10_000, 100_000))) for n in PASSKEY_LENGTHS for d in PASSKEY_DEPTHS
    ]
    variants = []
    for name, model in smollm2_variants(reference).items():
        trials = []
        for filler_tokens, depth, passkey in tqdm(cells, desc=name, unit="trial"):
            correct, prompt_tokens = passkey_trial(model, tokenizer, filler_tokens, depth, passkey)
            trials.append(
                {
                    "filler_tokens": filler_tokens,
                    "depth": depth,
                    "passkey": passkey,
                    "prompt_tokens": prompt_tokens,
                    "correct": correct,
                }
            )
        variants.append(
            {
                "name": name,
                "num_kv_heads": model.config.num_key_value_heads,
                "kv_bytes_per_token_bf16": kv_bytes_per_token(model.config.to_hf(), "bfloat16"),
                **smollm2_variant_metrics(model, reference, tokenizer),
                "passkey": trials,
            }
        )
    result = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32), no uptraining",
        "text": "kvlib/texts/kv_cache_essay.txt",
        "seed": seed,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "variants": variants,
    }
    with open(out_json, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    return result


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kvlib.gqa",
        description="Chapter 5's sweeps: GQA/MQA conversion and uptraining (CPU, 2 threads).",
    )
    parser.add_argument("sweep", choices=["uptraining", "smollm2"])
    parser.add_argument("--out", help="output file (default: results/gqa_<sweep>.csv|json)")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    if args.sweep == "uptraining":
        out = args.out or "results/gqa_uptraining.csv"
        rows = uptraining_sweep(out)
        print(f"wrote {len(rows)} points to {out}")
    else:
        out = args.out or "results/gqa_smollm2.json"
        result = smollm2_sweep(out)
        print(f"wrote {len(result['variants'])} variants to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
