"""The engine's numbers (chapter 12): `StepStats`, one per step, and `EngineStats`, what
`LLMEngine` reports from them and from its requests: per-request metrics (TTFT, TPOT, latency,
prefix hits, preemptions) and a run's summary (throughput, percentiles, peak KV blocks, tokens by
kind). Token counts are explained in `kvlib.engine.llm_engine`'s docstring."""

from __future__ import annotations

import dataclasses
import math
import statistics

__all__ = ["EngineStats", "StepStats"]


@dataclasses.dataclass(frozen=True)
class StepStats:
    """One step: its index and wall time (s), the engine's clock at its end (s), requests running
    and waiting after it, tokens computed (prefill, decode and recomputed: see the module
    docstring; they sum to the step's tokens), KV blocks in use, preemptions, the prefix-cache
    lookups of the requests admitted for the first time (tokens hit, tokens looked up) and those
    of the requests readmitted after a preemption; `scheduled`: (request id, tokens computed) for
    each request in the step, in batch order."""

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


class EngineStats:
    """`LLMEngine`'s metrics, from its `stats` (a `StepStats` per step), its `requests` and its
    `block_bytes`."""

    def request_metrics(self) -> list[dict]:
        """Per finished request: arrival, first-token and finish steps; TTFT, TPOT (mean time
        between its output tokens) and latency in seconds; prompt and output tokens; prefix-hit
        tokens at its admission; preemptions."""
        rows = []
        for r in self.requests.values():
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

    def summary(self) -> dict:
        """The run in numbers: steps, busy seconds, **output** tokens per second (generated tokens
        only: prompt tokens are work, not output), mean and 90th-percentile TTFT and TPOT (s),
        peak KV blocks in use and their bytes, preemptions, prefix hit rate of first admissions
        (tokens hit / tokens looked up) and, apart, of readmissions after a preemption (0 when
        none), and tokens computed by kind (prefill, decode, recomputed)."""
        rows, stats = self.request_metrics(), self.stats
        busy = sum(s.seconds for s in stats)
        out_tokens = sum(r["output_tokens"] for r in rows)
        queries = sum(s.prefix_query_tokens for s in stats)
        readmitted = sum(s.preempted_query_tokens for s in stats)

        def p90(values):
            return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]

        ttft, tpot = [r["ttft_s"] for r in rows], [r["tpot_s"] for r in rows]
        peak = max((s.num_blocks_in_use for s in stats), default=0)
        return dict(
            requests=len(rows),
            steps=len(stats),
            busy_s=busy,
            output_tokens=out_tokens,
            prompt_tokens=sum(r["prompt_tokens"] for r in rows),
            output_tokens_per_s=out_tokens / busy if busy else math.nan,
            mean_ttft_s=statistics.fmean(ttft) if ttft else math.nan,
            p90_ttft_s=p90(ttft) if ttft else math.nan,
            mean_tpot_s=statistics.fmean(tpot) if tpot else math.nan,
            p90_tpot_s=p90(tpot) if tpot else math.nan,
            peak_blocks=peak,
            peak_kv_bytes=peak * self.block_bytes,
            preemptions=sum(s.num_preemptions for s in stats),
            prefix_hit_rate=sum(s.prefix_hit_tokens for s in stats) / queries if queries else 0.0,
            preempted_hit_rate=(
                sum(s.preempted_hit_tokens for s in stats) / readmitted if readmitted else 0.0
            ),
            prefill_tokens=sum(s.num_prefill_tokens for s in stats),
            decode_tokens=sum(s.num_decode_tokens for s in stats),
            recomputed_tokens=sum(s.num_recomputed_tokens for s in stats),
        )
