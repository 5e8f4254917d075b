"""The server's Prometheus metrics (chapter 13): what `GET /metrics` reports, and how to read it.

Every production server exposes its state for a monitoring system to scrape (vLLM, SGLang and
TGI all serve `/metrics` in Prometheus' text format). This one uses vLLM's metric names, so a
dashboard written for vLLM reads it:

- gauges: `vllm:num_requests_running` (requests in the scheduler's running batch),
  `vllm:num_requests_waiting` (queued, not yet admitted), `vllm:kv_cache_usage_perc` (the
  fraction, 0 to 1 despite the name, of KV blocks in use);
- counters: `vllm:num_preemptions_total`; `vllm:request_success_total` by `finished_reason`:
  `stop`, `length`, `abort` (the client left), `error` (a failed step);
  `vllm:prompt_tokens_total` (prefilled), `vllm:generation_tokens_total` (generated);
  `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (tokens looked up in the
  prefix cache and tokens found, for requests admitted for the first time; their ratio is the
  hit rate, 0 without `--enable-prefix-caching`); with speculative decoding on
  (`--speculative-config`), `vllm:spec_decode_num_drafts_total`,
  `vllm:spec_decode_num_draft_tokens_total`, `vllm:spec_decode_num_accepted_tokens_total` and
  `vllm:spec_decode_num_accepted_tokens_per_pos_total` by `position` (0 .. k - 1: drafts whose
  token there was accepted), vLLM's names, from the engine's `SpecDecodingStats`;
- histograms (seconds): `vllm:time_to_first_token_seconds` (the request's arrival at the server
  to its first token), `vllm:inter_token_latency_seconds` (each gap between two tokens of a
  request), `vllm:request_time_per_output_token_seconds` (per request: (last - first token) /
  (tokens - 1)), `vllm:e2e_request_latency_seconds` (arrival to the request's end), and per
  request its phases: `vllm:request_queue_time_seconds` (arrival to the end of its first step),
  `vllm:request_prefill_time_seconds` (that step to its first token: the rest of a chunked
  prefill), `vllm:request_decode_time_seconds` (first token to last);
- histograms (tokens): `vllm:request_prompt_tokens` and `vllm:request_generation_tokens` per
  request, `vllm:iteration_tokens_total` per engine step (prompt and generated tokens computed).

prometheus_client's `_created` samples (a gauge family per counter and histogram, the time it was
created) are turned off (`disable_created_metrics`), as vLLM turns them off: no dashboard reads
them, and scrapers would store one series more per metric.

Every series carries the label `model_name`. A request with `n` choices counts as `n` requests
(each choice is one engine request, as in vLLM). The server measures its latencies from the moment
its handler accepted the request to the moment a token reached the handler, so they are at most
what a client sees (the client's time adds the network, HTTP parsing and its own event loop).

Each app has its own `CollectorRegistry` (never prometheus_client's global one), so several apps
in one process (tests, a notebook comparing servers) never share or collide on a metric. The
gauges are read from the engine loop's latest `EngineSnapshot` at scrape time, never from the
engine (which only the loop's thread may touch).

Reading: `parse_metrics(text)` and `scrape_metrics(url)` return the samples; `metric_value(samples,
name, **labels)` sums those of one name whose labels match (as PromQL's `sum(name{...})`).
What it deliberately does not do: multiprocess collection, or vLLM's metrics of features this
server lacks (LoRA, prefix-cache counters per tier).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

__all__ = [
    "CONTENT_TYPE",
    "FINISHED_REASONS",
    "ServerMetrics",
    "metric_value",
    "parse_metrics",
    "scrape_metrics",
]

CONTENT_TYPE = CONTENT_TYPE_LATEST  # Prometheus' text format, version 0.0.4
FINISHED_REASONS = ("stop", "length", "abort", "error")

# bucket bounds (s): the course model's steps take milliseconds, a large model's tens of them
TTFT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
E2E_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# token counts (vLLM's 1-2-5 series up to the context length it serves)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)

disable_created_metrics()  # process-wide in prometheus_client: no `_created` samples


class ServerMetrics:
    """One app's metrics (see the module docstring).

    Args:
        model_name: the served model's name (the `model_name` label).
        snapshot: a callable returning the engine loop's latest `EngineSnapshot` (read at scrape
            time).

    The server calls `first_token`, `next_token` and `finished` from its event loop;
    `exposition()` is the `/metrics` body (bytes, `CONTENT_TYPE`).
    """

    def __init__(self, model_name: str, snapshot):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model_name, snapshot))
        labels = ["model_name"]

        def counter(name, documentation, extra=()):
            return Counter(name, documentation, labels + list(extra), registry=self.registry)

        def histogram(name, documentation, buckets):
            metric = Histogram(name, documentation, labels, buckets=buckets, registry=self.registry)
            return metric.labels(model_name)

        success = counter(
            "vllm:request_success",
            "Requests (choices) ended, by finish reason (abort: the client left).",
            ["finished_reason"],
        )
        self.request_success = {r: success.labels(model_name, r) for r in FINISHED_REASONS}
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens prefilled.").labels(
            model_name
        )
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.").labels(
            model_name
        )
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds",
            "Arrival at the server to the first token, per request.",
            TTFT_BUCKETS_S,
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds",
            "Time between two consecutive tokens of a request.",
            TOKEN_BUCKETS_S,
        )
        self.time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Per request: (last token - first token) / (tokens - 1).",
            TOKEN_BUCKETS_S,
        )
        self.e2e_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Arrival at the server to the request's end.",
            E2E_BUCKETS_S,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Arrival at the server to the end of the request's first step.",
            E2E_BUCKETS_S,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "The request's first step to its first token.",
            E2E_BUCKETS_S,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "The request's first token to its last.",
            E2E_BUCKETS_S,
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", TOKEN_COUNT_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", TOKEN_COUNT_BUCKETS
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Tokens computed per engine step (prompt and generated).",
            TOKEN_COUNT_BUCKETS,
        )

    def first_token(self, ttft_s: float, prompt_tokens: int, new_tokens: int = 1) -> None:
        self.time_to_first_token.observe(ttft_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(new_tokens)

    def next_token(self, gap_s: float, new_tokens: int = 1) -> None:
        self.inter_token_latency.observe(gap_s)
        self.generation_tokens.inc(new_tokens)

    def finished(
        self,
        reason: str,
        e2e_s: float,
        num_tokens: int,
        first_to_last_s: float | None,
        *,
        prompt_tokens: int = 0,
        queue_s: float | None = None,
        prefill_s: float | None = None,
    ) -> None:
        """One request ended with `reason` (one of `FINISHED_REASONS`) after `e2e_s` seconds,
        having produced `num_tokens`, its first and last `first_to_last_s` apart, from
        `prompt_tokens`; `queue_s` and `prefill_s`: its phases (None: it never reached them)."""
        if reason not in self.request_success:
            raise ValueError(f"reason: expected one of {FINISHED_REASONS}, got {reason!r}")
        self.request_success[reason].inc()
        self.e2e_latency.observe(e2e_s)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(num_tokens)
        for histogram, seconds in (
            (self.queue_time, queue_s),
            (self.prefill_time, prefill_s),
            (self.decode_time, first_to_last_s),
        ):
            if seconds is not None:
                histogram.observe(seconds)
        if num_tokens > 1 and first_to_last_s is not None:
            self.time_per_output_token.observe(first_to_last_s / (num_tokens - 1))

    def step(self, record) -> None:
        """One engine step's `StepStats`: its tokens (called from the engine loop's thread)."""
        tokens = record.num_prefill_tokens + record.num_decode_tokens
        self.iteration_tokens.observe(tokens + record.num_recomputed_tokens)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)


class _EngineCollector:
    """The gauges and the preemption counter, read from the loop's snapshot at scrape time."""

    def __init__(self, model_name: str, snapshot):
        self.model_name, self.snapshot = model_name, snapshot

    def describe(self):
        return []  # the families are built at collect time; nothing to check at registration

    def collect(self):
        s, label = self.snapshot(), [self.model_name]
        gauges = (
            ("vllm:num_requests_running", "Requests in the running batch.", s.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be admitted.", s.num_waiting),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage: 1 means every block is in use.",
                s.kv_cache_usage,
            ),
        )
        for name, documentation, value in gauges:
            family = GaugeMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric(label, value)
            yield family
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions",
            "Requests preempted (their blocks freed).",
            labels=["model_name"],
        )
        preemptions.add_metric(label, s.num_preemptions)
        yield preemptions
        for name, documentation, value in (
            (
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                s.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                s.prefix_cache_hits,
            ),
        ):
            family = CounterMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric(label, value)
            yield family
        if s.spec_decoding is not None:
            yield from _spec_decode_families(s.spec_decoding, label)


def _spec_decode_families(spec, label: list[str]):
    """vLLM's speculative decoding counters from a `SpecDecodingStats`."""
    for name, documentation, value in (
        ("num_drafts", "Drafts verified.", spec.num_drafts),
        ("num_draft_tokens", "Draft tokens proposed.", spec.num_draft_tokens),
        ("num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
    ):
        family = CounterMetricFamily(
            f"vllm:spec_decode_{name}", documentation, labels=["model_name"]
        )
        family.add_metric(label, value)
        yield family
    family = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft.",
        labels=["model_name", "position"],
    )
    for position, value in enumerate(spec.num_accepted_tokens_per_pos):
        family.add_metric([*label, str(position)], value)
    yield family


def parse_metrics(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition (prometheus_client's parser): each has
    `.name` (counters end in `_total`, histograms in `_bucket`, `_sum`, `_count`), `.labels`
    (a dict) and `.value`."""
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def scrape_metrics(url: str, timeout_s: float = 10.0) -> list[Sample]:
    """GET `url` (a server's `/metrics`) and parse it."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return parse_metrics(response.read().decode())


def metric_value(samples: Iterable[Sample], name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels`.

    Raises:
        KeyError: no sample has that name (a typo, or a metric this server does not export).
    """
    matching = [s for s in samples if s.name == name]
    if not matching:
        raise KeyError(f"name: no sample named {name!r}")
    return float(sum(s.value for s in matching if labels.items() <= s.labels.items()))
