"""`python -m kvlib.experiments.serving_cpu`: chapter 12's engine on a CPU against what a learner
could run instead, transformers' `generate`; writes `results/serving_cpu.csv` (issue 62).

The workload: 16 and 64 requests at once, prompts of random token ids with lengths uniform in
[32, 96] (`serving_gpu.workload_prompts`, seeded; the course model's 128-token vocabulary takes
ids from all of it), 32 output tokens each (no stop token), greedy, float32, on both models.
Contenders, each given the same prompts:

- `kvlib_engine`: `LLMEngine` with its CPU defaults (continuous batching over the paged cache,
  attention through the torch reference over each sequence's gathered blocks); every prompt is
  admitted in the first step, so the run is one prefill step and 31 decode steps;
- `hf_generate`: transformers' `generate` on one left-padded batch with its dynamic cache (what
  a learner writes first), holding the same weights (`serving_gpu.hf_model`);
- `hf_generate_batch`: transformers' continuous batching (`generate_batch`), where the installed
  transformers has it, at 16 requests only (several times slower than both there, it would
  take most of the run at 64).

Each contender runs once to warm up, then `REPEATS` rounds interleaved (kvlib, transformers,
kvlib, ...) so that a busy spell of the machine slows them alike; a row keeps the fastest and the
median round. `speedup_vs_hf_generate` is the ratio of the fastest rounds, the issue's measure.
`identical_to_kvlib` counts the requests whose 32 tokens equal the engine's (float32 in another
operation order: equality is reported, not required). `--quick` runs SmolLM2 alone at 8 requests
and 16 tokens, the engine and `generate` only, one round, and prints the table without writing
(chapter 12 offers it).
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time

import torch

from kvlib.experiments.cli import write_rows
from kvlib.experiments.options import run_with_quick

PROMPT_LEN, OUTPUT_LEN, SEED, REPEATS = (32, 96), 32, 0, 3
REQUESTS = (16, 64)
CONTENDERS = ("kvlib_engine", "hf_generate", "hf_generate_batch")
BATCH_ONLY_UP_TO = 16  # hf_generate_batch runs at this many requests or fewer
PROVENANCE_SOURCES = (
    "kvlib/cache/block_manager.py",
    "kvlib/cache/paged.py",
    "kvlib/engine/batch.py",
    "kvlib/engine/input_batch.py",
    "kvlib/engine/llm_engine.py",
    "kvlib/engine/runner.py",
    "kvlib/engine/sampler.py",
    "kvlib/engine/scheduler.py",
    "kvlib/experiments/serving_cpu.py",
    "kvlib/experiments/serving_gpu.py",
    "kvlib/layers/llama.py",
    "kvlib/model.py",
    "kvlib/ops/attention.py",
)


def prompts_for(model, num_requests: int, seed: int = SEED) -> list[list[int]]:
    """The workload's prompts for `model`: `serving_gpu.workload_prompts` (ids from 256 up, no
    special tokens) for SmolLM2; for the course model, whose vocabulary has 128 ids, ids drawn
    from all of it, lengths as there."""
    from kvlib.experiments.serving_gpu import workload_prompts

    vocab = model.config.vocab_size
    return workload_prompts(
        vocab, num_requests=num_requests, prompt_len=PROMPT_LEN, seed=seed, low=256 * (vocab > 256)
    )


def kvlib_runner(model, prompts, max_tokens: int):
    """A callable that serves `prompts` on a fresh `LLMEngine` (blocks for every request's whole
    length, every prompt admitted in the first step) and returns the output ids per prompt."""
    from kvlib.engine import LLMEngine, SamplingParams

    longest = max(map(len, prompts)) + max_tokens
    blocks = sum(-(-(len(p) + max_tokens) // 16) for p in prompts)
    params = SamplingParams(max_tokens=max_tokens)

    def once():
        engine = LLMEngine(
            model,
            num_blocks=blocks,
            block_size=16,
            max_num_seqs=len(prompts),
            max_num_batched_tokens=max(2048, sum(map(len, prompts))),
            max_model_len=longest,
        )
        outputs = engine.generate(prompts, params, use_tqdm=False)
        return [list(o.output_token_ids) for o in outputs]

    return once


def contenders_for(model, prompts, max_tokens: int, *, quick: bool = False) -> dict:
    """{name: callable} of the contenders that run at this many requests here (`quick`: the
    engine and `hf_generate` only)."""
    from kvlib.experiments.serving_gpu import ContenderUnavailable, hf_model, hf_runner

    hf = hf_model(model)
    runners = {"kvlib_engine": kvlib_runner(model, prompts, max_tokens)}
    for name, theirs in (("hf_generate", "hf_generate_dynamic"), ("hf_generate_batch", None)):
        if name == "hf_generate_batch" and (quick or len(prompts) > BATCH_ONLY_UP_TO):
            continue
        try:
            runners[name] = hf_runner(
                hf, theirs or name, prompts, max_new_tokens=max_tokens, device="cpu"
            )
        except ContenderUnavailable as error:
            print(error, file=sys.stderr)
    return runners


def compare(
    model, num_requests: int, *, max_tokens=OUTPUT_LEN, repeats=REPEATS, quick=False
) -> list[dict]:
    """One row per contender serving `num_requests` prompts on `model`: the fastest and median
    of `repeats` interleaved rounds after a warm-up, output tok/s of the fastest, the speed-up
    over `hf_generate` and the requests whose tokens equal the engine's."""
    prompts = prompts_for(model, num_requests)
    runners = contenders_for(model, prompts, max_tokens, quick=quick)
    outputs = {name: run() for name, run in runners.items()}  # the warm-up
    seconds = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            outputs[name] = run()
            seconds[name].append(time.perf_counter() - start)
    ours, tokens = outputs["kvlib_engine"], num_requests * max_tokens
    rows = []
    for name in runners:
        assert all(len(o) == max_tokens for o in outputs[name]), name
        best = min(seconds[name])
        rows.append(
            dict(
                contender=name,
                requests=num_requests,
                prompt_tokens=sum(map(len, prompts)),
                output_tokens=tokens,
                best_s=round(best, 3),
                median_s=round(statistics.median(seconds[name]), 3),
                output_tok_s=round(tokens / best, 1),
                speedup_vs_hf_generate=round(min(seconds["hf_generate"]) / best, 3),
                identical_to_kvlib=sum(a == b for a, b in zip(outputs[name], ours)),
            )
        )
    return rows


def record(out_csv: str | None, *, quick: bool = False) -> list[dict]:
    """Both models at every request count of `REQUESTS` (quick: SmolLM2 at 8 requests, 16 tokens,
    one round); print the table; write `out_csv` unless it is None."""
    import transformers
    from tqdm.auto import tqdm

    from kvlib.experiments.timing import cpu_facts
    from kvlib.loaders.course_model import load_course_model
    from kvlib.loaders.smollm2 import load_smollm2

    torch.manual_seed(0)
    models = {"smollm2": lambda: load_smollm2()[0]}
    if not quick:
        models["course"] = load_course_model
    runs = [(m, n) for m in models for n in ((8,) if quick else REQUESTS)]
    rows = []
    for model_name, n in tqdm(runs, desc="serving runs", unit="run"):
        model = models[model_name]()
        kwargs = dict(max_tokens=16, repeats=1, quick=True) if quick else {}
        for row in compare(model, n, **kwargs):
            rows.append(dict(model=model_name, **row))
    facts = dict(
        cpu_facts(), transformers=transformers.__version__, date=datetime.date.today().isoformat()
    )
    rows = [dict(row, **facts) for row in rows]
    print(table(rows))
    return rows if out_csv is None else write_rows(out_csv, rows)


def table(rows: list[dict]) -> str:
    """The rows as a text table: model, requests, contender, output tok/s, the speed-up over
    transformers' `generate`, identical requests."""
    lines = [f"{'model':<8} {'requests':>8}  {'contender':<18} {'output tok/s':>12} "
             f"{'vs generate':>11} {'identical':>9}"]  # fmt: skip
    for r in rows:
        lines.append(
            f"{r['model']:<8} {r['requests']:>8}  {r['contender']:<18} "
            f"{float(r['output_tok_s']):>12.1f} {float(r['speedup_vs_hf_generate']):>10.2f}x "
            f"{r['identical_to_kvlib']:>5}/{r['requests']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_with_quick(
        "serving_cpu",
        __doc__.split("\n")[0],
        "results/serving_cpu.csv",
        "SmolLM2 alone, 8 requests, 16 tokens, one round; print, write nothing",
        record,
        argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
