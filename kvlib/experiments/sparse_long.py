"""`python -m kvlib.experiments.sparse_long`: chapter 15's selectors where the budget is a small
fraction of the context, the regime Quest was built for (its README, github.com/mit-han-lab/Quest
at commit ef9ac8e, reports a 1.7x speedup over the full cache with FlashInfer at 32K tokens of
input and a budget of 2,048 tokens; the paper's 7.03x self-attention speedup is not tied to that
setting here): SmolLM2-135M (an 8,192-token context) at about 4,000 tokens, with budgets of 8 and 32
pages of 16 tokens (3% and 12% of the context). Writes `results/sparse_long.csv`.

Two tasks, each from one dense prefill shared by every page selector (a sparse cache prefills
densely, so its prefill is the same for all of them; each selector decodes from a copy):

* **passkey_length**: the full cache alone on chapter 8's passkey prompt (key at depth 0.5, one
  key) with `PASSKEY_LENGTH_FILLERS` tokens of filler: how long a prompt SmolLM2-135M can find a
  key in at all (a selector cannot find what the full cache misses);
* **passkey**: that prompt with `LONG_PASSKEY_FILLER` tokens of filler (about 2,000 tokens, the
  longest of those lengths the full cache passes), then `PASSKEY_NEW_TOKENS` greedy tokens; one
  trial per policy (a demonstration, not a rate);
* **text**: the first `TEXT_TOKENS` tokens of the course book's prose (`TEXT_FILES`), the last
  `TEXT_DECODE` fed one decode step at a time, teacher-forced; per position, the KL (nats) of
  the policy's next-token distribution from the full cache's, and whether their top-1 agree.

Against them, chapter 8's best eviction policy per task (TOVA on the passkey, H2O normalized on
the text), prefilled in chunks of 32 so that it evicts while it reads, at the token budget whose
bytes read over the decode steps match each Quest budget's (`sparse_sweep.read_fraction`,
dense layers counted for Quest only). Selectors: Quest with `SPARSE_DENSE_LAYERS` dense layers
and with none, the oracle (true attention mass) and random pages.

CPU, one thread: the prefills of 1,000 to 4,000 tokens dominate (the passkey lengths, one dense
per task, one per eviction run), then 10 and 48 decode steps per run: about 14 minutes on one core
of a 2-core machine.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from kvlib.experiments.cli import run

LONG_BUDGETS = (8, 32)  # pages of 16 tokens per decode step
LONG_DENSE_LAYERS = 2  # Quest's choice for its models
PASSKEY_LENGTH_FILLERS = (1000, 2000, 3000, 3900)  # the full cache's passkey, prompt lengths
LONG_PASSKEY_FILLER = 2000  # filler tokens: prompts of about 2,000 tokens
LONG_PASSKEY_DEPTH = 0.5
PASSKEY_NEW_TOKENS = 10
TEXT_FILES = ("book/architecture.md",)  # not intro.md: its results table is generated
TEXT_TOKENS = 4096
TEXT_DECODE = 48  # the last 48 positions are decode steps
EVICTION_CHUNK = 32
BEST_EVICTION = {"passkey": "TOVA", "text": "H2O, normalized"}
PROVENANCE_SOURCES = (
    *TEXT_FILES,
    "kvlib/cache/evicting.py",
    "kvlib/cache/eviction_policies.py",
    "kvlib/cache/paged.py",
    "kvlib/cache/paged_bounds.py",
    "kvlib/experiments/eviction_sweep.py",
    "kvlib/experiments/sparse_long.py",
    "kvlib/experiments/sparse_sweep.py",
    "kvlib/layers/llama.py",
    "kvlib/memory/sparse.py",
    "kvlib/metrics/passkey.py",
    "kvlib/model.py",
    "kvlib/sparse/baselines.py",
    "kvlib/sparse/bounds.py",
    "kvlib/sparse/cache.py",
    "kvlib/sparse/selection.py",
)
LONG_FIELDS = [
    "task",
    "policy",
    "budget",
    "dense_layers",
    "context",
    "x",
    "metric",
    "value",
    "read_fraction",
    "torch",
    "date",
]


def long_text(tokenizer) -> torch.Tensor:
    """(1, `TEXT_TOKENS`) int64: the course book's prose (`TEXT_FILES`, joined), tokenized."""
    from pathlib import Path

    root = Path(__file__).parents[2]
    text = "\n\n".join((root / name).read_text() for name in TEXT_FILES)
    ids = tokenizer.encode(text)[:TEXT_TOKENS]
    if len(ids) < TEXT_TOKENS:
        raise ValueError(f"TEXT_FILES: expected {TEXT_TOKENS} tokens, got {len(ids)}")
    return torch.tensor([ids])


def sparse_policies(budgets=LONG_BUDGETS) -> list[tuple[str, int | None, int]]:
    """(selector, budget pages, dense layers) of the sparse runs: the full cache, then each
    selector at each budget, Quest also with no dense layer."""
    runs = [("full", None, 0)]
    for pages in budgets:
        runs += [
            ("quest", pages, LONG_DENSE_LAYERS),
            ("quest", pages, 0),
            ("oracle", pages, LONG_DENSE_LAYERS),
            ("random", pages, LONG_DENSE_LAYERS),
        ]
    return runs


def _with_selection(cache, selector: str, pages: int | None, dense: int):
    """A copy of a densely prefilled `SparsePagedCache` that decodes with `selector`."""
    decoding = copy.deepcopy(cache)
    decoding.selector = "quest" if selector == "full" else selector
    decoding.budget_pages, decoding.dense_layers = pages, dense
    return decoding


@torch.no_grad()
def _greedy(model, cache, first_logits, steps: int) -> list[int]:
    """`steps` greedy tokens, the first from `first_logits` (V,), each later one a decode step."""
    tokens = [int(first_logits.argmax())]
    for _ in range(steps - 1):
        logits = model(torch.tensor([[tokens[-1]]]), cache=cache, validate=False)
        tokens.append(int(logits[0, -1].argmax()))
    return tokens


@torch.no_grad()
def _teacher_forced(model, cache, ids: torch.Tensor, start: int) -> torch.Tensor:
    """(T - start, V) logits: ids[:, start:] fed one decode step at a time (row i predicts token
    start + i + 1)."""
    steps = range(start, ids.shape[1])
    return torch.stack(
        [model(ids[:, t : t + 1], cache=cache, validate=False)[0, -1] for t in steps]
    )


@torch.no_grad()
def _chunked_prefill(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """Prefill `ids` (1, T) in chunks of `EVICTION_CHUNK`; the last position's logits (V,)."""
    for start in range(0, ids.shape[1], EVICTION_CHUNK):
        logits = model(ids[:, start : start + EVICTION_CHUNK], cache=cache, validate=False)
    return logits[0, -1]


def passkey_key(seed: int = 0) -> int:
    """The recording's pass key, a five-digit int drawn from `seed`."""
    import numpy as np

    return int(np.random.default_rng(seed).integers(10_000, 100_000))


def full_cache_passkey(model, tokenizer, filler: int, key: int) -> tuple[int, int]:
    """(prompt tokens, 1 if the full cache's `PASSKEY_NEW_TOKENS` greedy tokens contain `key`
    else 0) for chapter 8's passkey prompt with `filler` tokens of filler, the key at
    `LONG_PASSKEY_DEPTH`."""
    from kvlib.experiments.sparse_sweep import sparse_factory
    from kvlib.metrics.passkey import passkey_prompt

    ids = torch.tensor([passkey_prompt(tokenizer, filler, LONG_PASSKEY_DEPTH, key)])
    cache = sparse_factory("quest", None, 0)(model, 1, ids.shape[1] + PASSKEY_NEW_TOKENS)
    with torch.no_grad():
        first = model(ids, cache=cache)[0, -1]
    answer = tokenizer.decode(_greedy(model, cache, first, PASSKEY_NEW_TOKENS))
    return ids.shape[1], int(str(key) in answer)


def sparse_long(out_csv: str, *, seed: int = 0) -> list[dict]:
    """The recording (see the module docstring): every row written to `out_csv` as it comes."""
    import csv
    import datetime

    from tqdm import tqdm

    from kvlib.experiments.eviction_sweep import eviction_factory
    from kvlib.experiments.sparse_sweep import (
        hf_config,
        matched_eviction_budget,
        read_fraction,
        sparse_factory,
    )
    from kvlib.loaders.smollm2 import load_smollm2
    from kvlib.metrics.passkey import passkey_prompt

    model, tokenizer = load_smollm2()
    config = hf_config(model)
    key = passkey_key(seed)
    prompt = torch.tensor([passkey_prompt(tokenizer, LONG_PASSKEY_FILLER, LONG_PASSKEY_DEPTH, key)])
    text = long_text(tokenizer)
    start = TEXT_TOKENS - TEXT_DECODE
    lengths = {
        "passkey": list(range(prompt.shape[1] + 1, prompt.shape[1] + PASSKEY_NEW_TOKENS)),
        "text": list(range(start + 1, TEXT_TOKENS + 1)),
    }
    context = {"passkey": prompt.shape[1], "text": TEXT_TOKENS}
    context["passkey_length"] = None  # per row: each prompt's own length
    jobs = [("passkey_length", "full", filler, 0) for filler in PASSKEY_LENGTH_FILLERS]
    jobs += [(task, *run) for task in ("passkey", "text") for run in sparse_policies()]
    jobs += [
        (task, "evict", pages, LONG_DENSE_LAYERS) for task in lengths for pages in LONG_BUDGETS
    ]
    rows, prefilled, reference = [], {}, None
    f = open(out_csv, "w", newline="")
    writer = csv.DictWriter(f, fieldnames=LONG_FIELDS)
    writer.writeheader()

    def emit(task, policy, budget, dense, fraction, results):
        for x, metric, value in results:
            rows.append(
                dict(
                    task=task,
                    policy=policy,
                    budget="" if budget is None else budget,
                    dense_layers=dense,
                    context=context[task] or x,
                    x=x,
                    metric=metric,
                    value=value,
                    read_fraction=round(fraction, 6),
                    torch=torch.__version__,
                    date=datetime.date.today().isoformat(),
                )
            )
            writer.writerow(rows[-1])
        f.flush()

    with f:
        for task, policy, pages, dense in tqdm(jobs, desc="sparse long", unit="run"):
            if task == "passkey_length":  # `pages` holds the filler length here
                length, found = full_cache_passkey(model, tokenizer, pages, key)
                emit(task, policy, None, 0, 1.0, [(length, "correct", found)])
                continue
            ids = prompt if task == "passkey" else text[:, :start]
            if policy == "evict":
                label = BEST_EVICTION[task]
                budget = matched_eviction_budget(config, lengths[task], pages, dense)
                cache = eviction_factory(label, budget)(model, 1, TEXT_TOKENS + 16)
                first = _chunked_prefill(model, cache, ids)
                policy, pages, dense = label, budget, 0
                fraction = read_fraction(config, lengths[task], "evict", budget, 0)
            else:
                if task not in prefilled:  # one dense prefill per task, copied per selector
                    base = sparse_factory("quest", None, 0)(model, 1, TEXT_TOKENS + 16)
                    with torch.no_grad():
                        logits = model(ids, cache=base)[0, -1]
                    prefilled[task] = (base, logits)
                base, first = prefilled[task]
                cache = _with_selection(base, policy, pages, dense)
                fraction = read_fraction(config, lengths[task], policy, pages, dense)
            if task == "passkey":
                answer = tokenizer.decode(_greedy(model, cache, first, PASSKEY_NEW_TOKENS))
                results = [(LONG_PASSKEY_DEPTH, "correct", int(str(key) in answer))]
            else:
                logits = _teacher_forced(model, cache, text, start)  # decode steps only
                if policy == "full":
                    reference = logits
                ref = F.log_softmax(reference, dim=-1)
                kl = (ref.exp() * (ref - F.log_softmax(logits, dim=-1))).sum(-1).clamp(min=0)
                top1 = logits.argmax(-1) == reference.argmax(-1)
                results = [(start + i, "kl", float(v)) for i, v in enumerate(kl)]
                results += [(start + i, "top1", int(v)) for i, v in enumerate(top1)]
            emit(task, policy, pages, dense, fraction, results)
    return rows


def main(argv: list[str] | None = None) -> int:
    return run("sparse_long", __doc__, "results/sparse_long.csv", sparse_long, argv, threads=1)


if __name__ == "__main__":
    raise SystemExit(main())
