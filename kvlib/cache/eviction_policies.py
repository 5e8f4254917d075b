"""Chapter 8's eviction policies: which tokens an evicting cache keeps (`kvlib.cache.evicting`,
`kvlib.cache.compaction`). Each is a small class with `observe` (update scores from attention
weights) and `priority` (the higher, the likelier a token is kept; `inf` means always kept):
`StreamingLLM`, `H2O`, `TOVA`, `SnapKV`, `RandomEviction`; the papers are cited in
`kvlib.cache.evicting`'s docstring. `LayerState` is what a policy reads and updates for one layer.

Layouts: keys (B, H_kv, S, D), positions (B, H_kv, S) int64 ascending along S, attention weights
grouped as (B, H_kv, G, T, S) with G = H / H_kv.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from kvlib._validate import check_positive_int


@dataclasses.dataclass
class LayerState:
    """What an `EvictingCache` holds for one layer; every tensor's dim 0 is the batch.

    keys (B, H_kv, S, D) and values (B, H_kv, S, D_v): the kept tokens, in original order (rotated
    by RoPE at their original positions, or not rotated with `positions="cache"`);
    positions (B, H_kv, S) int64: each kept token's position in the text (ascending along S);
    scores (B, H_kv, S) float32: the policy's accumulated score (H2O), zeros for others;
    seen (B, H_kv, S) int64: how many queries have attended to each token (H2O's normaliser);
    queries (B, H, W, D) or None: the last W queries, RoPE applied (SnapKV's observation window).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor
    seen: torch.Tensor
    queries: torch.Tensor | None = None

    def select(self, keep: torch.Tensor) -> None:
        """Keep the tokens `keep` (B, H_kv, S') (indices along S, ascending), in place."""
        for name in ("keys", "values"):
            t = getattr(self, name)
            setattr(self, name, t.gather(2, keep[..., None].expand(-1, -1, -1, t.shape[-1])))
        for name in ("positions", "scores", "seen"):
            setattr(self, name, getattr(self, name).gather(2, keep))

    def index_batch(self, indices: torch.Tensor) -> LayerState:
        """A new state holding sequences `indices` (B',) of the batch."""
        return LayerState(
            **{
                f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[indices]
                for f in dataclasses.fields(self)
            }
        )


class EvictionPolicy:
    """How a policy scores tokens. `observe` sees each forward's attention weights; `priority`
    ranks the tokens held (higher is kept; `inf` is always kept).

    Attributes:
        name: the label plots and tables use.
        observation_window: queries the cache keeps for the policy (SnapKV), 0 for none.
    """

    name = "policy"
    observation_window = 0

    def check_budget(self, budget: int) -> None:
        """Raise ValueError if `budget` cannot hold what the policy always keeps."""

    def observe(self, state: LayerState, weights: torch.Tensor, query_positions) -> None:
        """Update `state.scores` from this forward's weights (B, H_kv, G, T, S) (default: no-op)."""

    def priority(
        self, state: LayerState, weights: torch.Tensor, keys: torch.Tensor, budget: int
    ) -> torch.Tensor:
        """(B, H_kv, S) float: how much to keep each token, given this forward's weights (B, H_kv,
        G, T, S), the keys (B, H_kv, S, D) attention read (rotated) and the cache's budget."""
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def _most_recent(priority: torch.Tensor, count: int) -> torch.Tensor:
    """Mark the last `count` tokens (the most recent: S is in original order) as always kept."""
    if count:
        priority[..., -count:] = math.inf
    return priority


class StreamingLLM(EvictionPolicy):
    """Attention sinks + a recent window: keep the first `num_sinks` tokens of the text and the
    most recent `budget - num_sinks` (Xiao et al., ICLR 2024). `num_sinks=0` is a plain sliding
    window, the baseline the paper shows collapsing."""

    name = "StreamingLLM"

    def __init__(self, num_sinks: int = 4):
        self.num_sinks = check_positive_int("num_sinks", num_sinks, allow_zero=True)

    def check_budget(self, budget: int) -> None:
        if budget <= self.num_sinks:
            raise ValueError(
                f"budget: expected more than num_sinks={self.num_sinks} tokens (room for a "
                f"recent window), got {budget}"
            )

    def priority(self, state, weights, keys, budget):
        recency = state.positions.float()
        return recency.masked_fill(state.positions < self.num_sinks, math.inf)


class H2O(EvictionPolicy):
    """Heavy hitters + recent window (Zhang et al., NeurIPS 2023): each token's score is the
    attention it has received from every query so far, summed over the query heads of its GQA
    group; the most recent `recent_fraction` of the budget is always kept, the rest goes to the
    highest scores.

    Args:
        recent_fraction: share of the budget held by the recent window (the paper: half).
        normalize: divide each score by the number of queries that have attended to the token
            (its time in the cache), so that old tokens do not win by age alone; False is the
            paper's plain sum.
    """

    name = "H2O"

    def __init__(self, recent_fraction: float = 0.5, *, normalize: bool = False):
        if not 0.0 <= recent_fraction < 1.0:
            raise ValueError(
                f"recent_fraction: expected a number in [0, 1), got {recent_fraction!r}"
            )
        self.recent_fraction, self.normalize = recent_fraction, normalize

    def observe(self, state, weights, query_positions):
        state.scores += weights.float().sum(dim=(2, 3))  # (B, H_kv, S): group heads and queries
        sees = state.positions[..., None, :] <= query_positions[:, None]  # (B, H_kv, T, S)
        state.seen += sees.sum(dim=2)

    def priority(self, state, weights, keys, budget):
        score = state.scores / state.seen.clamp(min=1) if self.normalize else state.scores.clone()
        return _most_recent(score, int(self.recent_fraction * budget))


class TOVA(EvictionPolicy):
    """Token Omission Via Attention (Oren et al., EMNLP 2024): keep the tokens the current query
    attends to most, its weights averaged over all query heads of the layer; one decision per
    layer (every KV head keeps the same tokens). With a multi-token forward, the last query
    decides."""

    name = "TOVA"

    def priority(self, state, weights, keys, budget):
        last = weights[:, :, :, -1].float().mean(dim=(1, 2))  # (B, S): mean over all H heads
        return last[:, None].expand_as(state.positions).clone()


class SnapKV(EvictionPolicy):
    """SnapKV (Li et al., NeurIPS 2024): the last `window` queries vote. Each token's score is the
    attention these queries give it (softmax over the tokens they see, summed over the window and
    the query heads of the GQA group), max-pooled along the sequence with `kernel_size` so that a
    selected token brings its neighbours; the window's own tokens are always kept.

    Args:
        window: observation window W (32, the default of SnapKV's repository).
        kernel_size: odd pooling width (7; the repository defaults to average pooling over 5);
            1 for no pooling.
    """

    name = "SnapKV"

    def __init__(self, window: int = 32, kernel_size: int = 7):
        self.window = self.observation_window = check_positive_int("window", window)
        self.kernel_size = check_positive_int("kernel_size", kernel_size)
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size: expected an odd width, got {kernel_size}")

    def check_budget(self, budget: int) -> None:
        if budget <= self.window:
            raise ValueError(
                f"budget: expected more than window={self.window} tokens, got {budget}"
            )

    def priority(self, state, weights, keys, budget):
        q = state.queries  # (B, H, W, D): the window's queries, RoPE applied
        b, h_kv, s, d = state.keys.shape
        w = q.shape[2]
        query_positions = state.positions[:, 0, -w:]  # the window is the newest W tokens
        scores = (q.view(b, h_kv, -1, w, d) @ keys[:, :, None].transpose(-1, -2)) * d**-0.5
        sees = state.positions[:, :, None, None, :] <= query_positions[:, None, None, :, None]
        votes = scores.float().masked_fill(~sees, -math.inf).softmax(dim=-1).sum(dim=(2, 3))
        if self.kernel_size > 1:  # (B, H_kv, S): a kept token keeps its neighbours
            votes = F.max_pool1d(
                votes.view(b * h_kv, 1, s), self.kernel_size, 1, self.kernel_size // 2
            ).view(b, h_kv, s)
        return _most_recent(votes, w)


class RandomEviction(EvictionPolicy):
    """Keep a uniformly random subset (seeded): the baseline."""

    name = "random"

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)

    def priority(self, state, weights, keys, budget):
        return torch.rand(state.positions.shape, generator=self._generator)
