"""`python -m kvlib.experiments.engine_overhead`: the serving engine's own host time per decode
step, without the model's forward, at 8, 64 and 256 running requests; writes
`results/engine_overhead.csv` (issue 48, part 2).

On a GPU a decode step of a small model is host-bound: the device reads SmolLM2's weights and the
whole cache in well under a millisecond, while the engine schedules the step, builds its metadata,
samples and hands the tokens out in Python. This measures that Python on the CPU, where nothing
else hides it: an `LLMEngine` over the course model's configuration whose forward is replaced by
`LogitsStub`, which returns ready logits of the right shape and does no work. So a step's time is
the scheduler, the step's inputs and attention metadata (`kvlib.engine.input_batch`, the cache
object the model would see), sampling, the scheduler's update and the outputs: everything but
the forward, which on a GPU runs on the device (or replays as a CUDA graph).

Each run admits `n` requests at once (prompts of 16 to 31 tokens, so their block boundaries are
spread over the steps), prefills them in one step, then times `STEPS` decode steps one by one,
with the synchronous engine and with the overlapped one (`async_scheduling`, whose device work
runs inline on a CPU: the same work in another order). Each step is timed twice: by the calling
thread's CPU time (`time.thread_time`: the host's own work, which a machine shared with other
processes does not inflate by descheduling the thread, as it does wall time by a whole time slice
of a few milliseconds), and by the wall clock. The figures are medians over the steps of
`REPEATS` runs, interleaved across batch sizes and engines so that a busy spell of the machine
hits them alike; `wall_min_ms` is the fastest step. torch runs on 2 threads, as the other CPU
recordings do (the host path launches no multi-threaded operation: those wait for a second core).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from kvlib.experiments.cli import run, write_rows

BATCH_SIZES = (8, 64, 256)
STEPS = 64  # decode steps timed per run: four block boundaries of every request
REPEATS = 3


class LogitsStub(torch.nn.Module):
    """Stands in for a `LlamaModel` in the engine: the same `config` and `lm_head` (the engine
    reads its dtype, device and vocabulary), and a forward that returns logits `(1, N, V)` for the
    step's N tokens without computing anything (a slice of one fixed random tensor)."""

    def __init__(self, model, max_tokens: int = 8192):
        super().__init__()
        self.config, self.lm_head = model.config, model.lm_head
        generator = torch.Generator().manual_seed(0)
        self.logits = torch.randn(1, max_tokens, model.config.vocab_size, generator=generator)

    def forward(self, input_ids, **_):
        return self.logits[:, : input_ids.shape[1]]


def decode_step_times_ms(model, num_requests: int, steps: int = STEPS, **engine_options):
    """(CPU times, wall times) in ms of `steps` decode steps of an engine serving `num_requests`
    requests at once, every one decoding in each timed step (checked). `engine_options`:
    `LLMEngine`'s."""
    from kvlib.engine import LLMEngine, SamplingParams

    options = dict(
        num_blocks=num_requests * ((31 + steps + 2) // 16 + 2),
        max_num_seqs=num_requests,
        max_num_batched_tokens=max(512, 32 * num_requests),
        max_model_len=31 + steps + 2,
    )
    engine = LLMEngine(LogitsStub(model), **{**options, **engine_options})
    generator = torch.Generator().manual_seed(num_requests)
    vocab = model.config.vocab_size
    params = SamplingParams(max_tokens=steps + 2)
    for i in range(num_requests):
        prompt = torch.randint(0, vocab, (16 + i % 16,), generator=generator).tolist()
        engine.add_request(str(i), prompt, params)
    while not engine.stats or engine.stats[-1].num_decode_tokens < num_requests:
        engine.step()  # the prompts, and with overlap the first decode step's launch
    cpu_ms, wall_ms = [], []
    for _ in range(steps):
        cpu, wall = time.thread_time(), time.perf_counter()
        engine.step()
        wall_ms.append((time.perf_counter() - wall) * 1e3)
        cpu_ms.append((time.thread_time() - cpu) * 1e3)
        assert engine.stats[-1].num_decode_tokens == num_requests, engine.stats[-1]
    return cpu_ms, wall_ms


ENGINES = {"synchronous": {}, "overlapped": {"async_scheduling": True}}


def measure(model, batch_sizes=BATCH_SIZES, engines=ENGINES, *, repeats=REPEATS, steps=STEPS):
    """{(engine, n): (every timed step's CPU ms, wall ms)}, runs interleaved over the batch sizes
    and the engines."""
    times = {(name, n): ([], []) for name in engines for n in batch_sizes}
    for _ in range(repeats):
        for n in batch_sizes:
            for name, options in engines.items():
                cpu_ms, wall_ms = decode_step_times_ms(model, n, steps, **options)
                times[name, n][0].extend(cpu_ms)
                times[name, n][1].extend(wall_ms)
    return times


def record(out_csv: str, engines=ENGINES) -> list[dict]:
    from kvlib.experiments.timing import cpu_facts
    from kvlib.loaders.course_model import load_course_model

    times = measure(load_course_model(), engines=engines)
    facts = cpu_facts()
    rows = []
    for (name, n), (cpu_ms, wall_ms) in times.items():
        host = statistics.median(cpu_ms)
        rows.append(
            dict(
                engine=name,
                num_requests=n,
                steps=len(cpu_ms),
                host_ms_per_step=round(host, 4),
                wall_ms_per_step=round(statistics.median(wall_ms), 4),
                wall_min_ms=round(min(wall_ms), 4),
                host_us_per_request=round(host / n * 1e3, 3),
                **facts,
            )
        )
        print(
            f"{name:>11}, {n:>3} requests: {host:.3f} ms of host CPU time per decode step "
            f"({host / n * 1e3:.2f} us per request; wall median {rows[-1]['wall_ms_per_step']:.3f}"
            f" ms, fastest {rows[-1]['wall_min_ms']:.3f})",
            file=sys.stderr,
        )
    return write_rows(out_csv, rows)


def main(argv: list[str] | None = None) -> int:
    return run("engine_overhead", __doc__, "results/engine_overhead.csv", record, argv, threads=2)


if __name__ == "__main__":
    raise SystemExit(main())
