"""Compaction of a paged KV cache (chapter 9): getting back the blocks that token eviction empties.

A paged allocator (chapter 7) frees a block only when no sequence holds it, and a sequence can
let go of a block only when every slot in it holds an evicted token. Eviction (chapter 8) that
scatters its survivors (H2O, random) leaves almost every block with one, so it frees almost
nothing until a **compaction** pass moves the survivors together (TriAttention, arXiv 2604.04921;
NVIDIA's "KV Cache Compression and Its Infra Problems", 2026). Two passes, both per sequence, both
planned in `kvlib.cache.compaction_plans`: **repack**, order-preserving, and **hole-filling**, few
copies with a slot -> position map. A pass moves K/V in every layer with one gather of all its
sources before any write (repack's destinations are earlier moves' sources, so copies one at a
time are safe only front to back; a gather first is safe in any order). Blocks another
sequence also holds (prefix-cache hits, forked samples or beams) are **never written**: a pass
starts after the sequence's last shared block and reports the blocks it skipped
(`CompactionReport.blocks_pinned`); evicted tokens there stay masked. Blocks a pass writes leave the
prefix cache, and a sequence that has evicted anything hashes no new blocks
(`BlockManager.stop_hashing`): K/V computed without the evicted tokens is not what a fresh prefill
of that prefix computes.

`CompactingPagedCache` is chapter 7's `PagedCache` with a position map per sequence, an optional
chapter 8 policy deciding evictions (one decision per sequence: all layers and heads share its
block table, so a token's scores are summed over every layer and query head), zero-copy release of
blocks with no survivor, and compaction every `compact_every` tokens. Attention reads each
sequence's surviving tokens in text order, so the arithmetic is the same whatever the physical
layout: compacted and uncompacted caches holding the same survivors give bitwise-equal outputs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvlib._validate import check_positive_int
from kvlib.cache.base import check_unpadded
from kvlib.cache.compaction_plans import (
    STRATEGIES,
    CompactionReport,
    SlotMap,
    freeable_blocks,
    plan_hole_filling,
    plan_repack,
)
from kvlib.cache.eviction_policies import EvictionPolicy, LayerState, SnapKV
from kvlib.cache.paged import PagedCache
from kvlib.errors import UnsupportedConfigError
from kvlib.layers.llama import apply_rope, rope_cos_sin
from kvlib.ops.attention import reference_attention, visible

__all__ = [
    "STRATEGIES",
    "CompactingPagedCache",
    "CompactionReport",
    "SlotMap",
    "freeable_blocks",
    "plan_hole_filling",
    "plan_repack",
]


class _Read(NamedTuple):
    """What attention reads this step, (B, S) each, survivors in text order per sequence: pool
    slots, the sequence's slot indices, text positions, and which entries are real."""

    pool_slots: torch.Tensor
    slot_index: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor


class CompactingPagedCache(PagedCache):
    """A paged KV cache whose sequences evict tokens and get their blocks back by compaction (see
    the module docstring). Implements `kvlib.cache.KVCache`.

    Args:
        num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, device: as `PagedCache`.
        policy: a chapter 8 `EvictionPolicy` (`StreamingLLM`, `H2O`, `TOVA`, `RandomEviction`)
            deciding evictions after every forward, or None (evict by calling `evict`).
        budget: survivors kept per sequence (with a policy).
        strategy: "repack", "hole_filling" or None (never compact: blocks come back only when
            all their tokens are evicted).
        compact_every: compact whenever the text's length crosses a multiple of this many tokens.
        rotate_on_read: store keys before RoPE and rotate them when attention reads them, at the
            positions `rope_positions` gives (the position map); needs `rope`.
        rope: (head_dim, theta, scaling) of the model (`for_model` fills it in).
        sliding_window: the model's window, if any.
    Attributes:
        length: tokens seen per sequence (the text's length; all sequences have it).
        slot_maps: one `SlotMap` per sequence.
        reports: a `CompactionReport` per pass and per release of empty blocks that freed any.
        memory_trace: (length, survivors, slots held, blocks in use) after every forward.
    Raises:
        UnsupportedConfigError: SnapKV (it needs per-head queries and keys; use EvictingCache).
        ValueError: an unknown strategy, compact_every without a strategy, a policy without a
            budget, rotate_on_read without rope; padding (from `begin_forward`).
    """

    rollback_refusal = "its policy may have evicted or compacted tokens a rollback would keep"

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        policy: EvictionPolicy | None = None,
        budget: int | None = None,
        strategy: str | None = None,
        compact_every: int | None = None,
        rotate_on_read: bool = False,
        rope: tuple | None = None,
        sliding_window: int | None = None,
        **paged,
    ):
        super().__init__(num_layers, num_kv_heads, head_dim, **paged)
        if policy is not None:
            if not isinstance(policy, EvictionPolicy):
                raise TypeError(f"policy: expected an EvictionPolicy, got {type(policy).__name__}")
            if isinstance(policy, SnapKV):
                raise UnsupportedConfigError(
                    "policy: SnapKV scores tokens per KV head from its own queries and keys; a "
                    "paged cache decides once per sequence (use EvictingCache for SnapKV)"
                )
            if budget is None:
                raise ValueError("budget: a policy needs a budget (survivors per sequence)")
            policy.check_budget(check_positive_int("budget", budget))
        if strategy not in (None, *STRATEGIES):
            raise ValueError(f"strategy: expected one of {STRATEGIES} or None, got {strategy!r}")
        if compact_every is not None:
            check_positive_int("compact_every", compact_every)
            if strategy is None:
                raise ValueError("compact_every: set a strategy ('repack' or 'hole_filling') too")
        if rotate_on_read and rope is None:
            raise ValueError("rope: rotate_on_read needs the model's (head_dim, theta, scaling)")
        self.policy, self.budget = policy, budget
        self.strategy, self.compact_every = strategy, compact_every
        self.rotate_on_read, self.rope, self.sliding_window = rotate_on_read, rope, sliding_window
        self.slot_maps: list[SlotMap] = []
        self.reports: list[CompactionReport] = []
        self.memory_trace: list[tuple[int, int, int, int]] = []
        self.evicted = 0
        self._read: _Read | None = None
        self._weights: torch.Tensor | None = None  # (B, H, T, S): this forward's, over layers

    @classmethod
    def for_model(
        cls, model, num_sequences: int, max_seq_len: int, *, block_size: int = 16, **options
    ) -> CompactingPagedCache:
        """A cache for `model` with room for `num_sequences` sequences of `max_seq_len` tokens
        (as `PagedCache.for_model`); `options` are the constructor's keyword arguments (the
        model's RoPE and sliding window are filled in).

        Raises:
            ValueError: an MLA model.
        """
        c = model.config
        options.setdefault("rope", (c.head_dim, c.rope_theta, c.rope_scaling))
        options.setdefault("sliding_window", c.sliding_window)
        return super().for_model(
            model, num_sequences, max_seq_len, block_size=block_size, **options
        )

    @classmethod
    def factory(cls, *, block_size: int = 16, **options):
        """A `cache=` argument for `kvlib.generate`: factory(model, batch_size, max_seq_len)."""
        return lambda model, batch_size, max_seq_len: cls.for_model(
            model, batch_size, max_seq_len, block_size=block_size, **options
        )

    # --- the attention seam ---------------------------------------------------------------------

    @property
    def rotates_keys(self) -> bool:
        """True with rotate_on_read: the model hands `update` keys before RoPE."""
        return self.rotate_on_read

    def query_positions(self, num_tokens: int) -> torch.Tensor:
        """(1, T) RoPE positions of the next queries: their positions in the text (the text's
        length onward, not the number of slots held)."""
        return torch.arange(self.length, self.length + num_tokens)[None]

    def begin_forward(self, num_tokens: int, attention_mask: torch.Tensor | None) -> None:
        """Refuse padding (every sequence has the same length), then as `PagedCache`.

        Raises:
            ValueError: an attention mask with padding (0s).
        """
        check_unpadded(attention_mask, "CompactingPagedCache")
        super().begin_forward(num_tokens, attention_mask)

    def _begin_step(self, batch_size: int, num_tokens: int) -> None:
        super()._begin_step(batch_size, num_tokens)
        new = torch.arange(self.length, self.length + num_tokens)
        while len(self.slot_maps) < batch_size:
            self.slot_maps.append(SlotMap.empty())
        for slot_map in self.slot_maps:
            slot_map.append(new)
        self._read = self._build_read()
        self._weights = None

    def _build_read(self) -> _Read:
        """Each sequence's survivors in text order: the slots attention reads."""
        rows = []
        for b, slot_map in enumerate(self.slot_maps):
            live = slot_map.live.nonzero()[:, 0]
            index = live[slot_map.positions[live].argsort()]
            table = torch.tensor(self.manager.block_tables[b])
            pool = table[index // self.block_size] * self.block_size + index % self.block_size
            rows.append((pool, index, slot_map.positions[index]))
        width = max(len(r[0]) for r in rows)
        out = torch.zeros(4, len(rows), width, dtype=torch.int64)
        for b, (pool, index, positions) in enumerate(rows):
            n = len(pool)
            out[0, b, :n], out[1, b, :n], out[2, b, :n], out[3, b, :n] = pool, index, positions, 1
        device = self.key_cache[0].device
        pool_slots, slot_index, positions, valid = out.to(device)
        return _Read(pool_slots, slot_index, positions, valid.bool())

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Write the new keys and values `(B, H_kv, T, D)` through the slot mapping (as
        `PagedCache.update`); return the layer index, the handle `attention_backend` reads."""
        super().update(layer_idx, k, v)
        return layer_idx

    def rope_positions(self) -> torch.Tensor:
        """(B, S) int64: the positions RoPE rotates the read keys at (rotate_on_read): each
        slot's position in the text, from the position map."""
        return self._read.positions

    def attention_backend(self, q, layer_idx, mask=None, *, weights_out=None) -> torch.Tensor:
        """Attend with q (B, H, T, D) over layer `layer_idx`'s survivors, read in text order
        (`mask`, the model's mask in text positions, is not used: the position map decides what
        each query sees). Returns (B, H, T, D_v). Collects the weights for the policy."""
        read = self._read
        flat_k = self.key_cache[layer_idx].flatten(0, 1)  # (num_blocks * block_size, H_kv, D)
        flat_v = self.value_cache[layer_idx].flatten(0, 1)
        k = flat_k[read.pool_slots].transpose(1, 2)  # (B, H_kv, S, D)
        v = flat_v[read.pool_slots].transpose(1, 2)
        if self.rotate_on_read:
            head_dim, theta, scaling = self.rope
            k = apply_rope(k, *rope_cos_sin(self.rope_positions(), head_dim, theta, scaling))
        t = q.shape[2]
        query = torch.arange(self.length, self.length + t, device=q.device)
        sees = read.valid[:, None, :] & visible(  # (B, T, S)
            read.positions[:, None, :], query[None, :, None], self.sliding_window
        )
        weights: list = []
        out = reference_attention(q, (k, v), sees, weights_out=weights)
        if weights_out is not None:
            weights_out.append(weights[0])
        if self.policy is not None:
            w = weights[0].float()
            self._weights = w if self._weights is None else self._weights + w
        return out

    def advance(self, num_tokens: int) -> None:
        """Commit the forward's tokens; then let the policy evict down to the budget, give back
        the blocks left without survivors, and compact if the length crossed a multiple of
        `compact_every`."""
        start = self.length
        super().advance(num_tokens)
        if self.policy is not None:
            self._observe_and_evict(torch.arange(start, self.length))
        self.release_empty_blocks()
        every = self.compact_every
        if every is not None and self.length // every > start // every:
            self.compact(self.strategy)
        self._weights = None
        self._read = None
        self.memory_trace.append(
            (self.length, self.num_tokens_held, self.num_slots_held, self.num_blocks_in_use)
        )

    # --- eviction ---------------------------------------------------------------------------------

    def _observe_and_evict(self, query_positions: torch.Tensor) -> None:
        """One decision per sequence: the policy sees the survivors in text order, with this
        forward's weights summed over layers (B, 1, H, T, S) (H2O sums them; TOVA averages the
        heads: the layers' sum ranks as their mean)."""
        read, weights = self._read, self._weights
        for b, slot_map in enumerate(self.slot_maps):
            n = int(read.valid[b].sum())
            index = read.slot_index[b, :n].cpu()
            view = slot_map.take(index)
            state = LayerState(
                keys=torch.zeros(1, 1, n, 0),
                values=torch.zeros(1, 1, n, 0),
                positions=view.positions[None, None],
                scores=view.scores[None, None].clone(),
                seen=view.seen[None, None].clone(),
            )
            w = weights[b, None, None, :, :, :n].cpu()  # (1, 1, H, T, S)
            self.policy.observe(state, w, query_positions)
            slot_map.scores[index], slot_map.seen[index] = state.scores[0, 0], state.seen[0, 0]
            if n > self.budget:
                priority = self.policy.priority(state, w, state.keys, self.budget)[0, 0]
                ranked = priority.sort(descending=True, stable=True).indices
                self._evict_slots(b, index[ranked[self.budget :]])

    def evict(self, seq: int, positions: Sequence[int]) -> None:
        """Evict the tokens at text `positions` from sequence `seq` (their slots become dead:
        masked, until a compaction or a release reclaims them).

        Raises:
            ValueError: an unknown sequence, or a position the sequence does not hold.
        """
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < len(self.slot_maps):
            raise ValueError(f"seq: expected an int in [0, {len(self.slot_maps)}), got {seq!r}")
        slot_map = self.slot_maps[seq]
        wanted = torch.as_tensor(list(positions), dtype=torch.int64)
        hits = (slot_map.positions[:, None] == wanted[None]) & slot_map.live[:, None]
        missing = wanted[~hits.any(dim=0)].tolist()
        if missing:
            raise ValueError(f"positions: sequence {seq} holds no token at {missing}")
        self._evict_slots(seq, hits.any(dim=1).nonzero()[:, 0])

    def _evict_slots(self, seq: int, slots: torch.Tensor) -> None:
        if len(slots):
            self.slot_maps[seq].positions[slots] = -1
            self.evicted += len(slots)
            self.manager.stop_hashing(seq)

    # --- getting blocks back ---------------------------------------------------------------------

    def release_empty_blocks(self) -> CompactionReport:
        """Drop every block whose slots all hold evicted tokens from its sequence's block table:
        no copies (the later slots' indices shift down)."""
        report = CompactionReport("release")
        for b, slot_map in enumerate(self.slot_maps):
            drop = freeable_blocks(slot_map.live.tolist(), self.block_size)
            if not drop:
                continue
            keep = torch.ones(len(slot_map.positions), dtype=torch.bool)
            for i in drop:
                keep[i * self.block_size : (i + 1) * self.block_size] = False
            self.slot_maps[b] = slot_map.take(keep.nonzero()[:, 0])
            self.manager.drop_blocks(b, drop)
            report.blocks_freed += len(drop)
        self._finish(report)
        return report

    def compact(self, strategy: str) -> CompactionReport:
        """One compaction pass over every sequence ("repack" or "hole_filling", see the module
        docstring), starting after each sequence's last shared block. K/V move in every layer,
        one gather of all sources before the writes; the block tables, position maps, prefix-cache
        hashes and the allocator are updated together. Returns its `CompactionReport`.

        Raises:
            ValueError: an unknown strategy.
        """
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}")
        started = time.perf_counter()
        plan = plan_repack if strategy == "repack" else plan_hole_filling
        report = CompactionReport(strategy)
        manager, size = self.manager, self.block_size
        src_slots, dst_slots = [], []
        for b, slot_map in enumerate(self.slot_maps):
            table = manager.block_tables[b]
            shared = [i for i, block in enumerate(table) if manager.pool.blocks[block].ref_cnt > 1]
            pinned = shared[-1] + 1 if shared else 0
            report.blocks_pinned += pinned
            start = pinned * size
            live = slot_map.live.tolist()
            num_slots = start + sum(live[start:])
            if start >= len(live) or num_slots == len(live) or num_slots == 0:
                continue  # nothing private, nothing dead, or nothing left
            moves = plan(live, start)
            src_slots += [table[s // size] * size + s % size for s, _ in moves]
            dst_slots += [table[d // size] * size + d % size for _, d in moves]
            self.slot_maps[b] = slot_map.move(moves, num_slots)
            report.blocks_freed += len(manager.move_slots(b, moves, num_slots))
            report.slots_copied += len(moves)
        if src_slots:  # every layer's K and V: gather all sources, then write
            src = torch.tensor(src_slots, device=self.key_cache[0].device)
            dst = torch.tensor(dst_slots, device=self.key_cache[0].device)
            for cache in self.key_cache + self.value_cache:
                flat = cache.flatten(0, 1)
                flat[dst] = flat[src]
        report.seconds = time.perf_counter() - started
        self._finish(report)
        return report

    def _finish(self, report: CompactionReport) -> None:
        report.tokens_held, report.slots_held = self.num_tokens_held, self.num_slots_held
        if report.blocks_freed or report.slots_copied:
            self.reports.append(report)

    # --- bookkeeping ------------------------------------------------------------------------------

    @property
    def num_tokens_held(self) -> int:
        """Survivors, summed over the batch."""
        return sum(int(m.live.sum()) for m in self.slot_maps)

    @property
    def num_slots_held(self) -> int:
        """Slots in use (survivors and dead slots not yet reclaimed), summed over the batch."""
        return sum(len(m.positions) for m in self.slot_maps)

    def reorder(self, indices: torch.Tensor) -> None:
        """Keep sequences `indices` (beam search), their position maps with them."""
        order = [int(i) for i in indices.tolist()]
        super().reorder(indices)
        self.slot_maps = [self.slot_maps[i].clone() for i in order]

    def repeat(self, num_copies: int) -> CompactingPagedCache:
        """As `PagedCache.repeat`; the copies share blocks, which compaction leaves in place."""
        bigger = super().repeat(num_copies)
        self.slot_maps = []
        return bigger

    def check_invariants(self) -> None:
        """Raise AssertionError (naming the rule) unless, besides the allocator's invariants
        (`BlockManager.check_invariants`): each sequence's position map covers exactly its slots;
        the survivors' positions are distinct and in [0, length); slots held <= tokens seen
        (effective length <= logical length); and no block a sequence holds lacks a survivor
        (such a block is released at once)."""
        self.manager.check_invariants()
        for b, slot_map in enumerate(self.slot_maps):
            n = self.manager.num_tokens(b)
            assert len(slot_map.positions) == n, (
                f"sequence {b}: the position map has {len(slot_map.positions)} slots, the block "
                f"table {n}"
            )
            live = slot_map.positions[slot_map.live]
            assert len(live.unique()) == len(live), f"sequence {b}: a position held twice"
            assert bool((live < self.length).all()), f"sequence {b}: a position >= {self.length}"
            assert n <= self.length, f"sequence {b}: {n} slots for {self.length} tokens seen"
            empty = freeable_blocks(slot_map.live.tolist(), self.block_size)
            assert not empty, f"sequence {b}: blocks {empty} hold no survivor"
