"""`python -m kvlib.experiments.sparse_sweep`: chapter 15's page selectors (Quest's bound, the
oracle's true attention mass, random pages) at several budgets of pages read per decode step,
against chapter 8's best eviction policy at the same bytes read, on chapter 8's and 10's tasks:
the course model's recall by distance, SmolLM2's passkey and SmolLM2 on the course essay streamed
one token at a time (CPU, 1 thread: 44 minutes on a busy 2-core machine); writes
`results/sparse_sweep.csv`.

Bytes read per decode step are chapter 3's equation extended (`kvlib.memory.sparse`): a sparse
layer reads its selected pages' K/V and every page's bounds, a dense layer (the first
`SPARSE_DENSE_LAYERS`) and an evicting cache everything they hold. `read_fraction` is that, summed
over the task's decode steps, over what the full cache reads over the same steps; each eviction
budget is the one whose fraction is closest to a Quest budget's (`matched_eviction_budget`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kvlib.experiments.cli import run

SPARSE_BLOCK_SIZE = 16  # tokens per page, Quest's default
SPARSE_DENSE_LAYERS = {"recall": 1, "passkey": 2, "text": 2}  # the course model's 1 of 4; Quest's 2
SPARSE_BUDGETS = {"recall": (3, 4, 6), "passkey": (4, 8, 16), "text": (4, 8)}  # pages per step
SPARSE_SELECTORS = ("quest", "oracle", "random")
# Chapter 8's best policy per task in results/eviction_sweep.csv (tests/test_sparse.py checks it):
# the highest mean recall, the most passkeys, the lowest mean KL on the essay.
BEST_EVICTION = {"recall": "SnapKV", "passkey": "TOVA", "text": "H2O, normalized"}
TEXT_PREFILL = 16  # the essay: 16 tokens prefilled, then one decode step per token
PASSKEY_NEW_TOKENS = 10  # passkey_trial's answer: the prefill's token, then 9 decode steps
# what `python -m kvlib.course.recorded stamp results/sparse_sweep.csv` hashes
PROVENANCE_SOURCES = (
    "kvlib/cache/block_manager.py",
    "kvlib/cache/block_pool.py",
    "kvlib/cache/evicting.py",
    "kvlib/cache/eviction_policies.py",
    "kvlib/cache/paged.py",
    "kvlib/cache/paged_bounds.py",
    "kvlib/experiments/eviction_sweep.py",
    "kvlib/experiments/sparse_sweep.py",
    "kvlib/experiments/sweep.py",
    "kvlib/layers/llama.py",
    "kvlib/memory/sparse.py",
    "kvlib/metrics/passkey.py",
    "kvlib/metrics/quality.py",
    "kvlib/metrics/recall.py",
    "kvlib/model.py",
    "kvlib/sparse/baselines.py",
    "kvlib/sparse/bounds.py",
    "kvlib/sparse/cache.py",
    "kvlib/sparse/selection.py",
)
SPARSE_FIELDS = [
    "model",
    "task",
    "policy",
    "budget",
    "dense_layers",
    "x",
    "metric",
    "value",
    "read_fraction",
    "torch",
    "date",
]


def hf_config(model) -> dict:
    """The fields chapter 3's equation reads, from a loaded model's config (float32 caches)."""
    return dict(dataclasses.asdict(model.config), model_type="llama", torch_dtype="float32")


def read_fraction(config: dict, lengths, policy: str, budget, dense_layers: int) -> float:
    """Bytes the decode steps at `lengths` (tokens held at each step, the new one included) read
    under `policy` ("full", a selector with `budget` pages and `dense_layers`, or an eviction
    policy keeping `budget` tokens: each step attends over `budget` + 1), over the full cache's."""
    from kvlib.memory import kv_cache_bytes, sparse_decode_read_bytes

    full = sum(kv_cache_bytes(config, n) for n in lengths)
    if policy == "full":
        return 1.0
    if policy in SPARSE_SELECTORS:
        read = sum(
            sparse_decode_read_bytes(
                config, n, budget, block_size=SPARSE_BLOCK_SIZE, dense_layers=dense_layers
            )
            for n in lengths
        )
    else:
        read = sum(kv_cache_bytes(config, min(n, budget + 1)) for n in lengths)
    return read / full


def matched_eviction_budget(config: dict, lengths, pages: int, dense_layers: int) -> int:
    """The eviction budget (tokens) whose `read_fraction` over `lengths` is closest to Quest's at
    `pages` pages per step."""
    target = read_fraction(config, lengths, "quest", pages, dense_layers)
    return min(
        range(1, max(lengths) + 1),
        key=lambda b: abs(read_fraction(config, lengths, "evict", b, 0) - target),
    )


def sparse_factory(selector: str, pages: int | None, dense_layers: int):
    """The `cache=` factory of a sparse run (`pages` None: every page), chapter 7's torch paged
    attention over the compacted tables (the interpreted kernel would take days here)."""
    from kvlib.sparse import SparsePagedCache

    return SparsePagedCache.factory(
        block_size=SPARSE_BLOCK_SIZE,
        budget_pages=pages,
        dense_layers=dense_layers,
        selector=selector,
        decode_attention="torch",
    )


def streamed_essay_metrics(model, ids, factory, reference) -> dict:
    """The essay (1, T) prefilled for `TEXT_PREFILL` tokens, then fed one token per decode step
    through a cache from `factory`: perplexity, and against the full cache's `reference` logits
    the top-1 agreement, mean KL (nats) and its standard error over the positions compared."""
    from kvlib.metrics.quality import agreement, streamed_logits

    cache = factory(model, *ids.shape)
    logits = streamed_logits(model, ids, cache, prefill_len=TEXT_PREFILL)
    ppl = float(torch.exp(F.cross_entropy(logits[0, :-1], ids[0, 1:])))
    a = agreement(reference[0, TEXT_PREFILL:], logits[0, TEXT_PREFILL:])
    ref = F.log_softmax(reference[0, TEXT_PREFILL:], dim=-1)
    kl = (ref.exp() * (ref - F.log_softmax(logits[0, TEXT_PREFILL:], dim=-1))).sum(-1)
    return {
        "perplexity": ppl,
        "top1_agreement": a.top1,
        "mean_kl": a.mean_kl,
        "kl_stderr": float(kl.clamp(min=0).std() / len(kl) ** 0.5),
        "positions": a.positions,
    }


def sparse_jobs() -> list[tuple]:
    """(task, policy, budget, dense_layers) of every run: the full cache; each selector at each
    budget; Quest with no dense layer at each budget; the best eviction policy at each Quest
    budget's bytes (its budget, None here, is matched when the run starts)."""
    jobs = []
    for task, budgets in SPARSE_BUDGETS.items():
        dense = SPARSE_DENSE_LAYERS[task]
        jobs.append((task, "full", None, 0))
        jobs += [(task, s, k, dense) for k in budgets for s in SPARSE_SELECTORS]
        jobs += [(task, "quest", k, 0) for k in budgets]
        jobs += [(task, BEST_EVICTION[task], ("matching", k), dense) for k in budgets]
    return jobs


def _task_rows(models, task, policy, budget, dense_layers) -> list[tuple]:
    """(x, metric, value) rows of one run."""
    from kvlib.experiments.eviction_sweep import eviction_factory
    from kvlib.experiments.sweep import passkey_rows
    from kvlib.metrics.recall import recall_hits

    course, smol, tokenizer, (essay, reference), passkeys = models
    if policy == "full":
        factory = sparse_factory("quest", None, 0)
    elif policy in SPARSE_SELECTORS:
        factory = sparse_factory(policy, budget, dense_layers)
    else:
        factory = eviction_factory(policy, budget, snapkv_window=8 if task == "recall" else 32)
    if task == "recall":  # per distance, then per document ("distance:index"), for a bootstrap
        hits = recall_hits(course, cache_factory=factory)
        rows = []
        for d, docs in hits.items():
            facts = sum(n for _, n in docs)
            rows += [(d, "recall", sum(h for h, _ in docs) / facts), (d, "facts", facts)]
        for d, docs in hits.items():
            for i, (h, n) in enumerate(docs):
                rows += [(f"{d}:{i}", "document_hits", h), (f"{d}:{i}", "document_facts", n)]
        return rows
    if task == "passkey":
        rows = []
        for depth, correct, length in passkey_rows(smol, tokenizer, passkeys, factory):
            rows += [(depth, "correct", correct), (depth, "prompt_tokens", length)]
        return rows
    metrics = streamed_essay_metrics(smol, essay, factory, reference)
    return [("", m, v) for m, v in metrics.items()]


def decode_lengths(task: str, models, prompt_tokens: int | None = None) -> list[int]:
    """Tokens held at each decode step of a task (the new token included)."""
    course, smol, tokenizer, (essay, _), _ = models
    if task == "recall":
        from kvlib import data

        return list(range(1, data.DOC_LEN + 1))  # streamed from the first token on
    if task == "text":
        return list(range(TEXT_PREFILL + 1, essay.shape[1] + 1))
    return list(range(prompt_tokens + 1, prompt_tokens + PASSKEY_NEW_TOKENS))


def sparse_sweep(out_csv: str, *, seed: int = 0) -> list[dict]:
    """Chapter 15's sweep (`sparse_jobs`, 43 runs on one CPU thread): every row of every
    run written to `out_csv` as it comes (the committed `results/sparse_sweep.csv`, which a test
    spot-checks)."""
    import csv
    import datetime

    import numpy as np
    from tqdm import tqdm

    from kvlib.experiments.passkey import PASSKEY_DEPTHS
    from kvlib.experiments.sweep import EVICTION_PASSKEY_FILLER
    from kvlib.loaders.course_model import load_course_model
    from kvlib.loaders.smollm2 import load_smollm2
    from kvlib.metrics.passkey import passkey_prompt
    from kvlib.metrics.quality import course_text

    course, (smol, tokenizer) = load_course_model(), load_smollm2()
    essay = torch.tensor([tokenizer.encode(course_text())])
    with torch.no_grad():
        reference = smol(essay)  # the full cache's logits, once
    rng = np.random.default_rng(seed)  # the keys of chapter 8's sweep
    passkeys = {d: int(rng.integers(10_000, 100_000)) for d in PASSKEY_DEPTHS}
    models = (course, smol, tokenizer, (essay, reference), passkeys)
    prompt = len(passkey_prompt(tokenizer, EVICTION_PASSKEY_FILLER, 0.5, passkeys[0.5]))
    configs = {"recall": hf_config(course), "passkey": hf_config(smol), "text": hf_config(smol)}
    lengths = {task: decode_lengths(task, models, prompt) for task in configs}
    rows = []
    with open(out_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SPARSE_FIELDS)
        writer.writeheader()
        for task, policy, budget, dense in tqdm(sparse_jobs(), desc="sparse sweep", unit="run"):
            if isinstance(budget, tuple):  # eviction at a Quest budget's bytes
                budget = matched_eviction_budget(configs[task], lengths[task], budget[1], dense)
                dense = 0
            fraction = read_fraction(configs[task], lengths[task], policy, budget, dense)
            for x, metric, value in _task_rows(models, task, policy, budget, dense):
                rows.append(
                    {
                        "model": "course model" if task == "recall" else "SmolLM2-135M-Instruct",
                        "task": task,
                        "policy": policy,
                        "budget": "" if budget is None else budget,
                        "dense_layers": dense,
                        "x": x,
                        "metric": metric,
                        "value": value,
                        "read_fraction": round(fraction, 6),
                        "torch": torch.__version__,
                        "date": datetime.date.today().isoformat(),
                    }
                )
                writer.writerow(rows[-1])
            f.flush()
    return rows


def main(argv: list[str] | None = None) -> int:
    return run("sparse_sweep", __doc__, "results/sparse_sweep.csv", sparse_sweep, argv, threads=1)


if __name__ == "__main__":
    raise SystemExit(main())
