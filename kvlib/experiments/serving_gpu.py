"""`python -m kvlib.experiments.serving_gpu`: chapter 12's engine on a CUDA GPU against
transformers, serving SmolLM2-135M-Instruct in bf16 (fp16 on a GPU older than compute capability
8.0, `kvlib.ops.devices.kernel_dtype`); writes `results/serving_gpu.csv` (chapter 12, "On a
GPU").

The workload (issue 36): 64 requests, prompts of uniform random length in [64, 512] tokens of random
ids (seeded), 128 output tokens each (no stop token), greedy. Contenders, each in its own process
(so one that fails or hangs costs only its own row):

- kvlib's engine five ways: `eager` (attention through the torch reference, which gathers each
  sequence's K/V), `kernel` (decode rows through chapter 11's Triton kernel, prefill rows through
  `BatchKV`'s padded batch), `graphs` (the kernel, and decode-only steps replayed as CUDA graphs
  at bucketed batch sizes: the engine's default on a GPU), `overlap` (graphs, and the host
  planning step n + 1 while the GPU runs step n: `async_scheduling`), `mixed` (overlap, and
  steps with prompt tokens through the fused varlen kernel, replayed as graphs too:
  `kvlib.engine.mixed_graph`);
- transformers' `generate` on one left-padded batch, with its dynamic cache and with its static
  cache (`cache_implementation="static"`, which `generate` compiles with `torch.compile`);
- transformers' `generate_batch` (its continuous-batching engine), where the installed
  transformers has it.

Each is run once to warm up (compilation, graph capture) and once timed; output tok/s = output
tokens / wall seconds of the timed run. For the kvlib variants the timed run also records, for
each decode-only step, its host time (the wall time of `LLMEngine.step`) and its GPU time (CUDA
events around the step's device work, on the stream: the span from the first kernel to the
sampled tokens, idle gaps between kernels included, which is what a host-bound step shows):
`decode_host_ms`, `decode_gpu_ms` are their medians. The kvlib variants are also served under
wall-clock Poisson arrivals at three rates (TTFT and TPOT percentiles). Every row records the
device, the versions and the commit. `match16` counts the requests whose first 16 tokens equal
kvlib eager's (bf16 arithmetic differs between implementations, so equality is reported, not
required). A contender that cannot run here (its transformers API missing) or fails is left out of
the CSV and named on stderr and in the summary line; the others are recorded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np

from kvlib.experiments import options
from kvlib.experiments.cli import write_rows
from kvlib.serve.load import latency_percentiles, poisson_arrival_times

NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN, SEED = 64, (64, 512), 128, 0
POISSON_RATES = (16.0, 48.0, 128.0)  # requests per second, wall clock
_GRAPHS = dict(decode_kernel=True, prefill_varlen=False, cuda_graphs=True)
KVLIB = {  # (ModelRunner options, LLMEngine options) of each kvlib contender
    "kvlib_mixed": (
        dict(decode_kernel=True, prefill_varlen=True, cuda_graphs=True, mixed_graphs=True),
        dict(async_scheduling=True),
    ),
    "kvlib_overlap": (_GRAPHS, dict(async_scheduling=True)),
    "kvlib_graphs": (_GRAPHS, {}),
    "kvlib_kernel": (dict(decode_kernel=True, prefill_varlen=False, cuda_graphs=False), {}),
    "kvlib_eager": (dict(decode_kernel=False, prefill_varlen=False, cuda_graphs=False), {}),
}
TRANSFORMERS = ("hf_generate_dynamic", "hf_generate_batch", "hf_generate_static_compiled")
CONTENDERS = (*KVLIB, *TRANSFORMERS)


def workload_prompts(
    vocab_size: int, *, num_requests=NUM_REQUESTS, prompt_len=PROMPT_LEN, seed=SEED, low=256
):
    """The workload's prompts: lists of random token ids in [low, vocab_size) (by default from
    256: no special tokens), lengths uniform in `prompt_len` (inclusive); seeded, the same
    everywhere."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(prompt_len[0], prompt_len[1] + 1, num_requests)
    return [rng.integers(low, vocab_size, int(n)).tolist() for n in lengths]


MAX_NUM_BATCHED_TOKENS = 8192


def kvlib_engine(model, variant: str, prompts: list[list[int]]):
    """An `LLMEngine` for the workload whose runner and engine options are `KVLIB[variant]`'s."""
    from kvlib.engine import LLMEngine
    from kvlib.engine.runner import ModelRunner

    runner_options, engine_options = KVLIB[variant]
    longest = max(map(len, prompts)) + OUTPUT_LEN
    blocks = sum(-(-(len(p) + OUTPUT_LEN) // 16) for p in prompts) + 16
    engine = LLMEngine(
        model,
        num_blocks=blocks,
        block_size=16,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_model_len=longest,
        **engine_options,
    )
    engine.runner = ModelRunner(
        model,
        engine.storage,
        engine.manager,
        max_graph_batch=len(prompts),
        max_num_seqs=len(prompts),
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_model_len=longest,
        **runner_options,
    )
    return engine


def serve_offline(engine, prompts) -> tuple[float, list[list[int]], dict]:
    """All prompts at once: (wall seconds, output ids per prompt, the decode-only steps' median
    host and GPU milliseconds: `decode_step_times_ms`)."""
    import torch

    from kvlib.engine import SamplingParams

    params = SamplingParams(max_tokens=OUTPUT_LEN)
    engine.runner.gpu_events = []
    first_step = len(engine.stats)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    times = decode_step_times_ms(engine.stats[first_step:], engine.runner.gpu_events)
    engine.runner.gpu_events = None
    return seconds, [list(o.output_token_ids) for o in outputs], times


def decode_step_times_ms(stats, gpu_events) -> dict:
    """Median host ms (`StepStats.seconds`) of the decode-only steps among `stats`, and median GPU
    ms of the decode-only steps' events (`ModelRunner.gpu_events`: (decode only, start, end)
    CUDA events, synchronized already)."""
    decode = [s.seconds * 1e3 for s in stats if s.num_prefill_tokens + s.num_recomputed_tokens == 0]
    gpu = [start.elapsed_time(end) for only, start, end in gpu_events if only]
    return dict(
        decode_host_ms=float(np.median(decode)) if decode else float("nan"),
        decode_gpu_ms=float(np.median(gpu)) if gpu else float("nan"),
    )


def serve_poisson(engine, prompts, rate: float, seed: int = SEED) -> dict:
    """Requests arrive as a Poisson process of `rate` per second (wall clock, seeded gaps); the
    engine steps whenever it has work. Returns seconds, output tokens and TTFT/TPOT lists."""
    from kvlib.engine import SamplingParams

    arrivals = poisson_arrival_times(rate, len(prompts), seed + 1)
    params = SamplingParams(max_tokens=OUTPUT_LEN)
    first, done, arrived_at, tokens = {}, {}, {}, 0
    start, nxt = time.perf_counter(), 0
    while nxt < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while nxt < len(prompts) and arrivals[nxt] <= now:
            request_id = f"poisson-{rate}-{nxt}"
            engine.add_request(request_id, prompts[nxt], params)
            arrived_at[request_id], nxt = start + arrivals[nxt], nxt + 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[nxt] - now))
            continue
        for output in engine.step():  # the step's tokens are on the host when it returns
            stamp = time.perf_counter()
            tokens += len(output.new_token_ids)
            first.setdefault(output.request_id, stamp)
            if output.finished:
                done[output.request_id] = stamp
    ttft = [first[r] - arrived_at[r] for r in done]
    tpot = [(done[r] - first[r]) / (OUTPUT_LEN - 1) for r in done]
    return dict(seconds=time.perf_counter() - start, tokens=tokens, ttft=ttft, tpot=tpot)


def hf_model(model):
    """transformers' `LlamaForCausalLM` holding the same weights as kvlib's `model`."""
    import transformers

    config = transformers.LlamaConfig(**model.config.to_hf())
    hf = transformers.LlamaForCausalLM(config).to(model.lm_head.weight.dtype)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    missing = [m for m in missing if "rotary" not in m]
    if missing or unexpected:
        raise ValueError(f"hf_model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    hf.tie_weights()
    return hf.to(model.lm_head.weight.device).eval()


def hf_runner(hf, contender: str, prompts, *, max_new_tokens: int = OUTPUT_LEN, device="cuda"):
    """A callable that runs transformers contender `contender` once over `prompts` (greedy,
    exactly `max_new_tokens` each, no stop token) on `device` and returns the output ids per
    prompt. Raises ContenderUnavailable where the installed transformers lacks its API."""
    import torch
    import transformers

    config = transformers.GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    # generate fills what `config` leaves unset from the model's own generation config, whose
    # eos_token_id (LlamaConfig's default, 2) min_new_tokens would then keep from being sampled:
    # a real token of the course model, and a different greedy answer wherever it is the argmax
    if getattr(hf, "generation_config", None) is not None:
        hf.generation_config.eos_token_id = None
    if contender == "hf_generate_batch":
        if not hasattr(hf, "generate_batch"):
            raise ContenderUnavailable(
                f"hf_generate_batch: transformers {transformers.__version__} has no "
                "generate_batch (continuous batching): this contender is left out"
            )

        def once():
            out = hf.generate_batch(inputs=prompts, generation_config=config)
            ordered = sorted(out.values(), key=lambda o: int(str(o.request_id).split("_")[-1]))
            return [list(o.generated_tokens) for o in ordered]

        return once
    if contender == "hf_generate_static_compiled":
        config.cache_implementation = "static"
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)

    def once():
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        return out[:, width:].tolist()

    return once


def run_hf(hf, contender: str, prompts) -> tuple[float, list[list[int]]]:
    """One timed run of a transformers contender on the GPU (after a warm-up run): (seconds,
    outputs)."""
    import torch

    once = hf_runner(hf, contender, prompts)
    with torch.no_grad():
        once()  # warm-up: compilation, graph capture, allocator
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = once()
        torch.cuda.synchronize()
    return time.perf_counter() - start, outputs


class ContenderUnavailable(RuntimeError):
    """A contender this installation cannot run (an API its library lacks): left out, named."""


UNAVAILABLE_EXIT = 3  # the exit status of `--one` for an unavailable contender


def run_contender(contender: str) -> dict:
    """Load SmolLM2 on the GPU and run one contender: offline, and (kvlib) Poisson rates."""
    import torch

    from kvlib.loaders.smollm2 import load_smollm2
    from kvlib.ops.devices import kernel_dtype

    # bf16, or fp16 on a GPU without bf16 tensor cores (a T4): what the kernel can run in there
    model, _ = load_smollm2(dtype=kernel_dtype(torch.device("cuda")), device="cuda")
    prompts = workload_prompts(model.config.vocab_size)
    result = {"contender": contender, "runs": []}
    if contender in KVLIB:
        engine = kvlib_engine(model, contender, prompts)
        serve_offline(engine, prompts)  # warm-up: kernels compiled, graphs captured
        seconds, outputs, times = serve_offline(engine, prompts)
        result["runs"].append(dict(scenario="offline", seconds=seconds, outputs=outputs, **times))
        for rate in POISSON_RATES:
            run = serve_poisson(engine, prompts, rate)
            result["runs"].append(dict(scenario=f"poisson_{rate:g}_per_s", **run))
    else:
        seconds, outputs = run_hf(hf_model(model), contender, prompts)
        result["runs"].append(dict(scenario="offline", seconds=seconds, outputs=outputs))
    return result


def rows_of(results: dict, facts: dict) -> list[dict]:
    """The CSV rows of the contenders' results (`run_contender`'s dicts by name)."""
    reference = results.get("kvlib_eager", {}).get("runs", [{}])[0].get("outputs")
    rows = []
    for contender, result in results.items():
        for run in result["runs"]:
            outputs = run.get("outputs")
            tokens = run.get("tokens", sum(map(len, outputs or [])))
            ttft, tpot = (latency_percentiles(run.get(k, [])) for k in ("ttft", "tpot"))
            match = ""
            if outputs is not None and reference is not None:
                match = sum(o[:16] == r[:16] for o, r in zip(outputs, reference))
            rows.append(
                {
                    **facts,
                    "contender": contender,
                    "scenario": run["scenario"],
                    "requests": NUM_REQUESTS,
                    "output_tokens": tokens,
                    "seconds": round(run["seconds"], 3),
                    "output_tok_s": round(tokens / run["seconds"], 1),
                    "ttft_p50_ms": round(1e3 * ttft[50], 2),
                    "ttft_p99_ms": round(1e3 * ttft[99], 2),
                    "tpot_p50_ms": round(1e3 * tpot[50], 2),
                    "tpot_p99_ms": round(1e3 * tpot[99], 2),
                    "decode_host_ms": _rounded(run.get("decode_host_ms")),
                    "decode_gpu_ms": _rounded(run.get("decode_gpu_ms")),
                    "match16": match,
                }
            )
    return rows


def _rounded(value) -> float | str:
    """A per-step time for the CSV: rounded ms, or "" where the contender has none."""
    return "" if value is None or value != value else round(value, 3)


def record(out_csv: str, timeout_s: int = 150, contenders=CONTENDERS) -> str:
    """Run every contender in its own process with a time limit (a progress bar counts them);
    the CSV is rewritten after each, so an interrupted run keeps what finished."""
    import datetime
    import tempfile

    import transformers
    from tqdm import tqdm

    from kvlib.experiments.timing import commit_label, device_facts

    facts = {
        **device_facts(),
        "transformers": transformers.__version__,
        "commit": commit_label(),
        "date": datetime.date.today().isoformat(),
    }
    results, errors = {}, {}
    for contender in tqdm(contenders, desc="contenders", unit="contender"):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            command = [sys.executable, "-m", "kvlib.experiments.serving_gpu", "--one", contender]
            try:
                done = subprocess.run(
                    [*command, "--json", f.name], capture_output=True, text=True, timeout=timeout_s
                )
                if done.returncode == 0:
                    results[contender] = json.load(open(f.name))
                elif done.returncode == UNAVAILABLE_EXIT:
                    errors[contender] = "unavailable: " + done.stderr.strip().splitlines()[-1]
                else:
                    errors[contender] = done.stderr[-3000:]
            except subprocess.TimeoutExpired:
                errors[contender] = f"timed out after {timeout_s} s"
        if contender in errors:
            print(f"{contender} FAILED: {errors[contender]}", file=sys.stderr, flush=True)
        elif results:
            write_rows(out_csv, rows_of(results, facts))
    failed = sorted(errors) or "none"
    if not results:
        return f"wrote nothing: every contender failed ({failed})"
    return f"wrote {len(rows_of(results, facts))} rows to {out_csv}; failed: {failed}"


def main(argv: list[str] | None = None) -> int:
    """`python -m kvlib.experiments.serving_gpu [--out CSV]`; `--one NAME --json PATH` runs one
    contender (what `record` launches)."""
    parser = options.parser(
        "python -m kvlib.experiments.serving_gpu",
        "kvlib's engine vs transformers serving SmolLM2 on a CUDA GPU.",
        {
            "--out": {"default": "results/serving_gpu.csv", "help": "CSV to write"},
            "--one": {"choices": CONTENDERS, "help": "run one contender only"},
            "--json": {"help": "with --one: where to write its result"},
            "--timeout-s": {"type": int, "default": 150, "help": "per contender (default 150)"},
            "--contenders": {
                "nargs": "+",
                "choices": CONTENDERS,
                "default": CONTENDERS,
                "help": "a subset to run",
            },
        },
    )
    args = parser.parse_args(argv)
    options.need_cuda(parser, "the GPU serving benchmark needs a CUDA GPU")
    if args.one:
        try:
            result = run_contender(args.one)
        except ContenderUnavailable as error:
            print(error, file=sys.stderr)
            return UNAVAILABLE_EXIT
        with open(args.json, "w") as f:
            json.dump(result, f)
        return 0
    print(record(args.out, args.timeout_s, args.contenders))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
