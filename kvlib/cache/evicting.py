"""Token eviction: a dense KV cache that keeps at most `budget` tokens per sequence and KV head,
the tokens chosen by a policy (chapter 8).

`EvictingCache` implements `kvlib.cache.KVCache`. Each forward it appends the new keys and values,
attends over everything it holds (eager attention: the policies read the weights), lets the policy
update its scores, and then keeps the `budget` tokens of highest priority in each (sequence, KV
head), in their original order. One decision per KV head: a score sums over the query heads of a
GQA group, because the heads of a group share the keys and values the cache would drop.

Policies (`kvlib.cache.eviction_policies`, each a small class with `observe` and `priority`; the
higher the priority, the likelier a token is kept; `inf` means always kept):

- `StreamingLLM(num_sinks=4)`: the first `num_sinks` tokens ("attention sinks") and the most
  recent ones (Xiao et al., ICLR 2024, "Efficient Streaming Language Models with Attention Sinks";
  4 sinks is the paper's choice);
- `H2O(recent_fraction=0.5)`: "heavy hitters", the tokens that received the most attention so far,
  plus a window of recent tokens (Zhang et al., NeurIPS 2023, "H2O"; the paper splits the budget
  equally between the two). `normalize=True` divides each token's accumulated attention by the
  number of queries that have seen it; the paper's code sums (`normalize=False`), which favours
  old tokens;
- `TOVA()`: drop the token with the lowest attention from the current query, averaged over all
  heads of the layer, so one set of tokens per layer (Oren et al., EMNLP 2024, "Transformers are
  Multi-State RNNs");
- `SnapKV(window=32, kernel_size=7)`: score the tokens by the attention of the last `window`
  queries, summed over them and max-pooled along the sequence, and always keep the window itself
  (Li et al., NeurIPS 2024; window 32 as in its repository, whose pooling defaults to an
  average over 5 positions, max pooling an option; kvlib max-pools over 7). The paper applies it
  once, at the end of prefill; here it runs whenever a forward leaves the cache over budget
  (fed one token at a time, at every step), with the same rule. With positions="cache" the
  window's queries keep the rotation of the step that made them;
- `RandomEviction(seed)`: a uniformly random subset, the baseline every policy must beat.

Positions after eviction, `positions=`:

- `"original"`: keys are cached after RoPE at the position they had in the text, and a query is
  rotated at its own position, so a kept token's distance to the query is the true one (TOVA,
  SnapKV, H2O);
- `"cache"`: StreamingLLM's convention: keys are cached *before* RoPE and rotated on every read
  at their index in the cache (0 .. S - 1); a query is rotated at the cache's length, so the
  distances are those within the cache and never exceed what the model was trained on. The cache
  sets `rotates_keys`, so the model hands it unrotated keys, and defines `query_positions`, which
  the model uses instead of counting tokens.

Not done here: padding (batches must be unpadded), MLA (its latent cache is `LatentCache`), paged
storage (dropping tokens from blocks frees no block: chapter 9), fused attention (a fused kernel
never forms the weights the policies read: chapter 8's "kernel wall").

Layouts: keys (B, H_kv, S, D), values (B, H_kv, S, D_v), positions (B, H_kv, S) int64 ascending
along S, attention weights grouped as (B, H_kv, G, T, S) with G = H / H_kv.
"""

from __future__ import annotations

import copy

import torch

from kvlib._validate import check_positive_int
from kvlib.cache.base import check_kv_append, check_unpadded
from kvlib.cache.eviction_policies import EvictionPolicy, LayerState
from kvlib.errors import UnsupportedConfigError
from kvlib.layers.llama import apply_rope, rope_cos_sin
from kvlib.ops.attention import reference_attention, visible

__all__ = [
    "EvictingCache",
    "rerotate_keys",
    "token_scores_from_lse",
]


class EvictingCache:
    """A dense cache that keeps at most `budget` tokens per (sequence, KV head) after every
    forward, chosen by `policy` (see the module docstring).

    Args:
        num_layers: L.
        policy: an `EvictionPolicy`.
        budget: tokens kept per sequence and KV head, or None for no eviction (the full cache).
        positions: "original" or "cache" (see the module docstring).
        rope: (head_dim, theta, scaling) of the model, needed with positions="cache" (use
            `EvictingCache.for_model`).
        sliding_window: the model's window, if it has one (keys further back are masked).
    Attributes:
        length: tokens seen per sequence (the text's length so far); `seq_lens` says how many are
            held.
        evicted: tokens dropped so far, summed over layers, sequences and KV heads.
    Raises:
        ValueError: a budget the policy cannot work with, an unknown `positions`.
    """

    def __init__(
        self,
        num_layers: int,
        policy: EvictionPolicy,
        budget: int | None,
        *,
        positions: str = "original",
        rope: tuple | None = None,
        sliding_window: int | None = None,
    ):
        self.num_layers = check_positive_int("num_layers", num_layers)
        if not isinstance(policy, EvictionPolicy):
            raise TypeError(f"policy: expected an EvictionPolicy, got {type(policy).__name__}")
        if budget is not None:
            policy.check_budget(check_positive_int("budget", budget))
        if positions not in ("original", "cache"):
            raise ValueError(f"positions: expected 'original' or 'cache', got {positions!r}")
        if positions == "cache" and rope is None:
            raise ValueError(
                "rope: positions='cache' rotates keys on read and needs the model's (head_dim, "
                "theta, scaling); use EvictingCache.for_model"
            )
        self.policy, self.budget, self.positions_mode = policy, budget, positions
        self.rope, self.sliding_window = rope, sliding_window
        self.layers: list[LayerState | None] = [None] * num_layers
        self.length = 0
        self.evicted = 0
        self._query_positions = None  # (T,) positions of this forward's tokens

    @classmethod
    def for_model(
        cls, model, policy: EvictionPolicy, budget: int | None, *, positions: str = "original"
    ) -> EvictingCache:
        """A cache for `model` (a `LlamaModel`).

        Raises:
            UnsupportedConfigError: an MLA model (its latent rows are not per-head keys).
        """
        c = model.config
        if c.is_mla:
            raise UnsupportedConfigError(
                "model: EvictingCache holds per-head keys and values; MLA's latent cache is "
                "kvlib.cache.LatentCache"
            )
        return cls(
            c.num_hidden_layers,
            policy,
            budget,
            positions=positions,
            rope=(c.head_dim, c.rope_theta, c.rope_scaling),
            sliding_window=c.sliding_window,
        )

    @classmethod
    def factory(cls, policy: EvictionPolicy, budget: int | None, *, positions: str = "original"):
        """A `cache=` argument for `kvlib.generate` and `passkey_accuracy`: factory(model,
        batch_size, max_seq_len) -> a fresh EvictingCache."""
        return lambda model, batch_size, max_seq_len: cls.for_model(
            model, policy, budget, positions=positions
        )

    # --- the attention seam ---------------------------------------------------------------------

    @property
    def rotates_keys(self) -> bool:
        """True: the model must hand `update` keys before RoPE (positions="cache")."""
        return self.positions_mode == "cache"

    def query_positions(self, num_tokens: int) -> torch.Tensor:
        """(1, T) RoPE positions of the next `num_tokens` queries: their positions in the text, or
        (positions="cache") the cache's length onward."""
        start = self.length if self.positions_mode == "original" else self._held()
        return torch.arange(start, start + num_tokens)[None]

    def begin_forward(self, num_tokens: int, attention_mask: torch.Tensor | None) -> None:
        """Record this forward's token positions; refuse padding.

        Raises:
            ValueError: an attention mask with padding (0s).
        """
        check_unpadded(attention_mask, "EvictingCache")
        self._query_positions = torch.arange(self.length, self.length + num_tokens)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Append layer `layer_idx`'s new keys and values (B, H_kv, T, D); return the handle the
        cache's `attention_backend` reads (the layer index)."""
        stored = [None if s is None else s.keys for s in self.layers]
        state = None if check_kv_append(stored, layer_idx, k, v) is None else self.layers[layer_idx]
        if self._query_positions is None or self._query_positions.numel() != k.shape[2]:
            self.begin_forward(k.shape[2], None)  # a caller that is not LlamaModel
        b, h_kv, t, _ = k.shape
        new_positions = self._query_positions.to(k.device).expand(b, h_kv, t)
        zeros = torch.zeros(b, h_kv, t, device=k.device)
        if state is None:
            self.layers[layer_idx] = LayerState(k, v, new_positions.clone(), zeros, zeros.long())
        else:
            state.keys = torch.cat([state.keys, k], dim=2)
            state.values = torch.cat([state.values, v], dim=2)
            state.positions = torch.cat([state.positions, new_positions], dim=2)
            state.scores = torch.cat([state.scores, zeros], dim=2)
            state.seen = torch.cat([state.seen, zeros.long()], dim=2)
        return layer_idx

    def attention_backend(self, q, layer_idx, mask=None, *, weights_out=None) -> torch.Tensor:
        """Attend with q (B, H, T, D) over layer `layer_idx`'s tokens (`mask`, the model's mask in
        text positions, is not used: the cache masks by the positions it holds), let the policy
        observe the weights, then evict down to the budget. Returns (B, H, T, D_v).

        The arithmetic is `reference_attention`'s, so with nothing evicted the output is bitwise
        the full cache's.
        """
        state = self.layers[layer_idx]
        b, h, t, d = q.shape
        h_kv = state.keys.shape[1]
        keys = state.keys
        if self.positions_mode == "cache":  # rotate every key at its index in the cache
            head_dim, theta, scaling = self.rope
            index = torch.arange(keys.shape[2], device=keys.device)[None]
            keys = apply_rope(keys, *rope_cos_sin(index, head_dim, theta, scaling))
        query_positions = self._query_positions.to(q.device)
        sees = visible(  # (B, H_kv, T, S)
            state.positions[:, :, None, :], query_positions[:, None], self.sliding_window
        )
        group = h // h_kv
        weights: list = []
        out = reference_attention(
            q, (keys, state.values), sees.repeat_interleave(group, dim=1), weights_out=weights
        )
        if weights_out is not None:
            weights_out.append(weights[0])
        grouped = weights[0].view(b, h_kv, group, t, -1)  # (B, H_kv, G, T, S)
        self.policy.observe(state, grouped, query_positions)
        if self.policy.observation_window:
            window = self.policy.observation_window
            recent = q if state.queries is None else torch.cat([state.queries, q], dim=2)
            state.queries = recent[:, :, -window:]
        if self.budget is not None and state.keys.shape[2] > self.budget:
            priority = self.policy.priority(state, grouped, keys, self.budget)
            # the `budget` highest, ties to the older token (a stable sort of columns in text
            # order: max-pooled SnapKV scores tie often), then back in text order
            ranked = priority.sort(dim=-1, descending=True, stable=True).indices
            keep = ranked[..., : self.budget].sort(dim=-1).values
            self.evicted += b * h_kv * (state.keys.shape[2] - self.budget)
            state.select(keep)
        return out

    def advance(self, num_tokens: int) -> None:
        """Commit the forward's tokens (the model calls it after the last layer)."""
        self.length += check_positive_int("num_tokens", num_tokens)
        self._query_positions = None

    # --- batch bookkeeping ------------------------------------------------------------------------

    def _held(self) -> int:
        return 0 if self.layers[0] is None else self.layers[0].keys.shape[2]

    @property
    def seq_lens(self) -> torch.Tensor:
        """(B,) int64: tokens held per sequence (per KV head; at most `budget`)."""
        state = self.layers[0]
        if state is None:
            return torch.zeros(0, dtype=torch.int64)
        return torch.full((state.keys.shape[0],), state.keys.shape[2], dtype=torch.int64)

    def positions(self, layer_idx: int) -> torch.Tensor:
        """(B, H_kv, S) int64: the text positions of the tokens layer `layer_idx` holds."""
        return self.layers[layer_idx].positions

    def truncate(self, length: int) -> None:
        """Not supported: the policy may already have evicted, on seeing the rolled-back tokens,
        tokens a cache that never saw them would keep."""
        raise NotImplementedError(
            "EvictingCache does not roll back: its policy evicts after every forward, so the "
            "tokens before the rolled-back positions may already be gone"
        )

    def move_tokens(self, src, dst) -> None:
        """Not supported, as `truncate` (tree speculation moves tokens and then truncates)."""
        self.truncate(0)

    def reorder(self, indices: torch.Tensor) -> None:
        """Keep sequences `indices` of the batch, in that order (beam search)."""
        self.layers = [None if s is None else s.index_batch(indices) for s in self.layers]

    def repeat(self, num_copies: int) -> EvictingCache:
        """A new cache in which each sequence is copied `num_copies` times, consecutively."""
        num_copies = check_positive_int("num_copies", num_copies)
        bigger = copy.copy(self)
        batch_size = self.seq_lens.shape[0]
        bigger.reorder(torch.arange(batch_size).repeat_interleave(num_copies))  # new states
        return bigger

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values held (what eviction bounds)."""
        return sum(
            t.numel() * t.element_size()
            for s in self.layers
            if s is not None
            for t in (s.keys, s.values)
        )


def rerotate_keys(
    k: torch.Tensor, shift: int, head_dim: int, theta: float, scaling: dict | None = None
) -> torch.Tensor:
    """Move keys that RoPE rotated at position p to position p + `shift` by rotating them again by
    `shift` positions (what a cache that stores rotated keys must do to switch to cache-relative
    positions after an eviction; Hugging Face's former `SinkCache` did this). Rotations compose
    exactly in real numbers; in floating point each correction adds rounding, which accumulates.

    Args:
        k: (B, H, S, D) keys, rotated. shift: positions to move (negative: towards the start).
    Returns:
        (B, H, S, D) in k's dtype.
    """
    positions = torch.full((k.shape[0], k.shape[2]), shift, device=k.device)
    return apply_rope(k, *rope_cos_sin(positions, head_dim, theta, scaling))


def token_scores_from_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = True,
    block_size: int = 128,
) -> torch.Tensor:
    """The attention each key receives, summed over queries, from the log-sum-exp a fused kernel
    saves, without ever holding the (T, S) weights: one more pass over K, `block_size` queries at
    a time, with weight(i, j) = exp(q_i·k_j / sqrt(D) - lse_i) (exact: the softmax's normaliser is
    lse). What score-based eviction needs from a FlashAttention-style kernel (chapter 8).

    Args:
        q: (B, H, T, D) queries. k: (B, H, S, D) keys (repeat GQA heads first).
        lse: (B, H, T) float32 log-sum-exp of each query's scores (e.g. from
            `torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`).
        causal: query i sees keys j <= i + S - T.
    Returns:
        (B, H, S) float32: column sums of the attention weights.
    Raises:
        ValueError: shapes that disagree.
    """
    b, h, t, d = q.shape
    if k.shape[:2] != (b, h) or k.shape[-1] != d or lse.shape != (b, h, t):
        raise ValueError(
            f"q, k, lse: expected (B, H, T, D), (B, H, S, D), (B, H, T), got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(lse.shape)}"
        )
    s = k.shape[2]
    total = torch.zeros(b, h, s, dtype=torch.float32, device=q.device)
    key_index = torch.arange(s, device=q.device)
    for start in range(0, t, check_positive_int("block_size", block_size)):
        end = min(start + block_size, t)
        scores = (q[:, :, start:end] @ k.transpose(-1, -2)).float() * d**-0.5  # (B, H, t, S)
        weights = torch.exp(scores - lse[:, :, start:end, None])
        if causal:
            query_index = torch.arange(start, end, device=q.device)[:, None] + s - t
            weights = weights.masked_fill(key_index > query_index, 0.0)
        total += weights.sum(dim=2)
    return total
