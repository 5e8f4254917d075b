"""Chapter 7's graded questions: the slot mapping, appending a token with copy-on-write, and the
prefix-cache hit of a prompt. Oracles: the formulas written out here and kvlib's BlockManager,
BlockManager)."""

from __future__ import annotations

import copy

from kvlib.cache.block_manager import BlockManager
from kvlib.cache.block_pool import BlockPool, hash_block_tokens
from kvlib.course.checks.mistakes import naming_mistakes
from kvlib.course.grading import Submission, expect_int, expect_list, is_int, question


def _slots(block_table, positions, block_size):
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


@question(function="slot_mapping")
def test_slot_mapping(submission: Submission) -> None:
    slot_mapping = submission.function("slot_mapping")
    rng = submission.rng()
    random_cases = []
    for _ in range(3):  # drawn afresh on every run
        block_size = int(rng.choice([1, 2, 4, 16]))
        table = [int(b) for b in rng.permutation(40)[: int(rng.integers(1, 8))]]
        positions = [int(p) for p in rng.integers(0, len(table) * block_size, size=10)]
        random_cases.append((table, positions, block_size))
    fixed = [
        ([0], [0, 1, 2], 4),
        ([7, 2, 5], list(range(12)), 4),
        ([3, 9], [17, 16, 0, 31], 16),
        ([11, 4, 8, 1], [5, 6, 7], 2),
        ([5, 3], [], 4),
    ]
    for block_table, positions, block_size in [*submission.fixed(fixed), *random_cases]:
        got = slot_mapping(list(block_table), list(positions), block_size)
        expected = _slots(block_table, positions, block_size)
        expect_list(got, is_int, "slot_mapping should return a list of ints")
        table, size = block_table, block_size
        mistakes = {
            "block id + offset: a block's first slot is block id × block_size": lambda: [
                table[t // size] + t % size for t in positions
            ],
            "the logical position itself: look the block up in the block table": lambda: list(
                positions
            ),
            "the block id alone: add the offset t % block_size": lambda: [
                table[t // size] * size for t in positions
            ],
            "the block table indexed by position, not by t // block_size": lambda: [
                table[t] * size + t % size for t in positions
            ],
        }
        with naming_mistakes(got, mistakes):
            assert got == expected, (
                f"block table {block_table}, block size {block_size}, positions {positions}: "
                f"expected slots {expected} (block_table[t // block_size] * block_size + t % "
                f"block_size), got {got}"
            )


def _append_token(block_table, num_tokens, ref_cnt, free_blocks, block_size, *, cow=True,
                  release=True, first_free=True):  # fmt: skip
    """The rule written out: a new block at a block boundary; copy-on-write of a shared, partly
    filled last block; then the slot of token `num_tokens`. The common mistakes, switchable:
    `cow=False` writes into the shared block, `release=False` keeps the old block's reference,
    `first_free=False` takes the last free block."""
    copy_pair, take = None, 0 if first_free else -1
    if num_tokens % block_size == 0:
        new = free_blocks.pop(take)
        ref_cnt[new] = 1
        block_table.append(new)
    elif cow and ref_cnt[block_table[-1]] > 1:
        old, new = block_table[-1], free_blocks.pop(take)
        ref_cnt[old] -= 1 if release else 0
        ref_cnt[new] = 1
        block_table[-1] = new
        copy_pair = (old, new)
    return _slots(block_table, [num_tokens], block_size)[0], copy_pair


def _append_mistakes(block_table, num_tokens, ref_cnt, free_blocks, block_size) -> dict:
    """append_token's common mistakes (the first two from the chapter's pitfalls 3 and 4), each
    as (slot, copy), (block table, ref_cnt, free blocks) after the append."""

    def append(**mistake):
        state = copy.deepcopy((block_table, ref_cnt, free_blocks))
        result = _append_token(state[0], num_tokens, *state[1:], block_size, **mistake)
        return result, state

    return {
        "no copy-on-write: a shared, partly filled last block is copied to a new block before the "
        "write": lambda: append(cow=False),
        "the old block's reference kept: after the copy, this sequence no longer holds it "
        "(ref_cnt[old] -= 1)": lambda: append(release=False),
        "the last free block taken: take free_blocks.pop(0)": lambda: append(first_free=False),
    }


_APPEND_CASES = [
    # (block_table, num_tokens, ref_cnt, free_blocks, block_size, what)
    ([], 0, {}, [3, 1], 4, "an empty sequence"),
    ([2], 2, {2: 1}, [0, 5], 4, "room in an unshared last block"),
    ([2], 2, {2: 3}, [0, 5], 4, "a partly filled last block shared by 3 sequences"),
    ([2, 6], 8, {2: 2, 6: 2}, [4], 4, "a full, shared last block"),
    ([1, 0], 5, {1: 1, 0: 2}, [7, 3], 4, "a shared second block"),
]


@question(function="append_token")
def test_append_token(submission: Submission) -> None:
    append_token = submission.function("append_token")
    drawn, cases = submission.rng(), submission.fixed(_APPEND_CASES)
    for _ in range(4):  # drawn afresh on every run
        block_size = int(drawn.choice([1, 2, 4, 8]))
        ids = [int(b) for b in drawn.permutation(30)]
        table, free = ids[: int(drawn.integers(0, 6))], ids[20 : 20 + int(drawn.integers(1, 4))]
        last_block_start = (len(table) - 1) * block_size
        num_tokens = int(drawn.integers(last_block_start + 1, len(table) * block_size + 1))
        num_tokens = num_tokens if table else 0
        ref_cnt = {b: int(drawn.integers(1, 4)) for b in table}
        cases.append((table, num_tokens, ref_cnt, free, block_size, "a random sequence"))
    for table, num_tokens, ref_cnt, free, block_size, what in cases:
        state = (list(table), dict(ref_cnt), list(free))
        expected_state = copy.deepcopy(state)
        expected = _append_token(*expected_state[:1], num_tokens, *expected_state[1:], block_size)
        call = append_token.call(
            state[0], num_tokens, state[1], state[2], block_size, _options={"mutates": {0, 2, 3}}
        )
        got = call.result
        state = (call.args[0], call.args[2], call.args[3])
        assert isinstance(got, tuple) and len(got) == 2, (
            f"append_token should return (slot, copy), got {got!r}"
        )
        mistakes = _append_mistakes(table, num_tokens, ref_cnt, free, block_size)
        with naming_mistakes((got, state), mistakes, expected=(expected, expected_state)):
            assert got == expected, (
                f"{what} (block table {table}, {num_tokens} tokens, ref_cnt {ref_cnt}, block "
                f"size {block_size}): expected (slot, copy) = {expected}, got {got} "
                "(copy-on-write only when the last block is shared and partly filled)"
            )
            assert state == expected_state, (
                f"{what}: after the append expected block table, ref_cnt, free blocks = "
                f"{expected_state}, got {state}"
            )


def prefix_hit(token_ids, cached, block_size, *, capped=True, chained=True) -> int:
    """The prefix-cache hit written out (`cached_prefix_tokens`), its common mistakes switchable
    (the chapter's pitfalls 1 and 2): `capped=False` may take the whole prompt from the cache,
    `chained=False` hashes each block without its parent."""
    hit, parent = 0, None
    for i in range((len(token_ids) - (1 if capped else 0)) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent = hash_block_tokens(parent if chained else None, block)
        if parent not in cached:
            break
        hit += block_size
    return hit


def cached_prefix_tokens(token_ids, cached, block_size):
    """Tokens of `token_ids` a prefix cache holding the hashes `cached` covers (BlockManager's
    lookup: whole blocks, chained, stopping at the first miss, at most n - 1 tokens)."""
    pool = BlockPool(1, block_size)
    pool.cached_blocks = dict.fromkeys(cached, 0)
    covered, _ = BlockManager(pool).num_cached_prefix_blocks(token_ids)
    return covered


def chained_block_hashes(tokens, block_size):
    """The chained hashes of the full blocks of `tokens` (what a prefix cache stores)."""
    hashes, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


@question(function="prefix_hit_tokens", allowed=("kvlib.cache.block_pool.hash_block_tokens",))
def test_prefix_hit_tokens(submission: Submission) -> None:
    prefix_hit_tokens = submission.function("prefix_hit_tokens")
    system = list(range(100, 112))  # three blocks of 4
    # an earlier request left 4 blocks cached; `other` holds the block [5, 5, 5, 5] only under
    # another parent (system[4:8]) and as the first block of another prompt: a prompt
    # system[:4] + [5, 5, 5, 5] hits its first block only (a chained hash of [5, 5, 5, 5] under
    # system[:4] is not cached), while hashing blocks without their parent would find both
    cached = set(chained_block_hashes(system + [1, 2, 3, 4], 4))
    other = cached | set(chained_block_hashes([5, 5, 5, 5, 6, 6, 6, 6], 4))
    other |= set(chained_block_hashes(system[:8] + [5, 5, 5, 5], 4))
    cases = [
        (system + [7, 7], cached, "a prompt sharing 3 cached blocks"),
        (system + [1, 2, 3, 4], cached, "a prompt equal to a cached one (16 tokens)"),
        (system[:4] + [5, 5, 5, 5] + system[8:], cached, "a miss in the second block"),
        (system[:4] + [5, 5, 5, 5, 1], other, "a block cached only under another parent"),
        ([1, 2, 3], cached, "a prompt shorter than a block"),
    ]
    cases = submission.fixed([(tokens, hashes, 4, what) for tokens, hashes, what in cases])
    drawn = submission.rng()
    for _ in range(3):  # drawn per run: earlier prompts cached, a new one sharing a prefix
        block_size = int(drawn.choice([1, 2, 3, 4]))
        earlier = [int(t) for t in drawn.integers(0, 3, size=int(drawn.integers(0, 20)))]
        hashes = set(chained_block_hashes(earlier, block_size))
        shared = int(drawn.integers(0, len(earlier) + 1))
        tokens = earlier[:shared] + [
            int(t) for t in drawn.integers(0, 3, size=int(drawn.integers(0, 8)))
        ]
        cases.append((tokens or [0], hashes, block_size, f"random tokens, block size {block_size}"))
    for tokens, hashes, block_size, what in cases:
        expected = cached_prefix_tokens(tokens, hashes, block_size)
        got = prefix_hit_tokens(list(tokens), set(hashes), block_size)
        expect_int(got, "prefix_hit_tokens")
        args = (tokens, hashes, block_size)
        mistakes = {
            "the whole prompt taken from the cache: its last token must be computed (for its "
            "logits), so a hit covers at most n - 1 tokens": lambda: prefix_hit(
                *args, capped=False
            ),
            "each block hashed without its parent: hash_block(parent, tokens) chains the previous "
            "block's hash": lambda: prefix_hit(*args, chained=False),
            "the cached blocks counted, not their tokens (blocks x block_size)": lambda: (
                expected // block_size
            ),
        }
        with naming_mistakes(got, mistakes):
            assert got == expected, (
                f"{what}, {len(tokens)} tokens: expected {expected} cached tokens (whole blocks, "
                f"each hash chained to its parent's, stopping at the first miss, at most n - 1 "
                f"tokens), got {got}"
            )


def _blocks_in_use(seq_lens: list[int], block_size: int) -> int:
    """The blocks kvlib's block manager holds once each sequence is allocated (distinct prompts,
    so no prefix is shared)."""
    enough = sum(n // block_size + 1 for n in seq_lens)  # at least what they need
    pool = BlockPool(enough, block_size, enable_prefix_caching=False)
    manager = BlockManager(pool)
    for seq_id, n in enumerate(seq_lens):
        manager.allocate(seq_id, [seq_id * 100_000 + t for t in range(n)])
    return pool.num_blocks - pool.num_free_blocks


@question(function="predict_ragged_blocks")
def test_predict_ragged_blocks(submission: Submission) -> None:
    """A prediction question: the blocks a ragged batch occupies in a paged cache."""
    predict = submission.function("predict_ragged_blocks")
    drawn = submission.rng()
    cases = submission.fixed([([5, 17, 32, 1], 16), ([16, 16], 16), ([1], 4), ([9, 3, 12], 1)])
    for _ in range(3):  # drawn afresh on every run
        lens = [int(n) for n in drawn.integers(1, 200, size=int(drawn.integers(1, 9)))]
        cases.append((lens, int(drawn.choice([1, 4, 8, 16, 32]))))
    for seq_lens, block_size in cases:
        expected = _blocks_in_use(seq_lens, block_size)
        got = predict(list(seq_lens), block_size)
        expect_int(got, "predict_ragged_blocks")
        longest = max(seq_lens)
        mistakes = {
            "the batch's tokens pooled into shared blocks: a block belongs to one sequence, so "
            "each sequence rounds up on its own": lambda: -(-sum(seq_lens) // block_size),
            "each sequence rounded down: a partly filled last block is still a block": lambda: sum(
                n // block_size for n in seq_lens
            ),
            "every sequence padded to the longest: that is a contiguous batch, not a paged "
            "cache": lambda: len(seq_lens) * -(-longest // block_size),
            "one extra block per sequence (n // block_size + 1)": lambda: sum(
                n // block_size + 1 for n in seq_lens
            ),
        }
        with naming_mistakes(got, mistakes):
            assert got == expected, (
                f"sequences of {seq_lens} tokens in blocks of {block_size}: the block manager "
                f"holds {expected} blocks, you predicted {got}"
            )
