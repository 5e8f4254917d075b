"""`python -m kvlib.experiments.gqa_smollm2`: SmolLM2-135M-Instruct as shipped and pooled from 3 KV
heads to 1 (mean, first head), without uptraining: perplexity, agreement with the original and
passkey retrieval (chapter 5; CPU, about 2 minutes); writes `results/gqa_smollm2.json`.
"""

from __future__ import annotations

import torch

from kvlib.conversions.gqa import convert_kv_heads
from kvlib.experiments.cli import run

PASSKEY_LENGTHS = (200, 320, 560)
PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def smollm2_variant_metrics(model, reference, tokenizer) -> dict:
    """`model` against `reference` (the original SmolLM2) on the course essay: perplexity, and
    top-1 agreement and mean/max KL(P_reference || P_model) in nats of the next-token
    distributions at every position (one forward pass each)."""
    from kvlib.metrics.quality import agreement, course_text, perplexity

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

    from kvlib.loaders.smollm2 import load_smollm2
    from kvlib.memory import kv_bytes_per_token
    from kvlib.metrics.passkey import passkey_trial

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
    return run("gqa_smollm2", __doc__, "results/gqa_smollm2.json", smollm2_sweep, argv, threads=2)


if __name__ == "__main__":
    raise SystemExit(main())
