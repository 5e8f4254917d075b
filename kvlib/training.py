"""Training the course model and uptraining a converted one (chapters 2, 5 and 6).

`fit` runs a curriculum (`CURRICULUM`): short recall drills until the recall circuit forms, then
full documents; AdamW with warm-up and a cosine decay per phase; a progress bar; held-out loss,
copy and recall accuracy (`evaluate`) every `eval_every` steps. `uptrain` continues a converted
model's training for a fraction alpha of the course model's steps (GQA's recipe). What it is not:
a general training framework. `python -m kvlib.experiments.train_course_model` trains the
committed checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from kvlib import data
from kvlib.model import LlamaModel


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
    steps: its curriculum with every phase scaled by alpha (`kvlib.training.scaled_curriculum`), the
    warm-up scaled too, the same optimizer (`kvlib.training.fit`). GQA's uptraining (Ainslie et al.,
    2023, sec. 2.1, alpha = 0.05 there). Returns `fit`'s log, one entry per step.

    Raises:
        ValueError: alpha is not a positive number.
    """
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
