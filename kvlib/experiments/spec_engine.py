"""`python -m kvlib.experiments.spec_engine`: what speculation in chapter 12's engine does to the
wall clock as the batch grows, on a CPU; writes `results/spec_engine.csv` (chapter 16, issue 59).

Speculation makes fewer steps (a verification emits the accepted drafts and the bonus token) and
costlier ones (each speculating request computes k + 1 query tokens). At one request a decode
step reads every weight for one token, so verifying a few more is nearly free (chapter 11's
memory-bound regime; this chapter's "Why"); as the batch grows the step's matrix products get
rows enough to be bound by arithmetic, and the extra query tokens cost their full price. This
measures both sides of that trade on the engine itself:

- the workload: `requests` greedy requests admitted at once (every prompt prefilled in the first
  step), with prompt-lookup drafts of up to `K` tokens (`SpeculativeConfig`) or without them;
  - course model: the first 128 tokens of recall documents (`kvlib.data.recall_documents(32, n)`,
    the documents `spec_acceptance` drafts over), 48 new tokens each, at 1, 4, 16 and 64 requests;
  - SmolLM2-135M-Instruct: chat prompts over the course essay's long sentences
    (`kvlib.metrics.quality.course_text`), taken in turn from `ASKS` (copy it; say it in other
    words), 32 new tokens each, at 1, 4 and 16 requests;
- each engine runs once to warm up, then `REPEATS[model]` rounds interleaved (plain, speculative,
  plain, ...: 9 for the course model, whose steps of a few milliseconds a busy spell of the
  machine moves most, 5 for SmolLM2), so that a busy spell slows both alike; a row keeps the
  fastest round and the median;
- `decode_s`: the fastest round's decode steps (every step after the first, which prefills every
  prompt), the engine's own per-step wall times (`StepStats.seconds`); `decode_steps` and
  `decode_tokens` (tokens computed in them: the rejected drafts included) are exact counts, as are
  the drafts and the accepted draft tokens (vLLM's counters, `stats.spec_decoding`);
- `identical`: requests whose tokens equal the plain engine's (greedy speculation is
  token-identical by construction; the run asserts it);
- `rejected_drafts`: verifications that rejected a guess (the rest accepted every guess), so
  that `accepted_tokens / (accepted_tokens + rejected_drafts)` estimates the probability that a
  guess stands once reached, the alpha of Leviathan et al.'s i.i.d. model;
- `decode_median_s`, `decode_median_speedup`: the median round's decode time and the speed-up
  from the medians (the figure to read), beside the fastest round's (`decode_s`,
  `decode_speedup`), to show how much the ratio moves between rounds on a shared machine.

So a decode speed-up (plain decode time / this decode time) factors into the steps saved
(`plain decode_steps / decode_steps`) over the cost of a step (decode time / `decode_steps` against
the plain engine's), which chapter 16's Measure reads. float32, 2 threads. A spot check
(`make spot-checks`) recomputes the course model's counted columns at 1 and 4 requests; the
timings are this machine's. `--quick` runs the course model at 1 and 16 requests, one round,
and prints the table without writing (the chapter offers it).
"""

from __future__ import annotations

import datetime
import statistics
import time

from kvlib.experiments.cli import write_rows
from kvlib.experiments.options import run_with_quick

K = 4
REPEATS = {"course model": 9, "SmolLM2-135M-Instruct": 5}
REQUESTS = {"course model": (1, 4, 16, 64), "SmolLM2-135M-Instruct": (1, 4, 16)}
NEW_TOKENS = {"course model": 48, "SmolLM2-135M-Instruct": 32}
ASKS = ("Copy this sentence exactly:", "Say this sentence again in other words:")
ENGINES = ("plain", "speculative")
PROVENANCE_SOURCES = (
    "kvlib/cache/block_manager.py",
    "kvlib/cache/paged.py",
    "kvlib/engine/batch.py",
    "kvlib/engine/input_batch.py",
    "kvlib/engine/llm_engine.py",
    "kvlib/engine/runner.py",
    "kvlib/engine/sampler.py",
    "kvlib/engine/scheduler.py",
    "kvlib/engine/speculative.py",
    "kvlib/experiments/spec_engine.py",
    "kvlib/layers/llama.py",
    "kvlib/model.py",
    "kvlib/ops/attention.py",
    "kvlib/speculative/ngram.py",
    "kvlib/speculative/verify.py",
)


def course_prompts(num_requests: int) -> list[list[int]]:
    """The course model's prompts: the first 128 tokens of `num_requests` recall documents."""
    from kvlib import data

    return [d.tokens[:128].tolist() for d in data.recall_documents(32, num_requests)]


def smollm2_prompts(tokenizer, num_requests: int) -> list[list[int]]:
    """SmolLM2's chat prompts: request i asks `ASKS[i % 2]` of the essay's (i // 2)-th long
    sentence (over 80 characters; taken in turn)."""
    from kvlib.metrics.quality import course_text

    sentences = [s.strip() + "." for s in course_text().split(". ") if len(s) > 80]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{ASKS[i % 2]} {sentences[i // 2 % len(sentences)]}"}],
            add_generation_prompt=True,
        )
        for i in range(num_requests)
    ]


def engine_runner(model, prompts: list[list[int]], max_tokens: int, speculative: bool):
    """A callable serving `prompts` greedily on a fresh `LLMEngine` (blocks and budget for every
    request at once; prompt-lookup drafts of up to `K` tokens if `speculative`); it returns (the
    output ids per prompt, the engine's stats)."""
    from kvlib.engine import LLMEngine, SamplingParams, SpeculativeConfig

    blocks = sum(-(-(len(p) + max_tokens + K) // 16) for p in prompts)
    params = SamplingParams(max_tokens=max_tokens)
    spec = SpeculativeConfig(num_speculative_tokens=K) if speculative else None

    def once():
        engine = LLMEngine(
            model,
            num_blocks=blocks,
            block_size=16,
            max_num_seqs=len(prompts),
            max_num_batched_tokens=sum(map(len, prompts)) + (K + 1) * len(prompts),
            max_model_len=max(map(len, prompts)) + max_tokens + K,
            speculative_config=spec,
        )
        rejected = [0]  # verifications that rejected a guess (Leviathan's i.i.d. estimate)
        if spec is not None:
            observe = engine.speculator.stats.observe_draft

            def counting(num_draft_tokens: int, num_accepted_tokens: int) -> None:
                rejected[0] += num_accepted_tokens < num_draft_tokens
                observe(num_draft_tokens, num_accepted_tokens)

            engine.speculator.stats.observe_draft = counting
        outputs = engine.generate(prompts, params, use_tqdm=False)
        return [list(o.output_token_ids) for o in outputs], engine.stats, rejected[0]

    return once


def compare(model, prompts, max_tokens: int, *, repeats: int = 3) -> list[dict]:
    """A row per engine (plain, speculative) serving `prompts`: the fastest and median of
    `repeats` interleaved rounds after a warm-up, its decode steps' time and counts (see the
    module docstring)."""
    runners = {name: engine_runner(model, prompts, max_tokens, name != "plain") for name in ENGINES}
    runs = {name: [run()] for name, run in runners.items()}  # the warm-up, kept for its counts
    seconds = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            runs[name].append(run())
            seconds[name].append(time.perf_counter() - start)
    plain_tokens = runs["plain"][0][0]
    rows = []
    for name in ENGINES:
        tokens, _, rejected = runs[name][0]
        assert tokens == plain_tokens or name == "plain", "greedy speculation changed a token"
        decode_s = [sum(s.seconds for s in stats if s.num_prefill_tokens == 0)
                    for _, stats, _ in runs[name][1:]]  # fmt: skip
        fastest = min(range(repeats), key=seconds[name].__getitem__)
        stats = runs[name][1 + fastest][1]
        decode = [s for s in stats if s.num_prefill_tokens == 0]
        assert len(decode) == len(stats) - 1, "every prompt is prefilled in the first step"
        spec = stats.spec_decoding
        output = len(prompts) * max_tokens
        rows.append(
            dict(
                engine=name,
                requests=len(prompts),
                k=K if name != "plain" else 0,
                prompt_tokens=sum(map(len, prompts)),
                output_tokens=output,
                decode_steps=len(decode),
                decode_tokens=sum(s.num_decode_tokens for s in decode),
                drafts=spec.num_drafts if spec else 0,
                draft_tokens=spec.num_draft_tokens if spec else 0,
                accepted_tokens=spec.num_accepted_tokens if spec else 0,
                rejected_drafts=rejected,
                identical=sum(a == b for a, b in zip(tokens, plain_tokens)),
                best_s=round(min(seconds[name]), 4),
                median_s=round(statistics.median(seconds[name]), 4),
                decode_s=round(sum(s.seconds for s in decode), 4),
                decode_median_s=round(statistics.median(decode_s), 4),
            )
        )
    plain = rows[0]
    for row in rows:
        row["decode_speedup"] = round(plain["decode_s"] / row["decode_s"], 3)
        row["decode_median_speedup"] = round(plain["decode_median_s"] / row["decode_median_s"], 3)
        row["speedup"] = round(plain["best_s"] / row["best_s"], 3)
    return rows


def record(out_csv: str | None, *, quick: bool = False) -> list[dict]:
    """Both models at every request count of `REQUESTS` (quick: the course model at 1 and 16
    requests, one round); print the table; write `out_csv` unless it is None."""
    from tqdm.auto import tqdm

    from kvlib.experiments.timing import cpu_facts
    from kvlib.loaders.course_model import load_course_model
    from kvlib.loaders.smollm2 import load_smollm2

    models = {"course model": lambda: (load_course_model(), course_prompts)}
    if not quick:
        models["SmolLM2-135M-Instruct"] = lambda: _smollm2_with_prompts(load_smollm2)
    rows = []
    for name, load in models.items():
        model, prompts_for = load()
        counts = (1, 16) if quick else REQUESTS[name]
        for n in tqdm(counts, desc=name, unit="batch"):
            prompts = prompts_for(n)
            for row in compare(
                model, prompts, NEW_TOKENS[name], repeats=1 if quick else REPEATS[name]
            ):
                rows.append(dict(model=name, **row))
    facts = dict(cpu_facts(), date=datetime.date.today().isoformat())
    rows = [dict(row, **facts) for row in rows]
    print(table(rows))
    return rows if out_csv is None else write_rows(out_csv, rows)


def _smollm2_with_prompts(load_smollm2):
    model, tokenizer = load_smollm2()
    return model, lambda n: smollm2_prompts(tokenizer, n)


def table(rows: list[dict]) -> str:
    """The rows as a text table: model, requests, engine, decode steps, tokens per request-step,
    decode ms per step, decode speed-up."""
    lines = [f"{'model':<22} {'requests':>8}  {'engine':<12} {'steps':>6} {'ms/step':>8} "
             f"{'accepted':>9} {'decode speed-up':>15}"]  # fmt: skip
    for r in rows:
        steps, draft = int(r["decode_steps"]), int(r["draft_tokens"])
        accepted = f"{int(r['accepted_tokens']) / draft:.0%}" if draft else "-"
        lines.append(
            f"{r['model']:<22} {r['requests']:>8}  {r['engine']:<12} {steps:>6} "
            f"{float(r['decode_s']) / steps * 1e3:>8.1f} {accepted:>9} "
            f"{float(r['decode_speedup']):>14.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_with_quick(
        "spec_engine",
        __doc__.split("\n")[0],
        "results/spec_engine.csv",
        "the course model at 1 and 16 requests, one round; print, write nothing",
        record,
        argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
