"""`python -m kvlib.experiments.train_course_model`: train the course model on `kvlib.data` with
`kvlib.training.fit` and save it as a Hugging Face Llama checkpoint (config.json +
model.safetensors) in `kvlib/weights/course-model/`, with its training log and a loss curve PNG.

The defaults reproduce the committed checkpoint (on the pinned torch, CPU, 2 threads; about a
quarter of an hour on 2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvlib.experiments import options
from kvlib.loaders.course_model import COURSE_CONFIG, COURSE_MODEL_DIR
from kvlib.loaders.hf import save_hf_checkpoint
from kvlib.model import LlamaModel, ModelConfig
from kvlib.training import CURRICULUM, fit, scaled_curriculum


def train(
    *,
    config: ModelConfig = COURSE_CONFIG,
    curriculum=CURRICULUM,
    lr: float = 3e-3,
    warmup: int = 100,
    seed: int = 0,
    eval_every: int = 400,
    out_dir: Path = COURSE_MODEL_DIR,
    threads: int = 2,
    name: str | None = None,
) -> LlamaModel:
    """Train a model of `config` (the course model's by default; chapter 17's hybrid and chapter
    16's draft are others) through `curriculum`; write the checkpoint, `training_log.jsonl` and
    `loss_curve.png` (titled "`name` training"; None: the course model or the hybrid course
    model, by `config`) to `out_dir`."""
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    model = LlamaModel(config)
    log = fit(model, curriculum, lr=lr, warmup=warmup, seed=seed, eval_every=eval_every)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_hf_checkpoint(model, out_dir)
    (out_dir / "training_log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
    if name is None:
        name = "course model" if config.layer_types is None else "hybrid course model"
    plot_loss_curve(log, out_dir / "loss_curve.png", f"{name} training")
    return model


def plot_loss_curve(log: list[dict], path: Path, title: str = "course model training") -> None:
    """Training loss per step and held-out loss at each evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [e["step"] for e in log], [e["loss"] for e in log], lw=0.8, label="training loss (batch)"
    )
    evals = [e for e in log if "heldout_loss" in e]
    ax.plot(
        [e["step"] for e in evals], [e["heldout_loss"] for e in evals], "o-", label="held-out loss"
    )
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_yscale("log")
    ax.legend()
    fig.savefig(path, dpi=90, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(
        "python -m kvlib.experiments.train_course_model",
        "Train the course model (defaults reproduce the committed one).",
        {
            "--lr": {"type": float, "default": 3e-3},
            "--seed": {"type": int, "default": 0},
            "--scale": {
                "type": float,
                "default": 1.0,
                "help": "multiply every phase's steps (e.g. 0.1 for a quick smoke run)",
            },
            "--out": {
                "type": Path,
                "default": COURSE_MODEL_DIR,
                "help": f"output directory (default {COURSE_MODEL_DIR})",
            },
            "--threads": {
                "type": int,
                "default": 2,
                "help": "torch threads (default 2, as the committed model was trained; the "
                "result depends on it)",
            },
        },
    )
    args = parser.parse_args(argv)
    train(
        curriculum=scaled_curriculum(args.scale),
        lr=args.lr,
        seed=args.seed,
        out_dir=args.out,
        threads=args.threads,
    )
    print(f"saved to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
