"""The engine's numbers (chapter 12): `StepStats`, one record per step, and `EngineStats`, the
object `LLMEngine` holds and feeds: it keeps the most recent steps (a ring, so that a server that
runs for days holds a bounded number) and running totals over every step, and classifies each
step's computed tokens (prefill, decode, recomputed: explained in `kvlib.engine.llm_engine`'s
docstring). `request_metrics` (TTFT, TPOT, latency, prefix hits, preemptions per finished
request) and `summary` (throughput, percentiles, peak KV blocks, tokens by kind) compute a run's
metrics from it and the engine's requests."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Iterable, Iterator, Mapping

from kvlib._validate import check_positive_int

__all__ = ["EngineStats", "SpecDecodingStats", "StepStats", "request_metrics", "summary"]

# Totals kept over every step: the StepStats fields that a run's summary sums.
SUMMED = (
    "seconds",
    "num_prefill_tokens",
    "num_decode_tokens",
    "num_recomputed_tokens",
    "num_preemptions",
    "prefix_hit_tokens",
    "prefix_query_tokens",
    "preempted_hit_tokens",
    "preempted_query_tokens",
)


@dataclasses.dataclass(frozen=True)
class StepStats:
    """One step: its index and wall time (s), the engine's clock at its end (s), requests running
    and waiting after it, tokens computed (prefill, decode and recomputed: see the module
    docstring; they sum to the step's tokens), KV blocks in use, preemptions, the prefix-cache
    lookups of the requests admitted for the first time (tokens hit, tokens looked up) and those
    of the requests readmitted after a preemption; `scheduled`: (request id, tokens computed) for
    each request in the step, in batch order, as the scheduler planned them (a speculating
    request's draft tokens are counted in `num_decode_tokens`, not in `scheduled`)."""

    step: int
    seconds: float
    clock: float
    num_running: int
    num_waiting: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_recomputed_tokens: int
    num_blocks_in_use: int
    num_preemptions: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    preempted_hit_tokens: int
    preempted_query_tokens: int
    scheduled: tuple[tuple[str, int], ...] = ()


@dataclasses.dataclass
class SpecDecodingStats:
    """Speculative decoding's counters over a run (`kvlib.engine.speculative`), named as vLLM
    v1's `SpecDecodingStats` (`vllm/v1/spec_decode/metrics.py`): drafts verified (one per
    speculating request and step), draft tokens proposed, of them accepted, and accepted per
    draft position (position i counts the drafts whose first i + 1 tokens were accepted; a list
    of `num_spec_tokens` counts)."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        check_positive_int("num_spec_tokens", self.num_spec_tokens)
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one verified draft of `num_draft_tokens` tokens, its first `num_accepted_tokens`
        accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for position in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[position] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per draft token, in [0, 1] (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified draft's step emits, on average: 1 + accepted per draft (vLLM's)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class EngineStats:
    """Every step's `StepStats`, as far as memory allows: the last `max_recorded_steps` records,
    and totals (`totals[field]` for the fields in `SUMMED`, `peak_blocks`) over all of them.

    It reads like the list of all steps while none has been dropped: `len(stats)` is the number of
    steps recorded, `stats[i]` step i (negative from the end, slices too), iteration the kept
    records oldest first. Reading a dropped step raises IndexError naming the kept range.

    It also classifies a step's tokens before the step runs (`count_tokens`), for which it keeps,
    per unfinished request, the most tokens the request ever had computed (`forget` drops a
    finished or aborted request's entry). With speculative decoding on, `spec_decoding` holds its
    counters (`SpecDecodingStats`; None when off); a step's draft tokens count among its decode
    tokens (computed, accepted or not), and an accepted one is not counted again later.

    Args:
        max_recorded_steps: records kept (vLLM keeps none: its loggers aggregate as it goes).

    Raises:
        ValueError: max_recorded_steps < 1.
    """

    def __init__(self, max_recorded_steps: int = 10_000):
        self.max_recorded_steps = check_positive_int("max_recorded_steps", max_recorded_steps)
        self.recent: deque[StepStats] = deque(maxlen=max_recorded_steps)
        self.num_steps = 0
        self.totals = dict.fromkeys(SUMMED, 0)
        self.peak_blocks = 0
        self.computed_before: dict[str, int] = {}  # request id -> most tokens it ever computed
        self.spec_decoding: SpecDecodingStats | None = None

    # --- feeding ---------------------------------------------------------------------------------

    def record(self, step: StepStats) -> None:
        """Add the next step (its `step` must be `len(self)`); the oldest record may be dropped.
        Raises ValueError for a step out of order."""
        if step.step != self.num_steps:
            raise ValueError(f"step: expected step {self.num_steps} next, got {step.step}")
        self.recent.append(step)
        self.num_steps += 1
        for field in SUMMED:
            self.totals[field] += getattr(step, field)
        self.peak_blocks = max(self.peak_blocks, step.num_blocks_in_use)

    def count_tokens(self, scheduled) -> tuple[int, int, int]:
        """(prefill, decode, recomputed) tokens of a plan's `scheduled` (request, new tokens)
        pairs, before the step runs: token i of a request is recomputed if the request had
        computed it before (it was since preempted), otherwise prefill if it is a prompt token,
        decode if it is a generated one."""
        prefill = decode = recomputed = 0
        computed_before = self.computed_before
        for request, n in scheduled:
            start, end = request.num_computed_tokens, request.num_computed_tokens + n
            before = computed_before.get(request.request_id, 0)
            if before <= start and start >= len(request.prompt_token_ids):  # plain decoding
                decode += n
                computed_before[request.request_id] = end
                continue
            again = max(0, min(end, before) - start)
            fresh_start = start + again
            prompt_end = max(fresh_start, min(end, len(request.prompt_token_ids)))
            recomputed += again
            prefill += prompt_end - fresh_start
            decode += end - prompt_end
            computed_before[request.request_id] = max(before, end)
        return prefill, decode, recomputed

    def set_computed(self, request_id: str, num_tokens: int) -> None:
        """A request starts with `num_tokens` computed that it did not compute (a forked child
        shares its parent's prompt): they count as neither prefill nor recomputation."""
        self.computed_before[request_id] = num_tokens

    def forget(self, request_id: str) -> None:
        """Drop a finished or aborted request's token history (the memory stays bounded)."""
        self.computed_before.pop(request_id, None)

    # --- reading ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_steps

    def __iter__(self) -> Iterator[StepStats]:
        return iter(self.recent)

    def __getitem__(self, index):
        first = self.num_steps - len(self.recent)  # the oldest step kept
        if isinstance(index, slice):
            start, stop, stride = index.indices(self.num_steps)
            return [self[i] for i in range(start, stop, stride)]
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"index: expected an int or a slice, got {type(index).__name__}")
        position = index + self.num_steps if index < 0 else index
        if not first <= position < self.num_steps:
            raise IndexError(
                f"index: step {index} is not kept; steps {first}..{self.num_steps - 1} are "
                f"(the last max_recorded_steps={self.max_recorded_steps})"
            )
        return self.recent[position - first]

    def __repr__(self) -> str:
        return f"EngineStats({self.num_steps} steps, {len(self.recent)} kept)"


def request_metrics(requests: Iterable) -> list[dict]:
    """Per finished request of `requests` (`kvlib.engine.request.Request`s): arrival,
    first-token and finish steps; TTFT, TPOT (mean time between its output tokens) and latency in
    seconds of the engine's clock; prompt and output tokens; prefix-hit tokens at its admission;
    preemptions."""
    rows = []
    for r in requests:
        if not r.is_finished:
            continue
        n = len(r.output_token_ids)
        rows.append(
            dict(
                request_id=r.request_id,
                arrival_step=r.arrival_step,
                first_token_step=r.first_token_step,
                finish_step=r.finish_step,
                ttft_s=r.first_token_time - r.arrival_time,
                tpot_s=(r.finish_time - r.first_token_time) / (n - 1) if n > 1 else 0.0,
                latency_s=r.finish_time - r.arrival_time,
                prompt_tokens=len(r.prompt_token_ids),
                output_tokens=n,
                cached_tokens=r.num_cached_tokens,
                preemptions=r.num_preemptions,
            )
        )
    return rows


def summary(stats: EngineStats, requests: Mapping | Iterable, block_bytes: int) -> dict:
    """The run in numbers, from `stats`' totals over every step and the finished `requests`:
    steps, busy seconds, **output** tokens per second (generated tokens only: prompt tokens are
    work, not output), mean and 90th-percentile TTFT and TPOT (s), peak KV blocks in use and
    their bytes (`block_bytes` each), preemptions, prefix hit rate of first admissions (tokens
    hit / tokens looked up) and, apart, of readmissions after a preemption (0 when none), and
    tokens computed by kind (prefill, decode, recomputed)."""
    rows = request_metrics(requests.values() if isinstance(requests, Mapping) else requests)
    totals = stats.totals
    busy = totals["seconds"]
    out_tokens = sum(r["output_tokens"] for r in rows)
    queries, readmitted = totals["prefix_query_tokens"], totals["preempted_query_tokens"]

    def p90(values):
        return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]

    ttft, tpot = [r["ttft_s"] for r in rows], [r["tpot_s"] for r in rows]
    return dict(
        requests=len(rows),
        steps=stats.num_steps,
        busy_s=busy,
        output_tokens=out_tokens,
        prompt_tokens=sum(r["prompt_tokens"] for r in rows),
        output_tokens_per_s=out_tokens / busy if busy else math.nan,
        mean_ttft_s=statistics.fmean(ttft) if ttft else math.nan,
        p90_ttft_s=p90(ttft) if ttft else math.nan,
        mean_tpot_s=statistics.fmean(tpot) if tpot else math.nan,
        p90_tpot_s=p90(tpot) if tpot else math.nan,
        peak_blocks=stats.peak_blocks,
        peak_kv_bytes=stats.peak_blocks * block_bytes,
        preemptions=totals["num_preemptions"],
        prefix_hit_rate=totals["prefix_hit_tokens"] / queries if queries else 0.0,
        preempted_hit_rate=(totals["preempted_hit_tokens"] / readmitted if readmitted else 0.0),
        prefill_tokens=totals["num_prefill_tokens"],
        decode_tokens=totals["num_decode_tokens"],
        recomputed_tokens=totals["num_recomputed_tokens"],
    )
