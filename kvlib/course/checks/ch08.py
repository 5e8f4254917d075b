"""Chapter 8's graded questions: StreamingLLM's keep mask, H2O's score update and SnapKV's
selection. Oracles: kvlib's policies and the selection rule written out
here."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvlib.cache.eviction_policies import H2O, LayerState, StreamingLLM
from kvlib.course.checks.mistakes import naming_mistakes
from kvlib.course.grading import Submission, expect_list, question


def _streaming_keep(positions, budget, num_sinks):
    if len(positions) <= budget:
        return [True] * len(positions)
    state = LayerState(*(None,) * 2, torch.tensor(positions)[None, None], None, None)
    priority = StreamingLLM(num_sinks).priority(state, None, None, budget)[0, 0]
    ranked = priority.sort(descending=True, stable=True).indices[:budget]
    keep = [False] * len(positions)
    for i in ranked.tolist():
        keep[i] = True
    return keep


def _streaming_variant(positions, budget, num_sinks, *, sinks_by_slot=False,
                       recent_by_slot=False, window_is_budget=False):  # fmt: skip
    """StreamingLLM's keep mask written out, with its common mistakes switchable: the sinks taken
    as the first `num_sinks` slots rather than the tokens at positions below `num_sinks` (wrong
    once earlier evictions left the slots out of order); the recent tokens taken as the last
    slots rather than the highest positions; the window given the whole budget, the sinks kept
    on top of it (chapter 8's pitfall: the budget counts the sinks)."""
    n = len(positions)
    if n <= budget:
        return [True] * n
    if sinks_by_slot:
        sinks = set(range(min(num_sinks, n)))
    else:
        sinks = {i for i, p in enumerate(positions) if p < num_sinks}
    window = budget if window_is_budget else budget - len(sinks)
    rest = [i for i in range(n) if i not in sinks]
    rest.sort(key=(lambda i: i) if recent_by_slot else (lambda i: positions[i]), reverse=True)
    kept = sinks | set(rest[: max(window, 0)])
    return [i in kept for i in range(n)]


def _streaming_mistakes(positions, budget, num_sinks) -> dict:
    """streaming_keep's common mistakes."""
    args = (positions, budget, num_sinks)
    return {
        "the sinks taken as the first slots, not the positions below num_sinks (after an "
        "eviction the slots are no longer in position order)": (
            lambda: _streaming_variant(*args, sinks_by_slot=True)
        ),
        "the most recent tokens taken as the last slots, not the highest positions": (
            lambda: _streaming_variant(*args, recent_by_slot=True)
        ),
        "the window given the whole budget and the sinks kept on top (the budget counts the "
        "sinks)": lambda: _streaming_variant(*args, window_is_budget=True),
    }


@question(function="streaming_keep")
def test_streaming_keep(submission: Submission) -> None:
    streaming_keep = submission.function("streaming_keep")
    rng = submission.rng()
    random_cases = []
    for _ in range(3):  # drawn afresh: positions left in a slot order by earlier evictions
        n = int(rng.integers(1, 40))
        positions = sorted(int(p) for p in rng.choice(60, size=n, replace=False))
        if rng.random() < 0.7:
            positions = [int(p) for p in rng.permutation(positions)]
        num_sinks = int(rng.integers(0, 5))  # the budget exceeds the sinks, as the question says
        budget = int(rng.integers(num_sinks + 1, 45))
        random_cases.append((positions, budget, num_sinks, "random positions"))
    fixed = [
        (list(range(10)), 6, 2, "10 tokens, budget 6, 2 sinks"),
        (list(range(5)), 8, 4, "fewer tokens than the budget"),
        (list(range(40)), 12, 4, "40 tokens, budget 12, 4 sinks"),
        ([0, 1, 2, 3, 17, 18, 19, 20, 21], 8, 4, "a cache that has evicted before"),
        ([0, 5, 9, 10, 11, 12], 4, 2, "a sink already gone (position 1)"),
        (list(range(9)), 8, 0, "no sinks: a plain window"),
        (list(range(8)), 8, 2, "exactly the budget: nothing to evict"),
        ([0, 1, 30, 12, 25, 13, 2, 40, 18], 6, 2, "positions in slot order, not sorted"),
        ([3, 0, 9, 1, 2], 4, 3, "one place left after the sinks"),
    ]
    for positions, budget, num_sinks, what in [*submission.fixed(fixed), *random_cases]:
        expected = _streaming_keep(positions, budget, num_sinks)
        got = streaming_keep(list(positions), budget, num_sinks)
        expect_list(
            got,
            lambda x: isinstance(x, bool),
            "streaming_keep should return a list of bools, one per position",
        )
        mistakes = _streaming_mistakes(positions, budget, num_sinks)
        with naming_mistakes(got, mistakes, expected=expected):
            assert got == expected, (
                f"{what} (positions {positions}): expected keep mask {expected}, got {got} (keep "
                "every token whose position is below num_sinks, then the most recent tokens up "
                "to the budget; everything when the budget is not exceeded)"
            )


def _h2o_update(scores, weights):
    h_kv, s_old = scores.shape
    h, t, s = weights.shape
    state = LayerState(
        None,
        None,
        torch.arange(s)[None, None].expand(1, h_kv, s),
        torch.cat([scores, torch.zeros(h_kv, t)], dim=1)[None].clone(),
        torch.zeros(1, h_kv, s, dtype=torch.long),
    )
    H2O().observe(state, weights.view(1, h_kv, h // h_kv, t, s), torch.arange(s - t, s))
    return state.scores[0]


@question(function="h2o_update")
def test_h2o_update(submission: Submission) -> None:
    h2o_update = submission.function("h2o_update")
    g, drawn = torch.Generator().manual_seed(8), submission.rng()
    h_kv, group = (int(n) for n in drawn.integers(1, 4, size=2))  # drawn afresh on every run
    random_case = (h_kv * group, h_kv, *(int(n) for n in drawn.integers((0, 1), (12, 6))))
    fixed = [
        (2, 2, 5, 1, "one decode step, one query head per KV head"),
        (6, 2, 7, 1, "one decode step, groups of 3 (GQA)"),
        (4, 1, 3, 4, "a 4-token chunk, one KV head (MQA)"),
        (4, 2, 0, 5, "the first forward (no scores yet)"),
    ]
    label = "random: H={}, H_kv={}, S_old={}, T={}".format(*random_case)
    for h, h_kv, s_old, t, what in [*submission.fixed(fixed), (*random_case, label)]:
        scores = torch.rand(h_kv, s_old, generator=g)
        logits = torch.randn(h, t, s_old + t, generator=g)
        causal = torch.arange(s_old + t)[None] <= torch.arange(s_old, s_old + t)[:, None]
        weights = logits.masked_fill(~causal, -math.inf).softmax(-1)
        expected = _h2o_update(scores, weights)
        got = h2o_update(scores.clone(), weights.clone())
        assert isinstance(got, torch.Tensor) and got.shape == expected.shape, (
            f"{what}: expected a tensor of shape {tuple(expected.shape)} (H_kv, S_old + T), got "
            f"{getattr(got, 'shape', type(got).__name__)}"
        )
        assert got.dtype == scores.dtype, (
            f"{what}: expected the scores' dtype {scores.dtype}, got {got.dtype}"
        )
        with naming_mistakes(got, _h2o_mistakes(scores, weights), rtol=0.0, atol=1e-5):
            assert torch.allclose(got, expected, atol=1e-5), (
                f"{what}: each token's old score (0 for the new tokens) plus the attention it "
                "received in this forward, summed over the T queries and the query heads of its KV "
                f"head's group; expected {expected.numpy().round(3).tolist()}, got "
                f"{got.detach().float().numpy().round(3).tolist()}"
            )


def _h2o_mistakes(scores, weights) -> dict:
    """h2o_update's common mistakes: scores (H_kv, S_old), weights (H, T, S_old + T)."""
    h_kv, (h, t, s) = scores.shape[0], weights.shape
    old = torch.cat([scores, scores.new_zeros(h_kv, t)], dim=-1)
    grouped = weights.reshape(h_kv, h // h_kv, t, s)
    return {
        "summed over every query head, not over the KV head's own group": lambda: (
            old + weights.sum(dim=(0, 1))[None]
        ),
        "strided groups: KV head j's group is query heads j·G .. j·G + G - 1 (consecutive)": (
            lambda: old + weights.reshape(h // h_kv, h_kv, t, s).sum(dim=(0, 2))
        ),
        "the last query's attention only (TOVA's rule): H2O adds every query's": lambda: (
            old + grouped[:, :, -1].sum(dim=1)
        ),
        "the old scores dropped: H2O accumulates": lambda: grouped.sum(dim=(1, 2)),
        "the group's mean, not its sum": lambda: old + grouped.mean(dim=1).sum(dim=1),
    }


def _snapkv_select(votes, budget, window, kernel_size, *, pool=True, keep_window=True,
                   ascending=True):  # fmt: skip
    """SnapKV's selection written out. The common mistakes, switchable: `pool=False` ranks the
    raw votes, `keep_window=False` leaves the window to its votes, `ascending=False` returns the
    indices best first."""
    h_kv, s = votes.shape
    if s <= budget:
        return torch.arange(s).expand(h_kv, s)
    pooled = votes.clone()
    if pool:
        pooled = F.max_pool1d(votes[:, None], kernel_size, 1, kernel_size // 2)[:, 0]
    if keep_window:
        pooled[:, s - window :] = math.inf
    ranked = pooled.sort(dim=-1, descending=True, stable=True).indices[:, :budget]
    return ranked.sort(dim=-1).values if ascending else ranked


def _snapkv_mistakes(votes, budget, window, kernel_size) -> dict:
    """snapkv_select's common mistakes."""
    args = (votes, budget, window, kernel_size)
    return {
        "the votes not pooled: max-pool each token's vote over its kernel_size neighbours first, "
        "so that a chosen token brings its neighbours": lambda: _snapkv_select(*args, pool=False),
        "the observation window left to its votes: the last `window` tokens are always kept": (
            lambda: _snapkv_select(*args, keep_window=False)
        ),
        "the indices in the order of their pooled votes: return them ascending": lambda: (
            _snapkv_select(*args, ascending=False)
        ),
    }


@question(function="snapkv_select")
def test_snapkv_select(submission: Submission) -> None:
    snapkv_select = submission.function("snapkv_select")
    g = torch.Generator().manual_seed(3)
    spiky = torch.zeros(2, 20)
    spiky[0, 3], spiky[1, 11] = 5.0, 4.0
    fixed = [
        (torch.rand(1, 12, generator=g), 6, 2, 3, "12 tokens, budget 6, window 2, kernel 3"),
        (spiky, 8, 3, 5, "one spike per head: its neighbours come with it"),
        (torch.rand(3, 30, generator=g), 10, 4, 1, "kernel 1 (no pooling)"),
        (torch.rand(2, 6, generator=g), 8, 2, 3, "fewer tokens than the budget"),
        (torch.rand(2, 25, generator=g), 12, 4, 7, "SnapKV's kernel of 7"),
        (torch.rand(2, 16, generator=g), 6, 6, 3, "the window fills the budget"),
        (torch.rand(1, 9, generator=g), 9, 2, 3, "exactly the budget"),
    ]
    drawn, votes_generator = submission.rng(), submission.torch_generator()
    tokens = int(drawn.integers(1, 31))  # drawn afresh on every run
    budget = int(drawn.integers(1, tokens + 3))
    window = int(drawn.integers(1, min(budget, tokens) + 1))  # 1 <= window <= budget
    votes = torch.rand(int(drawn.integers(1, 4)), tokens, generator=votes_generator)
    random_case = (votes, budget, window, int(drawn.choice([1, 3, 5, 7])), "random votes")
    for votes, budget, window, kernel, what in [*submission.fixed(fixed), random_case]:
        expected = _snapkv_select(votes, budget, window, kernel)
        got = snapkv_select(votes.clone(), budget, window, kernel)
        assert isinstance(got, torch.Tensor) and got.shape == expected.shape, (
            f"{what}: expected indices of shape {tuple(expected.shape)} (H_kv, min(S, budget)), "
            f"got {getattr(got, 'shape', type(got).__name__)}"
        )
        assert not got.is_floating_point() and not got.is_complex() and got.dtype != torch.bool, (
            f"{what}: indices should be integers, got dtype {got.dtype}"
        )
        mistakes = _snapkv_mistakes(votes, budget, window, kernel)
        with naming_mistakes(got, mistakes, rtol=0.0, atol=0.0):
            assert torch.equal(got.long(), expected), (
                f"{what}: max-pool the votes over kernel_size neighbours, always keep the last "
                "`window` tokens, fill the rest of the budget with the highest pooled votes (ties "
                "to the older token) and return the indices in ascending order; expected "
                f"{expected.tolist()}, got {got.tolist()}"
            )
