"""Speculative decoding inside the serving engine (chapter 16, "speculation in the engine"): for
each running request, a drafter proposes up to k tokens: by default (method "ngram") an n-gram
prompt-lookup drafter (`kvlib.speculative.ngram`, after vLLM's `ngram` method: the same idea and
field names, other defaults, and the latest match where vLLM takes the earliest) from the
request's own tokens; with method "streaming", the target model itself over a StreamingLLM view
of the request's cache (sink blocks + a recent window: `kvlib.engine.streaming_draft`, after
MagicDec), k one-token forwards before the verification. The step computes the
request's newest token and its draft together, k + 1 query tokens, as one chunk of the mixed
batch; verification keeps a prefix of the draft plus one token of the target's (at the first
rejection, or the bonus after the last draft token); the rejected tokens' slots are rolled back
(`BlockManager.truncate`). vLLM v1's `spec_decode/ngram_proposer.py` and its rejection sampler,
whose greedy and random branches these are (Leviathan et al., 2023, "Fast Inference from
Transformers via Speculative Decoding", ICML, Algorithm 1; Chen et al., 2023, "Accelerating Large
Language Model Decoding with Speculative Sampling").

- A **greedy** request (`is_greedy`): `kvlib.speculative.verify.greedy_accept` keeps the longest
  prefix of the draft that equals the target's argmax, then the argmax after it. Its output is
  token-identical to the engine without speculation.
- A **sampled** request (temperature > 0, with its top_k and top_p): speculative sampling,
  `verify_sampled`. p_i is the request's own sampling distribution at row i
  (`kvlib.engine.sampler.sampling_distribution`, `sample_step`'s arithmetic). The streaming
  drafter draws x_i from its own q_i (that arithmetic over its view's logits), and
  `speculative_accept` gets those rows. Prompt lookup, being deterministic, has q_i = a point
  mass on draft token x_i, so
  `kvlib.speculative.verify.speculative_accept` with one-hot rows accepts x_i with probability
  min(1, p_i(x_i) / 1) = p_i(x_i), draws the token at the first rejection from max(0, p_i - q_i)
  normalised (p_i with x_i zeroed), and the bonus from p_k. Every emitted token is distributed
  exactly as the engine's plain sampling draws it; the draws come from the request's own
  generator (`Request.generator_for`), so, given its drafts, a request's tokens do not depend on
  the other requests in its batch. They are **equal in distribution, not token-identical**, to
  the engine's without speculation: verification draws uniforms and a multinomial where plain
  sampling draws one exponential per token of the vocabulary, so the request's random stream,
  and with it the tokens a seed gives, differ. A draft's length depends on the token budget and
  the free blocks the step leaves (below), so a seed gives the same tokens whatever the batch
  when those hold every draft (without preemption, as without speculation).
- A request **asking for logprobs** decodes normally in the same steps: the logprobs of the
  accepted tokens are not computed here.

How a step goes (`Speculator.submit`, then `Speculator.record`):

1. The scheduler plans the step as always (a decoding request computes 1 token). Drafts are
   planned after it, from the **token budget and free blocks the plan leaves**: a request gets
   min(k, its tokens still to generate - 1, what the free blocks and budget hold) draft slots,
   appended with unknown ids (`append_slot(request, None)`), so no block holding a draft token
   is ever hashed for the prefix cache; with no room it decodes plainly. A draft never preempts
   another request: it is a guess, and preempting a request for it costs a recomputation. Its
   blocks still come off the free queue, so they can evict cached prefix blocks, which costs
   recomputation later too (vLLM instead schedules the draft tokens with the step and preempts
   when they do not fit).
2. A step with no draft at all runs through `ModelRunner.submit`, exactly as without
   speculation. With method "streaming", copy-on-write's copies run, then the drafter's forwards
   (`StreamingDrafter.draft`) write the draft tokens into the slots appended. A step with
   drafts is built here (`verify_input`, the readable loop of
   `kvlib.engine.batch.prepare_inputs` with the drafts appended) and run by
   `ModelRunner.forward` with logits at every row of each draft chunk.
3. The accepted draft tokens get their ids (`set_token`, which hashes the blocks they complete),
   the rejected ones their slots back (`truncate`); the K/V written to the freed slots is never
   read (the block tables and sequence lengths say what is) and is overwritten by the next token
   stored there. Tokens are appended in order, each checked against `max_tokens` and the stop
   tokens, so nothing is emitted past a stop.

What it does not do: logprobs of speculated tokens (such a request decodes normally), overlap
(`async_scheduling`), static batching or eviction (refused by `check_engine_config`), or draft
with a separate draft model (vLLM's `draft_model`, EAGLE, MTP).
"""

from __future__ import annotations

import dataclasses

import torch

from kvlib._validate import check_positive_int
from kvlib.engine.batch import ModelInput
from kvlib.engine.overlap import InlineDevice, StepHandle
from kvlib.engine.request import Request, SamplingParams
from kvlib.engine.sampler import device_tensor, is_greedy, sample_step, sampling_distribution
from kvlib.engine.stats import SpecDecodingStats
from kvlib.engine.streaming_draft import StreamingDrafter, check_streaming_fields
from kvlib.speculative.ngram import ngram_draft
from kvlib.speculative.verify import greedy_accept, speculative_accept

__all__ = [
    "SpeculativeConfig",
    "Speculator",
    "check_engine_config",
    "verify_input",
    "verify_sampled",
]

METHODS = ("ngram", "streaming")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """The engine's speculative decoding, with vLLM's `SpeculativeConfig` field names (its
    defaults differ: vLLM sets both lookup bounds to 5 when neither is given).

    Args:
        method: "ngram" (prompt lookup, `kvlib.speculative.ngram.ngram_draft`) or "streaming"
            (self-speculation over a StreamingLLM view, `kvlib.engine.streaming_draft`; the
            prompt lookup fields must then keep their defaults).
        num_speculative_tokens: k >= 1, draft tokens per request and step, at most.
        prompt_lookup_max: "ngram" only: the longest n-gram looked up (>= 1).
        prompt_lookup_min: "ngram" only: the shortest n-gram looked up (1 .. prompt_lookup_max).
        disable_by_batch_size: no drafts in a step that schedules more requests than this (>= 1;
            None: always draft). A large batch's step is costlier per extra query token and
            saves fewer steps (chapter 16, Measure); vLLM's field of that name counts the
            requests enqueued rather than those scheduled.
        num_sink_blocks: "streaming" only: the view's first blocks (>= 0; None: 1).
        num_window_blocks: "streaming" only: the view's last blocks (>= 1; None: 4).

    Raises:
        ValueError: a value outside those ranges, or a field of the other method given a value
            other than its default (naming the field).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    disable_by_batch_size: int | None = None
    num_sink_blocks: int | None = None
    num_window_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {self.method!r}")
        check_positive_int("num_speculative_tokens", self.num_speculative_tokens)
        check_positive_int("prompt_lookup_max", self.prompt_lookup_max)
        check_positive_int("prompt_lookup_min", self.prompt_lookup_min)
        if self.disable_by_batch_size is not None:
            check_positive_int("disable_by_batch_size", self.disable_by_batch_size)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min: expected at most prompt_lookup_max = "
                f"{self.prompt_lookup_max}, got {self.prompt_lookup_min}"
            )
        if self.method == "streaming":  # prompt lookup's fields would be silently unused
            for field in dataclasses.fields(self):
                value = getattr(self, field.name)
                if field.name.startswith("prompt_lookup_") and value != field.default:
                    raise ValueError(
                        f"{field.name}: only for method='ngram' (prompt lookup), got {value!r} "
                        "with method='streaming'"
                    )
        view = check_streaming_fields(self.method, self.num_sink_blocks, self.num_window_blocks)
        object.__setattr__(self, "num_sink_blocks", view[0])
        object.__setattr__(self, "num_window_blocks", view[1])


def check_engine_config(config) -> SpeculativeConfig:
    """The `EngineConfig`'s `speculative_config` as a `SpeculativeConfig` (a dict of its fields
    is accepted, as vLLM accepts one).

    Raises:
        TypeError: neither a `SpeculativeConfig` nor a dict.
        ValueError: a bad field; combined with `async_scheduling` (a draft is made from the
            request's newest token, which the overlapped engine does not have when it plans),
            with policy="static" or with eviction.
    """
    spec = config.speculative_config
    if isinstance(spec, dict):
        fields = [f.name for f in dataclasses.fields(SpeculativeConfig)]
        unknown = sorted(set(spec) - set(fields))
        if unknown:
            raise ValueError(
                f"speculative_config: expected fields among {fields}, got unknown {unknown}"
            )
        spec = SpeculativeConfig(**spec)
    if not isinstance(spec, SpeculativeConfig):
        raise TypeError(
            "speculative_config: expected a SpeculativeConfig, a dict of its fields or None, "
            f"got {type(spec).__name__}"
        )
    if config.async_scheduling:
        raise ValueError(
            "speculative_config and async_scheduling: speculation drafts from each request's "
            "newest token, which an overlapped step is planned without; use one of them"
        )
    if config.policy == "static" or config.eviction is not None:
        raise ValueError(
            "speculative_config: expected policy='continuous' without eviction, got "
            f"policy={config.policy!r}, eviction={config.eviction!r}"
        )
    return spec


def verify_input(
    scheduled: list[tuple[Request, int]], drafts: dict[str, list[int]], manager, device
) -> tuple[ModelInput, dict[str, tuple[int, int]], list[Request]]:
    """The flattened batch of a step with drafts (as `kvlib.engine.batch.prepare_inputs`, after
    the draft slots were appended): a request with a draft of k' tokens computes its planned
    token and the draft, k' + 1 rows, every one of them sampled (logits for verification).

    Returns:
        (the `ModelInput`, {request id: (first, end) of its draft chunk's rows among the sampled
        rows}, the requests sampled normally, in the order of their rows after the chunks').
    """
    ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
    spec_rows, plain_rows, chunks, plain = [], [], {}, []
    for request, num_new in scheduled:
        request_id, start = request.request_id, request.num_computed_tokens
        draft = drafts.get(request_id, [])
        q = num_new + len(draft)  # query tokens
        held = manager.num_tokens(request_id)  # with the draft's slots
        ids += request.token_ids(start, start + num_new) + draft
        positions += range(start, start + q)
        slots += [manager.slot(request_id, held - q + t) for t in range(q)]
        starts.append(starts[-1] + q)
        seq_lens.append(held)
        tables.append(manager.block_tables[request_id])
        if draft:
            chunks[request_id] = (len(spec_rows), len(spec_rows) + q)
            spec_rows += range(starts[-2], starts[-1])
        elif start + num_new == request.num_tokens:  # its last token: logits for the next one
            plain_rows.append(starts[-1] - 1)
            plain.append(request)
    width = max(len(t) for t in tables)

    def tensor(values):
        return device_tensor(values, torch.int64, device)

    query_lens = [q1 - q0 for q0, q1 in zip(starts, starts[1:])]
    batch = ModelInput(
        input_ids=tensor(ids),  # (N,)
        positions=tensor(positions),  # (N,)
        slot_mapping=tensor(slots),  # (N,)
        query_start_loc=tensor(starts),  # (n + 1,)
        seq_lens=tensor(seq_lens),  # (n,)
        block_tables=tensor([t + [0] * (width - len(t)) for t in tables]),  # (n, width)
        sample_indices=tensor(spec_rows + plain_rows),  # (m,): the chunks' rows first
        sample_requests=plain,
        query_lens=query_lens,
        seq_lens_host=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return batch, chunks, plain


def verify_sampled(
    draft: list[int],
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> tuple[int, int]:
    """Speculative sampling of a draft: the k' draft tokens against `logits (k' + 1, V)`, the
    target's at `[planned token, *draft]`, under the request's `params` (a temperature above
    `GREEDY_TEMPERATURE`), drawn with its `generator`. p_i is `sampling_distribution` (the
    engine's sampling arithmetic, normalised); q_i is `draft_probs (k', V)`, the drafter's own
    distributions (x_i accepted with probability min(1, p_i(x_i) / q_i(x_i)), a rejection drawn
    from max(0, p_i - q_i) normalised), or for None (prompt lookup, deterministic) a point mass
    on x_i: x_i accepted with probability p_i(x_i), a rejection drawn from p_i with x_i zeroed,
    renormalised. Either way the bonus comes from p_k'. (The point-mass rule is exact for a
    guess drawn any way, but accepts less: p_i(x_i) <= min(1, p_i(x_i) / q_i(x_i)).)

    Returns:
        (accepted, next_token), as `speculative_accept`.
    """
    probs = sampling_distribution(logits, [params] * len(logits))  # (k' + 1, V)
    if draft_probs is None:
        ids = torch.tensor(draft, dtype=torch.int64, device=probs.device)  # (k',)
        draft_probs = torch.nn.functional.one_hot(ids, probs.shape[-1]).to(probs.dtype)
    return speculative_accept(draft, draft_probs, probs, generator)


class Speculator:
    """Drafts, verifies and commits the engine's speculative steps (see the module docstring);
    `LLMEngine` calls `submit` in place of `ModelRunner.submit` and `record` in place of
    `Scheduler.record_sampled`. `stats` counts as vLLM's `SpecDecodingStats` does;
    `num_new_tokens` holds the tokens each speculating request appended in the last step."""

    def __init__(self, config: SpeculativeConfig, scheduler, runner, engine_stats):
        self.config, self.scheduler, self.runner = config, scheduler, runner
        self.manager = scheduler.manager
        self.engine_stats = engine_stats  # `set_computed` for the accepted tokens
        self.stats = SpecDecodingStats(config.num_speculative_tokens)
        self.verified: dict[str, tuple[list[int], int, int]] = {}  # id -> (draft, accepted, next)
        self.num_new_tokens: dict[str, int] = {}
        self.num_drafted = 0  # draft tokens of the last step submitted (decode tokens computed)
        self.drafter, self.draft_probs = None, {}  # "streaming": its drafter, q of the step
        if config.method == "streaming":
            view = config.num_sink_blocks, config.num_window_blocks
            self.drafter = StreamingDrafter(runner, self.manager, *view)

    def propose(self, scheduled: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Draft for the plan's decoding requests (greedy or sampled; not those asking for
        logprobs) and append the drafts' slots (ids unknown: never hashed), within the token
        budget and the free blocks the plan left. Returns {request id: draft} for the requests
        that got one (k' >= 1 tokens; for "streaming", k' placeholders that `submit` fills)."""
        config, manager = self.config, self.manager
        limit = config.disable_by_batch_size
        if limit is not None and len(scheduled) > limit:
            return {}
        block_size = manager.block_size
        budget = self.scheduler.config.max_num_batched_tokens - sum(n for _, n in scheduled)
        drafts = {}
        for request, num_new in scheduled:
            params = request.sampling_params
            if (
                budget <= 0
                or num_new != 1
                or not request.output_token_ids
                or params.logprobs is not None
                or request.num_computed_tokens + 1 != request.num_tokens
            ):
                continue
            request_id = request.request_id
            held = manager.num_tokens(request_id)
            free_slots = (
                len(manager.block_tables[request_id]) + manager.pool.num_free_blocks
            ) * block_size - held
            left = params.max_tokens - len(request.output_token_ids) - 1  # + the bonus token
            room = min(config.num_speculative_tokens, left, budget, free_slots)
            if room <= 0:
                continue
            if self.drafter is not None:  # its tokens come from the draft forwards (`submit`)
                draft = [0] * room
            else:
                draft = ngram_draft(
                    request.all_token_ids,
                    room,
                    max_ngram=config.prompt_lookup_max,
                    min_ngram=config.prompt_lookup_min,
                )
            if not draft:
                continue
            for _ in draft:
                manager.append_slot(request_id, None)  # a private block: no copy-on-write
            drafts[request_id] = draft
            budget -= len(draft)
        return drafts

    def submit(self, scheduled: list[tuple[Request, int]], block_copies) -> StepHandle:
        """Run a planned step with drafts where there are any (`propose`); without any, it is
        `ModelRunner.submit`'s step, unchanged. Verifies each draft (`greedy_accept`: one argmax
        per chunk; `verify_sampled` for a sampled request, with its own generator; a host sync
        per speculating request) and samples the other requests with the runner's arithmetic
        (`sample_step`). Returns the handle of the normally sampled tokens; the verified drafts
        wait in `verified` for `record`."""
        drafts = self.propose(scheduled)
        self.num_drafted = sum(len(draft) for draft in drafts.values())
        if not drafts:
            return self.runner.submit(scheduled, block_copies)
        assert not self.manager.copies  # drafts append into private blocks: nothing to copy
        self.runner.submit([], block_copies).result()  # copy-on-write's copies, before any write
        if self.drafter is not None:  # self-speculation: the draft forwards fill the drafts
            self.draft_probs = self.drafter.draft(scheduled, drafts)
        runner = self.runner
        batch, chunks, plain = verify_input(scheduled, drafts, self.manager, runner.device)
        with torch.no_grad():
            logits = runner.forward(batch, sample_only=True)
            if logits.shape[0] != len(batch.sample_indices):  # a graph runner's: every row
                logits = logits.index_select(0, batch.sample_indices)  # (m, V)
            requests = {request.request_id: request for request, _ in scheduled}
            for request_id, (first, end) in chunks.items():
                draft, request = drafts[request_id], requests[request_id]
                rows = logits[first:end]  # (k' + 1, V)
                if is_greedy(request.sampling_params):
                    accepted, next_token = greedy_accept(draft, rows)
                else:
                    generator = request.generator_for(runner.device)
                    q = self.draft_probs.get(request_id)  # None: prompt lookup's point masses
                    extra = {} if q is None else {"draft_probs": q}
                    accepted, next_token = verify_sampled(
                        draft, rows, request.sampling_params, generator, **extra
                    )
                self.verified[request_id] = (draft, accepted, next_token)
            if not plain:
                return StepHandle(None, [])
            params = [request.sampling_params for request in plain]
            generators = [
                request.generator_for(runner.device) if p.temperature else None
                for request, p in zip(plain, params)
            ]
            step = sample_step(logits[len(logits) - len(plain) :], params, generators)
        return StepHandle(
            InlineDevice().submit(lambda: (step, None)), [r.request_id for r in plain]
        )

    def record(self, out, sampled: dict[str, int]) -> list[Request]:
        """Commit a step (`Scheduler.advance` has run): each verified request keeps its accepted
        draft tokens' slots (their ids set: `set_token`), gives the rejected ones back
        (`truncate`) and appends the accepted tokens and the target's next one in order, until
        one finishes it; then `Scheduler.record_sampled` records the other requests' tokens.
        Returns the requests that appended tokens, in plan order."""
        verified, self.verified = self.verified, {}
        self.num_new_tokens = {}
        scheduler, manager = self.scheduler, self.manager
        appended, finished = [], []
        for request, _ in out.scheduled:
            if request.request_id not in verified:
                continue
            request_id = request.request_id
            draft, accepted, next_token = verified[request_id]
            request.num_output_placeholders -= 1  # `advance` counted the step's token
            held = manager.num_tokens(request_id) - len(draft)  # through the planned token
            manager.truncate(request_id, held + accepted)  # the rejected tokens' slots
            for i, token in enumerate(draft[:accepted]):
                manager.set_token(request_id, held + i, token)
            request.num_computed_tokens += accepted
            self.engine_stats.set_computed(request_id, request.num_computed_tokens)
            self.stats.observe_draft(len(draft), accepted)
            new = 0
            for token in [*draft[:accepted], next_token]:
                request.append_output(token)
                new += 1
                if request.is_finished:  # a stop token or max_tokens: nothing after it
                    finished.append(request)
                    break
            self.num_new_tokens[request_id] = new
            if self.drafter is not None:
                self.drafter.kv_reads.observe_verification(held, len(draft), new)
            appended.append(request)
        appended += scheduler.record_sampled(out, sampled)  # the others (drafts: no entry)
        for request in finished:
            scheduler.running.remove(request)
            manager.free(request.request_id)
        order = {request.request_id: i for i, (request, _) in enumerate(out.scheduled)}
        return sorted(appended, key=lambda request: order[request.request_id])
