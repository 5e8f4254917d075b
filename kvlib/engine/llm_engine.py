"""`LLMEngine` (chapter 12): requests in, tokens out, one scheduler step at a time; named as
vLLM's `LLMEngine` (`add_request`, `step`, `has_unfinished_requests`) and `LLM.generate`.

Each `step()` asks the scheduler for a plan, runs it through the model runner, hands the sampled
tokens back to the scheduler, and returns a `RequestOutput` for every request that produced a
token (streaming). The engine owns the KV memory: one `BlockPool` of `num_blocks` blocks
(`kvlib.cache.block_pool`, with prefix caching if asked) and the pools behind it (a `PagedCache`,
or a `QuantizedPagedCache` when `kv_scheme` is given). It records per-step statistics
(`StepStats`) and per-request metrics (`request_metrics`): time to first token (TTFT), time per
output token (TPOT), latency, preemptions, prefix hits; `summary()` adds throughput.

Token counts: a step's computed tokens are split three ways. **Prefill**: prompt tokens computed
for the first time. **Decode**: generated tokens fed back, each counted once, the first time its
K/V is computed (the next token of its request; after a preemption the newest sampled token is
computed inside the recomputation's prefill, and is still its decode token). **Recomputed**:
tokens computed again after a preemption (prompt and generated tokens alike). Prefix-cache
lookups of first admissions and of readmissions after a preemption are counted apart (vLLM v1's
`PrefixCacheStats`): `summary()`'s `prefix_hit_rate` is the first admissions'.

Clock: a step's time is its wall time; the engine's clock, the sum of the steps' times (idle time
between arrivals not counted); a request added before step s arrives at the clock's value then.

For a server (chapter 13, `kvlib.serve`): `abort_request` drops a request whose client left and
frees its blocks; `add_parallel_requests` serves one prompt n times, forking the children from
the first request's blocks once its prefill is done (copy-on-write, chapter 7); a request with
`SamplingParams(logprobs=k)` gets each token's log-probability and the top k in its outputs.

**Overlap** (`async_scheduling=True`; SGLang's overlap scheduler, vLLM v1's async scheduling,
`kvlib.engine.overlap`): `step()` launches step n + 1 before it waits for step n's tokens, so on a
GPU the host plans and prepares a step while the device runs the previous one. The tokens are the
synchronous engine's; what changes is when they are seen: a `step()` returns the outputs of the
step launched by the call before, the first call returns none, and a request that finishes has
already been launched once more (that extra token is dropped, the extra step is counted in
`stats`). Not with static batching or eviction, which decide from tokens a step late.

**Speculative decoding** (`speculative_config=SpeculativeConfig(num_speculative_tokens=k)`,
chapter 16, `kvlib.engine.speculative`): requests verify up to k draft tokens per step (n-gram
prompt lookup, or with `method="streaming"` the model over a StreamingLLM view of the request's
cache, `kvlib.engine.streaming_draft`) and emit 1 to k + 1 tokens; greedy ones token-identical
to the engine without it, sampled ones (speculative sampling) equal in distribution, from another
random stream; logprobs requests decode normally. Counters in `stats.spec_decoding`. Off (None,
the default), nothing changes.

Sampling seeds: `SamplingParams(seed=None)` seeds a request's generator with 0, so two requests
with the same prompt and no seed sample the same tokens, and a rerun repeats a run exactly. vLLM
differs: there, no seed means fresh randomness per request; pass distinct seeds to get that here.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from kvlib._validate import check_positive_int
from kvlib.cache.block_manager import BlockManager
from kvlib.cache.block_pool import BlockPool
from kvlib.cache.paged import PagedCache
from kvlib.cache.quantized import QuantizedPagedCache
from kvlib.engine.hybrid_kv import HybridKVManager, engine_parts, layer_windows
from kvlib.engine.overlap import StepHandle
from kvlib.engine.request import Request, RequestOutput, SamplingParams
from kvlib.engine.runner import ModelRunner
from kvlib.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvlib.engine.speculative import SpeculativeConfig, Speculator, check_engine_config
from kvlib.engine.stats import EngineStats, StepStats, request_metrics, summary
from kvlib.errors import OutOfBlocksError
from kvlib.quant import QuantScheme

__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "SpeculativeConfig", "StepStats"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig(SchedulerConfig):
    """The scheduler's fields (`SchedulerConfig`: max_num_seqs, max_num_batched_tokens, policy,
    max_model_len, eviction, hash_evicted_blocks), and the KV memory's:

    Args:
    num_blocks: the KV pool's blocks (its memory: `LLMEngine.block_bytes` each).
    block_size: token slots per block.
    enable_prefix_caching: reuse cached full blocks of a prompt's prefix (chapter 7).
    kv_scheme: a per-token `kvlib.quant.QuantScheme` to store K/V quantized (chapter 10), or None.
    async_scheduling: overlap the host with the device (see `LLMEngine`'s module docstring):
        plan and launch a step before the previous one's tokens are back.
    max_recorded_steps: `StepStats` records the engine's `stats` keeps (the latest; its totals
        count every step).
    speculative_config: a `kvlib.engine.speculative.SpeculativeConfig` (or a dict of its
        fields) to decode requests speculatively (not those asking for logprobs); None: off.
    per_group_block_tables: a model with windows or linear layers gets a block table per layer
        group (`kvlib.engine.hybrid_kv`); False: one for every layer (a baseline; others: no-op).
    """

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = False
    kv_scheme: QuantScheme | None = None
    async_scheduling: bool = False
    max_recorded_steps: int = 10_000
    speculative_config: SpeculativeConfig | None = None
    per_group_block_tables: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("num_blocks", self.num_blocks)
        check_positive_int("max_recorded_steps", self.max_recorded_steps)
        check_positive_int("block_size", self.block_size)
        if self.async_scheduling and (self.policy == "static" or self.eviction is not None):
            raise ValueError(
                "async_scheduling: static batching and eviction decide from a step's tokens "
                "before the next step is planned; use policy='continuous' without eviction"
            )
        if self.kv_scheme is not None and not isinstance(self.kv_scheme, QuantScheme):
            raise TypeError(
                f"kv_scheme: expected a kvlib.quant.QuantScheme or None, got "
                f"{type(self.kv_scheme).__name__}"
            )
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", check_engine_config(self))


class _LaunchedStep(NamedTuple):
    """A step launched and not collected yet: its plan, its tokens' handle, and its (prefill,
    decode, recomputed) token counts."""

    plan: SchedulerOutput
    handle: StepHandle
    counts: tuple[int, int, int]


class LLMEngine:
    """A continuous-batching engine over the paged cache (see the module docstring). It holds
    its parts and feeds them: the `scheduler` (queues, token budget, preemption, aborts, forks),
    the block `manager` (block tables, copy-on-write), the `storage` (the KV pools), the
    `runner` (one forward and sampling per step) and the `stats` (`EngineStats`).

    Args:
        model: a `kvlib.model.LlamaModel` (not MLA; hybrids, windows: `kvlib.engine.hybrid_kv`).
        **config: `EngineConfig`'s fields.

    Raises:
        ValueError, TypeError: a bad config field (named); an MLA model (and as `hybrid_kv`).
    """

    def __init__(self, model, **config):
        self.config = EngineConfig(**config)
        c = model.config
        self.model = model
        if layer_windows(c) is not None:  # chapter 17's models (windows, linear layers)
            parts = engine_parts(model, self.config)  # a block table per layer group
            self.storage, self.manager, self.scheduler, self.runner = parts
        elif c.is_mla:
            raise ValueError("model: the engine serves K/V-head models; got an MLA model")
        else:
            kw = dict(num_blocks=self.config.num_blocks, block_size=self.config.block_size)
            if self.config.kv_scheme is not None:
                storage_class, kw["key_scheme"] = QuantizedPagedCache, self.config.kv_scheme
            else:
                storage_class = PagedCache
            weight = model.lm_head.weight
            self.storage = storage_class(
                c.num_hidden_layers,
                c.num_key_value_heads,
                c.head_dim,
                dtype=weight.dtype,
                device=weight.device,
                **kw,
            )
            pool = BlockPool(
                self.config.num_blocks,
                self.config.block_size,
                enable_prefix_caching=self.config.enable_prefix_caching,
            )
            self.storage.manager = self.manager = BlockManager(pool)  # the engine decides the slots
            self.scheduler = Scheduler(self.config, self.manager)  # an EngineConfig is one
            self.runner = ModelRunner(
                model,
                self.storage,
                self.manager,
                max_num_seqs=self.config.max_num_seqs,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                max_model_len=self.config.max_model_len,
            )
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats(self.config.max_recorded_steps)
        self.clock = 0.0
        self._in_flight: deque[_LaunchedStep] = deque()  # launched, tokens not collected yet
        self._unattributed_s = 0.0  # wall time of calls since the last collected step
        self.speculator = None
        if self.config.speculative_config is not None:
            self.speculator = Speculator(
                self.config.speculative_config, self.scheduler, self.runner, self.stats
            )
            self.stats.spec_decoding = self.speculator.stats

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: K and V (codes, scales and zero points if quantized), every
        layer."""
        return sum(pool[0].numel() * pool.element_size() for pool in self.storage.block_tensors())

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
    ) -> None:
        """Queue a request; it may be scheduled from the next `step()`.

        Raises:
            ValueError: a request id in use, an empty prompt, ids outside the vocabulary, a
                prompt + max_tokens longer than max_model_len, or needing more blocks than the
                pool has (without eviction).
        """
        request = self._new_request(request_id, prompt_token_ids, sampling_params)
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def add_parallel_requests(
        self,
        request_ids: Sequence[str],
        prompt_token_ids: Sequence[int],
        sampling_params: Sequence[SamplingParams],
    ) -> None:
        """Serve one prompt `len(request_ids)` times (OpenAI's `n`, parallel sampling; give each
        its own seed). The first request computes the prompt; the others are forked from its
        blocks in the step that completes it (`Scheduler.fork_children`: copy-on-write, chapter
        7, as vLLM's parallel sampling shares the prompt's blocks), within `max_num_seqs`.

        Raises:
            ValueError, TypeError: as `add_request`, or ids and params of different lengths.
        """
        if len(request_ids) != len(sampling_params) or not request_ids:
            raise ValueError(
                f"sampling_params: expected one per request id ({len(request_ids)}), got "
                f"{len(sampling_params)}"
            )
        if len(set(request_ids)) != len(request_ids) or set(request_ids) & set(self.requests):
            raise ValueError(f"request_ids: expected new, distinct ids, got {list(request_ids)}")
        family = [
            self._new_request(request_id, prompt_token_ids, params)
            for request_id, params in zip(request_ids, sampling_params)
        ]
        for request in family:
            self.requests[request.request_id] = request
        self.scheduler.add_parallel_requests(family[0], family[1:])

    def abort_request(self, request_id: str) -> bool:
        """Stop an unfinished request (its client went away): it leaves the queues, its blocks
        are freed at once (shared ones lose one reference) and it is forgotten. Returns False if
        it is unknown or already finished (nothing to do)."""
        request = self.requests.get(request_id)
        if request is None or (request.is_finished and request not in self.scheduler.running):
            return False
        del self.requests[request_id]
        self.stats.forget(request_id)
        self.scheduler.abort_request(request)
        return True

    def request_metrics(self) -> list[dict]:
        """Per finished request: `kvlib.engine.stats.request_metrics` of `requests`."""
        return request_metrics(self.requests.values())

    def summary(self) -> dict:
        """The run in numbers: `kvlib.engine.stats.summary` of `stats` and `requests`."""
        return summary(self.stats, self.requests, self.block_bytes)

    def _new_request(self, request_id, prompt_token_ids, sampling_params) -> Request:
        """A checked `Request` (see `add_request` for what is refused), arriving now."""
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"sampling_params: expected SamplingParams, got {type(params).__name__}"
            )
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        ids = [int(t) for t in prompt_token_ids]
        vocab = self.model.config.vocab_size
        if not ids or min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt_token_ids: expected 1+ ids in [0, {vocab}), got {ids[:8]}...")
        if len(ids) + params.max_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt_token_ids: {len(ids)} prompt tokens + max_tokens {params.max_tokens} "
                f"exceed max_model_len {self.config.max_model_len}"
            )
        held = len(ids) + params.max_tokens - 1  # the last token is sampled, never cached
        needed = -(-held // self.config.block_size)
        if isinstance(self.manager, HybridKVManager):  # chapter 17: every group's blocks
            self.manager.check_fits(len(ids), params.max_tokens)
        elif self.config.eviction is None and needed > len(self.manager.pool.blocks):
            raise ValueError(
                f"prompt_token_ids: {len(ids)} prompt tokens + max_tokens {params.max_tokens} "
                f"need {needed} blocks, more than the pool's "
                f"{self.config.num_blocks}: the request could never run"
            )
        return Request(
            str(request_id), ids, params, arrival_step=len(self.stats), arrival_time=self.clock
        )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests or bool(self._in_flight)

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; collect the tokens of the oldest step in flight (this
        one, unless `async_scheduling`: the one before); return the outputs of the requests that
        produced a token in it.

        Raises:
            OutOfBlocksError: nothing runs and the first waiting request cannot be admitted into
                an empty pool (possible only with eviction, where `add_request` cannot bound a
                request's blocks); the engine is left as it was.
        """
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.scheduled and not self._in_flight:
            if not self.scheduler.running and self.scheduler.waiting:
                request = self.scheduler.waiting[0]
                raise OutOfBlocksError(
                    f"request {request.request_id!r}: its first chunk does not fit in an empty "
                    f"pool of {self.config.num_blocks} blocks; nothing can run"
                )
        if plan.scheduled or not self.config.async_scheduling:
            self._in_flight.append(self._launch(plan))
        ahead = 1 if self.config.async_scheduling and plan.scheduled else 0
        if len(self._in_flight) <= ahead:  # the first overlapped step: nothing to collect yet
            self._unattributed_s += time.perf_counter() - start
            return []
        return self._collect(self._in_flight.popleft(), start)

    def _launch(self, plan: SchedulerOutput) -> _LaunchedStep:
        """Launch a planned step: count its tokens, queue its device work (with the block copies
        copy-on-write owes), fork the children of a parent whose prompt it completes, and advance
        its requests (placeholders for the tokens it samples)."""
        counts = self.stats.count_tokens(plan.scheduled)  # before the step advances them
        copies, self.manager.copies = self.manager.copies, []
        if self.speculator is None:
            handle = self.runner.submit(
                plan.scheduled, copies, non_blocking=self.config.async_scheduling
            )
        else:  # drafts verified in the step: its decode tokens too
            handle = self.speculator.submit(plan.scheduled, copies)
            counts = (counts[0], counts[1] + self.speculator.num_drafted, counts[2])
        for child in self.scheduler.fork_children(plan):  # parallel sampling
            self.stats.set_computed(child.request_id, child.num_computed_tokens)
        self.scheduler.advance(plan)
        return _LaunchedStep(plan, handle, counts)

    def _collect(self, launched: _LaunchedStep, start: float) -> list[RequestOutput]:
        """Wait for a launched step's tokens, record them (`Scheduler.record_sampled`), and
        account the step: its time is the calls' since the last collected step."""
        plan = launched.plan
        sampled, logprobs = launched.handle.result()
        if self.speculator is None:
            appended, num_new = self.scheduler.record_sampled(plan, sampled), {}
        else:
            appended = self.speculator.record(plan, sampled)
            num_new = self.speculator.num_new_tokens  # tokens each speculating request appended
        seconds = self._unattributed_s + time.perf_counter() - start + self._charged_seconds()
        self._unattributed_s = 0.0
        self.clock += seconds
        step = len(self.stats)
        outputs = []
        for request in appended:
            if request.first_token_step is None:
                request.first_token_step, request.first_token_time = step, self.clock
            finished = request.is_finished
            if finished:
                request.finish_step, request.finish_time = step, self.clock
                self.stats.forget(request.request_id)
            entry = logprobs.get(request.request_id) if logprobs else None
            outputs.append(
                RequestOutput(
                    request.request_id,
                    request.prompt_token_ids,
                    list(request.output_token_ids),
                    request.output_token_ids[-num_new.get(request.request_id, 1) :],
                    finished,
                    request.finish_reason,
                    None if entry is None else [entry],
                )
            )
        prefill, decode, recomputed = launched.counts
        self.stats.record(
            StepStats(
                step=step,
                seconds=seconds,
                clock=self.clock,
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                num_prefill_tokens=prefill,
                num_decode_tokens=decode,
                num_recomputed_tokens=recomputed,
                num_blocks_in_use=self.storage.num_blocks_in_use,
                num_preemptions=len(plan.preempted),
                prefix_hit_tokens=plan.prefix_hit_tokens,
                prefix_query_tokens=plan.prefix_query_tokens,
                preempted_hit_tokens=plan.preempted_hit_tokens,
                preempted_query_tokens=plan.preempted_query_tokens,
                scheduled=tuple([(r.request_id, n) for r, n in plan.scheduled]),
            )
        )
        return outputs

    def _charged_seconds(self) -> float:
        """Seconds a step is charged beyond its wall time: none here; chapter 14's engine
        charges the modelled transfer time of the blocks it promoted from slower tiers."""
        return 0.0

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Serve `prompts` (lists of token ids) to completion; return their final outputs in
        prompt order. `sampling_params`: one for all, or one per prompt. A progress bar counts
        finished requests (`use_tqdm`)."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"sampling_params: expected one or {len(prompts)} (one per prompt), got "
                f"{len(sampling_params)}"
            )
        first = len(self.requests)
        ids = [f"request-{first + i}" for i in range(len(prompts))]
        for request_id, prompt, params in zip(ids, prompts, sampling_params):
            self.add_request(request_id, prompt, params)
        final: dict[str, RequestOutput] = {}
        from tqdm.auto import tqdm

        with tqdm(total=len(ids), desc="requests", unit="req", disable=not use_tqdm) as bar:
            while self.has_unfinished_requests():
                for output in self.step():
                    if output.finished:
                        final[output.request_id] = output
                        bar.update(1)
        return [final[i] for i in ids]
