"""`python -m kvlib.experiments.draft_model`: train chapter 16's draft course model and measure
how often the course model accepts its drafts; writes `kvlib/weights/course-model-draft/` and
`results/draft_model.csv` (CPU; training with 2 threads took 9.6 min on a shared 2-core
machine, the measurement under a minute; `--skip-training` re-measures the shipped weights).

The draft (`kvlib.loaders.course_draft.DRAFT_CONFIG`: 2 layers, d_model 64, 2 heads of 32, MLP
176; 117,056 parameters against the course model's 836,736) is trained from scratch exactly as
the course model was: `train_course_model.train` with the same corpus, the full curriculum (no
scaling), optimizer, learning rate, warm-up, seed and thread count; only the config differs.
Its last evaluation (the shipped log, 6,200 steps): held-out loss 1.936 nats/token against the
course model's 2.043, copy accuracy 0.570 (the same), recall 1.0 at every SET-to-GET distance up
to 192 and 0.99 at 240, where the course model recalls 0.55 at 64 and 0.47 at 240: on this
corpus the small model is the better predictor, so acceptance is limited by where the two
disagree (the target's own recall errors included), not by a weak draft. Recorded (8 prompts,
48 tokens): accepted draft tokens per verification 0.52, 1.17, 1.21 and 1.31 at k = 1, 2, 4 and
8 (acceptance rates 0.53, 0.61, 0.32, 0.18), against prompt lookup's 0.32, 0.41, 0.41 and 0.41
on the same prompts (`spec_acceptance.csv`).

Rows of `results/draft_model.csv`, one per k (1, 2, 4, 8) and prompt (`spec_acceptance`'s 8
course-model prompts, 128 tokens of recall documents each): greedy speculative decoding of 48 new
tokens (`speculative_generate`, a `DynamicCache`), drafted by a fresh `DraftModelDrafter`, its
tokens asserted equal to plain greedy decoding's. Columns: `steps`, `draft_tokens`,
`accepted_tokens`, `emitted_tokens` (`SpeculationStats`, as `spec_acceptance.csv`), `forwards`
(the target's after its prefill), `draft_forwards` (the draft model's, its catch-ups included:
one per drafted token); both models' parameters and, from their shipped training logs' last
evaluation, held-out loss, copy accuracy, recall at distance 64, training steps and seconds (so
acceptance reads against the draft's quality); the recording's device, threads (of the
measurement: 1), versions, commit and date. Greedy decoding makes the counts exact: a spot check
recomputes rows and compares them equal.

On a busy machine, set `OMP_WAIT_POLICY=PASSIVE` in the environment (torch's threads then sleep
instead of spinning while they wait for each other: several times faster, the same numbers).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvlib.experiments.options import run_training

KS = (1, 2, 4, 8)  # draft tokens per step, as results/spec_acceptance.csv
NEW_TOKENS = 48  # per prompt, as spec_acceptance's course model rows

PROVENANCE_SOURCES = (
    "kvlib/cache/dense.py",
    "kvlib/data.py",
    "kvlib/experiments/draft_model.py",
    "kvlib/experiments/spec_acceptance.py",
    "kvlib/experiments/train_course_model.py",
    "kvlib/generation.py",
    "kvlib/layers/llama.py",
    "kvlib/loaders/course_draft.py",
    "kvlib/loaders/course_model.py",
    "kvlib/model.py",
    "kvlib/speculative/decode.py",
    "kvlib/speculative/draft_model.py",
    "kvlib/speculative/verify.py",
    "kvlib/training.py",
)


def train_draft(weights: Path, *, threads: int = 2, scale: float = 1.0):
    """Train `DRAFT_CONFIG` into `weights` exactly as the course model was trained (the same
    corpus, curriculum scaled by `scale`, optimizer, learning rate, warm-up, seed and threads);
    its loss curve is titled as the draft's."""
    from kvlib.experiments.train_course_model import train
    from kvlib.loaders.course_draft import DRAFT_CONFIG
    from kvlib.training import scaled_curriculum

    return train(
        config=DRAFT_CONFIG,
        curriculum=scaled_curriculum(scale),
        out_dir=weights,
        threads=threads,
        name="draft course model",
    )


def run_one(target, drafter_model, prompt: torch.Tensor, k: int) -> tuple[torch.Tensor, dict]:
    """One greedy speculative run of `target` drafted by `drafter_model` (a fresh
    `DraftModelDrafter`): its tokens and counts, as a row's values."""
    from kvlib.cache import DynamicCache
    from kvlib.speculative import DraftModelDrafter, speculative_generate

    drafter = DraftModelDrafter(drafter_model, target)
    forwards = []
    hook = target.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        tokens, stats = speculative_generate(
            target,
            prompt,
            DynamicCache(target.config.num_hidden_layers),
            max_new_tokens=NEW_TOKENS,
            k=k,
            drafter=drafter,
        )
    finally:
        hook.remove()
    return tokens, dict(
        steps=stats.num_drafts,
        draft_tokens=stats.num_draft_tokens,
        accepted_tokens=stats.num_accepted_tokens,
        emitted_tokens=stats.num_emitted_tokens,
        forwards=len(forwards) - 1,  # the target's, after its prefill: one per step
        draft_forwards=drafter.num_forwards,
    )


def final_metrics(log_path: Path) -> dict:
    """The last evaluation of a shipped training log: held-out loss, copy accuracy, recall
    accuracy at distance 64, and the steps and seconds of the training."""
    log = [json.loads(line) for line in log_path.read_text().splitlines()]
    last = [entry for entry in log if "heldout_loss" in entry][-1]
    return dict(
        heldout_loss=round(last["heldout_loss"], 4),
        copy_accuracy=round(last["copy_accuracy"], 4),
        recall_64=round(last["recall_accuracy"]["64"], 4),
        train_steps=log[-1]["step"],
        train_seconds=log[-1]["elapsed_s"],
    )


def measure(target, draft, *, ks=KS, prompts=None) -> list[dict]:
    """A row per k and prompt (`course_prompts()` by default): greedy speculative decoding of the
    course model drafted by `draft`, asserted token-identical to plain greedy decoding."""
    from tqdm.auto import tqdm

    from kvlib.experiments.spec_acceptance import course_prompts
    from kvlib.generation import generate

    prompts = course_prompts() if prompts is None else prompts
    plain = [generate(target, p, NEW_TOKENS) for p in prompts]
    rows = []
    for k, i in tqdm([(k, i) for k in ks for i in range(len(prompts))], desc="draft model"):
        tokens, values = run_one(target, draft, prompts[i], k)
        assert torch.equal(tokens, plain[i]), (k, i)
        rows.append(dict(model="course model", drafter="draft model", k=k, prompt=i, **values))
    return rows


def record(
    out_csv: str,
    *,
    weights: Path | None = None,
    train_model: bool = True,
    threads: int = 2,
    scale: float = 1.0,
) -> list[dict]:
    """Train the draft model into `weights` (None: `DRAFT_MODEL_DIR`, the shipped checkpoint;
    unless `train_model` is False: measure what is there) with `threads` threads, then measure it
    with one thread (as `spec_acceptance`) and write every row to `out_csv`."""
    from kvlib.experiments.cli import write_rows
    from kvlib.experiments.timing import cpu_facts
    from kvlib.loaders.course_draft import DRAFT_MODEL_DIR
    from kvlib.loaders.course_model import COURSE_MODEL_DIR, load_course_model
    from kvlib.loaders.hf import load_hf_checkpoint

    weights = Path(DRAFT_MODEL_DIR if weights is None else weights)
    if train_model:
        train_draft(weights, threads=threads, scale=scale)
    torch.set_num_threads(1)
    target, draft = load_course_model(), load_hf_checkpoint(weights)
    quality = {
        f"{who}_{column}": value
        for who, folder in (("draft", weights), ("target", COURSE_MODEL_DIR))
        for column, value in final_metrics(folder / "training_log.jsonl").items()
    }
    sizes = dict(draft_parameters=draft.num_parameters, target_parameters=target.num_parameters)
    for who, count in sizes.items():
        print(f"{who}: {count:,}")
    facts = cpu_facts()
    rows = [{**row, **sizes, **quality, **facts} for row in measure(target, draft)]
    return write_rows(out_csv, rows)


def main(argv: list[str] | None = None) -> int:
    return run_training(
        "draft_model",
        "Train the draft course model and record how often the course model accepts its drafts "
        "(defaults reproduce the committed weights and results/draft_model.csv).",
        "results/draft_model.csv",
        "kvlib/weights/course-model-draft",
        record,
        argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
