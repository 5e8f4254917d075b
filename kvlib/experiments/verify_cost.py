"""`python -m kvlib.experiments.verify_cost`: what verifying k draft tokens costs, measured as one
forward of q = k + 1 query tokens over a cached context, for q = 1, 2, 4, 8, 16, on the CPU;
writes `results/verify_cost.csv` (chapter 16's Why).

A decode step reads every weight and the whole cache to produce one token (chapter 11: it is
memory-bound on a GPU). Feeding q tokens instead reads the same bytes and does q times the
arithmetic, so while the arithmetic stays cheaper than the reading, the extra tokens come nearly
free: that is what speculative decoding spends. Which fixed costs the extra tokens share differs
by model: SmolLM2-135M reads about 540 MB of float32 weights per forward, and its cache; the
course model's weights are 3.4 MB, read in well under a millisecond, so its step is mostly the
framework's per-operation overhead, which q tokens share just as well, and its ratios say
nothing about memory. Each model (the course model; SmolLM2-135M in
float32) prefills a random context of C tokens into a `StaticCache`, then times forwards of q
tokens after it, rolling the cache back (`truncate`) after each, so every run sees the same
context. The runs are interleaved over q, `REPEATS` rounds after a warm-up round, and the figure
is each q's median; `ratio` is that median over q = 1's, the number the chapter reads. torch runs
on one thread, so that whatever else keeps the machine's other cores busy slows every q alike
(two threads on a busy 2-core machine stall each other and scatter the times). `--quick`: the
course model at one context, 3 rounds (what a notebook can afford to re-run).
"""

from __future__ import annotations

import statistics
import time

import torch

from kvlib.experiments import options
from kvlib.experiments.cli import write_rows

QUERY_TOKENS = (1, 2, 4, 8, 16)
CONTEXTS = {"course model": (256, 1000), "SmolLM2-135M-Instruct": (512, 2048)}
REPEATS = 9

PROVENANCE_SOURCES = (
    "kvlib/cache/dense.py",
    "kvlib/experiments/verify_cost.py",
    "kvlib/layers/llama.py",
    "kvlib/loaders/course_model.py",
    "kvlib/loaders/smollm2.py",
    "kvlib/model.py",
    "kvlib/ops/attention.py",
)


def forward_times_ms(
    model, context: int, query_tokens=QUERY_TOKENS, *, repeats: int = REPEATS
) -> dict[int, list[float]]:
    """{q: wall times (ms) of `repeats` forwards of q tokens after `context` cached tokens}, the
    q values interleaved in each round, after one warm-up round (not kept)."""
    from kvlib.cache import StaticCache

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, context + max(query_tokens)), generator=g)
    cache = StaticCache.for_model(model, 1, context + max(query_tokens))
    times = {q: [] for q in query_tokens}
    with torch.no_grad():
        model(ids[:, :context], cache=cache, validate=False)
        for round_ in range(repeats + 1):
            for q in query_tokens:
                start = time.perf_counter()
                model(ids[:, context : context + q], cache=cache, validate=False)
                elapsed = (time.perf_counter() - start) * 1e3
                cache.truncate(context)
                if round_:
                    times[q].append(elapsed)
    return times


def measure(quick: bool = False) -> list[dict]:
    """Rows of (model, context, query_tokens, median_ms, ratio) for every model and context."""
    from kvlib.loaders.course_model import load_course_model

    models = {"course model": load_course_model}
    if not quick:
        from kvlib.loaders.smollm2 import load_smollm2

        models["SmolLM2-135M-Instruct"] = lambda: load_smollm2()[0]
    rows = []
    for name, load in models.items():
        model = load()
        for context in CONTEXTS[name][:1] if quick else CONTEXTS[name]:
            times = forward_times_ms(model, context, repeats=3 if quick else REPEATS)
            one = statistics.median(times[1])
            for q, runs in times.items():
                median = statistics.median(runs)
                rows.append(
                    dict(
                        model=name,
                        context=context,
                        query_tokens=q,
                        runs=len(runs),
                        median_ms=round(median, 3),
                        ratio=round(median / one, 3),
                    )
                )
    return rows


def record(out_csv: str, quick: bool = False) -> list[dict]:
    from kvlib.experiments.timing import cpu_facts

    facts = cpu_facts()
    return write_rows(out_csv, [{**row, **facts} for row in measure(quick)])


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(
        "python -m kvlib.experiments.verify_cost",
        __doc__,
        {
            "--out": {"default": "results/verify_cost.csv", "help": "CSV to write"},
            "--quick": "the course model at one context, 3 rounds",
        },
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = record(args.out, quick=args.quick)
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
