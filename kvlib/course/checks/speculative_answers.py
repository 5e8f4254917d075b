"""Chapter 16's graded questions, their side: the expected answers written out (`greedy`,
`rejection` with kvlib's residual, `rollback_formula`, `gain`) and the plausible wrong answers
each is checked against (`*_mistakes`: a red team's list, each named in the feedback when a
learner's answer equals it), and the random rows of rejection_sample's cases. The questions
themselves: `kvlib.course.checks.ch16`."""

from __future__ import annotations

import math

import numpy as np
import torch

from kvlib.speculative.verify import residual_distribution


def greedy(draft, chosen: list[int]) -> tuple[int, int]:
    """greedy_accept from each row's chosen token (its argmax, or a mistake's)."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == chosen[accepted]:
        accepted += 1
    return accepted, chosen[accepted]


def greedy_mistakes(draft, logits) -> dict:
    chosen = logits.argmax(dim=-1).tolist()  # (k + 1,): the first maximum of each row
    k, (accepted, _) = len(draft), greedy(draft, chosen)
    last_max = (logits.shape[1] - 1 - logits.flip(-1).argmax(dim=-1)).tolist()
    return {
        "the bonus forgotten: when all k draft tokens are accepted, the next token is row k's "
        "argmax (the bonus), not row k - 1's": lambda: (k, chosen[k - 1] if k else chosen[0]),
        "the next token read one row late: the first mismatch at i takes row i's argmax (row i "
        "predicts the token after draft token i - 1)": lambda: (accepted, chosen[accepted + 1]),
        "the rows shifted by one: draft token i is checked against row i (row 0 predicts the "
        "token after the last accepted one), not row i + 1": lambda: greedy(
            draft,
            chosen[1:] + chosen[-1:],  # row i + 1 checks x_i, the bonus still row k
        ),
        "every matching draft token counted: acceptance stops at the first mismatch": lambda: (
            sum(d == c for d, c in zip(draft, chosen)),
            chosen[sum(d == c for d, c in zip(draft, chosen))],
        ),
        "the rejected draft token returned: at the first mismatch the target's argmax replaces "
        "it": lambda: (accepted, draft[accepted]),
        "ties broken towards the last maximum: the first (smallest index) wins, as torch.argmax "
        "returns": lambda: greedy(draft, last_max),
    }


# the random cases' distributions, and the rows of rejection_sample's harder kinds


def distribution(rng, vocab: int) -> np.ndarray:
    """A random distribution over `vocab` tokens, with zeros half of the time."""
    row = rng.dirichlet(np.ones(vocab) * float(rng.choice([0.3, 1.0, 3.0])))
    if rng.random() < 0.5:
        row = row * (rng.random(vocab) < 0.6)
        row[int(rng.integers(0, vocab))] += 0.1  # never all zero
    return row / row.sum()


def with_value(row: np.ndarray, token: int, value: float) -> np.ndarray:
    """`row` with `token`'s probability set to `value` exactly, the others scaled to 1 - value."""
    rest = np.delete(row, token)
    rest = rest / rest.sum() if rest.sum() > 0 else np.full(len(rest), 1 / len(rest))
    return np.insert(rest * (1 - value), token, value)


def special_row(rng, kind: str, p_row: np.ndarray, vocab: int) -> tuple:
    """q_i for the harder kinds, with the draft token and its uniform: (q_i, p_i, x_i, u_i).
    "tie": q_i(x_i) a power of two and p_i(x_i) = u_i · q_i(x_i) exactly (float32 would round
    u_i up); "close": q_i within 1e-9 of p_i, x_i rejected; "disjoint": supports almost
    disjoint, the residual's sum 1 - 1e-7 or so."""
    token = int(rng.integers(0, vocab))
    if kind == "tie":
        u = float(rng.random())
        while float(np.float32(u)) <= u:
            u = float(rng.random())
        q_x = 2.0 ** -int(rng.integers(1, 4))
        return (
            with_value(distribution(rng, vocab), token, q_x),
            with_value(p_row, token, u * q_x),
            token,
            u,
        )
    if kind == "close":
        delta = rng.normal(size=vocab) * 1e-9
        q_row = np.abs(p_row + delta - delta.mean())
        q_row = q_row / q_row.sum()
        token = int(np.argmax(q_row - p_row))
        return q_row, p_row, token, 1 - 1e-12
    q_row = np.zeros(vocab)
    q_row[token] = 1.0
    return (
        q_row,
        with_value(p_row, token, float(rng.choice([1e-7, 3e-7]))),
        token,
        float(rng.random()),
    )


def rejection(draft, q, p, uniforms, *, rule="leviathan", resample="residual",
               normalise=True, bonus_row=0) -> tuple[int, torch.Tensor]:  # fmt: skip
    """The verification written out (kvlib's `speculative_accept` with its draws given: reject
    where u · q > p, then `residual_distribution`). The common mistakes, switchable: `rule`
    ("strict": a tie rejected; "inverted": u <= q/p; "target only": u <= p), `resample` ("p":
    the target's row; "q - p": the other way round), `normalise=False`, `bonus_row=-1`; a
    mistaken rule divides by the residual's sum as a learner's code does (0 / 0 where it
    rejects a token of a row with p = q)."""
    for i, (token, u) in enumerate(zip(draft, uniforms)):
        p_x, q_x = float(p[i, token]), float(q[i, token])
        accept = {
            "leviathan": not u * q_x > p_x,
            "strict": u * q_x < p_x,
            "inverted": u * p_x <= q_x,
            "target only": u <= p_x,
        }[rule]
        if not accept:
            if resample == "p":
                return i, p[i].clone()
            first, second = (q[i], p[i]) if resample == "q - p" else (p[i], q[i])
            residual = (first - second).clamp(min=0)  # (V,)
            if not normalise:
                return i, residual
            if rule != "leviathan":
                return i, residual / residual.sum()
            return i, residual_distribution(first, second)
    return len(draft), p[len(draft) + bonus_row].clone()


def rejection_mistakes(draft, q, p, uniforms) -> dict:
    args = (draft, q, p, uniforms)
    return {
        "the residual not normalised: max(0, p_i - q_i) divided by its sum": lambda: rejection(
            *args, normalise=False
        ),
        "p_i resampled at a rejection: the residual is the normalised max(0, p_i - q_i) (with "
        "p_i, the tokens q over-drafts, q >= p, come out too often)": lambda: rejection(
            *args, resample="p"
        ),
        "the residual the wrong way round: max(0, p_i - q_i), not max(0, q_i - p_i)": lambda: (
            rejection(*args, resample="q - p")
        ),
        "the bonus from row k - 1: when all k are accepted, the next token comes from p_k, the "
        "row after the last draft token": lambda: rejection(*args, bonus_row=-1),
        "the ratio inverted: accept when u · q_i(x_i) <= p_i(x_i), not u · p_i(x_i) <= q_i(x_i)": (
            lambda: rejection(*args, rule="inverted")
        ),
        "q forgotten: accept when u · q_i(x_i) <= p_i(x_i), not u <= p_i(x_i)": lambda: rejection(
            *args, rule="target only"
        ),
        "a tie rejected: accept when u · q_i(x_i) <= p_i(x_i), equality included, in float64 "
        "(a uniform rounded to float32 moves some ties)": lambda: rejection(*args, rule="strict"),
    }


def rollback_formula(block_table, new_len, block_size, ref_cnt, *, keep_rule="ceil",
                      free_shared=False, order="last first",
                      copy_rule="partial and shared"):  # fmt: skip
    """The rule written out, its common mistakes switchable."""
    keep = {
        "ceil": -(-new_len // block_size),
        "floor": new_len // block_size,
        "floor + 1": new_len // block_size + 1,
    }[keep_rule]
    keep = min(keep, len(block_table))
    dropped = block_table[keep:]
    freed = [b for b in dropped if free_shared or ref_cnt[b] == 1]
    freed = freed[::-1] if order == "last first" else freed
    partial, shared = new_len % block_size != 0, keep > 0 and ref_cnt[block_table[keep - 1]] > 1
    copy = {
        "partial and shared": keep > 0 and partial and shared,
        "shared": shared,
        "partial": keep > 0 and partial,
        "never": False,
    }[copy_rule]
    return list(block_table[:keep]), freed, copy


def rollback_mistakes(block_table, new_len, block_size, ref_cnt) -> dict:
    args = (block_table, new_len, block_size, ref_cnt)
    return {
        "shared blocks freed: a dropped block another sequence holds (ref_cnt > 1) is only "
        "dereferenced": lambda: rollback_formula(*args, free_shared=True),
        "an empty block kept: new_len tokens need ceil(new_len / block_size) blocks": lambda: (
            rollback_formula(*args, keep_rule="floor + 1")
        ),
        "the partly filled last block dropped: keep ceil(new_len / block_size) blocks, not "
        "new_len // block_size": lambda: rollback_formula(*args, keep_rule="floor"),
        "freed in table order: blocks return last block first (vLLM's order)": lambda: (
            rollback_formula(*args, order="table")
        ),
        "a full shared last block copied: only a partly filled one is written again": lambda: (
            rollback_formula(*args, copy_rule="shared")
        ),
        "a private partial block copied: copy-on-write is for a block another sequence holds": (
            lambda: rollback_formula(*args, copy_rule="partial")
        ),
        "no copy-on-write: a kept last block that is shared and partly filled must be copied "
        "before the next token is written into it": lambda: rollback_formula(
            *args, copy_rule="never"
        ),
    }


def gain(alpha, k, c, *, power=1, from_target=True, at_one=1, cost="c k + 1") -> tuple:
    """Leviathan et al.'s expectation written out, its common mistakes switchable: `power=0`
    (alpha^k), `from_target=False` (the accepted drafts only), `at_one=0` (k at alpha = 1),
    `cost` ("c k": no target pass; "c (k + 1) + 1"; "1": none)."""
    if alpha == 1:
        tokens = float(k + at_one)
    else:
        tokens = (1 - alpha ** (k + power)) / (1 - alpha)
    if not from_target:
        tokens -= 1
    step = {"c k + 1": c * k + 1, "c k": c * k, "c (k + 1) + 1": c * (k + 1) + 1, "1": 1.0}[cost]
    return tokens, tokens / step


def gain_series(alpha, k, c) -> tuple[float, float]:
    """The expectation as the series 1 + alpha + ... + alpha^k, summed exactly enough (fsum of
    correctly rounded powers): the oracle, accurate near alpha = 1 where the closed form is not."""
    tokens = math.fsum(alpha**i for i in range(k + 1))
    return tokens, tokens / (c * k + 1)


def gain_mistakes(alpha, k, c) -> dict:
    return {
        "alpha^k instead of alpha^(k + 1): 1 + alpha + ... + alpha^k has k + 1 terms": lambda: gain(
            alpha, k, c, power=0
        ),
        "k tokens at alpha = 1: all k accepted, plus the bonus, is k + 1": lambda: gain(
            alpha, k, c, at_one=0
        ),
        "the target's own token left out: a step emits the accepted drafts plus one token from the "
        "target (the correction or the bonus)": lambda: gain(alpha, k, c, from_target=False),
        "the target's pass left out of a step's cost: c · k + 1, in target-step units": lambda: (
            gain(alpha, k, c, cost="c k")
        ),
        "k + 1 draft steps: the drafter runs k times (the bonus needs no draft), c · k + 1": (
            lambda: gain(alpha, k, c, cost="c (k + 1) + 1")
        ),
        "the speed-up as tokens per step: a step also costs c · k for the drafts": lambda: gain(
            alpha, k, c, cost="1"
        ),
    }
