"""Rollback within a margin for an evicting cache (chapter 16): `MarginEvictingCache` is chapter 8's
`EvictingCache` that remembers, for the last `rollback_margin` tokens of its latest forward,
everything each token's step changed, so that right after a forward `truncate(length)` is exact for
every `length >= self.length - rollback_margin` (`rollback_floor`), and refused, with the reason,
below it.

Why `EvictingCache` cannot roll back: it evicts after every forward, so by the time a verification
knows which draft tokens it rejects, their presence has already pushed out tokens that a cache
which never saw them would keep, and their queries' attention is already in the scores. Two rules
make the undo possible, and "the cache that never saw them" well defined:

- **One token, one step.** After the first forward (the prefill: one step that scores and evicts
  once at its end, as `kvlib.generate`'s prefill does), a forward of T tokens is T decode steps:
  token i is appended, its query attends over what the cache held after token i - 1's eviction
  (and itself), the policy scores that, and the cache evicts down to the budget before token
  i + 1 enters. The attention and eviction are `EvictingCache`'s own, called once per token, so
  given the same K/V, after n tokens the cache holds bitwise what `EvictingCache` fed one token
  per forward holds, however the tokens were chunked, and a verification of k + 1 tokens leaves it
  as k + 1 plain greedy steps would (greedy speculation over it emits plain greedy's tokens over
  `EvictingCache`, in exact arithmetic). Only the model's projections see the chunk, so K/V and
  logits equal a one-token step's up to the rounding of a (T, d_model) product against a
  (1, d_model) one; under H2O that rounding also enters the scores that choose evictions, so a
  near-tie can flip an eviction as well as an argmax.
- **An undo record per step and layer**, for the last `rollback_margin` steps: the tokens the step
  evicted (their K/V, positions and indices), the policy's score rows before the step (H2O's
  accumulated attention and query counts) and SnapKV's window of queries before it. Undoing a
  step puts the evicted tokens back in their places, drops the step's token and restores the rows:
  pure copies, so the rolled-back cache equals bitwise one that never saw the undone tokens.

What a rollback does to the scores (the design choice): they return to their values before the
rolled-back tokens' queries were observed. A rejected draft token's query did attend to the kept
tokens, and H2O could count that attention as evidence of what matters; keeping it would leave a
state no plain decoding reaches, and later evictions (and tokens) would differ from plain
greedy's. TOVA accumulates nothing (each step's last query decides), but the tokens it evicted at
the rejected steps come back; SnapKV's window of queries loses the rejected queries and gets back
the older ones they pushed out.

The margin costs memory, not behaviour: attention reads exactly the `budget` tokens
`EvictingCache` would hold. Per layer, sequence and KV head it keeps up to `rollback_margin` evicted
tokens' K/V beside the cache (a decode step evicts one token once the budget is full) and
`rollback_margin` rows of `budget` scores and query counts (`rollback_nbytes`). Speculation with k
draft tokens rejects at most k, so a margin of k suffices.

Not done: a rollback into the prefill (its tokens were scored and evicted as one step; only
`truncate(0)`, a cache as new, reaches before it), `RandomEviction` with a margin (its generator's
draws cannot be undone), `move_tokens` (tree speculation), and padding, MLA and paged storage, as
`EvictingCache`.

Layouts: as `EvictingCache` (keys (B, H_kv, S, D), positions and scores (B, H_kv, S)); an undo
record's evicted tokens are (B, H_kv, e, D) with their indices (B, H_kv, e) among the step's S + 1.
"""

from __future__ import annotations

import dataclasses

import torch

from kvlib._validate import check_positive_int
from kvlib.cache.base import check_kv_append, check_truncate_length
from kvlib.cache.evicting import EvictingCache
from kvlib.cache.eviction_policies import RandomEviction

__all__ = ["MarginEvictingCache", "StepUndo"]


@dataclasses.dataclass
class StepUndo:
    """What one decode step changed in one layer (see the module docstring).

    scores, seen (B, H_kv, S): the policy's rows before the step (S tokens held before it);
    queries: SnapKV's window before the step (or None);
    dropped (B, H_kv, e) int64 or None: indices, among the S + 1 tokens after the step's append,
    of the e tokens its eviction dropped; keys, values (B, H_kv, e, D), positions (B, H_kv, e):
    those tokens; evicted: what the step added to the cache's `evicted` count.
    """

    scores: torch.Tensor
    seen: torch.Tensor
    queries: torch.Tensor | None
    dropped: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    evicted: int = 0

    def index_batch(self, indices: torch.Tensor) -> StepUndo:
        """The record of sequences `indices` (B',) of the batch."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return StepUndo(
            **{
                name: value[indices] if isinstance(value, torch.Tensor) else value
                for name, value in fields.items()
            }
        )

    @property
    def nbytes(self) -> int:
        """Bytes the record holds."""
        return sum(
            t.numel() * t.element_size()
            for t in (self.scores, self.seen, self.dropped, self.keys, self.values, self.positions)
            if t is not None
        )


def _scatter(size: int, parts) -> torch.Tensor:
    """A (B, H_kv, size, ...) tensor with each part's columns (B, H_kv, n, ...) at its indices
    (B, H_kv, n): the inverse of the gathers that split them."""
    first = parts[0][1]
    out = first.new_empty(*first.shape[:2], size, *first.shape[3:])
    for index, columns in parts:
        out.scatter_(
            2, index.view(*index.shape, *[1] * (columns.dim() - 3)).expand_as(columns), columns
        )
    return out


class MarginEvictingCache(EvictingCache):
    """`EvictingCache` that decodes one token per step and rolls back within `rollback_margin`
    tokens (see the module docstring). Arguments as `EvictingCache`'s, plus:

    Args:
        rollback_margin: m >= 0, the most tokens `truncate` can roll back from the end of the
            latest forward (speculation: at least k). 0 keeps no undo records: the cache then
            decodes as `EvictingCache` fed one token per forward and refuses every rollback but
            one to 0 (a cache as new).

    Attributes:
        prefill_length: the first forward's tokens (rollback reaches no length inside them).
        rollback_floor: the shortest length `truncate` reaches, 0 aside: the latest forward's
            end less `rollback_margin`, or `prefill_length` if that is more.

    Raises:
        ValueError: as `EvictingCache`; a negative margin; `RandomEviction` with a margin.
    """

    def __init__(self, num_layers: int, policy, budget, *, rollback_margin: int = 0, **options):
        super().__init__(num_layers, policy, budget, **options)
        self.set_rollback_margin(rollback_margin)
        self._undo: list[list[StepUndo]] = [[] for _ in range(num_layers)]
        self._pending: list[tuple | None] = [None] * num_layers  # a step-wise forward's K/V
        self.prefill_length = 0
        self.rollback_floor = 0

    def set_rollback_margin(self, rollback_margin: int) -> None:
        """Check and set `rollback_margin` (see the class docstring)."""
        margin = check_positive_int("rollback_margin", rollback_margin, allow_zero=True)
        if margin and isinstance(self.policy, RandomEviction):
            raise ValueError(
                "rollback_margin: RandomEviction draws from a generator at every eviction, and a "
                "rollback cannot undo a draw; use 0, or a policy that scores from the cache's state"
            )
        self.rollback_margin = margin

    @classmethod
    def for_model(cls, model, policy, budget, *, rollback_margin: int = 0, positions="original"):
        """A cache for `model` (a `LlamaModel`), as `EvictingCache.for_model`."""
        cache = super().for_model(model, policy, budget, positions=positions)
        cache.set_rollback_margin(rollback_margin)
        return cache

    @classmethod
    def factory(cls, policy, budget, *, rollback_margin: int = 0, positions="original"):
        """`generate`'s `cache=` argument: factory(model, batch_size, max_seq_len)."""
        return lambda model, batch_size, max_seq_len: cls.for_model(
            model, policy, budget, rollback_margin=rollback_margin, positions=positions
        )

    # --- one token, one step ----------------------------------------------------------------------

    def query_positions(self, num_tokens: int) -> torch.Tensor:
        """(1, T) RoPE positions: as `EvictingCache`'s, except that with positions="cache" after
        the prefill token i is rotated at the count held before its own step, min(budget,
        held + i), as one-token forwards would rotate it."""
        if self.positions_mode == "original" or self.length == 0:
            return super().query_positions(num_tokens)
        ahead = self._held() + torch.arange(num_tokens)  # (T,)
        return (ahead if self.budget is None else ahead.clamp(max=self.budget))[None]

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """The prefill: `EvictingCache.update`. After it: check and hold the forward's new keys and
        values (B, H_kv, T, D); `attention_backend` appends them one token per step."""
        if self.length == 0:
            return super().update(layer_idx, k, v)
        check_kv_append([None if s is None else s.keys for s in self.layers], layer_idx, k, v)
        if self._query_positions is None or self._query_positions.numel() != k.shape[2]:
            self.begin_forward(k.shape[2], None)  # a caller that is not LlamaModel
        self._pending[layer_idx] = (k, v)
        return layer_idx

    def attention_backend(self, q, layer_idx, mask=None, *, weights_out=None) -> torch.Tensor:
        """The prefill: `EvictingCache.attention_backend`. After it: for each of the T tokens,
        append its K/V, attend with its query (B, H, 1, D), let the policy observe and evict (all
        `EvictingCache`'s code), and record the undo. Returns (B, H, T, D_v); `weights_out`
        receives one (B, H, 1, S) entry per token."""
        if self._pending[layer_idx] is None:
            return super().attention_backend(q, layer_idx, mask, weights_out=weights_out)
        (k, v), self._pending[layer_idx] = self._pending[layer_idx], None
        forward_positions, outs = self._query_positions, []
        for i in range(q.shape[2]):
            state = self.layers[layer_idx]
            before = StepUndo(state.scores.clone(), state.seen.clone(), state.queries)
            self._query_positions = forward_positions[i : i + 1]
            super().update(layer_idx, k[:, :, i : i + 1], v[:, :, i : i + 1])
            grown = dataclasses.replace(state)  # the S + 1 tokens' tensors, before eviction
            evicted = self.evicted
            outs.append(
                super().attention_backend(q[:, :, i : i + 1], layer_idx, weights_out=weights_out)
            )
            if self.rollback_margin:
                self._undo[layer_idx].append(self._record(before, grown, state, evicted))
        self._query_positions = forward_positions
        return torch.cat(outs, dim=2)  # (B, H, T, D_v)

    def _record(self, before: StepUndo, grown, state, evicted_before: int) -> StepUndo:
        """`before` completed with what the step evicted: the tokens of `grown` (after the append)
        missing from `state` (after the eviction), found by position (unique and ascending)."""
        before.evicted = self.evicted - evicted_before
        if not before.evicted:
            return before
        size = grown.positions.shape[2]
        kept = torch.searchsorted(grown.positions.contiguous(), state.positions.contiguous())
        dropped = torch.ones_like(grown.positions, dtype=torch.bool).scatter_(2, kept, False)
        index = torch.arange(size, device=dropped.device).expand_as(dropped)[dropped]
        before.dropped = index.view(*dropped.shape[:2], -1)  # (B, H_kv, e)
        d = grown.keys.shape[-1]
        take = before.dropped[..., None]
        before.keys = grown.keys.gather(2, take.expand(-1, -1, -1, d))
        before.values = grown.values.gather(2, take.expand(-1, -1, -1, grown.values.shape[-1]))
        before.positions = grown.positions.gather(2, before.dropped)
        return before

    def advance(self, num_tokens: int) -> None:
        """Commit the forward; keep the undo records of its last `rollback_margin` tokens."""
        if self.length == 0:
            self.prefill_length = num_tokens
        for layer_idx, pending in enumerate(self._pending):
            if pending is not None:  # a caller that never attended: appended as one step
                super().update(layer_idx, *pending)
                self._pending[layer_idx] = None
                self.prefill_length = self.length + num_tokens  # no step to undo before it
                self._undo = [[] for _ in self.layers]
        super().advance(num_tokens)
        for records in self._undo:
            del records[: max(0, len(records) - self.rollback_margin)]
        self.rollback_floor = max(self.prefill_length, self.length - self.rollback_margin)

    # --- rollback ---------------------------------------------------------------------------------

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` tokens: undo the last `self.length - length` steps in
        every layer (bitwise: the cache then equals one that never saw them). Reaches back to
        `rollback_floor`, `rollback_margin` tokens before the end of the latest forward (a
        verification's rejected tokens are within it when the margin is at least k), or the end of
        the prefill; `truncate(0)` empties the cache.

        Raises:
            ValueError: `length` not an int in [0, self.length]; a length below `rollback_floor`
                (other than 0), saying whether the margin or the prefill stops it.
        """
        length = check_truncate_length(length, self.length)
        if length == 0:
            self.layers = [None] * self.num_layers
            self._undo = [[] for _ in self.layers]
            self._pending = [None] * self.num_layers
            self.length = self.evicted = self.prefill_length = self.rollback_floor = 0
            return
        if length < self.rollback_floor and self.rollback_floor > self.prefill_length:
            raise ValueError(
                f"length: {length} is beyond rollback_margin = {self.rollback_margin}: the cache "
                f"keeps undo records from position {self.rollback_floor} on (rollback_margin "
                "positions back from the end of its latest forward), so it rolls back to lengths "
                f"{self.rollback_floor}..{self.length} only, and what the policy evicted before "
                f"position {self.rollback_floor} is gone; give the cache a margin of at least the "
                "draft length k"
            )
        if length < self.rollback_floor:
            raise ValueError(
                f"length: {length} lies inside the first forward's {self.prefill_length} tokens, "
                "which were scored and evicted as one step: no record separates them (roll back "
                f"to {self.prefill_length} or later, or to 0)"
            )
        count = self.length - length
        for layer_idx, records in enumerate(self._undo):
            for record in reversed(records[len(records) - count :]):
                self._undo_step(layer_idx, record)
            del records[len(records) - count :]
        self.length = length

    def _undo_step(self, layer_idx: int, record: StepUndo) -> None:
        """Put back what one step evicted, drop its token, restore the policy's rows."""
        state = self.layers[layer_idx]
        tensors = {"keys": state.keys, "values": state.values, "positions": state.positions}
        if record.dropped is not None:
            size = record.scores.shape[2] + 1  # the tokens after the step's append
            dropped = torch.zeros(*record.dropped.shape[:2], size, dtype=torch.bool)
            dropped = dropped.to(record.dropped.device).scatter_(2, record.dropped, True)
            kept = torch.arange(size, device=dropped.device).expand_as(dropped)[~dropped]
            kept = kept.view(*dropped.shape[:2], -1)  # (B, H_kv, budget)
            for name, now in tensors.items():
                tensors[name] = _scatter(
                    size, [(kept, now), (record.dropped, getattr(record, name))]
                )
        for name, full in tensors.items():
            setattr(state, name, full[:, :, :-1])  # the step's own token goes
        state.scores, state.seen, state.queries = record.scores, record.seen, record.queries
        self.evicted -= record.evicted

    def move_tokens(self, src, dst) -> None:
        """Not supported: tree speculation moves an accepted branch's K/V, and an evicting cache's
        columns are not positions."""
        raise NotImplementedError(
            "MarginEvictingCache does not move tokens: its columns are the tokens the policy kept, "
            "not positions (tree speculation needs a cache that holds every position)"
        )

    # --- batch bookkeeping ------------------------------------------------------------------------

    def reorder(self, indices: torch.Tensor) -> None:
        """Keep sequences `indices` of the batch, in that order, undo records included."""
        super().reorder(indices)
        self._undo = [[r.index_batch(indices) for r in records] for records in self._undo]
        self._pending = [None] * self.num_layers

    @property
    def rollback_nbytes(self) -> int:
        """Bytes of the undo records the margin keeps (evicted K/V, positions, score rows)."""
        return sum(r.nbytes for records in self._undo for r in records)
