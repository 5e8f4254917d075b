"""`python -m kvlib.experiments.mla_uptraining`: the course model converted to MLA
(`kvlib.conversions.mla`) at GQA-2's and MQA's cache bytes, uptrained, against MHA, GQA-2 and MQA
uptrained the same way (chapter 6; CPU, 2 threads, about 25 minutes); writes
`results/mla_uptraining.csv` and the shipped MLA model (`kvlib.loaders.course_model`).
"""

from __future__ import annotations

import os

from kvlib.conversions.mla import convert_to_mla
from kvlib.experiments.cli import run, write_rows
from kvlib.layers.mla import set_absorb
from kvlib.loaders.course_model import MLA_MODEL_DIR

ROPE_DIM = 16  # d_R = D/2 for the course model's D = 32, DeepSeek-V2's ratio (d_R = d_h/2)
SWEEP_RANKS = (112, 48)  # d_c + d_R = 128 and 64 values per token per layer: GQA-2's and MQA's
SWEEP_ALPHAS = (0.0, 0.01, 0.025, 0.05, 0.1, 0.25)
REFERENCE_ALPHA = 0.25  # chapter 5's sweep stops at 0.1; the references are rerun here at 0.25
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
    `kvlib.conversions.gqa.convert_kv_heads`; "MHA": itself, the control), uptrained for `alpha` of
    its training steps (`kvlib.training.uptrain`, the same recipe for all), then evaluated
    (`kvlib.training.evaluate`). `save_to`: a directory to write the model to (Hugging Face
    format).

    Raises:
        ValueError: an unknown attention, or kv_lora_rank given for anything but "MLA".
    """
    from kvlib.conversions.gqa import convert_kv_heads
    from kvlib.experiments.gqa_uptraining import evaluated_row
    from kvlib.loaders.course_model import load_course_model
    from kvlib.training import uptrain

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
        from kvlib.loaders.hf import save_hf_checkpoint

        save_hf_checkpoint(model, save_to)
    return row


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

    from tqdm import tqdm

    rows = []
    for name, alpha, rank in tqdm(sweep_points(), desc="MLA sweep", unit="point"):
        save_to = MLA_MODEL_DIR if (name, alpha, rank) == SAVED_POINT else None
        rows.append(uptraining_point(name, alpha, kv_lora_rank=rank, save_to=save_to))
    return write_rows(out_csv, rows)


def main(argv: list[str] | None = None) -> int:
    return run(
        "mla_uptraining", __doc__, "results/mla_uptraining.csv", uptraining_sweep, argv, threads=2
    )


if __name__ == "__main__":
    raise SystemExit(main())
