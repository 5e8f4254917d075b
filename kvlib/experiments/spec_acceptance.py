"""`python -m kvlib.experiments.spec_acceptance`: how many draft tokens the target accepts, per
drafter and k, on both models, and what each emitted token costs in forwards and K/V reads;
writes `results/spec_acceptance.csv` (chapter 16's Measure).

Greedy speculative decoding (`kvlib.speculative.speculative_generate`, temperature 0) of every
prompt with each drafter at k = 1, 2, 4, 8 draft tokens per step:

- `ngram`: prompt lookup (`ngram_draft`, n-grams of 3 down to 1) over a `DynamicCache`;
- `self`: self-speculation (`SparseSelfDrafter`): the target drafting over `budget_pages` pages of
  its own `SparsePagedCache` (Quest's pages; the first `dense_layers` layers read everything),
  verified densely.

A row is one run: one prompt, one drafter, one k. Greedy decoding makes every count exact, so a
spot check recomputes a row and compares it equal. The prompts (a run's `prompt` index):

- course model: the first 128 tokens of 8 recall documents (`kvlib.data.recall_documents(32, 8)`:
  facts that recur, which the model learned to repeat), 48 new tokens;
- SmolLM2-135M-Instruct: 4 chat prompts, two asking it to copy a sentence of the course essay, two
  asking about all of it (`kvlib.metrics.quality.course_text`, 440 tokens), 32 new tokens.

Columns: `steps` (verification forwards), `draft_tokens`, `accepted_tokens`, `emitted_tokens`
(`SpeculationStats`); `forwards` (every forward of the model after the prefill: verifications,
and a self-drafter's draft steps); `kv_token_layers_read` (one token's K and V in one layer read
once; the verification chunks read the whole cache; a draft step reads its selected pages and
their bounds, `SparsePagedCache.read_counts`); `plain_kv_token_layers_read` (what plain greedy
decoding of the same tokens reads: every cached token, every step). Greedy speculation emits the
plain tokens (the run asserts it against `kvlib.generation.generate`).
"""

from __future__ import annotations

import torch

from kvlib.experiments.cli import run, write_rows

KS = (1, 2, 4, 8)
SELF_BUDGETS = {"course model": (2, 4), "SmolLM2-135M-Instruct": (4, 8)}
SELF_LAYOUT = {"course model": (4, 1), "SmolLM2-135M-Instruct": (16, 2)}  # block size, dense
NEW_TOKENS = {"course model": 48, "SmolLM2-135M-Instruct": 32}

PROVENANCE_SOURCES = (
    "kvlib/cache/block_manager.py",
    "kvlib/cache/dense.py",
    "kvlib/cache/paged.py",
    "kvlib/cache/paged_bounds.py",
    "kvlib/experiments/spec_acceptance.py",
    "kvlib/loaders/course_model.py",
    "kvlib/loaders/smollm2.py",
    "kvlib/metrics/quality.py",
    "kvlib/model.py",
    "kvlib/sparse/cache.py",
    "kvlib/speculative/decode.py",
    "kvlib/speculative/ngram.py",
    "kvlib/speculative/self_draft.py",
    "kvlib/speculative/verify.py",
)


def course_prompts() -> list[torch.Tensor]:
    """The course model's 8 prompts, (1, 128) int64 each."""
    from kvlib import data

    return [torch.from_numpy(d.tokens[:128])[None] for d in data.recall_documents(32, 8)]


def smollm2_prompts(tokenizer) -> list[torch.Tensor]:
    """SmolLM2's 4 chat prompts, (1, T) int64 each."""
    from kvlib.metrics.quality import course_text

    text = course_text()
    sentences = [s.strip() + "." for s in text.split(". ") if len(s) > 80]
    asks = [f"Copy this sentence exactly: {sentences[i]}" for i in (0, 3)] + [
        f"{ask}\n\n{text}"
        for ask in (
            "Summarise this text in two sentences.",
            "What does this text say a KV cache is?",
        )
    ]
    return [
        torch.tensor(
            [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": a}], add_generation_prompt=True
                )
            ]
        )
        for a in asks
    ]


def run_one(model, prompt: torch.Tensor, name: str, drafter: str, k: int, budget: int | None):
    """One greedy speculative run: its `SpeculationStats` and read counts, as a row's values."""
    from kvlib.cache import DynamicCache
    from kvlib.sparse import SparsePagedCache
    from kvlib.speculative import SparseSelfDrafter, speculative_generate

    new, layers, length = NEW_TOKENS[name], model.config.num_hidden_layers, prompt.shape[1]
    if drafter == "ngram":
        cache, draft = DynamicCache(layers), None
    else:
        block_size, dense = SELF_LAYOUT[name]
        cache = SparsePagedCache.for_model(
            model,
            1,
            length + new,
            block_size=block_size,
            dense_layers=dense,
            decode_attention="torch",
        )
        draft = SparseSelfDrafter(model, cache, budget)
    forwards, dense_reads = [], []

    def count(module, args, kwargs):  # every forward: its query tokens and the cache it reads
        tokens = (args[0] if args else kwargs["input_ids"]).shape[1]
        forwards.append(tokens)
        if drafter == "ngram" or tokens > 1:  # a sparse cache counts its own single-token steps
            dense_reads.append((cache.length + tokens) * layers)

    hook = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        options = {} if draft is None else {"drafter": draft}
        tokens, stats = speculative_generate(
            model, prompt, cache, max_new_tokens=new, k=k, **options
        )
    finally:
        hook.remove()
    reads = sum(dense_reads[1:])  # the prefill's read is no decode cost
    if drafter == "self":
        counts = cache.read_counts()
        reads += counts["kv_tokens_read"] + counts["bound_pages_read"]
    plain = sum(range(length + 1, length + new)) * layers  # step t reads T + t tokens
    return tokens, dict(
        steps=stats.num_drafts,
        draft_tokens=stats.num_draft_tokens,
        accepted_tokens=stats.num_accepted_tokens,
        emitted_tokens=stats.num_emitted_tokens,
        forwards=len(forwards) - 1,
        kv_token_layers_read=reads,
        plain_kv_token_layers_read=plain,
    )


def measure(models: dict) -> list[dict]:
    """Rows for `models` ({name: (model, prompts)}), every drafter, budget, k and prompt."""
    from tqdm.auto import tqdm

    from kvlib.generation import generate

    rows = []
    for name, (model, prompts) in models.items():
        plain = [generate(model, p, NEW_TOKENS[name]) for p in prompts]
        runs = [("ngram", None)] + [("self", b) for b in SELF_BUDGETS[name]]
        todo = [(d, b, k, i) for d, b in runs for k in KS for i in range(len(prompts))]
        for drafter, budget, k, i in tqdm(todo, desc=name):
            tokens, values = run_one(model, prompts[i], name, drafter, k, budget)
            assert torch.equal(tokens, plain[i]), (name, drafter, budget, k, i)
            rows.append(
                dict(
                    model=name, drafter=drafter, budget_pages=budget or "", k=k, prompt=i, **values
                )
            )
    return rows


def record(out_csv: str) -> list[dict]:
    from kvlib.experiments.timing import cpu_facts
    from kvlib.loaders.course_model import load_course_model
    from kvlib.loaders.smollm2 import load_smollm2

    smol, tokenizer = load_smollm2()
    models = {
        "course model": (load_course_model(), course_prompts()),
        "SmolLM2-135M-Instruct": (smol, smollm2_prompts(tokenizer)),
    }
    facts = cpu_facts()
    return write_rows(out_csv, [{**row, **facts} for row in measure(models)])


def main(argv: list[str] | None = None) -> int:
    return run("spec_acceptance", __doc__, "results/spec_acceptance.csv", record, argv, threads=1)


if __name__ == "__main__":
    raise SystemExit(main())
