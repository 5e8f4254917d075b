"""The scheduler (chapter 12): which requests run this step, and how many tokens each computes.

One rule, vLLM v1's, covers prefill and decode alike: every request has `num_tokens` token ids
(prompt + generated) of which `num_computed_tokens` have K/V in the cache, and a step gives each
scheduled request some of the rest. A decoding request needs 1; a new request needs its whole
prompt, which **chunked prefill** spreads over several steps so that a step never computes more
than `max_num_batched_tokens` tokens (the **token budget**), and decodes are not stalled behind a
long prompt (Agrawal et al., 2024, "Taming Throughput-Latency Tradeoff in LLM Inference with
Sarathi-Serve", OSDI).

`policy="continuous"` (iteration-level scheduling, Yu et al., 2022, "Orca", OSDI):

1. Running requests first, oldest first: each gets min(its remaining tokens, the budget left).
   When the pool has too few free blocks for them, the **newest running request is preempted**
   (vLLM v1's rule under first-come-first-served: the one that has waited least loses least) and
   retried until the request fits or is itself the one preempted. A preempted request frees its
   blocks and goes back to the front of the waiting queue with `num_computed_tokens = 0`:
   **preemption by recomputation** (its blocks stay in the prefix cache until reused, so with
   prefix caching on the recomputation may be mostly hits; those readmission lookups are counted
   apart from first admissions, as vLLM v1 does).
2. Then waiting requests, first come first served, while the budget, `max_num_seqs` and the pool
   allow (not in a step that preempted): each starts at its prefix-cache hit and computes the
   first chunk of the rest. A request that does not fit stops admission (no overtaking).
3. A finished request frees its blocks at once; a newly arrived one can take them next step.

`policy="static"` (request-level scheduling, the baseline Orca improves on): a batch is admitted
only when the previous one has completely finished; each admitted request **reserves
`max_model_len` token slots** up front, as a contiguous cache would (so the pool limits the batch
to num_blocks // ceil(max_model_len / block_size) requests); its prompt is computed in one step;
a request that finishes early keeps its reservation, and nobody joins, until the whole batch is
done. (Real static batching also computes the finished rows' padding tokens; this baseline skips
them, which flatters it.)

Eviction (`StreamingEviction`) drops a sequence's whole blocks between its first `sink_blocks`
and its last `window_blocks` full blocks (StreamingLLM's sinks + recent window, Xiao et al., 2024,
at block granularity), so memory is freed without copying (`BlockManager.drop_blocks`).
"""

from __future__ import annotations

import dataclasses
from collections import deque

from kvlib._validate import check_positive_int
from kvlib.cache.block_manager import BlockManager
from kvlib.engine.request import FinishReason, Request, RequestStatus
from kvlib.errors import OutOfBlocksError

__all__ = ["SchedulerConfig", "SchedulerOutput", "Scheduler", "StreamingEviction"]

POLICIES = ("continuous", "static")


@dataclasses.dataclass(frozen=True)
class StreamingEviction:
    """Keep a sequence's first `sink_blocks` blocks and its last `window_blocks` full blocks (and
    the block being filled); drop the full blocks between them (chapter 8's StreamingLLM)."""

    sink_blocks: int = 1
    window_blocks: int = 4

    def __post_init__(self) -> None:
        check_positive_int("sink_blocks", self.sink_blocks)
        check_positive_int("window_blocks", self.window_blocks)

    def blocks_to_drop(self, num_blocks: int) -> list[int]:
        """Block-table indices to drop from a table of `num_blocks` blocks (the last one may be
        partly filled)."""
        return list(range(self.sink_blocks, num_blocks - 1 - self.window_blocks))


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Args:
    max_num_seqs: requests running at once, at most.
    max_num_batched_tokens: the token budget: tokens computed per step, at most (continuous).
    policy: "continuous" or "static" (see the module docstring).
    max_model_len: tokens per request (prompt + output), at most: a longer request is refused
        when added; under "static" each request reserves this many token slots.
    eviction: a `StreamingEviction`, or None (keep every token).
    hash_evicted_blocks: keep registering a sequence's blocks in the prefix cache after it has
        evicted tokens. Wrong (chapter 12's pitfall): those blocks' K/V were computed without the
        evicted tokens, so a hit hands another request K/V its own prefill would not compute.
    """

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 64
    policy: str = "continuous"
    max_model_len: int = 512
    eviction: StreamingEviction | None = None
    hash_evicted_blocks: bool = False

    def __post_init__(self) -> None:
        check_positive_int("max_num_seqs", self.max_num_seqs)
        check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        check_positive_int("max_model_len", self.max_model_len)
        if self.policy not in POLICIES:
            raise ValueError(f"policy: expected one of {POLICIES}, got {self.policy!r}")
        if self.eviction is not None and self.policy == "static":
            raise ValueError(
                "eviction: static batching reserves max_model_len per request, so eviction frees "
                "nothing; use policy='continuous'"
            )
        if self.eviction is not None and not isinstance(self.eviction, StreamingEviction):
            raise TypeError(
                "eviction: expected a StreamingEviction or None, got "
                f"{type(self.eviction).__name__}"
            )


@dataclasses.dataclass
class SchedulerOutput:
    """One step's plan: `scheduled` lists (request, number of new tokens to compute), running
    requests first; `preempted` the requests preempted to make room; `prefix_hit_tokens` and
    `prefix_query_tokens` the prefix-cache lookups of the requests admitted this step for the
    first time (tokens found, tokens looked up); `preempted_hit_tokens` and
    `preempted_query_tokens` those of preempted requests readmitted this step, counted apart
    (as vLLM v1's `PrefixCacheStats` counts `preempted_hits` and `preempted_queries`): their
    hits include their own freed blocks, which says nothing about prompts sharing a prefix."""

    scheduled: list[tuple[Request, int]] = dataclasses.field(default_factory=list)
    preempted: list[Request] = dataclasses.field(default_factory=list)
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    preempted_hit_tokens: int = 0
    preempted_query_tokens: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Waiting and running queues over a `BlockManager` whose sequence ids are request ids (see
    the module docstring for the rules)."""

    def __init__(self, config: SchedulerConfig, manager: BlockManager):
        self.config = config
        self.manager = manager
        self.block_size = manager.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved: dict[str, list[int]] = {}  # static: blocks held back for each request
        self._pending_forks: dict[str, list[Request]] = {}  # parent id -> children to fork

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    # --- parallel sampling and aborts ------------------------------------------------------------

    def add_parallel_requests(self, parent: Request, children: list[Request]) -> None:
        """Queue `parent` and the `children` that sample the same prompt (OpenAI's `n`). Where
        forking is possible (continuous batching, no eviction, a prompt of 2+ tokens: a
        one-token prompt has nothing computed to share) the children wait until the step that
        completes the parent's prompt (`fork_children`); otherwise they queue as ordinary
        requests (with prefix caching they then hit the parent's full blocks)."""
        self.add_request(parent)
        forkable = (
            self.config.policy == "continuous"
            and self.config.eviction is None
            and len(parent.prompt_token_ids) > 1
        )
        if forkable:
            self._pending_forks[parent.request_id] = list(children)
        else:
            for child in children:
                self.add_request(child)

    def fork_children(self, out: SchedulerOutput) -> list[Request]:
        """For each parent whose prompt the launched step `out` completes (the block
        manager then holds exactly the prompt's tokens): **fork** its children
        (`BlockManager.fork`: they share its blocks, chapter 7's copy-on-write), each
        keeping all but the prompt's last token, which it recomputes next step (one
        token) to sample its own first token. A child runs at once only while fewer
        than `max_num_seqs` requests run and a free block can take its copy of the
        shared last block; otherwise it queues as an ordinary request. Returns the
        children now running."""
        forked = []
        for request, num_new in out.scheduled:
            children = self._pending_forks.get(request.request_id)
            prompt_len = len(request.prompt_token_ids)
            if children is None or request.num_computed_tokens + num_new < prompt_len:
                continue
            del self._pending_forks[request.request_id]
            for child in children:
                if len(self.running) >= self.config.max_num_seqs:
                    self.add_request(child)
                    continue
                self.manager.fork(request.request_id, child.request_id)
                try:
                    self.manager.truncate(child.request_id, prompt_len - 1)
                except OutOfBlocksError:
                    self.manager.free(child.request_id)
                    self.add_request(child)
                    continue
                child.num_computed_tokens = child.num_cached_tokens = prompt_len - 1
                child.status = RequestStatus.RUNNING
                self.running.append(child)
                forked.append(child)
        return forked

    def abort_request(self, request: Request) -> None:
        """Stop an unfinished request: it leaves the queues (or its parent's children still to
        fork), its blocks are freed at once (shared ones lose one reference), and it finishes
        with `FinishReason.ABORT`. Children still waiting to be forked from it queue as ordinary
        requests."""
        request_id = request.request_id
        for children in self._pending_forks.values():
            if request in children:
                children.remove(request)
                break
        else:
            for child in self._pending_forks.pop(request_id, []):
                self.add_request(child)
            if request in self.waiting:
                self.waiting.remove(request)
            elif request in self.running:
                self.running.remove(request)
                reserved = self.reserved.pop(request_id, None)  # static batching
                if reserved:
                    self.manager.pool.free(reserved)
                if request_id in self.manager.block_tables:
                    self.manager.free(request_id)
        request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason.ABORT

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # --- planning a step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step and allocate its slots (blocks); see the module docstring."""
        if self.config.policy == "static":
            return self._schedule_static()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while self._blocks_needed(request, num_new) > self.manager.pool.num_free_blocks:
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:  # it preempted itself
                break
            self._append_slots(request, num_new)
            out.scheduled.append((request, num_new))
            budget -= num_new
            index += 1
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and not out.preempted
        ):
            request = self.waiting[0]
            tokens = request.all_token_ids
            hit, _ = self.manager.num_cached_prefix_blocks(tokens)
            num_new = min(len(tokens) - hit, budget)
            if not self.manager.can_allocate(tokens[: hit + num_new]):
                break  # first come, first served: nobody overtakes the request at the front
            self.waiting.popleft()
            covered = self.manager.allocate(request.request_id, tokens[: hit + num_new])
            assert covered == hit, (covered, hit)  # the same lookup, on a prefix of the tokens
            request.num_computed_tokens = hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            if request.num_preemptions == 0:  # first admission
                request.num_cached_tokens = hit
                out.prefix_hit_tokens += hit
                out.prefix_query_tokens += len(tokens)
            else:  # readmission after a preemption: counted apart
                out.preempted_hit_tokens += hit
                out.preempted_query_tokens += len(tokens)
            budget -= num_new
        return out

    def _schedule_static(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.running:  # the batch decodes until its last request finishes
            for request in self.running:
                if not request.is_finished:
                    held = self.manager.num_tokens(request.request_id)
                    if held % self.block_size == 0:  # a new block: take it from the reservation
                        self.manager.pool.free([self.reserved[request.request_id].pop()])
                    self._append_slots(request, 1)
                    out.scheduled.append((request, 1))
            return out
        reserve = -(-self.config.max_model_len // self.block_size)
        while (
            self.waiting
            and len(self.running) < self.config.max_num_seqs
            and self.manager.pool.num_free_blocks >= reserve
        ):
            request = self.waiting.popleft()
            tokens = request.prompt_token_ids
            hit = self.manager.allocate(request.request_id, tokens)  # 0 without prefix caching
            held = len(self.manager.block_tables[request.request_id])
            self.reserved[request.request_id] = self.manager.pool.allocate(reserve - held)
            request.num_computed_tokens = request.num_cached_tokens = hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, len(tokens) - hit))
            out.prefix_hit_tokens += hit
            out.prefix_query_tokens += len(tokens)
        return out

    def _blocks_needed(self, request: Request, num_new: int) -> int:
        """Free blocks `num_new` more tokens of a running request take."""
        table = self.manager.block_tables[request.request_id]
        held = len(self.manager.token_ids[request.request_id])
        return -(-(held + num_new) // self.block_size) - len(table)

    def _append_slots(self, request: Request, num_new: int) -> None:
        """Slots for the request's next `num_new` tokens (a placeholder's id is not known yet:
        the manager hashes its block once `record_sampled` gives it)."""
        start = request.num_computed_tokens
        if num_new == 1:  # decoding: the common case, kept short
            self.manager.append_slot(request.request_id, request.token_id(start))
            return
        for token in request.token_ids(start, start + num_new):
            self.manager.append_slot(request.request_id, token)

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks; it recomputes everything when it is admitted again."""
        self.manager.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    # --- after the forward -----------------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Record the step: each scheduled request has computed its new tokens (`advance`);
        those in `sampled` (request id -> token) append their token and may finish
        (`record_sampled`). Returns the requests that finished."""
        self.advance(out)
        return [r for r in self.record_sampled(out, sampled) if r.is_finished]

    def advance(self, out: SchedulerOutput) -> None:
        """The plan's requests have computed their new tokens: `num_computed_tokens` grows, and a
        request whose last token was computed gets a **placeholder** for the token the step
        samples (`num_output_placeholders`). The overlapped engine calls this as soon as the step
        is launched, so that the next plan, made while the step runs, counts that token and
        feeds it (its id is taken on the device); vLLM v1 advances its requests at scheduling
        time the same way."""
        for request, num_new in out.scheduled:
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == request.num_tokens:
                request.num_output_placeholders += 1

    def record_sampled(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """The step's tokens (request id -> token) replace the placeholders `advance` made, in
        order. A request finished (or aborted) since the step was launched drops its token: only
        the overlapped engine launches such a step, one step ahead of its stop check. Finished
        requests leave the queues and free their blocks (static: when the whole batch has
        finished); eviction then drops blocks. Returns the requests that appended a token, in
        plan order."""
        appended, finished = [], []
        for request, _ in out.scheduled:
            token = sampled.get(request.request_id)
            if token is None:  # a prefill chunk: nothing sampled
                continue
            request.num_output_placeholders -= 1
            if request.is_finished:
                continue
            position = len(request.prompt_token_ids) + len(request.output_token_ids)
            request.append_output(token)
            if request.num_output_placeholders:  # the next step already feeds it: name it
                self.manager.set_token(request.request_id, position, token)
            appended.append(request)
            if request.is_finished:
                finished.append(request)
        if self.config.policy == "static":
            if all(r.is_finished for r in self.running):
                for request in self.running:
                    self.manager.pool.free(self.reserved.pop(request.request_id))
                    self.manager.free(request.request_id)
                self.running.clear()
        else:
            for request in finished:
                if request in self.running:
                    self.running.remove(request)
                    self.manager.free(request.request_id)
                else:  # preempted while its last step ran: waiting, its blocks freed already
                    self.waiting.remove(request)
        if self.config.eviction is not None:
            for request in self.running:
                self._evict(request)
        return appended

    def _evict(self, request: Request) -> None:
        table = self.manager.block_tables[request.request_id]
        drop = self.config.eviction.blocks_to_drop(len(table))
        if drop:
            if not self.config.hash_evicted_blocks:
                self.manager.stop_hashing(request.request_id)
            self.manager.drop_blocks(request.request_id, drop)
