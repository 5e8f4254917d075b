"""Chapter 12's graded questions: one scheduler step under a token budget, the preemption victims
when blocks run out, and a new request's first step (prefix hit, chunk, blocks). Oracles: the
rules of `kvlib.engine.scheduler` written out here, and chapter 7's prefix-hit oracle (its
BlockManager)."""

from __future__ import annotations

from kvlib.course.checks.ch07 import cached_prefix_tokens, chained_block_hashes
from kvlib.course.grading import Submission, expect_list, question


def _schedule_step(running, waiting, token_budget, max_num_seqs):
    """Running first, in order, each min(its tokens left, budget left); then waiting, first come
    first served, while budget remains and fewer than max_num_seqs requests run."""
    plan, budget = [], token_budget
    for request_id, left in running:
        if budget == 0:
            break
        plan.append((request_id, min(left, budget)))
        budget -= plan[-1][1]
    admitted = 0
    for request_id, left in waiting:
        if budget == 0 or len(running) + admitted >= max_num_seqs:
            break
        plan.append((request_id, min(left, budget)))
        budget -= plan[-1][1]
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
        assert got == expected, (
            f"{what}: running {running}, waiting {waiting}, budget {budget}, max_num_seqs "
            f"{max_seqs}: expected {expected} (running requests first, in order, each min(tokens "
            f"left, budget left); then waiting ones in arrival order while budget remains and "
            f"fewer than max_num_seqs run), got {got}"
        )


def _victims(running, index, blocks_needed, free_blocks, blocks_held):
    """Preempt the newest running request until the one at `index` fits, or it was preempted."""
    running, preempted = list(running), []
    while free_blocks < blocks_needed:
        victim = running.pop()
        preempted.append(victim)
        free_blocks += blocks_held[victim]
        if len(running) == index:  # the request itself was the victim
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
        assert got == expected, (
            f"{what}: running {running}, request {running[index]!r} (index {index}) needs "
            f"{needed} block(s), {free} free, held {held}: expected {expected} (the newest "
            f"running request first, each freeing its blocks, until the request fits or it has "
            f"been preempted itself), got {got}"
        )


def _first_step(token_ids, cached, block_size, token_budget):
    hit = cached_prefix_tokens(token_ids, cached, block_size)
    new = min(len(token_ids) - hit, token_budget)
    return hit, new, -(-(hit + new) // block_size) - hit // block_size


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
        assert tuple(got) == expected, (
            f"{what} ({len(tokens)} tokens, block size {block_size}, budget {budget}): expected "
            f"(cached, new, blocks) = {expected}: cached = whole blocks found by chained hashes, "
            f"stopping at the first miss and leaving at least the last token to compute; new = "
            f"min(tokens left, budget); blocks = those the cached + new tokens need beyond the "
            f"cached ones; got {tuple(got)}"
        )
