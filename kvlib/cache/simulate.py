"""Where the memory of a KV cache goes under a stream of requests: contiguous reservation vs
paging (chapter 7's "Why").

Systems before PagedAttention reserved, for every request, one contiguous region of the maximum
sequence length, because they could not know how long its output would be. Kwon et al. (2023,
SOSP, sec. 3) measured that only 20.4%-38.2% of their KV memory held token states; the rest was
**reserved** for tokens not generated yet, lost to **internal fragmentation** (slots past the
request's final length) or to **external fragmentation** (free space too small for another
request's region). A paged cache allocates blocks as tokens arrive: only the unused slots of each
request's last block are wasted.

`synthetic_trace` draws a request stream; `simulate` replays it, one decode step at a time, against
a fixed number of token slots, either contiguous (`block_size=None`) or paged through the real
allocator (`kvlib.cache.block_pool`), and accounts for every slot at every step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvlib._validate import check_positive_int
from kvlib.cache.block_manager import BlockManager
from kvlib.cache.block_pool import BlockPool

__all__ = ["Request", "SimulationResult", "simulate", "synthetic_trace"]


@dataclasses.dataclass(frozen=True)
class Request:
    """One request: it arrives at decode step `arrival` with `prompt_len` tokens and will generate
    `output_len` tokens (unknown to a contiguous allocator, which reserves `max_len`)."""

    request_id: int
    arrival: int
    prompt_len: int
    output_len: int


def synthetic_trace(
    num_requests: int,
    *,
    seed: int = 0,
    arrival_rate: float = 0.5,
    prompt_median: int = 256,
    output_median: int = 128,
    sigma: float = 1.0,
    max_len: int = 2048,
) -> list[Request]:
    """`num_requests` requests: arrivals a Poisson process of `arrival_rate` requests per decode
    step; prompt and output lengths log-normal with the given medians and shape `sigma` (a long
    tail, as in chat traces), at least 1 token each, prompt + output clipped to `max_len`.

    Raises:
        ValueError: a non-positive count, rate, median or max_len.
    """
    check_positive_int("num_requests", num_requests)
    check_positive_int("max_len", max_len)
    if not arrival_rate > 0:
        raise ValueError(f"arrival_rate: expected > 0 requests per step, got {arrival_rate}")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / arrival_rate, num_requests)).astype(int)
    prompts = np.maximum(1, rng.lognormal(np.log(prompt_median), sigma, num_requests)).astype(int)
    outputs = np.maximum(1, rng.lognormal(np.log(output_median), sigma, num_requests)).astype(int)
    requests = []
    for i in range(num_requests):
        prompt = int(min(prompts[i], max_len - 1))
        requests.append(
            Request(i, int(arrivals[i]), prompt, int(min(outputs[i], max_len - prompt)))
        )
    return requests


@dataclasses.dataclass
class SimulationResult:
    """Per decode step (arrays of length `steps`), in token slots: `used` (token states held),
    `reserved` (held for tokens not generated yet), `internal` (allocated, never to be used),
    `external` (free but too small to admit the next waiting request), `running` (requests in the
    batch). `capacity` is the pool's size in slots; `finished_at` the step each request ends;
    `preemptions` the requests evicted (paged only) and recomputed later."""

    capacity: int
    used: np.ndarray
    reserved: np.ndarray
    internal: np.ndarray
    external: np.ndarray
    running: np.ndarray
    finished_at: dict[int, int]
    preemptions: int

    @property
    def steps(self) -> int:
        return len(self.used)

    @property
    def used_fraction(self) -> float:
        """Token states / allocated slots (used + reserved + internal), averaged over the steps
        with at least one request running: the paper's "20.4%-38.2%"."""
        allocated = self.used + self.reserved + self.internal
        busy = allocated > 0
        return float((self.used[busy] / allocated[busy]).mean())


def simulate(
    trace: list[Request],
    *,
    capacity_tokens: int,
    max_len: int = 2048,
    block_size: int | None = None,
) -> SimulationResult:
    """Replay `trace` against `capacity_tokens` slots of KV cache, one decode step at a time.

    Each step, waiting requests that have arrived are admitted first come, first served, while
    they fit: contiguous (`block_size=None`) reserves `max_len` slots per request; paged reserves
    nothing ahead and needs blocks for the prompt plus one free block. An admitted request prefills
    its prompt and then generates one token per step until `output_len`, then leaves. In a paged
    pool, a request that needs a block when none is free preempts the most recently admitted
    request, which frees its blocks and goes back to the front of the queue keeping its
    generated tokens; when readmitted it recomputes prompt + generated tokens in one prefill and
    goes on generating (vLLM's preemption by recomputation). A step costs one step whatever it
    prefills: the simulation counts memory, not compute.

    Raises:
        ValueError: capacity below one request's region (`max_len`; paged: its blocks plus one),
            or a request longer than `max_len`.
    """
    check_positive_int("capacity_tokens", capacity_tokens)
    if block_size is None and capacity_tokens < max_len:
        raise ValueError(
            f"capacity_tokens: expected at least max_len={max_len} for a contiguous cache, got "
            f"{capacity_tokens}"
        )
    for r in trace:
        if r.prompt_len + r.output_len > max_len:
            raise ValueError(f"trace: request {r.request_id} is longer than max_len={max_len}")
    manager = None
    if block_size is not None:
        check_positive_int("block_size", block_size)
        if capacity_tokens // block_size < -(-max_len // block_size) + 1:
            raise ValueError(
                f"capacity_tokens: expected room for one max_len={max_len} request plus a block "
                f"({(-(-max_len // block_size) + 1) * block_size} slots), got {capacity_tokens}"
            )
        manager = BlockManager(
            BlockPool(capacity_tokens // block_size, block_size, enable_prefix_caching=False)
        )
    # [request, tokens held]; a preempted request waits with the tokens it had (prompt + output)
    waiting = [[r, r.prompt_len] for r in sorted(trace, key=lambda r: (r.arrival, r.request_id))]
    running: list[list] = []  # [request, tokens held]
    log = {k: [] for k in ("used", "reserved", "internal", "external", "running")}
    finished_at, preemptions, step = {}, 0, 0
    while waiting or running:
        # admit, first come first served, while the head of the queue fits
        while waiting and waiting[0][0].arrival <= step:
            request, held = waiting[0]
            if manager is None:
                fits = capacity_tokens - len(running) * max_len >= max_len
            else:
                blocks = -(-held // manager.block_size) + 1
                fits = manager.pool.num_free_blocks >= blocks
            if not fits:
                break
            waiting.pop(0)
            if manager is not None:  # prefill: the prompt, and a readmitted request's output
                manager.allocate(request.request_id, [0] * held)
            running.append([request, held])
        # decode: every running request appends one token
        for entry in list(running):
            if entry not in running:  # preempted by an earlier request this step
                continue
            request_id = entry[0].request_id
            if manager is not None:
                needs_block = manager.num_tokens(request_id) % manager.block_size == 0
                while needs_block and not manager.pool.can_allocate(1):
                    victim = running.pop()  # the most recently admitted
                    manager.free(victim[0].request_id)
                    waiting.insert(0, victim)  # first in line, with the tokens it generated
                    preemptions += 1
                    if victim is entry:
                        break
                if entry not in running:
                    continue
                manager.append_slot(request_id, 0)
            entry[1] += 1
        # account for every slot, then retire finished requests
        used = sum(n for _, n in running)
        final = sum(r.prompt_len + r.output_len for r, _ in running)
        if manager is None:
            allocated = len(running) * max_len
            reserved, internal = final - used, allocated - final
            free = capacity_tokens - allocated
            external = free if waiting and waiting[0][0].arrival <= step and free < max_len else 0
        else:
            allocated = (manager.pool.num_blocks - manager.pool.num_free_blocks) * block_size
            reserved, internal, external = 0, allocated - used, 0
        for key, value in zip(log, (used, reserved, internal, external, len(running)), strict=True):
            log[key].append(value)
        for entry in list(running):
            request, held = entry
            if held == request.prompt_len + request.output_len:
                running.remove(entry)
                finished_at[request.request_id] = step
                if manager is not None:
                    manager.free(request.request_id)
        step += 1
    return SimulationResult(
        capacity_tokens,
        *(np.array(log[k]) for k in log),
        finished_at=finished_at,
        preemptions=preemptions,
    )
