"""Chapter 12's graded questions: one scheduler step under a token budget, the preemption victims
when blocks run out, and a new request's first step (prefix hit, chunk, blocks). Oracles: the
rules of `kvlib.engine.scheduler` written out here, and chapter 7's prefix-hit oracle (its
BlockManager)."""

from __future__ import annotations

from kvlib.course.checks.ch07 import cached_prefix_tokens, chained_block_hashes, prefix_hit
from kvlib.course.checks.mistakes import naming_mistakes
from kvlib.course.grading import Submission, expect_list, question


def _schedule_step(running, waiting, token_budget, max_num_seqs, *, chunked=True, limit=True,
                   shared=True):  # fmt: skip
    """Running first, in order, each min(its tokens left, budget left); then waiting, first come
    first served, while budget remains and fewer than max_num_seqs requests run. The common
    mistakes, switchable: `chunked=False` stops at the first request whose tokens left exceed the
    budget left, `limit=False` ignores max_num_seqs, `shared=False` never spends the budget."""
    plan, budget = [], token_budget
    for request_id, left in running:
        if budget == 0 or (not chunked and left > budget):
            break
        plan.append((request_id, min(left, budget)))
        budget -= plan[-1][1] if shared else 0
    admitted = 0
    for request_id, left in waiting:
        if budget == 0 or (not chunked and left > budget):
            break
        if limit and len(running) + admitted >= max_num_seqs:
            break
        plan.append((request_id, min(left, budget)))
        budget -= plan[-1][1] if shared else 0
        admitted += 1
    return plan


_STEP_CASES = [
    # (running, waiting, token_budget, max_num_seqs, what)
    ([("a", 1), ("b", 1)], [("c", 40)], 16, 8, "two decodes and a prompt chunked to the budget"),
    ([("a", 30), ("b", 1)], [("c", 5)], 16, 8, "a running prefill takes the whole budget"),
    ([("a", 1)], [("b", 3), ("c", 4), ("d", 50)], 10, 8, "several short prompts, then a chunk"),
    ([("a", 1), ("b", 1), ("c", 1)], [("d", 5), ("e", 5)], 64, 4, "max_num_seqs stops admission"),
    ([], [("a", 7), ("b", 7)], 7, 4, "the first prompt uses the budget exactly"),
    ([("a", 1), ("b", 1)], [], 1, 4, "a budget of one token"),
]


@question(function="schedule_step")
def test_schedule_step(submission: Submission) -> None:
    schedule_step = submission.function("schedule_step")
    drawn, cases = submission.rng(), submission.fixed(_STEP_CASES)
    for _ in range(4):  # drawn afresh on every run
        names = [f"r{i}" for i in range(12)]
        num_running, num_waiting = (int(n) for n in drawn.integers(0, 6, size=2))
        lefts = [int(n) if drawn.random() < 0.5 else 1 for n in drawn.integers(1, 40, size=12)]
        running = list(zip(names[:num_running], lefts[:num_running]))
        waiting = list(zip(names[6 : 6 + num_waiting], lefts[6 : 6 + num_waiting]))
        budget = int(drawn.integers(1, 64))
        if drawn.random() < 0.3:  # exactly the tokens asked for: a budget met, not exceeded
            budget = max(1, sum(left for _, left in running + waiting))
        max_seqs = int(drawn.integers(max(1, num_running), 10))
        cases.append((running, waiting, budget, max_seqs, "random requests"))
    for running, waiting, budget, max_seqs, what in cases:
        expected = _schedule_step(running, waiting, budget, max_seqs)
        got = schedule_step(list(running), list(waiting), budget, max_seqs)
        expect_list(
            got,
            lambda p: isinstance(p, tuple) and len(p) == 2,
            "schedule_step should return a list of (request_id, num_tokens) tuples",
        )
        args = (running, waiting, budget, max_seqs)
        mistakes = {
            "a prompt scheduled only whole: a request whose tokens do not fit gets a chunk, "
            "min(tokens left, budget left)": lambda: _schedule_step(*args, chunked=False),
            "max_num_seqs not enforced: admit waiting requests only while len(running) + admitted "
            "< max_num_seqs": lambda: _schedule_step(*args, limit=False),
            "the budget never spent: each request's tokens come out of the one budget left for "
            "the step": lambda: _schedule_step(*args, shared=False),
        }
        with naming_mistakes(got, mistakes):
            assert got == expected, (
                f"{what}: running {running}, waiting {waiting}, budget {budget}, max_num_seqs "
                f"{max_seqs}: expected {expected} (running requests first, in order, each "
                f"min(tokens left, budget left); then waiting ones in arrival order while budget "
                f"remains and fewer than max_num_seqs run), got {got}"
            )


def _victims(running, index, blocks_needed, free_blocks, blocks_held, *, newest=True, stop=True,
             strict=True):  # fmt: skip
    """Preempt the newest running request until the one at `index` fits, or it was preempted. The
    common mistakes, switchable: `newest=False` preempts the oldest first, `stop=False` goes on
    past the request itself, `strict=False` preempts while free blocks <= blocks needed."""
    queue, preempted = list(running), []
    while queue and (free_blocks < blocks_needed or (not strict and free_blocks == blocks_needed)):
        victim = queue.pop() if newest else queue.pop(0)
        preempted.append(victim)
        free_blocks += blocks_held[victim]
        if stop and victim == running[index]:  # the request itself was the victim
            break
    return preempted


_VICTIM_CASES = [
    # (running, index, blocks_needed, free_blocks, blocks_held, what)
    (["a", "b", "c"], 0, 1, 1, {"a": 3, "b": 2, "c": 2}, "enough free blocks: nobody"),
    (["a", "b", "c"], 0, 1, 0, {"a": 3, "b": 2, "c": 2}, "one block short"),
    (["a", "b", "c", "d"], 1, 3, 0, {"a": 3, "b": 2, "c": 1, "d": 1}, "two victims needed"),
    (["a", "b", "c"], 2, 2, 0, {"a": 3, "b": 2, "c": 1}, "the newest request itself"),
    (["a", "b", "c"], 1, 5, 0, {"a": 3, "b": 2, "c": 1}, "preempting down to the request"),
]


@question(function="preemption_victims")
def test_preemption_victims(submission: Submission) -> None:
    preemption_victims = submission.function("preemption_victims")
    drawn, cases = submission.rng(), submission.fixed(_VICTIM_CASES)
    for _ in range(4):  # drawn afresh on every run
        running = [f"r{i}" for i in range(int(drawn.integers(1, 8)))]
        held = {name: int(drawn.integers(0, 5)) for name in running}
        index = int(drawn.integers(0, len(running)))
        cases.append((running, index, *(int(n) for n in drawn.integers(0, (8, 4))), held, "random"))
    for running, index, needed, free, held, what in cases:
        expected = _victims(running, index, needed, free, held)
        got = preemption_victims(list(running), index, needed, free, dict(held))
        assert isinstance(got, list), f"preemption_victims should return a list, got {got!r}"
        args = (running, index, needed, free, held)
        mistakes = {
            "the oldest running request preempted first: under first-come-first-served the "
            "newest goes first": lambda: _victims(*args, newest=False),
            "requests older than the one that needs blocks preempted for it: stop once it has "
            "been preempted itself": lambda: _victims(*args, stop=False),
            "a request preempted although the blocks already fit: preempt only while free "
            "blocks < blocks needed": lambda: _victims(*args, strict=False),
        }
        with naming_mistakes(got, mistakes):
            assert got == expected, (
                f"{what}: running {running}, request {running[index]!r} (index {index}) needs "
                f"{needed} block(s), {free} free, held {held}: expected {expected} (the newest "
                f"running request first, each freeing its blocks, until the request fits or it "
                f"has been preempted itself), got {got}"
            )


def _first_step(token_ids, cached, block_size, token_budget):
    hit = cached_prefix_tokens(token_ids, cached, block_size)
    new = min(len(token_ids) - hit, token_budget)
    return hit, new, -(-(hit + new) // block_size) - hit // block_size


def _first_step_mistakes(token_ids, cached, block_size, token_budget) -> dict:
    """first_step's common mistakes: the first from chapter 7's pitfalls (a full hit)."""

    def step(capped=True, shared_blocks_allocated=False, whole_prompt=False):
        hit = prefix_hit(token_ids, cached, block_size, capped=capped)
        new = min(len(token_ids) - hit, token_budget)
        end = len(token_ids) if whole_prompt else hit + new
        return (
            hit,
            new,
            -(-end // block_size) - (0 if shared_blocks_allocated else hit // block_size),
        )

    return {
        "the last token's block taken from the cache: at least the last token is computed (its "
        "logits), so a hit stops at n - 1 tokens": lambda: step(capped=False),
        "the cached blocks allocated too: they are shared, count only the new blocks": lambda: step(
            shared_blocks_allocated=True
        ),
        "blocks for the whole prompt: allocate only what this step's cached and new tokens "
        "occupy": lambda: step(whole_prompt=True),
    }


@question(function="first_step", allowed=("kvlib.cache.block_pool.hash_block_tokens",))
def test_first_step(submission: Submission) -> None:
    first_step = submission.function("first_step")
    system = list(range(100, 116))  # a 16-token system prompt: four blocks of 4
    cached = set(chained_block_hashes(system + [1, 2, 3, 4], 4))  # an earlier request's five blocks
    cases = [
        (system + [7, 7, 7], 64, "a prompt behind the cached system prompt"),
        (system + [7] * 30, 8, "a long prompt chunked by the budget"),
        (system + [1, 2, 3, 4], 64, "a prompt equal to a cached one"),
        (system[:4] + [5] * 4 + system[8:] + [9], 64, "a miss in the second block"),
        ([3, 1, 4], 2, "no hit, budget smaller than the prompt"),
        (system[:8] + [6], 1, "a budget of one token"),
    ]
    cases = submission.fixed([(tokens, cached, 4, budget, what) for tokens, budget, what in cases])
    drawn = submission.rng()
    for _ in range(3):  # drawn per run: an earlier prompt cached, a new one sharing a prefix
        block_size = int(drawn.choice([1, 2, 3, 4]))
        earlier = [int(t) for t in drawn.integers(0, 3, size=int(drawn.integers(0, 20)))]
        shared = earlier[: int(drawn.integers(0, len(earlier) + 1))]
        tokens = shared + [int(t) for t in drawn.integers(0, 3, size=int(drawn.integers(0, 9)))]
        cached_hashes = set(chained_block_hashes(earlier, block_size))
        budget = int(drawn.integers(1, 24))
        cases.append((tokens or [1], cached_hashes, block_size, budget, f"random {tokens or [1]}"))
    for tokens, cached, block_size, budget, what in cases:
        expected = _first_step(tokens, cached, block_size, budget)
        got = first_step(list(tokens), set(cached), block_size, budget)
        assert isinstance(got, tuple) and len(got) == 3, (
            f"first_step should return (num_cached_tokens, num_new_tokens, num_new_blocks), got "
            f"{got!r}"
        )
        mistakes = _first_step_mistakes(tokens, cached, block_size, budget)
        with naming_mistakes(tuple(got), mistakes):
            assert tuple(got) == expected, (
                f"{what} ({len(tokens)} tokens, block size {block_size}, budget {budget}): "
                f"expected (cached, new, blocks) = {expected}: cached = whole blocks found by "
                f"chained hashes, stopping at the first miss and leaving at least the last token "
                f"to compute; new = min(tokens left, budget); blocks = those the cached + new "
                f"tokens need beyond the cached ones; got {tuple(got)}"
            )
