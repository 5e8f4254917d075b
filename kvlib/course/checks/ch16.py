"""Chapter 16's graded questions: greedy verification of a draft, speculative sampling's accept or
resample step with its random numbers given, a paged sequence's rollback (the blocks freed, shared
blocks only dereferenced, a shared partial last block copied) and the tokens per step and speed-up
of Leviathan et al. (ICML 2023). Oracles: `kvlib.speculative.verify`'s `greedy_accept` and
`residual_distribution`, `BlockManager.truncate` and `free` (through a pool set to the given
reference counts), and the expectation written out here (every answer is written without kvlib)."""

from __future__ import annotations

import math

import numpy as np
import torch

from kvlib.cache.block_manager import BlockManager
from kvlib.cache.block_pool import BlockPool
from kvlib.course.checks import speculative_answers as answers
from kvlib.course.checks.calls import answer_of
from kvlib.course.checks.mistakes import naming_mistakes
from kvlib.course.grading import (
    Submission,
    expect_list,
    expect_tensor,
    is_int,
    question,
)
from kvlib.speculative.verify import greedy_accept


def _plain_tuple(got, size: int, name: str, what: str) -> None:
    assert isinstance(got, tuple) and len(got) == size, (
        f"{name} should return {what} as a plain tuple (not a namedtuple or other tuple "
        f"subclass), got {got!r}"
    )


def _pair_of_ints(got, name: str) -> None:
    _plain_tuple(got, 2, name, "(accepted, next_token)")
    assert all(is_int(x) for x in got), (
        f"{name} should return (accepted, next_token), two Python ints (int(t) of a 0-d tensor "
        f"t; a bool is not accepted, not even for k = 1), got {got!r}"
    )


# --- question 1: greedy verification ----------------------------------------------------------


def _near_tie_row(rng, vocab: int, tiny: bool) -> torch.Tensor:
    """A row whose maximum is a hair above other near-maxima that come before it: 1e-9 above 0
    (`tiny`: softmax in float32 and half precision merge them), or 1e-4 relative at a magnitude
    up to 300, either sign (half and bfloat16 merge them)."""
    base = 0.0 if tiny else float(rng.choice([-1.0, 1.0]) * rng.uniform(1.0, 300.0))
    gap = 1e-9 if tiny else 1e-4 * abs(base)
    row = base - np.abs(rng.normal(size=vocab)) * (1.0 if tiny else abs(base) / 10) - 1e-3
    places = sorted(rng.choice(vocab, size=min(vocab, int(rng.integers(2, 5))), replace=False))
    row[places] = base
    row[places[int(rng.integers(1, len(places)))]] = base + gap  # never the first near-maximum
    return torch.tensor(row, dtype=torch.float32)


def _random_greedy_case(rng) -> tuple:
    """k in 0..5 draft tokens, V from 2 to 50,000, logits (k + 1, V) float32 of four kinds:
    normal; integers in [0, 3) (ties, at many places); large, hundreds of either sign; near-ties
    (the maximum a hair above earlier near-maxima). The draft follows the argmax for a random
    number of tokens, then differs (in a tie, by another maximum)."""
    k = int(rng.integers(0, 6))
    kind = str(rng.choice(["normal", "ties", "large", "near-ties"], p=[0.25, 0.3, 0.2, 0.25]))
    vocab = int(rng.choice([2, 3, 5, 11, 50, 300, 1000, 50_000]))
    if kind == "near-ties":
        tiny = bool(rng.random() < 0.5)
        logits = torch.stack([_near_tie_row(rng, vocab, tiny) for _ in range(k + 1)])
    else:
        values = {
            "normal": lambda: rng.normal(size=(k + 1, vocab)),
            "ties": lambda: rng.integers(0, 3, size=(k + 1, vocab)),
            "large": lambda: rng.normal(size=(k + 1, vocab)) * 300 + rng.uniform(-400, 400),
        }[kind]()
        logits = torch.tensor(values, dtype=torch.float32)
    chosen = logits.argmax(dim=-1).tolist()
    follow = int(rng.integers(0, k + 1))  # draft tokens equal to the argmax, then a mismatch
    draft = chosen[:follow]
    for i in range(follow, k):
        if i == follow:  # in a tie, another maximum (the first is the target's); else any other
            maxima = (logits[i] == logits[i].max()).nonzero()[:, 0].tolist()
            others = maxima[1:] if len(maxima) > 1 else [t for t in range(min(vocab, 400))
                                                         if t != chosen[i]]  # fmt: skip
            draft.append(int(rng.choice(others)))
        else:
            draft.append(int(rng.integers(0, vocab)))
    return draft, logits, f"a random case ({kind} logits, V = {vocab})"


def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _one_hot_logits(vocab: int, winners: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(winners), vocab)
    logits[range(len(winners)), winners] = 5.0
    return logits


_TIES = torch.tensor(np.random.default_rng(16).integers(0, 3, size=(3, 5000)), dtype=torch.float32)
_GREEDY_CASES = [
    ([2, 0, 4], _logits([[0, 1, 5, 0, 0], [3, 1, 0, 0, 2], [0, 0, 1, 2, 7], [1, 4, 0, 2, 0]]),
     "all 3 accepted: the bonus token comes from row 3"),
    ([3, 0, 4], _logits([[0, 1, 5, 0, 0], [3, 1, 0, 0, 2], [0, 0, 1, 2, 7], [1, 4, 0, 2, 0]]),
     "the first draft token rejected"),
    ([2, 1, 4], _logits([[0, 1, 5, 0, 0], [3, 1, 0, 0, 2], [0, 0, 1, 2, 7], [1, 4, 0, 2, 0]]),
     "a mismatch at draft token 1"),
    ([], _logits([[0.5, -1.0, 2.0, 0.0]]), "k = 0: no draft, the target's own next token"),
    ([2, 3, 0], _logits([[0, 0, 3, 1], [0, 2, 1, 2], [5, 0, 0, 0], [0, 0, 0, 1]]),
     "a tie in row 1 (tokens 1 and 3 score 2): the first maximum, token 1, is the target's"),
    ([1], _logits([[0, 3, 1, 0], [2, 0, 0, 1]]), "k = 1, accepted: accepted is the int 1"),
    ([300, 301], _one_hot_logits(600, [300, 301, 599]), "token ids above 256, all accepted"),
    ([1, 2], _logits([[100, 200, 0], [-500, -600, -400], [0, 1, 0]]),
     "large logits (exp(200) overflows float32, exp(-400) underflows)"),
    ([1, 0], _logits([[1.0, 1.0004, 0.0], [0.0, 1e-9, -1.0], [-3.0, -3.0, 5.0]]),
     "near-ties: 1.0004 > 1.0, 1e-9 > 0 (half precision or a float32 softmax merge them)"),
    ([3, 1, 3], _logits([[0, 1, 0, 2, 2, 0, 2, 1], [0, 2, 0, 2, 0, 2, 2, 0],
                         [1, 0, 1, 3, 0, 3, 0, 3], [0, 0, 1, 0, 1, 0, 0, 1]]),
     "ties at several places in every row, the first maximum never token 0"),
    (_TIES.argmax(dim=-1).tolist()[:2], _TIES, "V = 5,000, integer logits in [0, 3): thousands of "
     "maxima in each row, all accepted"),
]  # fmt: skip


@question(function="greedy_accept")
def test_greedy_accept(submission: Submission) -> None:
    greedy = submission.function("greedy_accept")
    rng = submission.rng()  # random cases are drawn afresh on every run
    cases = [*submission.fixed(_GREEDY_CASES), *(_random_greedy_case(rng) for _ in range(6))]
    for draft, logits, what in cases:
        expected = greedy_accept(draft, logits)
        got = answer_of(greedy, (list(draft), logits.clone()), f"{what} (draft {draft})")
        _pair_of_ints(got, "greedy_accept")
        argmax = logits.argmax(dim=-1).tolist()
        with naming_mistakes(got, answers.greedy_mistakes(draft, logits), expected=expected):
            assert tuple(int(x) for x in got) == expected, (
                f"{what}: draft {draft}, the rows' argmax {argmax}: expected (accepted, "
                f"next_token) = {expected}, got {got}: keep draft token i while it equals row i's "
                "argmax, then row `accepted`'s argmax (the bonus when all are accepted); the "
                "argmax of the float32 logits as given, its first maximum at a tie (a softmax "
                "or a lower precision can merge near-ties)"
            )


# --- question 2: speculative sampling's verification, its random numbers given ------------------


def _rows(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


_P = _rows([[0.25, 0.5, 0.125, 0.125], [0.25, 0.25, 0.125, 0.375], [0.5, 0.0, 0.5, 0.0]])
_Q = _rows([[0.25, 0.25, 0.25, 0.25], [0.5, 0.25, 0.125, 0.125]])
_ONE_HOT = _rows([[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
_HALVES = _rows([[0.5, 0.5]])
_CLOSE = answers.special_row(
    np.random.default_rng(15), "close", answers.distribution(np.random.default_rng(15), 5), 5
)  # (q_0, p_0, x_0, u_0), p_0 - q_0 about 1e-9: rejected
_REJECTION_CASES = [  # (draft, q (k, V), p (k + 1, V), uniforms, what)
    ([], torch.zeros(0, 4, dtype=torch.float64), _P[:1], [], "k = 0: the next token from p_0"),
    ([1, 3], _Q, _P, [0.4, 0.3], "both accepted (p_i(x_i) >= q_i(x_i)): the bonus row p_2"),
    ([0, 0], _Q, _P, [0.5, 0.75], "draft token 1 rejected: u = 0.75 > p_1(0) / q_1(0) = 0.5"),
    ([2, 1], _Q, _P, [0.75, 0.5], "draft token 0 rejected: u = 0.75 > p_0(2) / q_0(2) = 0.5"),
    ([2], _ONE_HOT[:1], _P[:2], [0.125], "a tie, u = p_0(2) / q_0(2) = 0.125 (a one-hot draft): "
     "accepted"),
    ([1], _Q[:1], _rows([[0.5, 0.0, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]]), [0.25],
     "p_0(1) = 0: the draft token is rejected whatever u > 0"),
    ([2, 1], _ONE_HOT, _P, [0.1, 0.5], "a one-hot draft (an n-gram drafter): accepted when "
     "u <= p_i(x_i); the residual is p_1 without token 1, renormalised"),
    ([0, 0], _HALVES.repeat(2, 1), _rows([[0.3, 0.7], [0.1, 0.9], [0.75, 0.25]]), [0.5, 0.2],
     "a tie in float64 at row 1, u · q_1(0) = 0.2 · 0.5 = 0.1 = p_1(0): accepted (0.2 in float32 "
     "is above 0.2)"),
    ([0], _HALVES, _rows([[0.0, 1.0], [0.75, 0.25]]), [0.0],
     "u = 0 and p_0(0) = 0: u · q_0(0) = 0 <= p_0(0), accepted"),
    ([_CLOSE[2]], _rows(_CLOSE[0][None]), _rows(np.stack([_CLOSE[1], np.full(5, 0.2)])),
     [_CLOSE[3]],
     "q_0 within 1e-9 of p_0, token 0 rejected: the residual, about 1e-9 in all, divided by its "
     "own sum"),
    ([0], _rows([[1 - 2e-7, 2e-7, 0.0]]), _rows([[0.0, 1e-7, 1 - 1e-7], [0.5, 0.25, 0.25]]),
     [0.5], "q and p almost disjoint: the residual (0, 0, 1 - 1e-7) sums to 1 - 1e-7, not 1"),
]  # fmt: skip


def _random_rejection_case(rng) -> tuple:
    """k in 0..5, V in 2..8; q's rows random, one-hot, equal to p's, or of the kinds
    `answers.special_row` makes; the draft drawn from q; uniforms in [0, 1), sometimes small."""
    k, vocab = int(rng.integers(0, 6)), int(rng.choice([2, 3, 5, 8]))
    p = [answers.distribution(rng, vocab) for _ in range(k + 1)]
    q_rows, draft = [], []
    uniforms = (rng.random(k) * float(rng.choice([1.0, 0.1]))).tolist()
    if k and rng.random() < 0.2:
        uniforms[int(rng.integers(0, k))] = 0.0  # accepts even a token p gives 0
    kinds = ["random", "one-hot", "equal", "tie", "close", "disjoint"]
    for i in range(k):
        kind = rng.choice(kinds, p=[0.4, 0.15, 0.1, 0.15, 0.1, 0.1])
        if kind in ("tie", "close", "disjoint"):
            q_row, p[i], token, uniforms[i] = answers.special_row(rng, kind, p[i], vocab)
        else:
            q_row = np.eye(vocab)[int(rng.integers(0, vocab))] if kind == "one-hot" else (
                p[i] if kind == "equal" else answers.distribution(rng, vocab))  # fmt: skip
            token = int(rng.choice(vocab, p=q_row))
        q_rows.append(q_row)
        draft.append(token)
    q = np.stack(q_rows) if q_rows else np.zeros((0, vocab))
    return draft, _rows(q), _rows(np.stack(p)), uniforms, "a random case"


def _digits(row: torch.Tensor) -> str:
    return "[" + ", ".join(f"{x:.10g}" for x in row.tolist()) + "]"


@question(function="rejection_sample")
def test_rejection_sample(submission: Submission) -> None:
    rejection_sample = submission.function("rejection_sample")
    rng = submission.rng()
    cases = [
        *submission.fixed(_REJECTION_CASES),
        *(_random_rejection_case(rng) for _ in range(6)),
    ]
    for draft, q, p, uniforms, what in cases:
        expected = answers.rejection(draft, q, p, uniforms)
        args = (list(draft), q.clone(), p.clone(), list(uniforms))
        got = answer_of(rejection_sample, args, f"{what} (draft {draft}, uniforms {uniforms})")
        _plain_tuple(got, 2, "rejection_sample", "(accepted, distribution)")
        assert is_int(got[0]), (
            f"rejection_sample should return (accepted, distribution): a Python int (not a "
            f"bool) and a (V,) torch.float64 tensor, got {got!r}"
        )
        shown = f"draft {draft}, uniforms {[round(u, 4) for u in uniforms]}"
        if p.numel() <= 16:
            shown += f", q {q.tolist()}, p {p.tolist()}"
        mistakes = answers.rejection_mistakes(draft, q, p, uniforms)
        with naming_mistakes(got, mistakes, expected=expected, rtol=1e-9, atol=1e-12):
            assert int(got[0]) == expected[0], (
                f"{what}: expected {expected[0]} accepted, got {got[0]} (accept draft token i "
                f"while u_i · q_i(x_i) <= p_i(x_i), in float64 as written; stop at the first "
                f"rejection); {shown}"
            )
            expect_tensor(got[1], expected[1], "rejection_sample's distribution (a (V,) "
                          "torch.float64 tensor)")  # fmt: skip
            assert torch.allclose(got[1], expected[1], rtol=1e-9, atol=1e-12), (
                f"{what}: {expected[0]} accepted; expected the distribution "
                f"{_digits(expected[1])}, got {_digits(got[1])} (after a rejection at i, the "
                f"float64 max(0, p_i - q_i) divided by its own sum; when all are accepted, p_k); "
                f"{shown}"
            )


# --- question 3: a paged sequence's rollback ----------------------------------------------------


def _rollback(block_table, new_len, block_size, ref_cnt) -> tuple[list[int], list[int], bool]:
    """kvlib's rollback (BlockManager.truncate, or free for 0 tokens, as PagedCache.truncate
    calls them) on a pool set to `ref_cnt`: (the blocks kept, the blocks freed in the order they
    joined the free queue, whether the kept last block was copied)."""
    spare = 2  # free blocks beyond every id given: one for a copy-on-write
    pool = BlockPool(max([*block_table, *ref_cnt, 0]) + 1 + spare, block_size,
                     enable_prefix_caching=False)  # fmt: skip
    for block, count in ref_cnt.items():
        del pool.free_queue[block]
        pool.blocks[block].ref_cnt = count
    manager = BlockManager(pool)
    manager.block_tables[0] = list(block_table)
    manager.token_ids[0] = [0] * (len(block_table) * block_size)
    manager.block_hashes[0] = []
    before = set(pool.free_queue)
    if new_len > 0:
        manager.truncate(0, new_len)
        kept = manager.block_tables[0]
    else:
        manager.free(0)
        kept = []
    freed = [b for b in pool.free_queue if b not in before]
    return list(block_table[: len(kept)]), freed, bool(manager.copies)


_ROLLBACK_CASES = [  # (block_table, new_len, block_size, ref_cnt, what); sequences of S tokens
    ([7, 3, 9], 10, 4, {7: 1, 3: 1, 9: 1}, "11 tokens to 10: within the last block"),
    ([7, 3, 9], 8, 4, {7: 1, 3: 1, 9: 1}, "12 tokens to 8: a block boundary"),
    ([7, 3, 9, 5], 5, 4, {7: 1, 3: 1, 9: 1, 5: 1}, "15 tokens to 5: two blocks freed"),
    ([2, 6, 11, 4], 3, 4, {2: 2, 6: 2, 11: 1, 4: 1},
     "a fork's child (blocks 2 and 6 shared), 14 tokens to 3"),
    ([5, 1], 0, 4, {5: 3, 1: 1, 8: 2}, "rolled back to 0 tokens (block 5 shared)"),
    ([8, 2], 6, 4, {8: 2, 2: 2}, "7 tokens to 6, every block shared"),
    ([8, 2, 3], 8, 4, {8: 2, 2: 2, 3: 1}, "9 tokens to 8: the kept last block is full"),
    ([4, 0, 6], 16, 16, {4: 1, 0: 1, 6: 1}, "35 tokens to 16, blocks of 16"),
    ([4, 9, 6], 0, 4, {4: 1, 9: 2, 6: 1}, "a shared block between private ones, to 0 tokens"),
    ([4, 9, 6], 9, 4, {4: 2, 9: 1, 6: 2}, "a private block between shared ones, 12 tokens to 9"),
    ([4, 9], 5, 4, {4: 1, 9: 2}, "a private block before the shared partial last one"),
    ([4, 9], 5, 4, {4: 2, 9: 1}, "a shared block before the private partial last one"),
    ([4, 9, 6], 4, 3, {4: 1, 9: 1, 6: 1}, "blocks of 3, 8 tokens to 4"),
    ([4, 9, 6], 7, 6, {4: 1, 9: 2, 6: 1}, "blocks of 6, 13 tokens to 7"),
]  # fmt: skip


def _random_rollback_case(rng) -> tuple:
    """Blocks of 1 to 16 tokens (not only powers of two); 1 to 7 blocks; each block's reference
    count 1 or, independently, 2 to 4 (any pattern: forks share a whole table, prefix hits a
    leading run, and a block two sequences computed at once stays private to the second), other
    sequences' blocks beside them; the new length 0, within the last block, at a block boundary
    or anywhere."""
    block_size = int(rng.choice([1, 2, 3, 4, 5, 6, 12, 16]))
    num_blocks = int(rng.integers(1, 8))
    ids = [int(b) for b in rng.permutation(40)]
    table = ids[:num_blocks]
    shared = float(rng.choice([0.0, 0.3, 0.5, 0.8]))  # 0: nothing shared
    counts = [int(rng.integers(2, 5)) if rng.random() < shared else 1 for _ in table]
    ref_cnt = dict(zip(table, counts))
    ref_cnt.update({b: int(rng.integers(1, 4)) for b in ids[30 : 30 + int(rng.integers(0, 3))]})
    seq_len = int(rng.integers((num_blocks - 1) * block_size + 1, num_blocks * block_size + 1))
    kind = rng.choice(["zero", "last block", "boundary", "any"])
    if kind == "zero":
        new_len = 0
    elif kind == "last block":
        new_len = int(rng.integers((num_blocks - 1) * block_size, seq_len + 1))
    elif kind == "boundary":
        new_len = int(rng.integers(1, num_blocks)) * block_size if num_blocks > 1 else 0
    else:
        new_len = int(rng.integers(0, seq_len + 1))
    return table, new_len, block_size, ref_cnt, f"a random case ({seq_len} tokens to {new_len})"


@question(function="rollback_blocks")
def test_rollback_blocks(submission: Submission) -> None:
    rollback_blocks = submission.function("rollback_blocks")
    rng = submission.rng()
    cases = [
        *submission.fixed(_ROLLBACK_CASES),
        *(_random_rollback_case(rng) for _ in range(6)),
    ]
    for table, new_len, block_size, ref_cnt, what in cases:
        expected = _rollback(table, new_len, block_size, ref_cnt)
        args = (list(table), new_len, block_size, dict(ref_cnt))
        got = answer_of(rollback_blocks, args, what)
        _plain_tuple(got, 3, "rollback_blocks", "(block_table, freed, copy)")
        kept, freed, copy = got
        expect_list(kept, is_int, "rollback_blocks's block_table should be a list of ints")
        expect_list(freed, is_int, "rollback_blocks's freed should be a list of ints")
        assert isinstance(copy, (bool, np.bool_)), (
            f"rollback_blocks's copy should be a bool, got {type(copy).__name__} {copy!r}"
        )
        case = (
            f"{what}: block table {table}, ref_cnt {ref_cnt}, block size {block_size}, new "
            f"length {new_len}"
        )
        mistakes = answers.rollback_mistakes(table, new_len, block_size, ref_cnt)
        with naming_mistakes((list(kept), list(freed), bool(copy)), mistakes, expected=expected):
            assert list(kept) == expected[0], (
                f"{case}: expected the block table {expected[0]} (ceil(new_len / block_size) "
                f"blocks), got {kept}"
            )
            assert list(freed) == expected[1], (
                f"{case}: expected freed {expected[1]} (the dropped blocks no other sequence "
                f"holds, last block first), got {freed}"
            )
            assert bool(copy) == expected[2], (
                f"{case}: expected copy {expected[2]} (the kept last block is copied when it is "
                f"partly filled and shared), got {copy}"
            )


# --- question 4: tokens per step and speed-up --------------------------------------------------


_GAIN_CASES = [
    (0.5, 3, 0.25, "alpha = 0.5, k = 3"),
    (1.0, 4, 0.1, "alpha = 1: every draft accepted"),
    (0.0, 3, 0.2, "alpha = 0: no draft accepted"),
    (0.9, 0, 0.3, "k = 0: plain decoding"),
    (0.7, 5, 0.0, "c = 0: a free drafter"),
    (1.0, 0, 0.5, "alpha = 1 and k = 0"),
    (0.8, 7, 0.05, "alpha = 0.8, k = 7, a drafter 20x cheaper"),
    (0.9995, 12, 0.1, "alpha = 0.9995, near 1 but not 1"),
    (1 - 1e-7, 40, 0.02, "alpha = 1 - 1e-7"),
    (0.12345, 4, 0.1, "alpha = 0.12345"),
    (0.5, 3, 2.0, "c = 2: a drafter dearer than the target"),
    (0.9, 20, 0.1, "k = 20"),
]


def _random_gain_case(rng) -> tuple:
    """alpha 0, 1, uniform in [0, 1) at full precision, or 1 - 10^-e (e uniform in [3, 8]);
    k in 0..64; c 0, 1, or uniform in [0, 1) or [0, 5)."""
    kind = rng.choice(["zero", "one", "uniform", "near one"], p=[0.1, 0.15, 0.5, 0.25])
    alpha = {"zero": 0.0, "one": 1.0, "uniform": float(rng.random()),
             "near one": 1 - 10 ** -float(rng.uniform(3, 8))}[kind]  # fmt: skip
    c = float(rng.choice([0.0, 1.0, float(rng.random()), float(rng.uniform(0, 5))]))
    return (
        alpha,
        int(rng.choice([int(rng.integers(0, 13)), int(rng.integers(0, 65))])),
        c,
        ("a random case"),
    )


def _gain_tolerance(alpha: float) -> float:
    """1e-9 relative, loosened near alpha = 1 by what the closed form's rounding costs there
    (1 - alpha^(k + 1) and 1 - alpha lose digits as alpha nears 1)."""
    return 1e-9 if alpha == 1 else 1e-9 + 1e-15 / (1 - alpha)


@question(function="speculation_gain")
def test_speculation_gain(submission: Submission) -> None:
    speculation_gain = submission.function("speculation_gain")
    rng = submission.rng()
    cases = [*submission.fixed(_GAIN_CASES), *(_random_gain_case(rng) for _ in range(6))]
    for alpha, k, c, what in cases:
        expected, rtol = answers.gain_series(alpha, k, c), _gain_tolerance(alpha)
        got = answer_of(speculation_gain, (alpha, k, c), f"{what} (alpha={alpha!r}, k={k}, c={c})")
        _plain_tuple(got, 2, "speculation_gain", "(tokens_per_step, speedup)")
        assert all(isinstance(x, (float, np.floating)) for x in got), (
            f"speculation_gain should return (tokens_per_step, speedup), two floats (not ints: "
            f"float(k + 1) at alpha = 1), got {got!r}"
        )
        close = all(
            math.isfinite(g) and math.isclose(g, e, rel_tol=rtol)
            for g, e in zip(map(float, got), expected)
        )
        got_floats = tuple(float(x) for x in got)
        mistakes = answers.gain_mistakes(alpha, k, c)  # named within the check's own tolerance
        with naming_mistakes(got_floats, mistakes, expected=expected, rtol=rtol, atol=0.0):
            assert close, (
                f"{what} (alpha={alpha!r}, k={k}, c={c}): expected (tokens_per_step, speedup) = "
                f"({expected[0]:.12g}, {expected[1]:.12g}) within a relative {rtol:.2g}, got "
                f"({got_floats[0]:.12g}, {got_floats[1]:.12g}): 1 + alpha + ... + alpha^k "
                "tokens, (1 - alpha^(k + 1)) / (1 - alpha) for alpha < 1 (k + 1 at alpha = 1), "
                "over a step's cost c · k + 1, with alpha, k and c exactly as given"
            )
