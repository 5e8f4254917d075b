"""Offered load against a running server (chapter 13): wall-clock Poisson arrivals, streaming
clients, TTFT/TPOT percentiles and goodput under an SLO.

Chapter 12 counted arrivals in engine steps: every request of a run arrived within its first few
dozen steps, an offline burst. Here requests arrive on the wall clock, as independent users do:
the gaps between arrivals are exponential with mean 1 / rate (a Poisson process), each request
is an HTTP streaming client (the `openai` package's async client), and its latencies are what
that client sees:

- **TTFT** (time to first token): arrival -> first streamed text;
- **TPOT** (time per output token): (last text - first text) / (output tokens - 1);
- **goodput** (Zhong et al., 2024, "DistServe", OSDI): requests per second that met the
  service-level objective, here TTFT <= `ttft_slo_s` and TPOT <= `tpot_slo_s`. Throughput counts
  every request; goodput counts only those a user would call served.

`MetricsScraper` polls the server's `/metrics` (`kvlib.serve.metrics`) in a background thread
while a run lasts, as a monitoring system would: the server's own view (requests running and
waiting, KV blocks in use, its counters) beside the clients'.

What it deliberately does not do: open-loop overload control, or retries (a failed request is
reported as failed, never retried).
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Sequence

import numpy as np

__all__ = [
    "MetricsScraper",
    "goodput",
    "latency_percentiles",
    "measure_load",
    "poisson_arrival_times",
    "run_load",
]


def poisson_arrival_times(rate_per_s: float, num_requests: int, seed: int = 0) -> np.ndarray:
    """Arrival times (s, from 0) of `num_requests` requests of a Poisson process of rate
    `rate_per_s`: cumulative sums of exponential gaps of mean 1 / rate, the first request at 0."""
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s: expected a number > 0, got {rate_per_s!r}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, size=num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps)


async def _one_request(client, model, prompt, max_tokens, send_at, clock_start) -> dict:
    await asyncio.sleep(max(0.0, clock_start + send_at - time.perf_counter()))
    arrival = time.perf_counter()
    text_times, pieces, usage, finish_reason = [], [], None, None
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.text:
                text_times.append(time.perf_counter() - arrival)
                pieces.append(choice.text)
            finish_reason = choice.finish_reason or finish_reason
    n = usage.completion_tokens if usage is not None else len(pieces)
    return dict(
        arrival_s=arrival - clock_start,
        ttft_s=text_times[0] if text_times else float("nan"),
        tpot_s=(text_times[-1] - text_times[0]) / (n - 1) if n > 1 else 0.0,
        latency_s=time.perf_counter() - arrival,
        output_tokens=n,
        text="".join(pieces),
        finish_reason=finish_reason,
    )


async def run_load(
    base_url: str,
    model: str,
    prompts: Sequence,
    arrival_times_s: Sequence[float],
    *,
    max_tokens: int = 16,
    timeout_s: float = 120.0,
) -> list[dict]:
    """Send `prompts[i]` at `arrival_times_s[i]` (s after the start), each a greedy streaming
    completion of `max_tokens`; return one row per request, in prompt order: arrival_s, ttft_s,
    tpot_s, latency_s, output_tokens, text, finish_reason."""
    import openai

    if len(prompts) != len(arrival_times_s):
        raise ValueError(
            f"arrival_times_s: expected one per prompt ({len(prompts)}), got {len(arrival_times_s)}"
        )
    async with openai.AsyncOpenAI(
        base_url=base_url, api_key="unused", max_retries=0, timeout=timeout_s
    ) as client:
        start = time.perf_counter()
        return await asyncio.gather(
            *(
                _one_request(client, model, p, max_tokens, float(t), start)
                for p, t in zip(prompts, arrival_times_s)
            )
        )


def measure_load(*args, **kwargs) -> list[dict]:
    """`run_load` from synchronous code, also inside Jupyter (whose own event loop is already
    running): it runs in a fresh event loop in a helper thread."""
    result: dict = {}

    def target():
        try:
            result["rows"] = asyncio.run(run_load(*args, **kwargs))
        except BaseException as error:  # re-raised in the caller's thread
            result["error"] = error

    thread = threading.Thread(target=target, name="kvlib-load")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["rows"]


def latency_percentiles(values: Sequence[float], percents=(50, 99)) -> dict[int, float]:
    """{p: the p-th percentile} of `values` (linear interpolation between order statistics,
    `statistics.quantiles(method="inclusive")`)."""
    values = list(values)
    if len(values) < 2:
        return {p: (values[0] if values else float("nan")) for p in percents}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {
        p: cuts[p - 1] if 0 < p < 100 else (min(values) if p == 0 else max(values))
        for p in percents
    }


def goodput(rows: Sequence[dict], *, ttft_slo_s: float, tpot_slo_s: float) -> int:
    """How many requests met the SLO: TTFT <= ttft_slo_s and TPOT <= tpot_slo_s (divide by the
    run's duration for requests per second)."""
    return sum(1 for r in rows if r["ttft_s"] <= ttft_slo_s and r["tpot_s"] <= tpot_slo_s)


class MetricsScraper:
    """Scrape `url` (a server's `/metrics`) every `interval_s` seconds in a background thread,
    from entering the `with` block to leaving it, and once more on leaving: `scrapes` is a list
    of (seconds since entering, samples), samples as `kvlib.serve.metrics.parse_metrics` returns
    them; `series(name, **labels)` is (times_s, values) of one metric.

    Raises:
        ValueError: `interval_s` not > 0.
    """

    def __init__(self, url: str, interval_s: float = 0.02):
        if not interval_s > 0:
            raise ValueError(f"interval_s: expected a number > 0, got {interval_s!r}")
        self.url, self.interval_s = url, interval_s
        self.scrapes: list[tuple[float, list]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="kvlib-scraper", daemon=True)

    def _scrape(self) -> None:
        from kvlib.serve.metrics import scrape_metrics

        self.scrapes.append((time.perf_counter() - self._start, scrape_metrics(self.url)))

    def _poll(self) -> None:
        while not self._done.wait(self.interval_s):
            self._scrape()

    def __enter__(self) -> MetricsScraper:
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self._scrape()

    @property
    def last(self) -> list:
        """The samples of the final scrape (taken on leaving the `with` block)."""
        return self.scrapes[-1][1]

    def series(self, name: str, **labels: str) -> tuple[list[float], list[float]]:
        from kvlib.serve.metrics import metric_value

        times = [t for t, _ in self.scrapes]
        return times, [metric_value(samples, name, **labels) for _, samples in self.scrapes]
