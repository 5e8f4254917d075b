"""`python -m kvlib.train`: train the course model on `kvlib.data` and save it as a Hugging Face
Llama checkpoint (config.json + model.safetensors) with its training log.

The defaults reproduce the committed checkpoint in `kvlib/weights/course-model/` (on the pinned
torch, CPU, 2 threads). A two-phase curriculum (`CURRICULUM`): short recall drills until the recall
circuit forms, then full documents; AdamW with warm-up and a cosine decay per phase; a progress
bar; held-out loss, copy and recall accuracy every `eval_every` steps; a loss curve PNG at the end.
What it is not: a general training framework.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kvlib import data
from kvlib.model import LlamaModel, ModelConfig, load_hf_checkpoint, save_hf_checkpoint

COURSE_MODEL_DIR = Path(__file__).with_name("weights") / "course-model"
COURSE_CONFIG = ModelConfig(
    vocab_size=data.VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    rope_theta=10000.0,
    max_position_embeddings=1024,
    torch_dtype="float32",
)


def load_course_model(
    *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> LlamaModel:
    """The course model trained by `python -m kvlib.train` and shipped in `kvlib/weights`
    (4 layers, 4 heads, d_model 128; its model card is `book/model_card.md`), in eval mode.

    Raises:
        FileNotFoundError: the weights are missing (re-train with `python -m kvlib.train`).
    """
    return load_hf_checkpoint(COURSE_MODEL_DIR, dtype=dtype, device=device)


def evaluate(
    model: LlamaModel,
    *,
    seed: int = 99,
    num_documents: int = 64,
    distances=(8, 32, 64, 128, 192, 240),
) -> dict:
    """Held-out next-token loss, recall accuracy per SET-to-GET distance, and copy accuracy."""
    model.eval()
    rng = np.random.default_rng(seed)
    docs = [data.make_document(rng) for _ in range(num_documents)]
    with torch.no_grad():
        tokens = torch.from_numpy(np.stack([d.tokens for d in docs]))
        logits = model(tokens)
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        ).item()
        predictions = logits.argmax(-1)
        copy_hits = [
            predictions[i, p - 1] == tokens[i, p]
            for i, d in enumerate(docs)
            for p in d.copy_positions
        ]
        recall = {}
        for distance in distances:
            recall_docs = data.recall_documents(distance, 32)
            recall_tokens = torch.from_numpy(np.stack([d.tokens for d in recall_docs]))
            recall_predictions = model(recall_tokens).argmax(-1)
            hits = [
                recall_predictions[i, p - 1] == recall_tokens[i, p]
                for i, d in enumerate(recall_docs)
                for p in d.answer_positions
            ]
            recall[distance] = float(torch.stack(hits).float().mean())
    model.train()
    return {
        "heldout_loss": loss,
        "copy_accuracy": float(torch.stack(copy_hits).float().mean()),
        "recall_accuracy": recall,
    }


@dataclasses.dataclass(frozen=True)
class Phase:
    """One stage of the curriculum: `steps` optimizer steps on drills or on full documents."""

    name: str
    steps: int
    batch_size: int
    drill: bool
    lr_end_fraction: float  # the learning rate decays (cosine) from lr to lr * this over the phase


CURRICULUM = (
    Phase("recall drills (64 tokens)", 4000, 16, True, 1.0),
    Phase("documents (256 tokens)", 2200, 16, False, 0.1),
)


def scaled_curriculum(fraction: float, curriculum=CURRICULUM) -> tuple[Phase, ...]:
    """`curriculum` with every phase's steps multiplied by `fraction` (at least 1 step each): a
    quick smoke run (`--scale 0.1`) or GQA's uptraining budget, a fraction alpha of the original
    training steps (Ainslie et al., 2023, sec. 2.1).

    Raises:
        ValueError: `fraction` is not a positive number.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not fraction > 0:
        raise ValueError(f"fraction: expected a positive number, got {fraction!r}")
    return tuple(
        dataclasses.replace(p, steps=max(1, round(p.steps * fraction))) for p in curriculum
    )


def fit(
    model: LlamaModel,
    curriculum=CURRICULUM,
    *,
    lr: float = 3e-3,
    warmup: int = 100,
    seed: int = 0,
    eval_every: int | None = 400,
    desc: str = "training",
    progress: bool = True,
) -> list[dict]:
    """Train `model` in place through `curriculum` (phase i draws its batches from seed + i): AdamW
    (betas 0.9/0.95, weight decay 0.1 on matrices), linear warm-up over `warmup` steps, a cosine
    decay per phase, gradients clipped to norm 1. Returns the log, one dict per step (loss, lr,
    elapsed seconds; `evaluate`'s metrics every `eval_every` steps and at each phase's end; None:
    at phase ends only). Leaves the model in eval mode."""
    from tqdm import tqdm

    torch.manual_seed(seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    model.train()
    log, started, step = [], time.perf_counter(), 0
    bar = tqdm(total=sum(p.steps for p in curriculum), desc=desc, unit="step", disable=not progress)
    for phase_index, phase in enumerate(curriculum):
        for phase_step, batch in enumerate(
            data.batches(seed + phase_index, phase.batch_size, phase.steps, drill=phase.drill)
        ):
            cosine = 0.5 * (1 + math.cos(math.pi * phase_step / phase.steps))
            scale = min(1.0, (step + 1) / warmup) * (
                phase.lr_end_fraction + (1 - phase.lr_end_fraction) * cosine
            )
            for group in optimizer.param_groups:
                group["lr"] = lr * scale
            tokens = torch.from_numpy(batch)
            logits = model(tokens)
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            entry = {
                "step": step,
                "phase": phase.name,
                "loss": round(loss.item(), 5),
                "lr": lr * scale,
                "elapsed_s": round(time.perf_counter() - started, 1),
            }
            if (eval_every and step % eval_every == 0) or phase_step + 1 == phase.steps:
                entry.update(evaluate(model, num_documents=32))
                bar.set_postfix(
                    loss=f"{loss.item():.3f}",
                    heldout=f"{entry['heldout_loss']:.3f}",
                    recall64=f"{entry['recall_accuracy'][64]:.2f}",
                )
            log.append(entry)
            bar.update()
    bar.close()
    model.eval()
    return log


def train(
    *,
    curriculum=CURRICULUM,
    lr: float = 3e-3,
    warmup: int = 100,
    seed: int = 0,
    eval_every: int = 400,
    out_dir: Path = COURSE_MODEL_DIR,
    threads: int = 2,
) -> LlamaModel:
    """Train the course model through `curriculum`; write the checkpoint, `training_log.jsonl` and
    `loss_curve.png` to `out_dir`."""
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    model = LlamaModel(COURSE_CONFIG)
    log = fit(model, curriculum, lr=lr, warmup=warmup, seed=seed, eval_every=eval_every)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_hf_checkpoint(model, out_dir)
    (out_dir / "training_log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
    plot_loss_curve(log, out_dir / "loss_curve.png")
    return model


def plot_loss_curve(log: list[dict], path: Path) -> None:
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
    ax.set_title("course model training")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_yscale("log")
    ax.legend()
    fig.savefig(path, dpi=90, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvlib.train",
        description="Train the course model (defaults reproduce the committed one).",
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every phase's steps (e.g. 0.1 for a quick smoke run)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=COURSE_MODEL_DIR,
        help=f"output directory (default {COURSE_MODEL_DIR})",
    )
    args = parser.parse_args(argv)
    train(curriculum=scaled_curriculum(args.scale), lr=args.lr, seed=args.seed, out_dir=args.out)
    print(f"saved to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
