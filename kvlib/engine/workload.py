"""The serving comparison of chapter 12: a synthetic workload, served by four engines at the same
KV memory budget.

The workload (`make_workload`): requests arrive as a Poisson process (exponential gaps, measured
in engine steps: the engine's clock is its steps, see `kvlib.engine.llm_engine`), with prompt and
output lengths uniform in stated ranges, and a shared system prompt in front of a stated fraction
of the prompts. Output lengths are fixed per request (no stop tokens), so every configuration
generates exactly the same tokens, and the schedule (steps, preemptions, blocks, prefix hits)
depends only on the lengths: it is the same on every machine; only the seconds differ.

The configurations (`CONFIGS`), each given the same bytes of KV memory:

- `static`: static batching with a contiguous reservation of `max_model_len` tokens per request;
- `continuous`: continuous batching over the paged cache, chunked prefill under a token budget;
- `prefix`: the same with prefix caching;
- `prefix+int8`: the same with the cache stored as int8 with per-token scales (chapter 10), so
  the same bytes hold more blocks.

`python -m kvlib.experiments.serving` records the comparison (`results/serving.csv`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvlib.engine.llm_engine import LLMEngine
from kvlib.engine.request import SamplingParams

__all__ = [
    "CONFIGS",
    "WORKLOADS",
    "Workload",
    "WorkloadRequest",
    "engine_for",
    "make_workload",
    "run_workload",
]


@dataclasses.dataclass(frozen=True)
class WorkloadRequest:
    arrival_step: int
    prompt_token_ids: list[int]
    max_tokens: int


@dataclasses.dataclass(frozen=True)
class Workload:
    """A synthetic workload's distributions (see the module docstring). Token ids are drawn
    uniformly from [token_low, token_high); lengths are inclusive ranges; `arrival_rate` is in
    requests per step; the KV budget is `budget_blocks` blocks of the full-precision cache."""

    num_requests: int
    arrival_rate: float
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    system_prompt_len: int
    shared_fraction: float
    token_low: int
    token_high: int
    budget_blocks: int
    max_num_batched_tokens: int
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        """The longest request the workload can make: what a contiguous cache reserves."""
        return self.system_prompt_len + self.prompt_len[1] + self.output_len[1]


WORKLOADS = {
    "course": Workload(
        num_requests=48,
        arrival_rate=1.0,
        prompt_len=(16, 96),
        output_len=(8, 96),
        system_prompt_len=64,
        shared_fraction=0.5,
        token_low=0,
        token_high=128,
        budget_blocks=96,
        max_num_batched_tokens=64,
    ),
    "smollm2": Workload(
        num_requests=24,
        arrival_rate=1.0,
        prompt_len=(16, 64),
        output_len=(8, 48),
        system_prompt_len=64,
        shared_fraction=0.5,
        token_low=100,
        token_high=40_000,
        budget_blocks=48,
        max_num_batched_tokens=64,
    ),
}

# configuration -> LLMEngine options (besides num_blocks and the workload's budget)
CONFIGS = {
    "static": dict(policy="static"),
    "continuous": dict(),
    "prefix": dict(enable_prefix_caching=True),
    "prefix+int8": dict(enable_prefix_caching=True, kv_scheme="int8"),
}


def make_workload(workload: Workload) -> list[WorkloadRequest]:
    """The workload's requests, in arrival order (seeded: the same on every machine)."""
    rng = np.random.default_rng(workload.seed)
    system = rng.integers(workload.token_low, workload.token_high, workload.system_prompt_len)
    gaps = rng.exponential(1 / workload.arrival_rate, workload.num_requests)
    arrivals = np.floor(np.cumsum(gaps) - gaps[0]).astype(int)  # the first arrives at step 0
    requests = []
    for arrival in arrivals:
        length = int(rng.integers(workload.prompt_len[0], workload.prompt_len[1] + 1))
        prompt = rng.integers(workload.token_low, workload.token_high, length)
        if rng.random() < workload.shared_fraction:
            prompt = np.concatenate([system, prompt])
        max_tokens = int(rng.integers(workload.output_len[0], workload.output_len[1] + 1))
        requests.append(WorkloadRequest(int(arrival), prompt.tolist(), max_tokens))
    return requests


def engine_for(model, workload: Workload, config: str, **overrides) -> LLMEngine:
    """An engine for `config` (a name in `CONFIGS`) holding the workload's KV budget in bytes."""
    from kvlib.quant import QuantScheme

    options = dict(CONFIGS[config])
    if options.get("kv_scheme") == "int8":
        options["kv_scheme"] = QuantScheme("int8")
    options = dict(
        max_model_len=workload.max_model_len,
        max_num_batched_tokens=workload.max_num_batched_tokens,
        **options,
        **overrides,
    )
    if "kv_scheme" not in options:
        return LLMEngine(model, num_blocks=workload.budget_blocks, **options)
    budget = workload.budget_blocks * LLMEngine(model, num_blocks=1).block_bytes
    per_block = LLMEngine(model, num_blocks=1, **options).block_bytes  # one block: just its bytes
    return LLMEngine(model, num_blocks=budget // per_block, **options)


def run_workload(engine: LLMEngine, requests: list[WorkloadRequest]) -> LLMEngine:
    """Serve `requests`: before step s, add those that arrived by s; when the engine is idle,
    the next arrival comes at once (idle steps are not counted). Returns the engine (its
    `stats`, `request_metrics()` and `summary()` hold the run)."""
    pending = list(requests)
    while pending or engine.has_unfinished_requests():
        step = len(engine.stats)
        if not engine.has_unfinished_requests() and pending[0].arrival_step > step:
            step = pending[0].arrival_step  # idle until then: skip ahead
        while pending and pending[0].arrival_step <= step:
            r = pending.pop(0)
            engine.add_request(
                f"request-{len(engine.requests)}",
                r.prompt_token_ids,
                SamplingParams(max_tokens=r.max_tokens),
            )
        engine.step()
    return engine
