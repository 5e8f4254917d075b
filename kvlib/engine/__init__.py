"""A small serving engine (chapter 12): continuous batching over the paged cache, with chunked
prefill, preemption by recomputation, prefix caching, and optional quantized or evicting caches.

Modules, named as vLLM v1 and nano-vllm name theirs:

- `request`: `SamplingParams`, `Request` (token ids, computed tokens, status), `RequestOutput`;
- `scheduler`: waiting and running queues, the per-step token budget, preemption, eviction, and
  a request's lifecycle beyond them: aborts, and the forks of parallel sampling (`n > 1`);
- `runner`: the flattened batch and its attention metadata (positions, slot mapping, block tables,
  sequence lengths: `batch`, built with array operations over persistent rows by `input_batch`),
  one forward of the course's model, sampling (`sampler`); decode-only steps through static
  buffers for CUDA graphs (`cuda_graph`), steps with prompt tokens too on request (`mixed_graph`);
- `overlap`: where a step's device work runs and how its tokens come back, so that the engine can
  plan step n + 1 while step n runs (`async_scheduling`);
- `llm_engine`: `LLMEngine` (`add_request`, `step`, `generate`), which holds the parts above and
  feeds its statistics (`stats`: `EngineStats`, `StepStats`: the latest steps and running totals);
- `speculative`: speculative decoding (chapter 16, `speculative_config`) with n-gram drafts or
  self-speculation over a StreamingLLM view of each request's cache (`streaming_draft`),
  verified as chunks of the mixed batch, rejected slots rolled back;
- `hybrid_kv`: hybrid models (chapter 17): a block table per layer group over one pool, each
  layer attending through its group's tables under its window; a state slot per request for each
  linear (recurrent) layer;
- `workload`: a synthetic serving workload and the configurations chapter 12 compares
  (`python -m kvlib.experiments.serving` records the comparison, `results/serving.csv`).

The block allocator itself is chapter 7's `kvlib.cache.block_pool`.
"""

from kvlib.engine.llm_engine import EngineConfig, LLMEngine
from kvlib.engine.request import FinishReason, Request, RequestOutput, SamplingParams
from kvlib.engine.scheduler import Scheduler, SchedulerConfig, StreamingEviction
from kvlib.engine.speculative import SpeculativeConfig
from kvlib.engine.stats import EngineStats, SpecDecodingStats, StepStats

__all__ = [
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "LLMEngine",
    "Request",
    "RequestOutput",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SpecDecodingStats",
    "SpeculativeConfig",
    "StepStats",
    "StreamingEviction",
]
