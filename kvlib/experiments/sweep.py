"""The tasks that chapters 8 and 10 sweep a cache over, and the loop that writes their rows: the
course model's recall by distance, SmolLM2's passkey retrieval (prefilled in chunks) and its
agreement with the full cache on the course essay. `kvlib.experiments.eviction_sweep` and
`kvlib.experiments.quant_sweep` each give it a cache factory per (policy or scheme, budget).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kvlib.experiments.passkey import PASSKEY_DEPTHS
from kvlib.metrics.passkey import passkey_trial
from kvlib.metrics.quality import agreement, course_text, streamed_logits
from kvlib.metrics.recall import recall_by_distance

SWEEP_FIELDS = ["model", "task", "policy", "budget", "x", "metric", "value", "torch", "date"]


def run_sweep(out_csv, jobs, desc, factory_for, seed) -> list[dict]:
    """Run each (task, label, parameter) of `jobs` through the cache factory
    `factory_for(task, label, parameter)` (see `task_rows`) and write one row per measurement
    to `out_csv` as it goes (a crash keeps the rows so far). `parameter` fills the CSV's `budget`
    column (None: empty)."""
    import csv
    import datetime

    from tqdm import tqdm

    from kvlib.loaders.course_model import load_course_model
    from kvlib.loaders.smollm2 import load_smollm2

    course, (smol, tokenizer) = load_course_model(), load_smollm2()
    essay = torch.tensor([tokenizer.encode(course_text())])
    essay_reference = streamed_logits(smol, essay, None)  # the full cache's logits, once
    rng = np.random.default_rng(seed)
    passkeys = {d: int(rng.integers(10_000, 100_000)) for d in PASSKEY_DEPTHS}
    models = (course, smol, tokenizer, (essay, essay_reference), passkeys)
    rows = []
    with open(out_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SWEEP_FIELDS)
        writer.writeheader()
        for task, label, parameter in tqdm(jobs, desc=desc, unit="run"):
            factory = factory_for(task, label, parameter)
            for x, metric, value in task_rows(models, task, factory):
                rows.append(
                    {
                        "model": "course model" if task == "recall" else "SmolLM2-135M-Instruct",
                        "task": task,
                        "policy": label,
                        "budget": "" if parameter is None else parameter,
                        "x": x,
                        "metric": metric,
                        "value": value,
                        "torch": torch.__version__,
                        "date": datetime.date.today().isoformat(),
                    }
                )
                writer.writerow(rows[-1])
            f.flush()
    return rows


def passkey_rows(smol, tokenizer, passkeys, factory) -> list[tuple[int, int, int]]:
    """(depth, 1 if the key was retrieved else 0, the prompt's length in tokens) for each
    {depth: passkey} of `passkeys`: SmolLM2's passkey trial (10 new tokens) with caches from
    `factory`, the prompt prefilled in chunks of `EVICTION_CHUNK` tokens."""
    trials = {
        depth: passkey_trial(
            smol,
            tokenizer,
            EVICTION_PASSKEY_FILLER,
            depth,
            key,
            cache_factory=factory,
            prefill_chunk_size=EVICTION_CHUNK,
        )
        for depth, key in passkeys.items()
    }
    return [(depth, int(correct), length) for depth, (correct, length) in trials.items()]


def task_rows(models, task, factory) -> list[tuple]:
    """One sweep run: (x, metric, value) rows of `task` ("recall", "passkey" or "text") with
    caches from `factory` (a `generate` `cache=` factory, or "dynamic": the full cache).
    `models`: (course model, SmolLM2, its tokenizer, (essay ids, the full cache's logits),
    {depth: passkey})."""
    course, smol, tokenizer, (ids, reference), passkeys = models
    if task == "recall":
        cache_factory = None if factory == "dynamic" else factory
        return [
            (d, "recall", value)
            for d, value in recall_by_distance(course, cache_factory=cache_factory).items()
        ]
    if task == "passkey":
        return [(d, "correct", c) for d, c, _ in passkey_rows(smol, tokenizer, passkeys, factory)]
    if factory == "dynamic":
        from kvlib.cache import DynamicCache

        cache = DynamicCache(smol.config.num_hidden_layers)
    else:
        cache = factory(smol, *ids.shape)
    metrics = streamed_text_metrics(smol, ids, cache, reference=reference)
    return [("", m, v) for m, v in metrics.items()]


EVICTION_PASSKEY_FILLER = 560
EVICTION_CHUNK = 32  # passkey prompts are prefilled in chunks of this many tokens
TEXT_CHUNK = 16  # the essay is streamed in chunks of this many tokens after a 16-token prefill


def streamed_text_metrics(model, ids, cache, *, reference=None) -> dict:
    """A (1, T) text streamed through `cache` (prefill `TEXT_CHUNK` tokens, then chunks of
    `TEXT_CHUNK`): its perplexity, and the top-1 agreement and mean KL (nats) of its next-token
    distributions after the prefill against the full cache's.

    Args:
        cache: an empty cache (an evicting one, say).
        reference: the full cache's (1, T, V) logits, if already computed (else one forward).
    """
    reference = streamed_logits(model, ids, None) if reference is None else reference
    logits = streamed_logits(model, ids, cache, prefill_len=TEXT_CHUNK, chunk_size=TEXT_CHUNK)
    ppl = float(torch.exp(F.cross_entropy(logits[0, :-1], ids[0, 1:])))
    a = agreement(reference[0, TEXT_CHUNK:], logits[0, TEXT_CHUNK:])
    return {"perplexity": ppl, "top1_agreement": a.top1, "mean_kl": a.mean_kl}
