"""`python -m kvlib.experiments.gqa_uptraining`: the course model converted from MHA to GQA-2 and
MQA (`kvlib.conversions.gqa`, mean-pooled, first head or random), uptrained for a fraction alpha of
its training (`kvlib.training.uptrain`) and evaluated (chapter 5; CPU, 2 threads, about 25
minutes); writes `results/gqa_uptraining.csv`.
"""

from __future__ import annotations

import torch

from kvlib.conversions.gqa import INITS, convert_kv_heads
from kvlib.experiments.cli import run, write_rows
from kvlib.model import LlamaModel
from kvlib.training import UPTRAIN_LR, UPTRAIN_SEED, uptrain

SWEEP_ALPHAS = (0.0, 0.01, 0.025, 0.05, 0.1)
SWEEP_KV_HEADS = (2, 1)


def uptraining_point(num_kv_heads: int, init: str, alpha: float, *, progress: bool = False) -> dict:
    """One row of `results/gqa_uptraining.csv`: the course model converted to `num_kv_heads` KV
    heads with `init` (or, with init "none" and 4 heads, the MHA model itself: the control that
    gets the same extra training), uptrained for `alpha`, then evaluated by
    `kvlib.training.evaluate` (held-out loss in nats/token, copy accuracy, recall accuracy per
    SET-to-GET distance)."""
    from kvlib.loaders.course_model import load_course_model

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
    token, `kvlib.training.evaluate`'s metrics rounded to 5 digits, and how they were produced
    (uptraining lr and seed, threads, versions, date)."""
    import datetime

    import numpy as np

    from kvlib.memory import kv_bytes_per_token
    from kvlib.training import evaluate

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

    from tqdm import tqdm

    points = [(4, "none", a) for a in alphas] + [
        (h, init, a) for h in kv_heads for init in INITS for a in alphas
    ]
    sweep = tqdm(points, desc="GQA uptraining sweep", unit="point")
    return write_rows(out_csv, [uptraining_point(*point) for point in sweep])


def main(argv: list[str] | None = None) -> int:
    return run(
        "gqa_uptraining", __doc__, "results/gqa_uptraining.csv", uptraining_sweep, argv, threads=2
    )


if __name__ == "__main__":
    raise SystemExit(main())
